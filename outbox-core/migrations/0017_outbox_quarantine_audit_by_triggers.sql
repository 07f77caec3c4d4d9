-- The audit of the quarantines is written by the database, not by the client: triggers record
-- every UPDATE and DELETE of quarantined rows, whoever issues it (`outbox quarantine
-- requeue|discard`, `outbox prune quarantine`, `outbox parked skip`, or a statement typed in
-- psql), and no role but the owner needs INSERT on the audit (`roles.sql` takes it from the
-- operator). Before, the client wrote the audit row in the statement that acted: a DELETE
-- typed by hand left none, and an operator could write entries that never happened.
--
-- What the server knows is the server's: when, which role, which rows. What only the client
-- knows (the action's name, the operator's reason, a requeue's target) it says in
-- transaction-local settings `outbox.audit_action`, `outbox.audit_reason` and
-- `outbox.audit_detail` (JSON) before acting; a statement that says nothing is recorded as
-- `update` or `delete`, and so is one whose claimed name is not what it did (a `requeue`
-- that left the row quarantined), with the claim in the detail. Not covered: TRUNCATE, and
-- an owner who disables the triggers (owners can change anything, the audit included), nor
-- UPDATEs of the parked records (only the consumer may make them).
--
-- The consumer's quarantine and its parked records: one audit row per statement (a
-- statement-level trigger over the rows it changed; the parked records on DELETE only: a
-- redelivered head is updated by the consumer itself). The outbox: one audit row per
-- quarantined row changed (a row-level trigger on quarantined rows alone: the relay changes
-- other rows all the time, and a statement-level trigger would copy each of its statements'
-- rows to run).

