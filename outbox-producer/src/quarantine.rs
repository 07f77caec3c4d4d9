//! Operator actions on quarantined outbox rows. `requeue` and `discard` act only on an outbox
//! the migrations registered (`outbox_quarantine_tables`), and record each action in
//! `outbox_quarantine_audit` in the statement that acts (`outbox_core::QuarantineTable`).

use chrono::{DateTime, Utc};
use outbox_core::{ActionNote, QuarantineColumns, QuarantineSide, QuarantineTable, TableNames};
use sqlx::PgConnection;
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

const COLUMNS: QuarantineColumns = QuarantineColumns {
    all: "seq, id, aggregatetype, aggregateid, type, topic, attempts, last_error, created_at",
    key: "seq",
    held: "status = 'quarantined'",
    event_id: "id",
    consumer: "NULL::text",
    requeue: Some("status = 'pending', attempts = 0, next_attempt_at = now(), last_error = NULL"),
};

fn quarantine(tables: &TableNames) -> QuarantineTable<'_> {
    QuarantineTable::new(QuarantineSide::Relay, &tables.outbox, &COLUMNS)
}

/// Checks that `tables.outbox` is an outbox the migrations made (registered in
/// `outbox_quarantine_tables`); returns its schema-qualified name, or
/// `CoreError::NotAQuarantineTable`. `requeue` and `discard` check it themselves.
pub async fn verify(conn: &mut PgConnection, tables: &TableNames) -> Result<String, ProducerError> {
    Ok(quarantine(tables).verify(conn).await?)
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

/// Makes quarantined rows pending again, with a fresh attempt count, and records it (with
/// `note`) in `outbox_quarantine_audit`, in one statement. Returns how many rows were
/// requeued. A table that is not a registered outbox is refused with
/// `CoreError::NotAQuarantineTable`, nothing changed.
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
    note: &ActionNote,
) -> Result<u64, ProducerError> {
    Ok(quarantine(tables).requeue(conn, seqs, note).await?)
}

/// Deletes quarantined rows for good, and records it (with `note`) in
/// `outbox_quarantine_audit`, in one statement. Returns how many rows were deleted. A table
/// that is not a registered outbox is refused with `CoreError::NotAQuarantineTable`, nothing
/// changed.
pub async fn discard(
    conn: &mut PgConnection,
    tables: &TableNames,
    seqs: &[i64],
    note: &ActionNote,
) -> Result<u64, ProducerError> {
    Ok(quarantine(tables).discard(conn, seqs, note).await?)
}

/// A key of the outbox whose pending rows wait behind a quarantined one: under `BlockKey`
/// (the relay's option, the dispatcher's default) they stay there until the quarantined row
/// is requeued or discarded; under `SkipQuarantined` the relay publishes them past it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct HeldKey {
    /// Where its rows go (`dispatch:<destination>` for a dispatcher's actions).
    pub topic: String,
    /// The key.
    pub aggregateid: String,
    /// The first quarantined row of the key: what `requeue` or `discard` takes.
    pub quarantined_seq: i64,
    /// Why it is quarantined.
    pub last_error: Option<String>,
    /// Pending rows of the key after it.
    pub pending_behind: i64,
}

/// The keys with pending rows behind a quarantined row, the oldest quarantine first, at most
/// `limit`.
pub async fn held_keys(
    conn: &mut PgConnection,
    tables: &TableNames,
    limit: i64,
) -> Result<Vec<HeldKey>, ProducerError> {
    let t = &tables.outbox;
    // Through the partial index on unpublished rows (aggregateid, seq).
    let sql = format!(
        "SELECT q.topic, q.aggregateid, q.seq AS quarantined_seq, q.last_error, \
                (SELECT count(*) FROM {t} p WHERE p.aggregateid = q.aggregateid \
                   AND p.status = 'pending' AND p.seq > q.seq) AS pending_behind \
         FROM (SELECT DISTINCT ON (aggregateid) topic, aggregateid, seq, last_error \
               FROM {t} WHERE status = 'quarantined' ORDER BY aggregateid, seq) q \
         WHERE EXISTS (SELECT FROM {t} p WHERE p.aggregateid = q.aggregateid \
                       AND p.status = 'pending' AND p.seq > q.seq) \
         ORDER BY q.seq LIMIT $1"
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(limit)
        .fetch_all(conn)
        .await?)
}
