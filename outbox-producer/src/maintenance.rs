use std::time::Duration;

use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use crate::ProducerError;

/// Counts stop at this many rows: past it the alarm is the same, and counting further would
/// make each read cost as much as the backlog.
pub const STATS_COUNT_CAP: i64 = 1_000_000;

/// How the outbox is doing: what to alarm on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, sqlx::FromRow)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows waiting to be published, counted up to [`STATS_COUNT_CAP`].
    pub pending: i64,
    /// Age in milliseconds of the first pending row in sequence order (the relay's lag), if
    /// any is pending.
    pub oldest_pending_age_ms: Option<i64>,
    /// Rows in quarantine, waiting for an operator, counted up to [`STATS_COUNT_CAP`].
    pub quarantined: i64,
}

/// Reads [`OutboxStats`] with bounded index scans: the lag from the first entry of the
/// pending index, the counts stopping at [`STATS_COUNT_CAP`]. It never reads the published
/// rows, however many are retained.
pub async fn stats(
    conn: &mut PgConnection,
    tables: &TableNames,
) -> Result<OutboxStats, ProducerError> {
    stats_where(conn, tables, "TRUE").await
}

/// [`stats`] of the rows matching `lane` (a predicate on `topic` the lane's SQL built from
/// validated names), so that a relay's gauges never count a dispatcher's actions.
pub(crate) async fn stats_where(
    conn: &mut PgConnection,
    tables: &TableNames,
    lane: &str,
) -> Result<OutboxStats, ProducerError> {
    let t = &tables.outbox;
    let query = format!(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'pending' AND {lane} LIMIT $1) AS p) \
                  AS pending, \
                (SELECT (extract(epoch FROM now() - created_at) * 1000)::bigint \
                   FROM {t} WHERE status = 'pending' AND {lane} ORDER BY seq LIMIT 1) AS oldest_pending_age_ms, \
                (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'quarantined' AND {lane} LIMIT $1) AS q) \
                  AS quarantined"
    );
    // Past a few million rows the counts' cost estimates pass `jit_above_cost` and the
    // parallel thresholds, and compiling the plan and starting workers cost more than the
    // bounded reads themselves (bench P7: 2.1-2.3 × the cost at the cap, equal without). The
    // settings live in a transaction of its own (a savepoint inside the caller's), rolled
    // back: the caller's session keeps its own.
    let mut tx = conn.begin().await?;
    sqlx::raw_sql("SET LOCAL jit = off; SET LOCAL max_parallel_workers_per_gather = 0")
        .execute(&mut *tx)
        .await?;
    let stats = sqlx::query_as(AssertSqlSafe(query))
        .bind(STATS_COUNT_CAP)
        .fetch_one(&mut *tx)
        .await?;
    tx.rollback().await?;
    Ok(stats)
}

/// Deletes published rows older than `older_than`, `batch` rows per statement so no lock is
/// held for long and relays keep running (rows a relay has locked are skipped), one instance
/// at a time (another finds it running and returns 0). Each batch reads only the rows it
/// deletes, through the index on `published_at` of published rows, from where the previous
/// batch stopped. Returns how many rows were removed.
pub async fn prune_published(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
) -> Result<u64, ProducerError> {
    let t = &tables.outbox;
    // In published_at order from where the previous batch stopped: see delete_in_batches.
    let query = format!(
        "WITH gone AS ( \
            DELETE FROM {t} WHERE seq IN ( \
                SELECT seq FROM {t} WHERE status = 'published' \
                  AND published_at < now() - $1 * interval '1 millisecond' \
                  AND published_at >= coalesce($3, '-infinity'::timestamptz) \
                ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED) \
            RETURNING published_at) \
         SELECT count(*), max(published_at) FROM gone"
    );
    Ok(outbox_core::delete_in_batches(conn, t, query, older_than, batch).await?)
}
