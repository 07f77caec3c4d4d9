-- Operators' actions on the quarantines are checked and recorded.
--
-- `outbox_quarantine_tables` lists the tables that are quarantines of this framework, by oid,
-- with their side: `outbox quarantine requeue|discard` and `outbox prune quarantine` act on a
-- table only when it is listed here for that side, so a mistyped `--quarantine-table invoices`
-- changes nothing. Each set of table names runs this migration with its own names (the
-- migrator renames the tables below) and registers its own tables; the registry and the audit
-- are shared by every set in the schema, hence `IF NOT EXISTS`. A table dropped and made again
-- under the same name by something else has another oid, and is not listed. (A REGCLASS is
-- dumped by name and kept by pg_upgrade, so the registry survives both.)
CREATE TABLE IF NOT EXISTS outbox_quarantine_tables (
    table_oid     REGCLASS    PRIMARY KEY,
    side          TEXT        NOT NULL CHECK (side IN ('relay', 'consumer')),
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

INSERT INTO outbox_quarantine_tables (table_oid, side)
VALUES ('outbox_events'::regclass, 'relay'),
       ('outbox_consumer_quarantine'::regclass, 'consumer')
ON CONFLICT (table_oid) DO NOTHING;

-- One row per requeue or discard (written by the statement that acts, so neither commits
-- without the other), and per batch of a prune: what was done to which rows, when, by which
-- role, and why.
CREATE TABLE IF NOT EXISTS outbox_quarantine_audit (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    action          TEXT        NOT NULL CHECK (action IN ('requeue', 'discard', 'prune')),
    side            TEXT        NOT NULL CHECK (side IN ('relay', 'consumer')),
    -- Schema-qualified.
    table_name      TEXT        NOT NULL,
    -- The rows acted on (relay: `seq`; consumer: `id`), and their event ids, in the same
    -- order (NULL where the consumer could not decode one).
    row_ids         BIGINT[]    NOT NULL,
    event_ids       UUID[]      NOT NULL,
    -- Consumer side: the consumers whose messages they were.
    consumers       TEXT[]      NOT NULL,
    db_user         TEXT        NOT NULL DEFAULT current_user,
    db_session_user TEXT        NOT NULL DEFAULT session_user,
    reason          TEXT,
    -- What else the action took: a requeue's `to_consumer` and where the copy went, a
    -- prune's age and batch size.
    detail          JSONB       NOT NULL DEFAULT '{}'::jsonb
);

-- The time and roles are the server's, whatever an insert says.
CREATE OR REPLACE FUNCTION outbox_quarantine_audit_stamp() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.at := now();
    NEW.db_user := current_user;
    NEW.db_session_user := session_user;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER outbox_quarantine_audit_stamp
    BEFORE INSERT ON outbox_quarantine_audit
    FOR EACH ROW EXECUTE FUNCTION outbox_quarantine_audit_stamp();

-- `outbox prune quarantine` deletes by age in batches, each from where the previous stopped.
CREATE INDEX IF NOT EXISTS outbox_consumer_quarantine_quarantined_at_idx
    ON outbox_consumer_quarantine (quarantined_at);
