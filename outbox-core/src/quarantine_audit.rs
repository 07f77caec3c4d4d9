//! Reading the record of changes to quarantined rows (`outbox_quarantine_audit`, written by
//! the database: migration 0017's triggers record every UPDATE and DELETE of a quarantined
//! row, whoever issues it; [`crate::QuarantineTable`]'s actions name themselves).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

/// One action on quarantined rows.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The row's number. Not the order of the actions: an insert can choose it (`OVERRIDING
    /// SYSTEM VALUE`); `at`, which the server sets, is.
    pub id: i64,
    /// When its transaction began (the server's `now()`).
    pub at: DateTime<Utc>,
    /// `requeue`, `discard` or `prune` (an operator's action), `replay` (a consumer replaying
    /// a released parked record), or `update` or `delete`: a statement that did not name
    /// itself (typed by hand, say). The name is the acting session's word; the time, the roles
    /// and the rows are the server's.
    pub action: String,
    /// `relay` or `consumer`.
    pub side: String,
    /// The table acted on, schema-qualified.
    pub table_name: String,
    /// The rows acted on (relay: `seq`, one row per entry; consumer: quarantine row id, every
    /// row of the statement; none for a prune, whose detail counts them).
    pub row_ids: Vec<i64>,
    /// Their event ids, in the same order (`None` where the consumer could not decode one).
    pub event_ids: Vec<Option<Uuid>>,
    /// Consumer side: whose messages they were.
    pub consumers: Vec<String>,
    /// The database role the action ran as (set by `SET ROLE`, else the login role).
    pub db_user: String,
    /// The role that logged in (`session_user`).
    pub db_session_user: String,
    /// The operator's reason.
    pub reason: Option<String>,
    /// What else the action took (a requeue's target, a prune's age).
    pub detail: Json<serde_json::Map<String, serde_json::Value>>,
}

/// The newest `limit` actions, newest first (by `at`, which the server sets; then by `id`).
pub async fn quarantine_audit(
    conn: &mut PgConnection,
    limit: i64,
) -> Result<Vec<AuditEntry>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, at, action, side, table_name, row_ids, event_ids, consumers, db_user, \
                db_session_user, reason, detail \
         FROM outbox_quarantine_audit ORDER BY at DESC, id DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(conn)
    .await
}
