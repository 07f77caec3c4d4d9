//! The operator's side of [`HandlerFailurePolicy::ParkKey`](crate::HandlerFailurePolicy::ParkKey)
//! (`outbox parked list|show|release|skip`): which keys are parked and why, and the two ways
//! to let one flow again. Both only ask: the consumer owning the key's partition replays its
//! records through its handler, in offset order (within a second of the request while it
//! runs; when it next runs otherwise).

use chrono::{DateTime, Utc};
use outbox_core::{ActionNote, QuarantineSide, QuarantineTable, TableNames};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::ConsumerError;
use crate::quarantine::{COLUMNS, QuarantinedMessage};

/// Suffix of the park table's name (after the quarantine table's).
pub(crate) const PARKED: &str = "_parked";
/// Suffix of the parked keys' table's name.
pub(crate) const PARKED_KEYS: &str = "_parked_keys";

/// A key parked on one partition for one consumer, and the record at its head.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct ParkedKey {
    /// The consumer that parked it.
    pub consumer: String,
    /// Topic and partition.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The Kafka key.
    pub message_key: Vec<u8>,
    /// When its first record was parked.
    pub parked_at: DateTime<Utc>,
    /// When an operator asked for its release, if the consumer has not replayed it yet.
    pub release_requested_at: Option<DateTime<Utc>>,
    /// Records parked under it.
    pub records: i64,
    /// The parked record at its head: what `skip` takes, and the first to be replayed.
    pub head_id: Option<i64>,
    /// The head's offset.
    pub head_offset: Option<i64>,
    /// Why the head was set aside (`handler_failed`, `invalid_json`, ...).
    pub head_reason: Option<String>,
    /// The head's error.
    pub head_error: Option<String>,
}

fn table(tables: &TableNames, suffix: &'static str) -> outbox_core::Ident {
    tables.consumer_quarantine.suffixed(suffix)
}

/// The parked keys of every consumer, oldest first, at most `limit`.
pub async fn list_parked(
    conn: &mut PgConnection,
    tables: &TableNames,
    limit: i64,
) -> Result<Vec<ParkedKey>, ConsumerError> {
    let (keys, parked) = (table(tables, PARKED_KEYS), table(tables, PARKED));
    let sql = format!(
        "SELECT k.consumer, k.topic, k.partition, k.message_key, k.parked_at, \
                k.release_requested_at, \
                (SELECT count(*) FROM {parked} p WHERE p.consumer = k.consumer \
                    AND p.topic = k.topic AND p.partition = k.partition \
                    AND p.message_key = k.message_key) AS records, \
                h.id AS head_id, h.\"offset\" AS head_offset, h.reason AS head_reason, \
                h.error AS head_error \
         FROM {keys} k LEFT JOIN LATERAL ( \
            SELECT id, \"offset\", reason, error FROM {parked} p WHERE p.consumer = k.consumer \
                AND p.topic = k.topic AND p.partition = k.partition \
                AND p.message_key = k.message_key ORDER BY \"offset\", id LIMIT 1) h ON TRUE \
         ORDER BY k.parked_at, k.consumer, k.topic, k.partition LIMIT $1"
    );
    Ok(sqlx::query_as(AssertSqlSafe(sql))
        .bind(limit)
        .fetch_all(conn)
        .await?)
}

/// The records parked under `key` (of any consumer, topic and partition), in offset order.
pub async fn parked_records(
    conn: &mut PgConnection,
    tables: &TableNames,
    key: &[u8],
) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
    let sql = format!(
        "SELECT {} FROM {} WHERE message_key = $1 \
         ORDER BY consumer, topic, partition, \"offset\", id",
        COLUMNS.all,
        table(tables, PARKED)
    );
    Ok(sqlx::query_as(AssertSqlSafe(sql))
        .bind(key)
        .fetch_all(conn)
        .await?)
}

/// Asks for the release of `key`, parked for `consumer` (every consumer when `None`): the
/// consumer replays its records through the handler in offset order, then the key flows
/// again. Returns how many parked keys (one per consumer and partition) it asked for.
pub async fn release(
    conn: &mut PgConnection,
    tables: &TableNames,
    key: &[u8],
    consumer: Option<&str>,
) -> Result<u64, ConsumerError> {
    let sql = format!(
        "UPDATE {} SET release_requested_at = now() \
         WHERE message_key = $1 AND ($2::text IS NULL OR consumer = $2)",
        table(tables, PARKED_KEYS)
    );
    Ok(sqlx::query(AssertSqlSafe(sql))
        .bind(key)
        .bind(consumer)
        .execute(conn)
        .await?
        .rows_affected())
}

/// Drops parked record `id`, the first of its key, for good, recorded in
/// `outbox_quarantine_audit` as a discard (with `note`), and asks for the release of its key,
/// so that the records behind it are replayed: all in one transaction. Returns how many
/// records it dropped (0: `id` is gone). A record behind another of its key is refused
/// ([`ConsumerError::NotParkedHead`]), as is one whose key's release is under way
/// ([`ConsumerError::ParkedKeyReleasing`]: its consumer may be running that record's handler).
pub async fn skip(
    conn: &mut PgConnection,
    tables: &TableNames,
    id: i64,
    note: &ActionNote,
) -> Result<u64, ConsumerError> {
    let (keys, parked) = (table(tables, PARKED_KEYS), table(tables, PARKED));
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // The key's row, locked: a release asked for now waits for this skip, and one asked for
    // before is being replayed (the consumer may be running this very record's handler).
    let found: Option<(Option<i64>, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT h.id FROM {parked} h WHERE h.consumer = p.consumer AND h.topic = p.topic \
                 AND h.partition = p.partition AND h.message_key = p.message_key \
                 ORDER BY h.\"offset\", h.id LIMIT 1), \
                k.release_requested_at IS NOT NULL \
         FROM {parked} p JOIN {keys} k ON k.consumer = p.consumer AND k.topic = p.topic \
              AND k.partition = p.partition AND k.message_key = p.message_key \
         WHERE p.id = $1 FOR UPDATE OF k"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    match found {
        None | Some((None, _)) => return Ok(0),
        Some((_, true)) => return Err(ConsumerError::ParkedKeyReleasing { id }),
        Some((Some(head), false)) if head != id => {
            return Err(ConsumerError::NotParkedHead { id, head });
        }
        Some(_) => {}
    }
    let sql = format!(
        "UPDATE {keys} k SET release_requested_at = now() FROM {parked} p \
         WHERE p.id = $1 AND k.consumer = p.consumer AND k.topic = p.topic \
         AND k.partition = p.partition AND k.message_key = p.message_key"
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let dropped = QuarantineTable::new(QuarantineSide::Consumer, &parked, &COLUMNS)
        .discard(&mut tx, &[id], note)
        .await?;
    tx.commit().await?;
    Ok(dropped)
}
