//! SQL text for the consumer's tables. Only validated `Ident`s are spliced in.

use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// How many advisory locks late ids (`slice.rs`) share per (dedup table, consumer): what one
/// transaction may hold at most, whatever its batch size, so that a replay of old events by
/// many partitions at once stays within Postgres's lock table (`max_locks_per_transaction`,
/// 64 by default, per connection). Ids that share a lock only wait for each other.
pub(crate) const LATE_ID_LOCKS: u32 = 64;

#[derive(Debug, Clone)]
pub(crate) struct ConsumerSql {
    /// `$3` is the id's slice (`slice::Placement::slice`), as in the next three.
    pub(crate) insert_dedup: SqlStr,
    /// Inserts many ids at once; returns those that were new.
    pub(crate) insert_dedup_batch: SqlStr,
    /// Inserts many ids expected to be new; fails on any that is not (a unique violation).
    pub(crate) insert_new_dedup_batch: SqlStr,
    /// Deletes ids this transaction inserted but did not handle.
    pub(crate) delete_dedup_batch: SqlStr,
    /// Takes the transaction advisory locks of late ids (`slice.rs`): `$1` the dedup table,
    /// `$2` the consumer, `$3` the ids; in the order of their keys, so that transactions that
    /// lock overlapping sets cannot deadlock on them. An id's lock is one of
    /// [`LATE_ID_LOCKS`] per (dedup table, consumer).
    pub(crate) lock_late_ids: SqlStr,
    /// Run before COMMIT (`failure.rs`): whether the dedup row of consumer `$1`, id `$2`, slice
    /// `$3` is visible (it also sets the session's `search_path` back to `$4`, the consumer's,
    /// whatever a handler set: see [`crate::consumer::Session`]) and was inserted by the transaction now open; it also lets the
    /// consumer's COMMIT through migration 0015's gate (and deletes the gate's row). Fails with SQLSTATE 25P02
    /// in an aborted transaction (and with the server's error if it ended the session); false
    /// if the transaction that holds the dedup rows was ended by a handler (`ROLLBACK`, or
    /// `COMMIT`, with or without a `BEGIN` after it). A row's `xmin` is the 32-bit `xid` of
    /// the transaction that inserted it; the current transaction's is the `xid8` cast down.
    pub(crate) holds_dedup_row: SqlStr,
    /// Lets the consumer's own COMMIT through migration 0015's gate, where no
    /// [`Self::holds_dedup_row`] ran (no message of the transaction was processed).
    pub(crate) allow_commit: SqlStr,
    /// The ids of `$2` recorded for consumer `$1` in any slice.
    pub(crate) find_recorded: SqlStr,
    /// Stores a record in the quarantine table (`quarantine::store` binds `$1`..`$12`).
    pub(crate) quarantine: SqlStr,
    /// Under `ParkKey`: stores the record that parks its key (`$6`), as [`Self::quarantine`]
    /// binds it, and parks the key, clearing a release asked for it (the release's replay
    /// failed on this record again). The record redelivered, or failing again in a replay,
    /// keeps one row, with the latest reason.
    pub(crate) park_head: SqlStr,
    /// Under `ParkKey`: stores a record behind its parked key, as [`Self::quarantine`].
    pub(crate) park_behind: SqlStr,
    /// The parked keys of consumer `$1`, topic `$2`, partition `$3`, with their records' count.
    pub(crate) parked_keys: SqlStr,
    /// The keys of `$1`, `$2`, `$3` whose release an operator asked for.
    pub(crate) released_keys: SqlStr,
    /// The first record parked under `$1`, `$2`, `$3`, key `$4`.
    pub(crate) parked_head: SqlStr,
    /// Parked record `$5` cannot be replayed: says so in its error, and clears the release of
    /// its key (`$1`..`$4` as `unpark_key`'s).
    pub(crate) unreplayable: SqlStr,
    /// Deletes parked record `$1` (replayed).
    pub(crate) unpark_record: SqlStr,
    /// Unparks key `$4` of `$1`, `$2`, `$3` when it has no record parked; true if it did.
    pub(crate) unpark_key: SqlStr,
}

