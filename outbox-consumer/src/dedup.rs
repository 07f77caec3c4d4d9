use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{TimeZone, Utc};
use futures::FutureExt;
use futures::future::BoxFuture;
use moka::future::Cache;
use outbox_core::{Envelope, wire};
use rdkafka::Message;
use rdkafka::message::{Headers, OwnedMessage};
use serde::de::DeserializeOwned;
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::span;
use crate::sql::ConsumerSql;
use crate::{ConsumerConfig, ConsumerError, Event, HandlerFailurePolicy};

/// What a handler may fail with. Anything that converts into a boxed error works
/// (`anyhow::Error`, `sqlx::Error`, `std::io::Error`, ...).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The future a handler returns: it may borrow the event and the transaction.
pub type HandlerFuture<'c> = BoxFuture<'c, Result<(), HandlerError>>;

/// A message handler: any `Send + Sync` function or closure that takes the event and the
/// transaction its effect must be written on. Implemented for every such function; write
/// closures inline where a handler is expected, or `|e, tx| Box::pin(my_async_fn(e, tx))`.
pub trait Handler<P>:
    for<'c> Fn(&'c Event<P>, &'c mut Transaction<'static, Postgres>) -> HandlerFuture<'c>
    + Send
    + Sync
    + 'static
{
}

impl<P, F> Handler<P> for F where
    F: for<'c> Fn(&'c Event<P>, &'c mut Transaction<'static, Postgres>) -> HandlerFuture<'c>
        + Send
        + Sync
        + 'static
{
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its transaction committed with the dedup row.
    Processed,
    /// The id was in the in-memory cache: skipped without touching the database.
    DuplicateCached,
    /// The dedup table already had the id: skipped.
    DuplicateStored,
    /// Stored in the quarantine table, with this reason (`missing_id`, `invalid_json`,
    /// `wrong_shape`, `unknown_type`, `too_large`, `handler_failed`, ...).
    Quarantined(&'static str),
    /// Shutdown came while a blocked handler was still retrying; the offset is not stored.
    Abandoned,
}

/// Counters of a [`DedupConsumer`], cumulative since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Messages whose handler committed.
    pub processed: u64,
    /// Duplicates caught by the in-memory cache.
    pub duplicates_cached: u64,
    /// Duplicates caught by the dedup table.
    pub duplicates_stored: u64,
    /// Messages quarantined.
    pub quarantined: u64,
    /// Handler failures (each attempt).
    pub handler_errors: u64,
    /// Database transactions begun.
    pub transactions: u64,
    /// Queued messages dropped because their partition was revoked from this member before
    /// they were handled (the partition's next owner reads them again).
    pub revoked_skipped: u64,
    /// Times a partition's fetch was paused because its queue was full
    /// (`max_queued_per_partition`): how often this member fell behind.
    pub partition_pauses: u64,
}

