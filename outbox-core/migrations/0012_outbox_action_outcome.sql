-- The effect ledger of dispatched actions (topic `dispatch:<destination>`): what the
-- destination answered, stored by the dispatcher in the statement that marks the action done
-- (or, for an action the destination rejected, the statement that quarantines it), and read
-- back by `outbox_producer::dispatch::outcome`. Always NULL for events relayed to Kafka.
--
-- A nullable column without a default changes only the catalog, but it needs a lock that
-- waits for every relay batch in flight while enqueues queue behind it: give up after a few
-- seconds instead (rolled back as a whole) and run the migration again.
SET LOCAL lock_timeout = '5s';

ALTER TABLE outbox_events ADD COLUMN IF NOT EXISTS outcome JSONB;
