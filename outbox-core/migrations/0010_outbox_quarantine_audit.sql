-- Operators' actions on the quarantines are checked and recorded.
--
-- `outbox_quarantine_tables` lists the tables that are quarantines of this framework, by oid
-- and by name, with their side: `outbox quarantine requeue|discard` and `outbox prune
-- quarantine` act on a table only when it is listed here for that side under its oid, schema
-- and name all three, so a mistyped `--quarantine-table invoices` changes nothing. A row can
-- outlive its table (nothing removes it on DROP TABLE), and its oid can come back: after oid
-- wraparound, or from a dump, which writes a dangling REGCLASS as a bare number. The names
-- keep such a row from passing for the user's table that got the oid. A table dropped and
-- made again under the same name by something else has another oid, and is not listed
-- either (re-register it as the README says).
--
-- Each set of table names runs this migration with its own names (the migrator renames the
-- tables below) and registers its own tables; the registry, the audit and the audit's trigger
-- are shared by every set in the schema, so each is made only where it is missing: the set
-- that comes first owns them, and a set owned by another role needs only INSERT on the
-- registry (README, "Upgrading to migration 0010").
CREATE TABLE IF NOT EXISTS outbox_quarantine_tables (
    table_oid     REGCLASS    PRIMARY KEY,
    side          TEXT        NOT NULL CHECK (side IN ('relay', 'consumer')),
    registered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The table's schema and name when it was registered.
    nspname       NAME        NOT NULL,
    relname       NAME        NOT NULL
);

INSERT INTO outbox_quarantine_tables (table_oid, side, nspname, relname)
SELECT c.oid, s.side, n.nspname, c.relname
FROM (VALUES ('outbox_events'::regclass, 'relay'),
             ('outbox_consumer_quarantine'::regclass, 'consumer')) AS s (oid, side)
JOIN pg_catalog.pg_class c ON c.oid = s.oid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
ON CONFLICT (table_oid) DO NOTHING;

-- One row per requeue or discard that changed rows (written by the statement that acts, so
-- neither commits without the other), and per batch of a prune: what was done to which rows,
-- when, by which role, and why.
CREATE TABLE IF NOT EXISTS outbox_quarantine_audit (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at              TIMESTAMPTZ NOT NULL DEFAULT now(),
    action          TEXT        NOT NULL CHECK (action IN ('requeue', 'discard', 'prune')),
    side            TEXT        NOT NULL CHECK (side IN ('relay', 'consumer')),
    -- Schema-qualified.
    table_name      TEXT        NOT NULL,
    -- The rows acted on (relay: `seq`; consumer: `id`), and their event ids, in the same
    -- order (NULL where the consumer could not decode one). Empty for a prune, whose detail
    -- has the count and the range of ids and times instead.
    row_ids         BIGINT[]    NOT NULL,
    event_ids       UUID[]      NOT NULL,
    -- Consumer side: the consumers whose messages they were.
    consumers       TEXT[]      NOT NULL,
    db_user         TEXT        NOT NULL DEFAULT current_user,
    db_session_user TEXT        NOT NULL DEFAULT session_user,
    reason          TEXT,
    -- What else the action took: a requeue's `to_consumer` and where the copy went, a
    -- prune's age, batch size, and the count, least and greatest id and time of what it
    -- deleted.
    detail          JSONB       NOT NULL DEFAULT '{}'::jsonb
);

-- The time and roles are the server's, whatever an insert says. The function's search_path
-- is fixed: resolved through the inserting session's path, `now()` could be its own
-- `evil.now()`.
-- (Looked up in the schema this migration creates in, whatever else the path holds.)
DO $$
DECLARE
    here TEXT := current_schema();
BEGIN
    IF to_regprocedure(format('%I.outbox_quarantine_audit_stamp()', here)) IS NULL THEN
        EXECUTE format($f$
            CREATE FUNCTION %I.outbox_quarantine_audit_stamp() RETURNS trigger
            LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $b$
            BEGIN
                NEW.at := pg_catalog.now();
                NEW.db_user := current_user;
                NEW.db_session_user := session_user;
                RETURN NEW;
            END
            $b$ $f$, here);
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_trigger
                   WHERE tgrelid = to_regclass(format('%I.outbox_quarantine_audit', here))
                     AND tgname = 'outbox_quarantine_audit_stamp') THEN
        EXECUTE format(
            'CREATE TRIGGER outbox_quarantine_audit_stamp BEFORE INSERT ON %I.outbox_quarantine_audit '
            'FOR EACH ROW EXECUTE FUNCTION %I.outbox_quarantine_audit_stamp()', here, here);
    END IF;
END
$$;

-- `outbox prune quarantine` deletes by age in batches, each from where the previous stopped.
CREATE INDEX IF NOT EXISTS outbox_consumer_quarantine_quarantined_at_idx
    ON outbox_consumer_quarantine (quarantined_at);
