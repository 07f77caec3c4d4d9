-- The dedup table in time slices, so that pruning drops whole slices (no row deletes, no dead
-- tuples, the same cost whatever a slice holds) instead of deleting rows.
--
-- A row's slice is a function of its event id alone, so a redelivered id always meets its
-- earlier row in the same slice and the primary key still makes (consumer, event id) unique:
-- the day (since the Unix epoch) of a UUIDv7 id's timestamp, one slice per day; 0 for an id
-- that carries no time (UUIDv4 ids of other producers, Debezium users' own ids), whose slice
-- is pruned by processing time with batched deletes. The consumer computes the same value
-- (`outbox_consumer::dedup_slice`); this function is for SQL and this migration.
CREATE FUNCTION outbox_consumer_dedup_slice(id uuid) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN get_byte(uuid_send(id), 6) >> 4 = 7
                THEN (('x' || encode(substring(uuid_send(id) FROM 1 FOR 6), 'hex'))::bit(48)::bigint
                      / 86400000)::integer
                ELSE 0 END
$$;

ALTER TABLE outbox_consumer_dedup RENAME TO outbox_consumer_dedup_unsliced;
ALTER TABLE outbox_consumer_dedup_unsliced
    RENAME CONSTRAINT outbox_consumer_dedup_pkey TO outbox_consumer_dedup_unsliced_pkey;
ALTER INDEX outbox_consumer_dedup_processed_at_idx
    RENAME TO outbox_consumer_dedup_unsliced_processed_at_idx;

CREATE TABLE outbox_consumer_dedup (
    consumer     TEXT        NOT NULL,
    event_id     UUID        NOT NULL,
    slice        INTEGER     NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id, slice)
) PARTITION BY RANGE (slice);

-- Ids without a time: the only slice that needs an index on processing time.
CREATE TABLE outbox_consumer_dedup_timeless PARTITION OF outbox_consumer_dedup
    FOR VALUES FROM (MINVALUE) TO (1);
CREATE INDEX outbox_consumer_dedup_timeless_processed_at_idx
    ON outbox_consumer_dedup_timeless (processed_at);

-- Every row of the old table moves to its slice; none is lost. In one transaction, so the
-- consumers wait for it (documented in the README: prune first to shorten it).
DO $$
DECLARE
    day integer;
BEGIN
    FOR day IN
        SELECT DISTINCT outbox_consumer_dedup_slice(event_id) FROM outbox_consumer_dedup_unsliced
    LOOP
        CONTINUE WHEN day < 1;
        EXECUTE format('CREATE TABLE %I PARTITION OF outbox_consumer_dedup FOR VALUES FROM (%s) TO (%s)',
                       'outbox_consumer_dedup_d' || day, day, day + 1);
    END LOOP;
END
$$;

INSERT INTO outbox_consumer_dedup (consumer, event_id, slice, processed_at)
SELECT consumer, event_id, outbox_consumer_dedup_slice(event_id), processed_at
FROM outbox_consumer_dedup_unsliced;

DROP TABLE outbox_consumer_dedup_unsliced;
