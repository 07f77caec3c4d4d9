-- The index the relay's claim probes for rows that hold their key back (waiting for a retry,
-- or quarantined), with a predicate the claim can imply without naming status 'pending'.
--
-- 0003's index said `status = 'pending' AND attempts > 0`; the claim's probe then said
-- `status = 'pending'` too, which also implies the predicate of `outbox_events_pending_idx`.
-- With statistics taken while every row was published (a quiet table, then a burst), the
-- planner thought that index nearly empty and probed it instead, scanning every earlier
-- pending row for each claimed row: 36 ms against 7 ms per batch of 500 over 1M retained
-- rows, and slower as the batch moved on (bench P5). The probe now says `status <>
-- 'published' AND status <> 'quarantined'`, which only this index (and the unpublished-key
-- index, larger) can serve. The rows it holds are the same as 0003's.
--
-- Built beforehand with CREATE INDEX CONCURRENTLY on a large table (README, upgrading), this
-- migration only drops the old index.
CREATE INDEX IF NOT EXISTS outbox_events_holding_idx ON outbox_events (aggregateid, seq)
    WHERE status <> 'published' AND (status = 'quarantined' OR attempts > 0);

DROP INDEX IF EXISTS outbox_events_held_idx;
