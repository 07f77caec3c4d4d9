-- A handler must leave its transaction to the consumer. A handler that ran `COMMIT` in a
-- batch committed the dedup rows of every message of the batch, those whose handlers had not
-- run yet included: when a later handler failed, its replay found its id recorded and never
-- handled it. So a consumer's transaction that records ids also inserts a row here, whose
-- deferred check runs at COMMIT and lets it through only when the consumer itself commits (it
-- sets `outbox.consumer_commit` in the statement it runs just before): a handler's `COMMIT`
-- fails, the transaction rolls back whole, and the handler's message fails alone.
--
-- The rows live only inside their transaction (the consumer deletes its own before its
-- COMMIT): unlogged, no index.
CREATE UNLOGGED TABLE IF NOT EXISTS outbox_consumer_dedup_gate (
    tx xid8 NOT NULL DEFAULT pg_current_xact_id()
);

CREATE OR REPLACE FUNCTION outbox_consumer_dedup_gate_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.consumer_commit', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'a handler ended the consumer''s transaction (COMMIT): the transaction is rolled back; a handler must leave COMMIT to the consumer'
            USING ERRCODE = 'P0001';
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_consumer_dedup_gate_check ON outbox_consumer_dedup_gate;
CREATE CONSTRAINT TRIGGER outbox_consumer_dedup_gate_check
    AFTER INSERT ON outbox_consumer_dedup_gate
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_consumer_dedup_gate_check();
