-- Indexes of dispatched actions. One pending index per kind of claimer, so that neither scans the other's backlog: the
-- relay skips dispatched actions (topic `dispatch:...`), a dispatcher takes only its own
-- destination's. Without them, a destination that is down for an hour leaves its actions
-- pending at the front of `outbox_events_pending_idx`, and every relay claim walks them all
-- before the first event it may publish (and the reverse for a Kafka backlog). The claims and the outcome query
-- repeat these predicates word for word so that the planner can use them.
--
-- A plain CREATE INDEX blocks writes to the table while it builds. On a large table, build
-- all three beforehand with CREATE INDEX CONCURRENTLY (same names and definitions; README,
-- upgrading): this migration then finds them and does nothing. It gives up after a few
-- seconds of waiting for its lock instead of queueing every enqueue behind it.
SET LOCAL lock_timeout = '5s';

CREATE INDEX IF NOT EXISTS outbox_events_pending_relay_idx
    ON outbox_events (seq)
    WHERE status = 'pending' AND topic NOT LIKE 'dispatch:%';

CREATE INDEX IF NOT EXISTS outbox_events_pending_dispatch_idx
    ON outbox_events (topic, seq)
    WHERE status = 'pending' AND topic LIKE 'dispatch:%';

-- An agent reads an action's outcome back by its event id (`dispatch::outcome`).
CREATE INDEX IF NOT EXISTS outbox_events_dispatch_id_idx
    ON outbox_events (id)
    WHERE topic LIKE 'dispatch:%';
