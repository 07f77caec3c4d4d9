use std::time::Duration;

use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, PgConnection};

use crate::ProducerError;

/// How the outbox is doing: what to alarm on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, sqlx::FromRow)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows waiting to be published.
    pub pending: i64,
    /// Age of the oldest pending row in milliseconds (the relay's lag), if any is pending.
    pub oldest_pending_age_ms: Option<i64>,
    /// Rows in quarantine, waiting for an operator.
    pub quarantined: i64,
}

/// Reads [`OutboxStats`]. Uses the pending index, so it stays cheap however many published
/// rows are retained.
pub async fn stats(
    conn: &mut PgConnection,
    tables: &TableNames,
) -> Result<OutboxStats, ProducerError> {
    let t = &tables.outbox;
    let query = format!(
        "SELECT (SELECT count(*) FROM {t} WHERE status = 'pending') AS pending, \
                (SELECT (extract(epoch FROM now() - min(created_at)) * 1000)::bigint \
                   FROM {t} WHERE status = 'pending') AS oldest_pending_age_ms, \
                (SELECT count(*) FROM {t} WHERE status = 'quarantined') AS quarantined"
    );
    Ok(sqlx::query_as(AssertSqlSafe(query)).fetch_one(conn).await?)
}

/// Deletes published rows older than `older_than`, `batch` rows per statement so no lock is
/// held for long and relays keep running (rows a relay has locked are skipped). Returns how many rows were removed.
pub async fn prune_published(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
) -> Result<u64, ProducerError> {
    let t = &tables.outbox;
    let query = format!(
        "DELETE FROM {t} WHERE seq IN ( \
            SELECT seq FROM {t} WHERE status = 'published' \
              AND published_at < now() - $1 * interval '1 millisecond' \
            LIMIT $2 FOR UPDATE SKIP LOCKED)"
    );
    Ok(outbox_core::delete_in_batches(conn, query, older_than, batch).await?)
}
