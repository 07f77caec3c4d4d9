use std::sync::Arc;

use outbox_core::trace::{HEADER_TRACEPARENT, HEADER_TRACESTATE, TraceParent};
use outbox_core::{EventId, Ident, NewEvent, TableNames};
use sqlx::PgConnection;

use crate::ProducerError;
use crate::sql::EnqueueSql;

/// Writes events into the outbox, on the caller's connection and inside the caller's
/// transaction. Cheap to clone; build one at startup and share it.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_producer::{NewEvent, Outbox};
///
/// let outbox = Outbox::default();
/// let mut tx = pool.begin().await?;
/// sqlx::query("UPDATE invoices SET state = 'decided' WHERE id = $1")
///     .bind(42_i64)
///     .execute(&mut *tx)
///     .await?;
/// let event = NewEvent::new("invoice", "42", "InvoiceDecided", &serde_json::json!({"cents": 1200}))?;
/// outbox.enqueue(&mut tx, &event).await?;
/// tx.commit().await?; // the state change and the event commit together, or not at all
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    table: Ident,
    sql: Arc<EnqueueSql>,
    lock_per_key: bool,
    notify: bool,
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new(&TableNames::default())
    }
}

impl Outbox {
    /// An outbox writing to `names.outbox`, with per-key locking on.
    pub fn new(names: &TableNames) -> Self {
        Self {
            table: names.outbox.clone(),
            sql: Arc::new(EnqueueSql::new(&names.outbox, true, true)),
            lock_per_key: true,
            notify: true,
        }
    }

    /// Whether `enqueue` takes a transaction-scoped advisory lock on the aggregate id (on by
    /// default). With it, two transactions writing events for one aggregate are serialized,
    /// so the outbox order of that aggregate is its commit order. Turn it off only when a
    /// single writer per aggregate is guaranteed otherwise (for example by a row lock on the
    /// aggregate that the transaction already holds).
    pub fn lock_per_key(mut self, on: bool) -> Self {
        self.lock_per_key = on;
        self.sql = Arc::new(EnqueueSql::new(&self.table, self.lock_per_key, self.notify));
        self
    }

    /// Whether `enqueue` wakes relays with `NOTIFY` at commit (on by default), so events go
    /// out within milliseconds. Postgres serializes committing transactions that notify, so
    /// under heavy concurrent writing this costs throughput (see the guide's benchmarks, P1);
    /// with it off, relays find rows by polling every `poll_interval`.
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self.sql = Arc::new(EnqueueSql::new(&self.table, self.lock_per_key, self.notify));
        self
    }

    /// Writes `event`. Run it inside the transaction that makes the state change: it commits
    /// or rolls back with it. Takes `&mut PgConnection`, so `&mut tx` (or `&mut *tx`) works.
    ///
    /// With the `opentelemetry` feature, an event without a `traceparent` of its own gets the
    /// current span's, so the consumer's span continues the trace that decided the event.
    pub async fn enqueue(
        &self,
        conn: &mut PgConnection,
        event: &NewEvent,
    ) -> Result<EventId, ProducerError> {
        sqlx::query(self.sql.one.clone())
            .bind(event.id())
            .bind(event.aggregate_type())
            .bind(event.aggregate_id())
            .bind(event.event_type())
            .bind(event.payload())
            .bind(headers_json(event, &ambient_trace()))
            .bind(event.topic())
            .execute(conn)
            .await?;
        Ok(event.id())
    }

    /// Writes `events` in one statement, in the given order.
    pub async fn enqueue_all(
        &self,
        conn: &mut PgConnection,
        events: &[NewEvent],
    ) -> Result<Vec<EventId>, ProducerError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let column =
            |f: fn(&NewEvent) -> &str| events.iter().map(|e| f(e).to_owned()).collect::<Vec<_>>();
        sqlx::query(self.sql.many.clone())
            .bind(events.iter().map(|e| *e.id().as_uuid()).collect::<Vec<_>>())
            .bind(column(NewEvent::aggregate_type))
            .bind(column(NewEvent::aggregate_id))
            .bind(column(NewEvent::event_type))
            .bind(
                events
                    .iter()
                    .map(|e| e.payload().clone())
                    .collect::<Vec<_>>(),
            )
            .bind({
                let ambient = ambient_trace();
                events
                    .iter()
                    .map(|e| headers_json(e, &ambient))
                    .collect::<Vec<_>>()
            })
            .bind(column(NewEvent::topic))
            .execute(conn)
            .await?;
        Ok(events.iter().map(NewEvent::id).collect())
    }
}

/// The trace context of the code calling `enqueue`: the current span's with the
/// `opentelemetry` feature, nothing without it.
type Ambient = Option<(TraceParent, Option<String>)>;

fn ambient_trace() -> Ambient {
    #[cfg(feature = "opentelemetry")]
    {
        outbox_core::trace::current()
    }
    #[cfg(not(feature = "opentelemetry"))]
    {
        None
    }
}

/// The event's headers as stored; an event without its own trace context gets the ambient one.
fn headers_json(event: &NewEvent, ambient: &Ambient) -> serde_json::Value {
    let mut headers: serde_json::Map<String, serde_json::Value> = event
        .headers()
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    if let Some((parent, state)) = ambient
        && !headers.contains_key(HEADER_TRACEPARENT)
    {
        headers.insert(HEADER_TRACEPARENT.to_owned(), parent.to_string().into());
        if let Some(state) = state {
            headers.insert(HEADER_TRACESTATE.to_owned(), state.clone().into());
        }
    }
    serde_json::Value::Object(headers)
}

/// [`Outbox::enqueue`] on the default table.
pub async fn enqueue(conn: &mut PgConnection, event: &NewEvent) -> Result<EventId, ProducerError> {
    default_outbox().enqueue(conn, event).await
}

/// [`Outbox::enqueue_all`] on the default table.
pub async fn enqueue_all(
    conn: &mut PgConnection,
    events: &[NewEvent],
) -> Result<Vec<EventId>, ProducerError> {
    default_outbox().enqueue_all(conn, events).await
}

fn default_outbox() -> &'static Outbox {
    static DEFAULT: std::sync::OnceLock<Outbox> = std::sync::OnceLock::new();
    DEFAULT.get_or_init(Outbox::default)
}
