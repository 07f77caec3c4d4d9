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
    /// `$3` is visible and was inserted by the transaction now open; it also lets the
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
    pub(crate) quarantine: SqlStr,
}

impl ConsumerSql {
    pub(crate) fn new(tables: &TableNames) -> Self {
        let dedup = &tables.consumer_dedup;
        let quarantine = &tables.consumer_quarantine;
        // Migration 0015's gate: a row per transaction that records ids, whose deferred check
        // fails any COMMIT but the consumer's own (`holds_dedup_row` allows it).
        // An `Ident` is lowercase letters, digits and '_': the suffixed name stays one.
        let gate = format!("\"{}_gate\"", dedup.as_str());
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
                    AND EXISTS (SELECT FROM {dedup} WHERE consumer = $1 AND event_id = $2 \
                                AND slice = $3 AND xmin = pg_current_xact_id_if_assigned()::xid)"
            ))
            .into_sql_str(),
            allow_commit: AssertSqlSafe(format!(
                "WITH opened AS (DELETE FROM {gate} WHERE tx = pg_current_xact_id_if_assigned()) \
                 SELECT set_config('outbox.consumer_commit', 'on', true)"
            ))
            .into_sql_str(),
            find_recorded: AssertSqlSafe(format!(
                "SELECT DISTINCT event_id FROM {dedup} WHERE consumer = $1 AND event_id = ANY($2)"
            ))
            .into_sql_str(),
            quarantine: AssertSqlSafe(format!(
                "INSERT INTO {quarantine} \
                    (consumer, topic, partition, \"offset\", event_id, message_key, payload, headers, \
                     header_bytes, reason, error) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                 ON CONFLICT (consumer, topic, partition, \"offset\", record_digest) DO NOTHING"
            ))
            .into_sql_str(),
        }
    }
}
