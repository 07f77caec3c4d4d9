use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection};

/// Runs `delete` (a statement taking `$1` = age in milliseconds and `$2` = row limit) until a
/// run deletes fewer than `batch` rows. Each run is its own short statement, so pruning never
/// holds many locks for long and can run beside relays and consumers. Returns the total.
///
/// Shared by the framework's prune functions; `delete` must be built only from validated
/// [`crate::Ident`]s.
pub async fn delete_in_batches(
    conn: &mut PgConnection,
    delete: String,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let batch = batch.max(1);
    let mut removed = 0;
    loop {
        let n = sqlx::query(AssertSqlSafe(delete.clone()))
            .bind(older_than.as_secs_f64() * 1000.0)
            .bind(i64::from(batch))
            .execute(&mut *conn)
            .await?
            .rows_affected();
        removed += n;
        if n < u64::from(batch) {
            return Ok(removed);
        }
    }
}
