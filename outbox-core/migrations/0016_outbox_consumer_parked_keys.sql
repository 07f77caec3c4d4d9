-- `HandlerFailurePolicy::ParkKey`: a record the consumer gives up on parks its key. It and
-- every later record of the same key on that partition are set aside here, in offset order,
-- while the partition's other keys flow on and its offset advances; nothing waits in memory,
-- and a restart or a rebalance finds the key parked. `outbox parked release` asks the
-- partition's consumer to replay the key's records through its handler, in order, after which
-- the key flows again.
--
-- The parked records have the quarantine's columns (the consumer stores both the same way,
-- and `outbox parked skip` discards a record as `outbox quarantine discard` does, audited),
-- and the record's timestamp, which both now keep: a requeued or replayed copy carries it.
ALTER TABLE outbox_consumer_quarantine ADD COLUMN record_timestamp TIMESTAMPTZ;

CREATE TABLE outbox_consumer_quarantine_parked (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer         TEXT        NOT NULL,
    topic            TEXT        NOT NULL,
    partition        INT         NOT NULL,
    "offset"         BIGINT      NOT NULL,
    event_id         UUID,
    -- A record without a key has no order to keep: it is quarantined instead.
    message_key      BYTEA       NOT NULL,
    payload          BYTEA,
    headers          JSONB       NOT NULL DEFAULT '{}'::jsonb,
    header_bytes     BYTEA,
    reason           TEXT        NOT NULL,
    error            TEXT        NOT NULL,
    quarantined_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    record_timestamp TIMESTAMPTZ,
    record_digest    BYTEA       NOT NULL GENERATED ALWAYS AS (sha256(
        int4send(length(message_key)) || message_key
        || coalesce(int4send(length(payload)) || payload, '\xffffffff'::bytea)
        || coalesce(header_bytes, '\x'::bytea)
    )) STORED
);

-- A redelivered record is parked once.
CREATE UNIQUE INDEX outbox_consumer_quarantine_parked_record_idx
    ON outbox_consumer_quarantine_parked (consumer, topic, partition, "offset", record_digest);
-- A key's records in offset order: the head first.
CREATE INDEX outbox_consumer_quarantine_parked_key_idx
    ON outbox_consumer_quarantine_parked (consumer, topic, partition, message_key, "offset");

-- The keys parked, one row per (consumer, partition, key) while any of its records is parked.
-- `release_requested_at` is set by `outbox parked release` (and `skip`), and cleared when the
-- replay parks the key again.
CREATE TABLE outbox_consumer_quarantine_parked_keys (
    consumer             TEXT        NOT NULL,
    topic                TEXT        NOT NULL,
    partition            INT         NOT NULL,
    message_key          BYTEA       NOT NULL,
    parked_at            TIMESTAMPTZ NOT NULL DEFAULT now(),
    release_requested_at TIMESTAMPTZ,
    PRIMARY KEY (consumer, topic, partition, message_key)
);

-- `outbox parked skip` discards a parked record through the quarantine machinery: checked
-- against this registry and recorded in `outbox_quarantine_audit`.
INSERT INTO outbox_quarantine_tables (table_oid, side, nspname, relname)
SELECT c.oid, 'consumer', n.nspname, c.relname
FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = 'outbox_consumer_quarantine_parked'::regclass
ON CONFLICT (table_oid) DO NOTHING;
