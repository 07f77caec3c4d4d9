-- Grants for the outbox framework's least-privileged roles (README, "Roles").
--
-- Run it as the owner of the framework's tables (the role that ran `outbox migrate`), with
-- their schema first in `search_path`, in one transaction (so that no running part is left
-- between a REVOKE and its GRANT), e.g.
--     psql "$OWNER_URL" -1 -v ON_ERROR_STOP=1 -f roles.sql
-- The roles must exist: creating them, their passwords and their LOGIN or REPLICATION
-- attributes is the operator's, never a migration's. Replace the names outbox_writer,
-- outbox_relay, outbox_dispatcher, outbox_dedup_consumer, outbox_status_reader,
-- outbox_debezium and outbox_quarantine_operator with yours
-- (or create roles by those names and GRANT them to your login roles), and the table names
-- if you chose others (`TableNames`, the CLI's --outbox-table and friends). Delete the lines
-- of the parts you do not run. Running it twice is harmless.
--
-- The pruner (`outbox prune dedup`, `DedupPruner`) and `outbox migrate` run as the owner:
-- dropping and making the dedup table's day slices (DETACH / ATTACH PARTITION, DROP TABLE)
-- needs ownership of it, which no GRANT gives. Nothing here grants on the day slices
-- themselves: privileges are checked on the table a statement names, and every part reaches
-- the slices through the dedup table, so slices the owner makes later need no grant
-- (no ALTER DEFAULT PRIVILEGES).

-- Every part reaches the tables' schema. The owner must own the schema (or hold USAGE on it
-- WITH GRANT OPTION): otherwise PostgreSQL grants nothing, says so only in a warning, and
-- every part then fails with "relation ... does not exist".
DO $$
DECLARE
    part TEXT;
BEGIN
    -- One role a line: delete the line of a part you do not run.
    FOREACH part IN ARRAY ARRAY[
        'outbox_writer',
        'outbox_relay',
        'outbox_dispatcher',
        'outbox_dedup_consumer',
        'outbox_status_reader',
        'outbox_debezium',
        'outbox_quarantine_operator'
    ] LOOP
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I',
            (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.oid = 'outbox_events'::regclass),
            part);
    END LOOP;
END
$$;

-- The application writer: the transaction that changes state and enqueues its events.
-- INSERT (the identity column needs no sequence grant; the advisory lock per key and NOTIFY
-- need none), and the columns `dispatch::outcome` reads, to learn what became of its
-- actions (not the payloads and headers: what it wrote is its own to keep).
GRANT INSERT ON outbox_events TO outbox_writer;
GRANT SELECT (seq, id, topic, status, attempts, lease, calls, last_error, outcome)
    ON outbox_events TO outbox_writer;

-- Every role below that changes outbox rows changes only the columns that say what became of
-- them: none can rewrite a row's payload, headers, topic or key (turn a published row into a
-- pending `dispatch:billing` action with a payload of its choosing, say). The REVOKEs take
-- back the table-wide UPDATE this file granted before.

-- The relay: claims pending rows (SELECT .. FOR UPDATE SKIP LOCKED, which needs UPDATE of a
-- column), marks them published or records failures and quarantines, LISTENs (no grant).
REVOKE UPDATE ON outbox_events FROM outbox_relay;
GRANT SELECT ON outbox_events TO outbox_relay;
GRANT UPDATE (status, attempts, next_attempt_at, last_error, published_at)
    ON outbox_events TO outbox_relay;
-- The dispatcher (`outbox_producer::dispatch`): the same, and its leases, calls and answers.
REVOKE UPDATE ON outbox_events FROM outbox_dispatcher;
GRANT SELECT ON outbox_events TO outbox_dispatcher;
GRANT UPDATE (status, attempts, next_attempt_at, last_error, published_at, outcome, lease, calls)
    ON outbox_events TO outbox_dispatcher;
-- Only with `AfterPublish::Delete` (rows deleted once published):
-- GRANT DELETE ON outbox_events TO outbox_relay;

