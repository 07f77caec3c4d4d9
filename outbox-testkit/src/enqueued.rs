//! The producer side: what a transaction wrote into the outbox, read back without a relay.

use chrono::{DateTime, Utc};
use outbox_core::{CoreError, EventId, NewEvent, TableNames};
use sqlx::{AssertSqlSafe, PgConnection, Row};

/// Where an outbox row stands with the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EnqueuedStatus {
    /// Waiting for a relay (or a dispatcher): every row a transaction just enqueued.
    Pending,
    /// Acknowledged by Kafka (or done by a dispatcher).
    Published,
    /// Given up on by the relay; the reason is in the row's `last_error`.
    Quarantined,
}

/// One row of the outbox, as the producer wrote it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Enqueued {
    /// The row's position in the outbox: the order of enqueueing (of committing, per
    /// aggregate).
    pub seq: i64,
    /// The event id (the consumer's dedup key).
    pub id: EventId,
    /// The aggregate type (the default topic's suffix).
    pub aggregate_type: String,
    /// The aggregate id: the Kafka key.
    pub aggregate_id: String,
    /// The event type: the `type` header.
    pub event_type: String,
    /// The JSON payload.
    pub payload: serde_json::Value,
    /// The application headers as stored: a JSON object of strings when `enqueue` wrote the
    /// row (`headers["tenant"] == "acme"` reads one). A `traceparent` captured at enqueue is
    /// among them.
    pub headers: serde_json::Value,
    /// The topic, or `dispatch:<destination>` for an action for a dispatcher.
    pub topic: String,
    /// Where it stands with the relay.
    pub status: EnqueuedStatus,
    /// When it was enqueued (its transaction's start).
    pub created_at: DateTime<Utc>,
}

impl Enqueued {
    /// The event this row holds, to deliver it to a handler with
    /// [`HandlerKit`](crate::HandlerKit): producer and consumer tested end to end, without
    /// Kafka. An error when the row's headers are not a JSON object of strings, or name a
    /// header the wire contract reserves (the relay would quarantine such a row).
    pub fn to_event(&self) -> Result<NewEvent, CoreError> {
        let mut event = NewEvent::new(
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.payload,
        )?
        .with_id(self.id)
        .with_topic(&self.topic)?;
        let serde_json::Value::Object(headers) = &self.headers else {
            return Err(CoreError::InvalidEvent(format!(
                "row {}: headers are not a JSON object: {}",
                self.seq, self.headers
            )));
        };
        for (name, value) in headers {
            let serde_json::Value::String(value) = value else {
                return Err(CoreError::InvalidEvent(format!(
                    "row {}: header {name:?} is not a JSON string: {value}",
                    self.seq
                )));
            };
            event = event.with_header(name, value)?;
        }
        Ok(event)
    }
}

/// Every row of the outbox `tables.outbox`, in enqueue order (`seq`), as `conn` sees it.
///
/// Inside a transaction, that includes the rows the transaction enqueued and has not
/// committed: pass the transaction (`&mut tx`) to check what it wrote before it commits. From
/// any other connection, it is what committed. No relay is needed, and none should run on the
/// table meanwhile if the test asserts [`EnqueuedStatus::Pending`].
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::{NewEvent, TableNames};
/// use outbox_testkit::{EnqueuedStatus, enqueued};
///
/// let tables = TableNames::default();
/// let mut tx = pool.begin().await?;
/// let event = NewEvent::new("invoice", "inv-1", "InvoiceRequested", &serde_json::json!({"cents": 1200}))?;
/// outbox_producer::enqueue(&mut tx, &event).await?;
/// let rows = enqueued(&mut tx, &tables).await?;
/// assert_eq!(rows.len(), 1);
/// assert_eq!((rows[0].id, rows[0].status), (event.id(), EnqueuedStatus::Pending));
/// tx.rollback().await?;
/// assert!(enqueued(&mut *pool.acquire().await?, &tables).await?.is_empty());
/// # Ok(()) }
/// ```
pub async fn enqueued(
    conn: &mut PgConnection,
    tables: &TableNames,
) -> Result<Vec<Enqueued>, sqlx::Error> {
    let query = format!(
        "SELECT seq, id, aggregatetype, aggregateid, type, payload, headers, topic, status, \
         created_at FROM {} ORDER BY seq",
        tables.outbox
    );
    let rows = sqlx::query(AssertSqlSafe(query)).fetch_all(conn).await?;
    rows.iter()
        .map(|row| {
            let status: String = row.try_get("status")?;
            let status = match status.as_str() {
                "pending" => EnqueuedStatus::Pending,
                "published" => EnqueuedStatus::Published,
                "quarantined" => EnqueuedStatus::Quarantined,
                other => {
                    return Err(sqlx::Error::ColumnDecode {
                        index: "status".into(),
                        source: format!("unknown outbox status {other:?}").into(),
                    });
                }
            };
            Ok(Enqueued {
                seq: row.try_get("seq")?,
                id: row.try_get("id")?,
                aggregate_type: row.try_get("aggregatetype")?,
                aggregate_id: row.try_get("aggregateid")?,
                event_type: row.try_get("type")?,
                payload: row.try_get("payload")?,
                headers: row.try_get("headers")?,
                topic: row.try_get("topic")?,
                status,
                created_at: row.try_get("created_at")?,
            })
        })
        .collect()
}
