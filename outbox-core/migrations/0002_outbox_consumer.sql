-- One row per (consumer, event id) whose effect has committed.
CREATE TABLE outbox_consumer_dedup (
    consumer     TEXT        NOT NULL,
    event_id     UUID        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

CREATE INDEX outbox_consumer_dedup_processed_at_idx ON outbox_consumer_dedup (processed_at);

-- Messages a consumer could not handle, kept whole so that nothing is lost.
CREATE TABLE outbox_consumer_quarantine (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer       TEXT        NOT NULL,
    topic          TEXT        NOT NULL,
    partition      INT         NOT NULL,
    "offset"       BIGINT      NOT NULL,
    event_id       UUID,
    message_key    BYTEA,
    payload        BYTEA,
    headers        JSONB       NOT NULL DEFAULT '{}'::jsonb,
    reason         TEXT        NOT NULL,
    error          TEXT        NOT NULL,
    quarantined_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX outbox_consumer_quarantine_consumer_idx ON outbox_consumer_quarantine (consumer, id);

-- A redelivered poison message is quarantined once.
CREATE UNIQUE INDEX outbox_consumer_quarantine_position_idx
    ON outbox_consumer_quarantine (consumer, topic, partition, "offset");
