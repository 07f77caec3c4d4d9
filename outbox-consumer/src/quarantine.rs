//! Operator actions on quarantined consumer messages.

use chrono::{DateTime, Utc};
use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::ConsumerError;

/// A quarantined message, whole: enough to publish it again exactly as it was received.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct QuarantinedMessage {
    /// Quarantine row id: what `discard` takes.
    pub id: i64,
    /// Consumer that quarantined it.
    pub consumer: String,
    /// Where it was read.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// The event id, when it could be decoded.
    pub event_id: Option<Uuid>,
    /// Reason kind (`invalid_json`, `handler_failed`, ...).
    pub reason: String,
    /// The error in words.
    pub error: String,
    /// When it was quarantined.
    pub quarantined_at: DateTime<Utc>,
    /// The raw key.
    pub message_key: Option<Vec<u8>>,
    /// The raw value.
    pub payload: Option<Vec<u8>>,
    /// Headers, as UTF-8 text.
    pub headers: sqlx::types::Json<serde_json::Map<String, serde_json::Value>>,
}

const COLUMNS: &str = "id, consumer, topic, partition, \"offset\", event_id, reason, error, quarantined_at, \
                       message_key, payload, headers";

/// The oldest `limit` quarantined messages, of every consumer.
pub async fn list_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    limit: i64,
) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
    let t = &tables.consumer_quarantine;
    let query = format!("SELECT {COLUMNS} FROM {t} ORDER BY id LIMIT $1");
    Ok(sqlx::query_as(AssertSqlSafe(query))
        .bind(limit)
        .fetch_all(conn)
        .await?)
}

/// Quarantined messages with the given ids.
pub async fn get_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
    let t = &tables.consumer_quarantine;
    let query = format!("SELECT {COLUMNS} FROM {t} WHERE id = ANY($1) ORDER BY id");
    Ok(sqlx::query_as(AssertSqlSafe(query))
        .bind(ids)
        .fetch_all(conn)
        .await?)
}

/// Deletes quarantined messages (after they were requeued, or to drop them for good).
pub async fn discard(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
) -> Result<u64, ConsumerError> {
    let t = &tables.consumer_quarantine;
    let query = format!("DELETE FROM {t} WHERE id = ANY($1)");
    Ok(sqlx::query(AssertSqlSafe(query))
        .bind(ids)
        .execute(conn)
        .await?
        .rows_affected())
}