#[derive(Debug, Default)]
struct Counters {
    processed: AtomicU64,
    duplicates_cached: AtomicU64,
    duplicates_stored: AtomicU64,
    quarantined: AtomicU64,
    handler_errors: AtomicU64,
    transactions: AtomicU64,
    revoked_skipped: AtomicU64,
    partition_pauses: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Counts `outcome` for `consumer` in the process's metrics recorder (a no-op without one).
fn record_metric(consumer: &str, outcome: &Outcome) {
    let consumer = consumer.to_owned();
    match outcome {
        Outcome::Processed => {
            metrics::counter!("outbox_consumer_processed_total", "consumer" => consumer)
                .increment(1)
        }
        Outcome::DuplicateCached => {
            metrics::counter!("outbox_consumer_duplicates_total", "consumer" => consumer, "via" => "cache").increment(1);
        }
        Outcome::DuplicateStored => {
            metrics::counter!("outbox_consumer_duplicates_total", "consumer" => consumer, "via" => "table").increment(1);
        }
        Outcome::Quarantined(reason) => {
            metrics::counter!("outbox_consumer_quarantined_total", "consumer" => consumer, "reason" => *reason).increment(1);
        }
        Outcome::Abandoned => {}
    }
}

/// Runs a handler once per (consumer name, event id), however often Kafka delivers the event.
///
/// For each message: decode under the wire contract (or quarantine); skip if the id is in the
/// in-memory cache; else, in one transaction, insert the id into the dedup table
/// (`ON CONFLICT DO NOTHING`: no row means a duplicate, skipped) and run the handler on the
/// same transaction, then commit and remember the id. Cheap to clone.
pub struct DedupConsumer<P, H> {
    pub(crate) inner: Arc<Inner<P, H>>,
}

impl<P, H> Clone for DedupConsumer<P, H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P, H> std::fmt::Debug for DedupConsumer<P, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupConsumer")
            .field("name", &self.inner.name)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner<P, H> {
    pub(crate) name: String,
    pub(crate) config: ConsumerConfig,
    pool: PgPool,
    handler: H,
    cache: Cache<Uuid, ()>,
    sql: ConsumerSql,
    counters: Counters,
    _payload: std::marker::PhantomData<fn() -> P>,
    #[cfg(feature = "fault-injection")]
    pub(crate) crash_after_commit: std::sync::atomic::AtomicBool,
}

impl<P, H> Inner<P, H> {
    /// Counts a queued message dropped because its partition was revoked.
    pub(crate) fn note_revoked_skip(&self) {
        bump(&self.counters.revoked_skipped);
        metrics::counter!("outbox_consumer_revoked_skipped_total", "consumer" => self.name.clone())
            .increment(1);
    }
}

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// A consumer named `config.name` (required here) running `handler`.
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_consumer::ConsumerError> {
    /// use outbox_consumer::{ConsumerConfig, DedupConsumer, Event};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Invoice { cents: i64 }
    ///
    /// let consumer = DedupConsumer::new(pool, ConsumerConfig::new("billing"), |event: &Event<Invoice>, tx| {
    ///     Box::pin(async move {
    ///         sqlx::query("INSERT INTO charges (idempotency_key, cents) VALUES ($1, $2)")
    ///             .bind(event.idempotency_key())
    ///             .bind(event.payload.cents)
    ///             .execute(&mut **tx)
    ///             .await?;
    ///         Ok(())
    ///     })
    /// })?;
    /// # Ok(()) }
    /// ```
    pub fn new(pool: PgPool, config: ConsumerConfig, handler: H) -> Result<Self, ConsumerError> {
        let name = config.validate()?;
        let cache = Cache::builder()
            .max_capacity(config.cache_capacity)
            .time_to_live(config.cache_ttl)
            .build();
        Ok(Self {
            inner: Arc::new(Inner {
                name,
                sql: ConsumerSql::new(&config.tables),
                config,
                pool,
                handler,
                cache,
                counters: Counters::default(),
                _payload: std::marker::PhantomData,
                #[cfg(feature = "fault-injection")]
                crash_after_commit: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// The consumer name that scopes deduplication.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            processed: get(&c.processed),
            duplicates_cached: get(&c.duplicates_cached),
            duplicates_stored: get(&c.duplicates_stored),
            quarantined: get(&c.quarantined),
            handler_errors: get(&c.handler_errors),
            transactions: get(&c.transactions),
            revoked_skipped: get(&c.revoked_skipped),
            partition_pauses: get(&c.partition_pauses),
        }
    }

    /// Counts a partition whose fetch was paused (stats and metrics).
    pub(crate) fn count_pause(&self) {
        bump(&self.inner.counters.partition_pauses);
        metrics::counter!("outbox_consumer_partition_pauses_total",
            "consumer" => self.inner.name.clone())
        .increment(1);
    }

    /// Makes the next committed message stop the consumer before its offset is stored, as a
    /// crash there would. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_commit(&self) {
        self.inner.crash_after_commit.store(true, Ordering::SeqCst);
    }

    /// Handles one message end to end (everything but storing its offset). `Err` means the
    /// database was unavailable: nothing was skipped, and the message should be retried.
    pub async fn process(
        &self,
        message: &OwnedMessage,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, ConsumerError> {
        let started = std::time::Instant::now();
        let outcome = self
            .process_unmetered(message, shutdown)
            .instrument(span::message_span(&self.inner.name, message))
            .await?;
        record_metric(&self.inner.name, &outcome);
        metrics::histogram!("outbox_consumer_message_seconds", "consumer" => self.inner.name.clone())
            .record(started.elapsed().as_secs_f64());
        Ok(outcome)
    }

    async fn process_unmetered(
        &self,
        message: &OwnedMessage,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, ConsumerError> {
        let inner = &*self.inner;
        let event = match self.decode(message) {
            Ok(event) => event,
            Err((reason, error, id)) => return self.quarantine(message, id, reason, &error).await,
        };
        let id = *event.id.as_uuid();
        if inner.cache.contains_key(&id) {
            bump(&inner.counters.duplicates_cached);
            tracing::debug!(consumer = %inner.name, event_id = %event.id, "duplicate (cache)");
            return Ok(Outcome::DuplicateCached);
        }
        let mut attempt = 0_u32;
        loop {
            attempt += 1;
            let mut tx = inner.pool.begin().await?;
            bump(&inner.counters.transactions);
            let inserted = sqlx::query(inner.sql.insert_dedup.clone())
                .bind(&inner.name)
                .bind(id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if inserted == 0 {
                tx.rollback().await?;
                inner.cache.insert(id, ()).await;
                bump(&inner.counters.duplicates_stored);
                tracing::debug!(consumer = %inner.name, event_id = %event.id, "duplicate (dedup table)");
                return Ok(Outcome::DuplicateStored);
            }
            // A panicking handler is a failing handler: it must not take the partition down.
            let result = AssertUnwindSafe((inner.handler)(&event, &mut tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| Err(panic_message(&panic).into()));
            let error = match result {
                Ok(()) => {
                    tx.commit().await?;
                    inner.cache.insert(id, ()).await;
                    bump(&inner.counters.processed);
                    tracing::debug!(consumer = %inner.name, event_id = %event.id, topic = %event.topic,
                        partition = event.partition, offset = event.offset, "processed");
                    return Ok(Outcome::Processed);
                }
                Err(error) => error,
            };
            tx.rollback().await?;
            bump(&inner.counters.handler_errors);
            metrics::counter!("outbox_consumer_handler_errors_total", "consumer" => inner.name.clone()).increment(1);
            let config = &inner.config;
            let give_up = config.on_handler_failure == HandlerFailurePolicy::Quarantine
                && attempt >= config.max_attempts;
            tracing::warn!(consumer = %inner.name, event_id = %event.id, attempt, %error, "handler failed");
            if give_up {
                return self
                    .quarantine(
                        message,
                        Some(id),
                        "handler_failed",
                        &format!("after {attempt} attempts: {error}"),
                    )
                    .await;
            }
            if shutdown.is_cancelled() {
                return Ok(Outcome::Abandoned);
            }
            tokio::time::sleep(outbox_core::backoff(
                config.backoff_base,
                config.backoff_max,
                attempt - 1,
            ))
            .await;
        }
    }

    /// Decodes under the wire contract and the configured limits; on failure returns the
    /// quarantine reason, the detail, and the event id when one could be read.
    fn decode(
        &self,
        message: &OwnedMessage,
    ) -> Result<Event<P>, (&'static str, String, Option<Uuid>)> {
        let config = &self.inner.config;
        let payload = message.payload();
        if payload.is_some_and(|p| p.len() > config.max_payload_bytes) {
            let len = payload.map_or(0, <[u8]>::len);
            return Err((
                "too_large",
                format!(
                    "payload of {len} bytes exceeds {}",
                    config.max_payload_bytes
                ),
                None,
            ));
        }
        let headers = message
            .headers()
            .into_iter()
            .flat_map(|hs| hs.iter().map(|h| (h.key, h.value)));
        let Envelope {
            id,
            aggregate_id,
            event_type,
            payload,
            headers,
        } = wire::decode(message.key(), headers, payload)
            .map_err(|e| (e.kind(), e.to_string(), None))?;
        let uuid = Some(*id.as_uuid());
        if let Some(allowed) = &config.event_types
            && !event_type.as_ref().is_some_and(|t| allowed.contains(t))
        {
            return Err((
                "unknown_type",
                format!("event type {event_type:?} is not accepted"),
                uuid,
            ));
        }
        let payload =
            serde_json::from_value(payload).map_err(|e| ("wrong_shape", e.to_string(), uuid))?;
        Ok(Event {
            id,
            key: aggregate_id,
            event_type,
            payload,
            headers,
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
            timestamp: message
                .timestamp()
                .to_millis()
                .and_then(|ms| Utc.timestamp_millis_opt(ms).single()),
        })
    }

    async fn quarantine(
        &self,
        message: &OwnedMessage,
        event_id: Option<Uuid>,
        reason: &'static str,
        error: &str,
    ) -> Result<Outcome, ConsumerError> {
        let inner = &*self.inner;
        let headers: serde_json::Map<String, serde_json::Value> = message
            .headers()
            .into_iter()
            .flat_map(|hs| hs.iter())
            .map(|h| {
                (
                    h.key.to_owned(),
                    String::from_utf8_lossy(h.value.unwrap_or_default())
                        .into_owned()
                        .into(),
                )
            })
            .collect();
        sqlx::query(inner.sql.quarantine.clone())
            .bind(&inner.name)
            .bind(message.topic())
            .bind(message.partition())
            .bind(message.offset())
            .bind(event_id)
            .bind(message.key())
            .bind(message.payload())
            .bind(serde_json::Value::Object(headers))
            .bind(reason)
            .bind(error)
            .execute(&inner.pool)
            .await?;
        bump(&inner.counters.quarantined);
        tracing::error!(consumer = %inner.name, topic = message.topic(), partition = message.partition(),
            offset = message.offset(), reason, %error, "quarantined message");
        Ok(Outcome::Quarantined(reason))
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned());
    format!("handler panicked: {text}")
}