-- Objects shared by every set of tables in the schema, which the migrations reuse where they
-- exist (`CREATE TABLE IF NOT EXISTS`, a function looked up by name): each must belong to the
-- migrating role or to the schema's owner. On PostgreSQL 12-14 every role may create in
-- `public`; one that made the registry, the audit or the audit's functions before the first
-- migration would own them (read and forge the audit, run its own code on every change of a
-- quarantined row as the trigger's SECURITY DEFINER).
DO $$
DECLARE
    here TEXT := current_schema();
    schema_owner NAME := (SELECT r.rolname FROM pg_catalog.pg_namespace n
                          JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner
                          WHERE n.nspname = current_schema());
    found RECORD;
BEGIN
    FOR found IN
        SELECT c.relname::text AS object, r.rolname AS owner
        FROM pg_catalog.pg_class c JOIN pg_catalog.pg_roles r ON r.oid = c.relowner
        WHERE c.oid IN (to_regclass(format('%I.outbox_quarantine_tables', here)),
                        to_regclass(format('%I.outbox_quarantine_audit', here)))
        UNION ALL
        SELECT p.oid::regprocedure::text, r.rolname
        FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_roles r ON r.oid = p.proowner
        WHERE p.oid IN (to_regprocedure(format('%I.outbox_quarantine_audit_stamp()', here)),
                        to_regprocedure(format('%I.outbox_quarantine_audit_write()', here)),
                        to_regprocedure(format('%I.outbox_quarantine_id_fixed()', here)))
    LOOP
        IF found.owner <> current_user AND found.owner <> schema_owner THEN
            RAISE EXCEPTION 'migration 0017: % in schema % belongs to role %, which is neither the migrating role (%) nor the schema''s owner (%): whoever made it first could read or forge the audit; drop it (or ALTER ... OWNER TO the tables'' owner) and migrate again',
                found.object, here, found.owner, current_user, schema_owner
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END LOOP;
END
$$;

-- The audit, its stamp and the trigger function are shared by every set of tables in the
-- schema: the first set to run this migration (the audit's owner) changes them; a set owned
-- by another role, migrated after it, only puts the triggers on its own tables.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_constraint
                   WHERE conrelid = to_regclass(format('%I.outbox_quarantine_audit', current_schema()))
                     AND conname = 'outbox_quarantine_audit_action_check'
                     AND pg_catalog.pg_get_constraintdef(oid) LIKE '%replay%') THEN
        ALTER TABLE outbox_quarantine_audit DROP CONSTRAINT IF EXISTS outbox_quarantine_audit_action_check;
        ALTER TABLE outbox_quarantine_audit ADD CONSTRAINT outbox_quarantine_audit_action_check
            CHECK (action IN ('requeue', 'discard', 'prune', 'replay', 'update', 'delete'));
    END IF;
END
$$;

-- The acting role, as the session sees it: the role set by `SET ROLE`, else the login role.
-- Not `current_user`: inside the trigger's function below (SECURITY DEFINER) that is the
-- function's owner, while the `role` setting stays the session's.
DO $$
DECLARE
    here TEXT := current_schema();
    actor TEXT := 'CASE WHEN pg_catalog.current_setting(''role'') = ''none'' THEN session_user::text '
                  'ELSE pg_catalog.current_setting(''role'') END';
BEGIN
    IF (SELECT prosrc FROM pg_catalog.pg_proc
        WHERE oid = to_regprocedure(format('%I.outbox_quarantine_audit_stamp()', here)))
       NOT LIKE '%current_setting(''role'')%' THEN
        EXECUTE format($f$
            CREATE OR REPLACE FUNCTION %I.outbox_quarantine_audit_stamp() RETURNS trigger
            LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $b$
            BEGIN
                NEW.at := pg_catalog.now();
                NEW.db_user := %s;
                NEW.db_session_user := session_user;
                RETURN NEW;
            END
            $b$ $f$, here, actor);
    END IF;
END
$$;

-- Shared by every set of tables in the schema, made where missing (as migration 0010's). Runs
-- as its owner (SECURITY DEFINER), whose INSERT on the audit the acting role does not need;
-- its search_path is fixed, so nothing in the acting session's path can stand in for what it
-- calls.
DO $$
DECLARE
    here TEXT := current_schema();
BEGIN
    IF to_regprocedure(format('%I.outbox_quarantine_audit_write()', here)) IS NULL THEN
        EXECUTE format($f$
            CREATE FUNCTION %1$I.outbox_quarantine_audit_write() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $b$
            DECLARE
                -- Named apart from the tables' columns (`reason`, `detail`).
                v_said TEXT := nullif(current_setting('outbox.audit_action', true), '');
                v_action TEXT;
                v_reason TEXT := nullif(current_setting('outbox.audit_reason', true), '');
                v_detail JSONB := coalesce(
                    nullif(current_setting('outbox.audit_detail', true), '')::jsonb, '{}');
                v_table TEXT := format('%%I.%%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
                v_side TEXT := CASE WHEN TG_LEVEL = 'ROW' THEN 'relay' ELSE 'consumer' END;
            BEGIN
                -- Anyone may put a trigger on a table of their own (a temporary one) that
                -- calls this function: it writes for the registered quarantines alone.
                IF NOT EXISTS (SELECT FROM %1$I.outbox_quarantine_tables
                               WHERE table_oid = TG_RELID AND side = v_side) THEN
                    RAISE EXCEPTION 'outbox_quarantine_audit_write() audits registered quarantine tables only, not %%', v_table
                        USING ERRCODE = 'insufficient_privilege';
                END IF;
                -- A name the statement claims must be what it did; else it is recorded as
                -- what it did, with the claim in its detail.
                -- (NEW is read only in a row-level trigger's branch: a statement-level one
                -- has none.)
                IF v_said IS NULL THEN
                    v_action := lower(TG_OP);
                ELSIF TG_OP = 'DELETE' AND (v_said = 'discard' OR (v_side = 'consumer'
                        AND v_said IN ('requeue', 'prune', 'replay'))) THEN
                    v_action := v_said;
                ELSIF TG_OP = 'UPDATE' AND v_side = 'relay' AND v_said = 'requeue' THEN
                    IF NEW.status <> 'quarantined' THEN
                        v_action := v_said;
                    ELSE
                        v_action := 'update';
                    END IF;
                ELSE
                    v_action := lower(TG_OP);
                END IF;
                IF v_said IS NOT NULL AND v_said <> v_action THEN
                    v_detail := v_detail || jsonb_build_object('claimed_action', v_said);
                END IF;
                IF TG_LEVEL = 'ROW' THEN
                    -- The outbox: one quarantined row.
                    INSERT INTO %1$I.outbox_quarantine_audit
                        (action, side, table_name, row_ids, event_ids, consumers, reason, detail)
                    VALUES (v_action, 'relay', v_table, ARRAY[OLD.seq], ARRAY[OLD.id], '{}',
                            v_reason, v_detail);
                    RETURN NULL;
                END IF;
                -- A consumer's quarantine or parked records: the statement's rows, `changed`.
                -- A prune of more than a thousand rows lists no ids (a flood of poison would
                -- double in the audit): how many, their least and greatest id and time.
                INSERT INTO %1$I.outbox_quarantine_audit
                    (action, side, table_name, row_ids, event_ids, consumers, reason, detail)
                SELECT v_action, 'consumer', v_table,
                       CASE WHEN v_action = 'prune' AND count(*) > 1000 THEN '{}'
                            ELSE array_agg(c.id ORDER BY c.id) END,
                       CASE WHEN v_action = 'prune' AND count(*) > 1000 THEN '{}'
                            ELSE array_agg(c.event_id ORDER BY c.id) END,
                       coalesce(array_agg(DISTINCT c.consumer), '{}'),
                       v_reason,
                       CASE WHEN v_action = 'prune' THEN v_detail || jsonb_build_object(
                                'rows', count(*), 'first_row_id', min(c.id),
                                'last_row_id', max(c.id), 'first_at', min(c.quarantined_at),
                                'last_at', max(c.quarantined_at))
                            ELSE v_detail END
                FROM changed c HAVING count(*) > 0;
                -- What the statement said was for it alone: a later statement of the same
                -- transaction is not that action.
                PERFORM set_config('outbox.audit_action', '', true),
                        set_config('outbox.audit_reason', '', true),
                        set_config('outbox.audit_detail', '', true);
                RETURN NULL;
            END
            $b$ $f$, here);
    END IF;
    -- A quarantined message keeps its id: the operator's `UPDATE (id)` (roles.sql) is for the row
    -- locks of a requeue, and a renumbered row would no longer be the one the audit names.
    IF to_regprocedure(format('%I.outbox_quarantine_id_fixed()', here)) IS NULL THEN
        EXECUTE format($f$
            CREATE FUNCTION %I.outbox_quarantine_id_fixed() RETURNS trigger
            LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $b$
            BEGIN
                RAISE EXCEPTION 'the id of a quarantined message never changes'
                    USING ERRCODE = 'insufficient_privilege';
            END
            $b$ $f$, here);
    END IF;
END
$$;

-- This set's tables. Transition tables take one event per trigger.
CREATE TRIGGER outbox_events_audit_update AFTER UPDATE ON outbox_events
    FOR EACH ROW WHEN (OLD.status = 'quarantined')
    EXECUTE FUNCTION outbox_quarantine_audit_write();
CREATE TRIGGER outbox_events_audit_delete AFTER DELETE ON outbox_events
    FOR EACH ROW WHEN (OLD.status = 'quarantined')
    EXECUTE FUNCTION outbox_quarantine_audit_write();
CREATE TRIGGER outbox_consumer_quarantine_audit_update AFTER UPDATE ON outbox_consumer_quarantine
    REFERENCING OLD TABLE AS changed FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_quarantine_audit_write();
CREATE TRIGGER outbox_consumer_quarantine_audit_delete AFTER DELETE ON outbox_consumer_quarantine
    REFERENCING OLD TABLE AS changed FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_quarantine_audit_write();
CREATE TRIGGER outbox_consumer_quarantine_parked_audit_delete
    AFTER DELETE ON outbox_consumer_quarantine_parked
    REFERENCING OLD TABLE AS changed FOR EACH STATEMENT
    EXECUTE FUNCTION outbox_quarantine_audit_write();
CREATE TRIGGER outbox_consumer_quarantine_id_fixed BEFORE UPDATE OF id ON outbox_consumer_quarantine
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION outbox_quarantine_id_fixed();