-- The dedup consumer: records ids (INSERT), looks for recorded ones (SELECT), deletes the
-- rows of a batch cut short by a rebalance (DELETE); quarantines poison (INSERT, and SELECT on
-- the columns its ON CONFLICT names: it reads no quarantined message). Its handlers' own
-- tables are the application's to grant. It cannot make day slices: the owner's `outbox
-- migrate` and `outbox prune dedup` make them ahead, and a day without one is recorded in the
-- timeless slice (README, "Roles").
GRANT SELECT, INSERT, DELETE ON outbox_consumer_dedup TO outbox_dedup_consumer;
-- Its transactions' gate rows (migration 0015): inserted with the ids, deleted before COMMIT.
GRANT SELECT, INSERT, DELETE ON outbox_consumer_dedup_gate TO outbox_dedup_consumer;
GRANT INSERT, SELECT (consumer, topic, partition, "offset", record_digest)
    ON outbox_consumer_quarantine TO outbox_dedup_consumer;
-- Under `ParkKey` (migration 0016): parks records and keys, reads them back to replay a
-- released key, and deletes what it replayed.
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_consumer_quarantine_parked,
    outbox_consumer_quarantine_parked_keys TO outbox_dedup_consumer;

-- `outbox status`: reads only.
GRANT SELECT ON outbox_events, outbox_consumer_dedup, outbox_consumer_quarantine,
    outbox_consumer_quarantine_parked, outbox_consumer_quarantine_parked_keys
    TO outbox_status_reader;

-- Debezium's connector (instead of the relay): a role with the REPLICATION and LOGIN
-- attributes (CREATE ROLE outbox_debezium LOGIN REPLICATION, the operator's), SELECT on the
-- outbox table, and a publication made beforehand by the owner, the connector set to
-- `publication.name` = it and `publication.autocreate.mode` = disabled (making it needs
-- ownership of the table):
--     CREATE PUBLICATION outbox_publication FOR TABLE outbox_events;
GRANT SELECT ON outbox_events TO outbox_debezium;

-- Quarantine operators (`outbox quarantine list|show|requeue|discard|audit`, `outbox prune
-- quarantine`): find the quarantine tables in the registry, act on their rows (UPDATE also
-- for a consumer requeue's row locks and a relay requeue), and read the audit (`outbox
-- quarantine audit`). The database writes the audit (migration 0017's triggers, as its owner,
-- for every change of quarantined rows, whoever makes it): nobody but the owner gets INSERT,
-- UPDATE or DELETE on it (the REVOKE takes back what this file granted before), nor INSERT on
-- the registry (a row there makes a table actionable).
GRANT SELECT ON outbox_quarantine_tables TO outbox_quarantine_operator;
GRANT SELECT ON outbox_quarantine_audit TO outbox_quarantine_operator;
REVOKE INSERT ON outbox_quarantine_audit FROM outbox_quarantine_operator;
-- A relay requeue sets the row's state only; a consumer requeue locks its rows (FOR UPDATE
-- needs UPDATE of a column: `id`, an identity column an UPDATE can only renumber, audited
-- like any change) and deletes them.
REVOKE UPDATE ON outbox_events, outbox_consumer_quarantine FROM outbox_quarantine_operator;
GRANT SELECT, DELETE ON outbox_events, outbox_consumer_quarantine TO outbox_quarantine_operator;
GRANT UPDATE (status, attempts, next_attempt_at, last_error) ON outbox_events
    TO outbox_quarantine_operator;
GRANT UPDATE (id) ON outbox_consumer_quarantine TO outbox_quarantine_operator;
-- `outbox parked list|show|release|skip`: reads parked keys and records, asks for a release
-- (UPDATE of one column), drops a parked record (audited, as a discard).
GRANT SELECT ON outbox_consumer_quarantine_parked, outbox_consumer_quarantine_parked_keys
    TO outbox_quarantine_operator;
GRANT UPDATE (release_requested_at) ON outbox_consumer_quarantine_parked_keys
    TO outbox_quarantine_operator;
GRANT DELETE ON outbox_consumer_quarantine_parked TO outbox_quarantine_operator;