impl ConsumerSql {
    /// The statements on `tables`, the dedup table's (and its gate's) qualified by
    /// `schemas.0` and the quarantine's (and its park's) by `schemas.1` when given (see
    /// [`crate::consumer::Session`]).
    pub(crate) fn new(tables: &TableNames, schemas: Option<(&str, &str)>) -> Self {
        let qualified = |schema: Option<&str>, table: &outbox_core::Ident| match schema {
            Some(schema) => format!("\"{}\".{table}", schema.replace('"', "\"\"")),
            None => table.to_string(),
        };
        let (dedup_schema, quarantine_schema) = (schemas.map(|s| s.0), schemas.map(|s| s.1));
        let (dedup_table, quarantine_table) = (&tables.consumer_dedup, &tables.consumer_quarantine);
        // Migration 0016's tables, named after the quarantine as the gate is after the dedup
        // table.
        let parked = qualified(
            quarantine_schema,
            &quarantine_table.suffixed(crate::parked::PARKED),
        );
        let keys = qualified(
            quarantine_schema,
            &quarantine_table.suffixed(crate::parked::PARKED_KEYS),
        );
        let (dedup, quarantine) = (
            qualified(dedup_schema, dedup_table),
            qualified(quarantine_schema, quarantine_table),
        );
        let store = |table: &str, on_conflict: &str| {
            format!(
                "INSERT INTO {table} \
                    (consumer, topic, partition, \"offset\", event_id, message_key, payload, headers, \
                     header_bytes, reason, error, record_timestamp) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) \
                 ON CONFLICT (consumer, topic, partition, \"offset\", record_digest) {on_conflict}"
            )
        };
        let park_key = |on_conflict: &str| {
            format!(
                "parked AS (INSERT INTO {keys} (consumer, topic, partition, message_key) \
                    VALUES ($1, $2, $3, $6) \
                    ON CONFLICT (consumer, topic, partition, message_key) {on_conflict})"
            )
        };
        let position = "consumer = $1 AND topic = $2 AND partition = $3";
        // Migration 0015's gate: a row per transaction that records ids, whose deferred check
        // fails any COMMIT but the consumer's own (`holds_dedup_row` allows it).
        // An `Ident` is lowercase letters, digits and '_': the suffixed name stays one.
        let gate = qualified(dedup_schema, &dedup_table.suffixed("_gate"));
        let with_gate = |insert: String| {
            format!(
                "WITH ins AS ({insert} RETURNING event_id), \
                      gate AS (INSERT INTO {gate} SELECT WHERE EXISTS (SELECT FROM ins)) \
                 SELECT event_id FROM ins"
            )
        };
        Self {
            insert_dedup: AssertSqlSafe(with_gate(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING"
            )))
            .into_sql_str(),
            insert_dedup_batch: AssertSqlSafe(with_gate(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) \
                 SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice) \
                 ON CONFLICT DO NOTHING"
            )))
            .into_sql_str(),
            insert_new_dedup_batch: AssertSqlSafe(with_gate(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) \
                 SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice)"
            )))
            .into_sql_str(),
            delete_dedup_batch: AssertSqlSafe(format!(
                "DELETE FROM {dedup} WHERE consumer = $1 \
                 AND (event_id, slice) IN (SELECT * FROM unnest($2::uuid[], $3::int[]))"
            ))
            .into_sql_str(),
            // Keys in the one-bigint advisory lock space, apart from the two-int keys of the
            // slice creators and pruners.
            lock_late_ids: AssertSqlSafe(format!(
                "SELECT pg_advisory_xact_lock(k) FROM ( \
                    SELECT DISTINCT hashtextextended( \
                        $1 || '/' || $2 || '/' || (hashtext(id::text) & {mask}), 0) AS k \
                    FROM unnest($3::uuid[]) AS t(id) ORDER BY k) AS keys",
                mask = LATE_ID_LOCKS - 1
            ))
            .into_sql_str(),
            holds_dedup_row: AssertSqlSafe(format!(
                "WITH opened AS (DELETE FROM {gate} WHERE tx = pg_current_xact_id_if_assigned()) \
                 SELECT set_config('outbox.consumer_commit', 'on', true) = 'on' \
                    AND set_config('search_path', \
                                   coalesce($4, current_setting('search_path')), false) \
                        IS NOT NULL \
                    AND EXISTS (SELECT FROM {dedup} WHERE consumer = $1 AND event_id = $2 \
                                AND slice = $3 AND xmin = pg_current_xact_id_if_assigned()::xid)"
            ))
            .into_sql_str(),
            allow_commit: AssertSqlSafe(format!(
                "WITH opened AS (DELETE FROM {gate} WHERE tx = pg_current_xact_id_if_assigned()) \
                 SELECT set_config('outbox.consumer_commit', 'on', true), \
                    set_config('search_path', coalesce($1, current_setting('search_path')), false)"
            ))
            .into_sql_str(),
            find_recorded: AssertSqlSafe(format!(
                "SELECT DISTINCT event_id FROM {dedup} WHERE consumer = $1 AND event_id = ANY($2)"
            ))
            .into_sql_str(),
            quarantine: AssertSqlSafe(store(&quarantine, "DO NOTHING")).into_sql_str(),
            park_head: AssertSqlSafe(format!(
                "WITH {} {}",
                park_key("DO UPDATE SET release_requested_at = NULL"),
                store(
                    &parked,
                    "DO UPDATE SET reason = EXCLUDED.reason, error = EXCLUDED.error, \
                     quarantined_at = now()"
                )
            ))
            .into_sql_str(),
            park_behind: AssertSqlSafe(format!(
                "WITH {} {}",
                park_key("DO NOTHING"),
                store(&parked, "DO NOTHING")
            ))
            .into_sql_str(),
            parked_keys: AssertSqlSafe(format!(
                "SELECT k.message_key, (SELECT count(*) FROM {parked} p WHERE p.consumer = $1 \
                    AND p.topic = $2 AND p.partition = $3 AND p.message_key = k.message_key) \
                 FROM {keys} k WHERE {position}"
            ))
            .into_sql_str(),
            released_keys: AssertSqlSafe(format!(
                "SELECT message_key FROM {keys} WHERE {position} \
                 AND release_requested_at IS NOT NULL"
            ))
            .into_sql_str(),
            parked_head: AssertSqlSafe(format!(
                "SELECT {} FROM {parked} WHERE {position} AND message_key = $4 \
                 ORDER BY \"offset\", id LIMIT 1",
                crate::quarantine::COLUMNS.all
            ))
            .into_sql_str(),
            unreplayable: AssertSqlSafe(format!(
                "WITH held AS (UPDATE {keys} SET release_requested_at = NULL \
                    WHERE {position} AND message_key = $4) \
                 UPDATE {parked} SET error = 'cannot be replayed: a header name is not UTF-8 \
                    (outbox parked skip drops it); ' || error WHERE id = $5"
            ))
            .into_sql_str(),
            // Audited by migration 0017's trigger, as a replay.
            unpark_record: AssertSqlSafe(format!(
                "WITH noted AS (SELECT set_config('outbox.audit_action', 'replay', true)) \
                 DELETE FROM {parked} WHERE id = $1 AND EXISTS (SELECT FROM noted)"
            ))
            .into_sql_str(),
            unpark_key: AssertSqlSafe(format!(
                "DELETE FROM {keys} k WHERE {position} AND message_key = $4 AND NOT EXISTS \
                    (SELECT FROM {parked} p WHERE p.consumer = $1 AND p.topic = $2 \
                     AND p.partition = $3 AND p.message_key = $4)"
            ))
            .into_sql_str(),
        }
    }
}
