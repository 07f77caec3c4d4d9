//! Operator actions on quarantined outbox rows.

use chrono::{DateTime, Utc};
use outbox_core::{QuarantineTable, TableNames};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::ProducerError;

/// A quarantined outbox row, without its payload.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct QuarantinedRow {
    /// The row's sequence number: what `requeue` and `discard` take.
    pub seq: i64,
    /// The event id.
    pub id: Uuid,
    /// Debezium's `aggregatetype`.
    pub aggregatetype: String,
    /// The key.
    pub aggregateid: String,
    /// The event type.
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
    pub event_type: String,
    /// Where it was to be published.
    pub topic: String,
    /// Publish attempts made.
    pub attempts: i32,
    /// Why it is quarantined.
    pub last_error: Option<String>,
    /// When the event was decided.
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str =
    "seq, id, aggregatetype, aggregateid, type, topic, attempts, last_error, created_at";

fn quarantine(tables: &TableNames) -> QuarantineTable<'_> {
    QuarantineTable::new(&tables.outbox, COLUMNS, "seq", "status = 'quarantined'")
}

/// The oldest `limit` quarantined rows.
pub async fn list_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    limit: i64,
) -> Result<Vec<QuarantinedRow>, ProducerError> {
    Ok(quarantine(tables).list(conn, limit).await?)
}

/// Quarantined rows with the given sequence numbers.
pub async fn get_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    seqs: &[i64],
) -> Result<Vec<QuarantinedRow>, ProducerError> {
    Ok(quarantine(tables).get(conn, seqs).await?)
}

/// Makes quarantined rows pending again, with a fresh attempt count. Returns how many rows
/// were requeued.
///
/// The relay publishes requeued rows of a key in `seq` order, and before any later row of the
/// key still pending. Where a requeued row lands among what was already published depends on
/// the [`QuarantinePolicy`](crate::QuarantinePolicy) it was quarantined under: with
/// `BlockKey` its key's later rows waited behind it, so it takes its place in the key's order;
/// with `SkipQuarantined` (the default) they were published meanwhile, and the requeued row
/// lands after them: consumers see that event late, out of its key's order.
pub async fn requeue(
    conn: &mut PgConnection,
    tables: &TableNames,
    seqs: &[i64],
) -> Result<u64, ProducerError> {
    let t = &tables.outbox;
    let query = format!(
        "UPDATE {t} SET status = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL \
         WHERE seq = ANY($1) AND status = 'quarantined'"
    );
    Ok(sqlx::query(AssertSqlSafe(query))
        .bind(seqs)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Deletes quarantined rows for good. Returns how many rows were deleted.
pub async fn discard(
    conn: &mut PgConnection,
    tables: &TableNames,
    seqs: &[i64],
) -> Result<u64, ProducerError> {
    Ok(quarantine(tables).discard(conn, seqs).await?)
}
