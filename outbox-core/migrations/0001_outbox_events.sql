-- The outbox. Column names id, aggregatetype, aggregateid, type and payload are the defaults of
-- Debezium's Outbox Event Router, so the same table can later be relayed by CDC unchanged.
CREATE TABLE outbox_events (
    seq             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              UUID        NOT NULL,
    aggregatetype   TEXT        NOT NULL,
    aggregateid     TEXT        NOT NULL,
    type            TEXT        NOT NULL,
    payload         JSONB       NOT NULL,
    headers         JSONB       NOT NULL DEFAULT '{}'::jsonb,
    topic           TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    status          TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'published', 'quarantined')),
    attempts        INT         NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error      TEXT,
    published_at    TIMESTAMPTZ
);

-- The relay's scan touches only pending rows, however many published rows are retained.
CREATE INDEX outbox_events_pending_idx ON outbox_events (seq) WHERE status = 'pending';

-- Per-key order check: "is there an earlier unpublished row of this key?"
CREATE INDEX outbox_events_unpublished_key_idx ON outbox_events (aggregateid, seq)
    WHERE status <> 'published';
