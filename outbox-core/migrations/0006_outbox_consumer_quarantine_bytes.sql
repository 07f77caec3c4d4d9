-- The consumer's quarantine keeps a record's headers as bytes, and a different record at an
-- offset a row already holds (a topic deleted and made again, a cluster failed over) gets a
-- row of its own.
--
-- `headers` (JSONB) could not hold a header value with a NUL (U+0000 is valid UTF-8, JSONB
-- refuses it): the insert failed and the partition stalled. `header_bytes` holds the headers
-- in order, names and values as bytes (format: outbox-consumer's `header_list.rs`); `headers`
-- stays as a view for people. Rows written before this migration have no `header_bytes` and
-- are read from `headers`, as before.
ALTER TABLE outbox_consumer_quarantine ADD COLUMN header_bytes BYTEA;

-- What makes a redelivery the same record: its key, value and headers (lengths keep the parts
-- apart; a missing key or value is not an empty one). Rows written before this migration
-- have no `header_bytes`, so no new row matches them: a message they hold that is redelivered
-- after the upgrade gets a second row, never none.
ALTER TABLE outbox_consumer_quarantine ADD COLUMN record_digest BYTEA NOT NULL
    GENERATED ALWAYS AS (sha256(
        coalesce(int4send(length(message_key)) || message_key, '\xffffffff'::bytea)
        || coalesce(int4send(length(payload)) || payload, '\xffffffff'::bytea)
        || coalesce(header_bytes, '\x'::bytea)
    )) STORED;

-- One row per position and record, instead of one per position.
CREATE UNIQUE INDEX outbox_consumer_quarantine_record_idx
    ON outbox_consumer_quarantine (consumer, topic, partition, "offset", record_digest);
DROP INDEX outbox_consumer_quarantine_position_idx;
