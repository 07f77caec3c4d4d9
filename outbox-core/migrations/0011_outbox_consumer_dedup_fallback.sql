-- Dedup rows of a day whose slice was missing when a consumer that may not make slices met it
-- are recorded in the timeless slice under the slice value -day (outbox-consumer's
-- `slice.rs`). Whoever makes a day's slice first asks whether any such row exists, which this
-- index answers without reading the timeless slice (it holds every id without a time, which
-- can be most of them). It is empty unless consumers fall back.
--
-- Building it holds a lock that consumers' inserts of timeless ids wait for while the
-- timeless slice is read once; like 0009, the migration gives up after a few seconds of
-- waiting for that lock instead of queueing every insert behind it (run it again).
SET LOCAL lock_timeout = '5s';

CREATE INDEX IF NOT EXISTS outbox_consumer_dedup_timeless_fallback_idx
    ON outbox_consumer_dedup_timeless (slice) WHERE slice < 0;
