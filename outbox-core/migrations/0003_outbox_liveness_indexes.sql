-- Rows that can hold their key's later rows back: waiting for a retry (pending after a failed
-- attempt) or quarantined. Few by nature, so the relay's claim can skip a held-back key's
-- rows before its LIMIT by probing this index, however long that key's backlog.
CREATE INDEX IF NOT EXISTS outbox_events_held_idx ON outbox_events (aggregateid, seq)
    WHERE status = 'quarantined' OR (status = 'pending' AND attempts > 0);

-- Pruning published rows by age reads only the rows it deletes.
CREATE INDEX IF NOT EXISTS outbox_events_published_at_idx ON outbox_events (published_at)
    WHERE status = 'published';
