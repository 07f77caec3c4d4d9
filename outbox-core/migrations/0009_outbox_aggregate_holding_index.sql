-- The index the relay's claim probes for rows that hold their aggregate's later rows back,
-- replacing 0005's `outbox_events_holding_idx` for two reasons.
--
-- An aggregate is (aggregatetype, aggregateid): a quarantined `invoice/42` must not hold
-- `customer/42` back, so the claim's probe names both, and the index serves both.
--
-- A row can now hold its aggregate back without having been charged an attempt: a row whose
-- partition could not take writes (no leader, fewer in-sync replicas than
-- `min.insync.replicas`) waits out that outage with `attempts` unchanged, `last_error` saying
-- why and `next_attempt_at` in the future. Such rows must still keep their aggregate's later
-- rows from filling the claim's LIMIT, so the predicate takes rows with a `last_error` too
-- (every row that failed has one; an acknowledged row has none).
--
-- Built beforehand with CREATE INDEX CONCURRENTLY on a large table (README, upgrading), this
-- migration only drops the old index.
--
-- Both statements need a lock that waits for every relay batch in flight (a batch can last
-- `message.timeout.ms`), and while one waits, every enqueue queues behind it. So the
-- migration gives up after a few seconds instead (rolled back as a whole); run it again.
SET LOCAL lock_timeout = '5s';

CREATE INDEX IF NOT EXISTS outbox_events_aggregate_holding_idx
    ON outbox_events (aggregateid, aggregatetype, seq)
    WHERE status <> 'published'
      AND (status = 'quarantined' OR attempts > 0 OR last_error IS NOT NULL);

DROP INDEX IF EXISTS outbox_events_holding_idx;
