//! The relay: moves committed outbox rows to Kafka, at least once, in order per key.
//!
//! # How a batch runs
//! 1. In one transaction, lock up to `batch_size` due pending rows (`FOR UPDATE SKIP LOCKED`)
//!    and keep those with no earlier unpublished row of the same aggregate outside the batch.
//! 2. Send them with an idempotent producer (`enable.idempotence=true`, `acks=all`), in
//!    sequence order, and wait for every delivery report.
//! 3. Only then mark the acknowledged rows published (or delete them) and record failures,
//!    and commit. A crash anywhere before the commit leaves the rows pending and unlocked:
//!    they are published again (same event id), never lost.
//!
//! # Per-key order, with any number of relays
//! A row is published only when every earlier row of its aggregate is published. Rows
//! another relay has locked count as unpublished until that relay commits, so two relays
//! never publish one aggregate's rows concurrently, and a row waiting for its retry holds its
//! later rows back. Within a batch, one aggregate's rows go to one partition in sequence
//! order, and the idempotent producer keeps that order across its own retries. If a row
//! fails before it leaves the client (for example: too large), the later rows of its
//! aggregate in that batch are not sent. The one remaining window is a row that the broker
//! rejects asynchronously while a later row of the same aggregate in the same batch
//! succeeds; only permanent rejections do that in practice, and under
//! [`QuarantinePolicy::SkipQuarantined`] such a row would be skipped anyway.
//!
//! # Failures
//! Permanent errors (too large, invalid topic, not authorized) quarantine the row at once
//! with the reason. Transient ones (broker down, timeout, topic missing) retry with
//! exponential backoff and jitter, and quarantine after `max_attempts`. Other aggregates
//! keep flowing either way; [`QuarantinePolicy`] says whether the same aggregate does.
//! A fatal producer error (an idempotent producer that lost its sequence state) is not a
//! row's failure: the batch is left pending as it was and the relay stops with
//! [`ProducerError::FatalProducer`], to be restarted with a new producer.

mod config;
mod failure;
mod kafka;

use std::collections::HashSet;
use std::sync::Arc;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::join_all;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

pub use config::{AfterPublish, QuarantinePolicy, RelayConfig};
pub use kafka::producer_config;

use crate::ProducerError;
use crate::sql::RelaySql;
use failure::{FailureKind, backoff, classify};
use kafka::OutboxRow;

/// How often [`Relay::run`] refreshes the depth and lag gauges.
const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Longest pause of [`Relay::run`] after a failed batch (database or broker unreachable).
const RELAY_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// What one [`Relay::run_once`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows claimed for publishing.
    pub claimed: usize,
    /// Rows acknowledged by Kafka and marked published (or deleted).
    pub published: usize,
    /// Rows that failed and will be retried.
    pub retried: usize,
    /// Rows moved to quarantine.
    pub quarantined: usize,
    /// Rows not sent because an earlier row of their aggregate failed in this batch.
    pub deferred: usize,
}

/// Publishes committed outbox rows to Kafka. Cheap to clone; `Send + Sync`. Run one or many
/// (in one process or several) against the same table: order per key holds either way.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    producer: FutureProducer,
    config: RelayConfig,
    sql: RelaySql,
    #[cfg(feature = "fault-injection")]
    crash_after_ack: AtomicBool,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

enum Outcome {
    Delivered,
    Failed(KafkaError),
    Deferred,
}

impl Relay {
    /// A relay with a producer built from `kafka`, with `enable.idempotence=true`,
    /// `acks=all` and `partitioner=murmur2_random` (Java's, which Debezium uses) enforced
    /// (see [`producer_config`] for a starting point).
    pub fn new(
        pool: PgPool,
        kafka: &ClientConfig,
        config: RelayConfig,
    ) -> Result<Self, ProducerError> {
        let mut kafka = kafka.clone();
        kafka::enforce_required(&mut kafka);
        Self::with_producer(pool, kafka.create()?, config)
    }

    /// A relay on an existing producer. It must be configured with `enable.idempotence=true`
    /// and `acks=all`, or per-key order and no-loss do not hold, and with
    /// `partitioner=murmur2_random`, or its keys land on other partitions than Debezium's
    /// and any Java producer's (a librdkafka producer's settings cannot be read back, so
    /// this is not checked).
    pub fn with_producer(
        pool: PgPool,
        producer: FutureProducer,
        config: RelayConfig,
    ) -> Result<Self, ProducerError> {
        config.validate()?;
        let needed = 1 + u32::from(config.listen);
        let max = pool.options().get_max_connections();
        if max < needed {
            // With fewer, `run` would wait on the pool for the connection its listener holds.
            return Err(ProducerError::Config(format!(
                "the relay needs a pool of at least {needed} connections (one for its batch{}), \
                 this one has {max}",
                if config.listen { ", one to LISTEN" } else { "" }
            )));
        }
        let sql = RelaySql::new(&config.tables.outbox, config.quarantine_policy);
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                producer,
                config,
                sql,
                #[cfg(feature = "fault-injection")]
                crash_after_ack: AtomicBool::new(false),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.inner.config
    }

    /// Makes the next batch fail after Kafka acknowledged it and before the rows are marked,
    /// as a crash there would. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_ack(&self) {
        self.inner.crash_after_ack.store(true, Ordering::SeqCst);
    }

    /// Claims, publishes and marks one batch. Tests drive the relay with this.
    pub async fn run_once(&self) -> Result<BatchReport, ProducerError> {
        self.run_batch(true).await
    }

    /// Claims and marks one batch as published **without sending it**: the relay's own SQL
    /// cycle, the ceiling benchmarks compare publishing against. Never use it on real data.
    #[cfg(feature = "bench")]
    #[doc(hidden)]
    pub async fn run_once_without_publishing(&self) -> Result<BatchReport, ProducerError> {
        self.run_batch(false).await
    }

    async fn run_batch(&self, publish: bool) -> Result<BatchReport, ProducerError> {
        let inner = &*self.inner;
        let mut tx = inner.pool.begin().await?;
        let rows: Vec<OutboxRow> = sqlx::query_as(inner.sql.claim.clone())
            .bind(i64::from(inner.config.batch_size))
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let outcomes = if publish {
            self.publish(&rows).await
        } else {
            rows.iter().map(|_| Outcome::Delivered).collect()
        };
        if let Some((code, reason)) = inner.producer.client().fatal_error() {
            // Every send now fails: recording those failures would walk healthy rows to
            // quarantine. Dropping the transaction leaves the batch pending, untouched.
            return Err(ProducerError::FatalProducer { code, reason });
        }
        #[cfg(feature = "fault-injection")]
        if inner.crash_after_ack.swap(false, Ordering::SeqCst) {
            // Dropping the transaction rolls it back, exactly as a dead process would.
            return Err(ProducerError::InjectedFault(
                "crash after ack, before marking",
            ));
        }
        let report = self.record(&mut tx, &rows, outcomes).await?;
        tx.commit().await?;
        tracing::debug!(
            claimed = report.claimed,
            published = report.published,
            retried = report.retried,
            quarantined = report.quarantined,
            deferred = report.deferred,
            "relay batch"
        );
        Ok(report)
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Vec<Outcome> {
        enum Sent {
            InFlight(rdkafka::producer::DeliveryFuture),
            Done(Outcome),
        }
        let mut failed_keys = HashSet::new();
        let sent: Vec<Sent> = rows
            .iter()
            .map(|row| {
                if failed_keys.contains(row.aggregateid.as_str()) {
                    return Sent::Done(Outcome::Deferred);
                }
                let record = FutureRecord::to(&row.topic)
                    .key(row.aggregateid.as_bytes())
                    .payload(row.payload.as_bytes())
                    .headers(row.kafka_headers())
                    .timestamp(row.created_at.timestamp_millis());
                match self.inner.producer.send_result(record) {
                    Ok(delivery) => Sent::InFlight(delivery),
                    Err((error, _)) => {
                        failed_keys.insert(row.aggregateid.as_str());
                        Sent::Done(Outcome::Failed(error))
                    }
                }
            })
            .collect();
        let outcomes = join_all(sent.into_iter().map(|s| async move {
            match s {
                Sent::Done(outcome) => (outcome, None),
                Sent::InFlight(delivery) => match delivery.await {
                    Ok(Ok(d)) => (Outcome::Delivered, Some(d)),
                    Ok(Err((error, _))) => (Outcome::Failed(error), None),
                    Err(_canceled) => (Outcome::Failed(KafkaError::Canceled), None),
                },
            }
        }))
        .await;
        outcomes
            .into_iter()
            .zip(rows)
            .map(|((outcome, delivery), row)| {
                if let Some(d) = delivery {
                    tracing::debug!(event_id = %row.id, topic = %row.topic, partition = d.partition, offset = d.offset, "published");
                }
                outcome
            })
            .collect()
    }

    async fn record(
        &self,
        conn: &mut PgConnection,
        rows: &[OutboxRow],
        outcomes: Vec<Outcome>,
    ) -> Result<BatchReport, ProducerError> {
        let config = &self.inner.config;
        let mut report = BatchReport {
            claimed: rows.len(),
            ..BatchReport::default()
        };
        let mut published = Vec::new();
        let table = config.tables.outbox.as_str().to_owned();
        // From the decision (created_at) to Kafka's acknowledgement.
        let latency =
            metrics::histogram!("outbox_relay_publish_latency_seconds", "table" => table.clone());
        let now = chrono::Utc::now();
        let (mut seqs, mut statuses, mut delays, mut errors) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (row, outcome) in rows.iter().zip(outcomes) {
            let error = match outcome {
                Outcome::Delivered => {
                    published.push(row.seq);
                    let age = (now - row.created_at).to_std().unwrap_or_default();
                    latency.record(age.as_secs_f64());
                    continue;
                }
                Outcome::Deferred => {
                    report.deferred += 1;
                    continue;
                }
                Outcome::Failed(error) => error,
            };
            let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
            let kind = classify(&error);
            let quarantine = kind == FailureKind::Permanent || attempts >= config.max_attempts;
            let reason = format!("{kind:?} after attempt {attempts}: {error}");
            if quarantine {
                report.quarantined += 1;
                tracing::error!(event_id = %row.id, topic = %row.topic, attempts, error = %error, "quarantined outbox row");
                statuses.push("quarantined");
                delays.push(0.0);
            } else {
                report.retried += 1;
                let delay = backoff(config, attempts - 1);
                tracing::warn!(event_id = %row.id, topic = %row.topic, attempts, retry_in = ?delay, error = %error, "publish failed; will retry");
                statuses.push("pending");
                delays.push(delay.as_secs_f64() * 1000.0);
            }
            seqs.push(row.seq);
            errors.push(reason);
        }
        report.published = published.len();
        metrics::counter!("outbox_relay_published_total", "table" => table.clone())
            .increment(published.len() as u64);
        metrics::counter!("outbox_relay_failed_total", "table" => table.clone())
            .increment(seqs.len() as u64);
        metrics::counter!("outbox_relay_quarantined_total", "table" => table)
            .increment(report.quarantined as u64);
        if !published.is_empty() {
            let statement = match config.after_publish {
                AfterPublish::Mark => &self.inner.sql.mark_published,
                AfterPublish::Delete => &self.inner.sql.delete_published,
            };
            sqlx::query(statement.clone())
                .bind(&published)
                .execute(&mut *conn)
                .await?;
        }
        if !seqs.is_empty() {
            sqlx::query(self.inner.sql.record_failures.clone())
                .bind(&seqs)
                .bind(&statuses)
                .bind(&delays)
                .bind(&errors)
                .execute(&mut *conn)
                .await?;
        }
        Ok(report)
    }

    /// Runs batches until `shutdown` is cancelled: immediately while batches come back full,
    /// otherwise on a `NOTIFY` from a committing writer or every `poll_interval`. A batch in
    /// progress always finishes (its deliveries are awaited and recorded) before shutdown is
    /// looked at; then the producer is flushed within `shutdown_timeout`.
    ///
    /// Returns [`ProducerError::FatalProducer`] when the producer can no longer be used;
    /// restart the relay with a new producer (its rows are still pending).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProducerError> {
        let config = &self.inner.config;
        let mut listener = None;
        let mut failures = 0_u32;
        let mut stats_due = tokio::time::Instant::now();
        while !shutdown.is_cancelled() {
            if tokio::time::Instant::now() >= stats_due {
                self.export_stats().await;
                stats_due = tokio::time::Instant::now() + STATS_INTERVAL;
            }
            if config.listen && listener.is_none() {
                listener = self.listen().await;
            }
            match self.run_once().await {
                Ok(report) => {
                    failures = 0;
                    if report.claimed >= config.batch_size as usize {
                        continue;
                    }
                }
                Err(error @ ProducerError::FatalProducer { .. }) => {
                    tracing::error!(%error, "relay stops: its producer is unusable");
                    return Err(error);
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    // The database or broker is down: retry soon enough to notice it is back.
                    let delay =
                        outbox_core::backoff(config.backoff_base, RELAY_RETRY_MAX, failures - 1);
                    tracing::warn!(%error, retry_in = ?delay, "relay batch failed");
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(config.poll_interval) => {}
                notified = recv(&mut listener) => {
                    if let Err(error) = notified {
                        tracing::warn!(%error, "outbox listener failed; polling until it reconnects");
                        listener = None;
                    }
                }
            }
        }
        self.flush().await
    }

    /// Sets the depth, lag and quarantine gauges (a failure only skips this export).
    async fn export_stats(&self) {
        let tables = &self.inner.config.tables;
        let stats = async {
            let mut conn = self.inner.pool.acquire().await?;
            crate::stats(&mut conn, tables).await
        };
        match stats.await {
            Ok(s) => {
                let table = tables.outbox.as_str().to_owned();
                metrics::gauge!("outbox_pending", "table" => table.clone()).set(s.pending as f64);
                metrics::gauge!("outbox_quarantined", "table" => table.clone())
                    .set(s.quarantined as f64);
                metrics::gauge!("outbox_oldest_pending_age_seconds", "table" => table)
                    .set(s.oldest_pending_age_ms.unwrap_or(0) as f64 / 1000.0);
            }
            Err(error) => tracing::debug!(%error, "cannot read outbox stats for metrics"),
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        let listen = async {
            let channel: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT {}",
                crate::sql::channel_sql(&self.inner.config.tables.outbox)
            )))
            .fetch_one(&self.inner.pool)
            .await?;
            let mut listener = PgListener::connect_with(&self.inner.pool).await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        listen
            .await
            .inspect_err(
                |error| tracing::warn!(%error, "cannot LISTEN for outbox commits; polling only"),
            )
            .ok()
    }

    /// Flushes the producer within `shutdown_timeout`, off the async runtime (it blocks).
    async fn flush(&self) -> Result<(), ProducerError> {
        let producer = self.inner.producer.clone();
        let timeout = self.inner.config.shutdown_timeout;
        let flushed = tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| ProducerError::Config(format!("flush task failed: {e}")))?;
        match flushed {
            Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) => {
                tracing::warn!(
                    ?timeout,
                    "producer flush timed out; unmarked rows stay pending and will be republished"
                );
                Ok(())
            }
            other => Ok(other?),
        }
    }
}

/// Waits for the next notification, draining any that queued up meanwhile; never resolves
/// when there is no listener.
async fn recv(listener: &mut Option<PgListener>) -> Result<(), sqlx::Error> {
    match listener {
        Some(l) => {
            l.recv().await?;
            while l.next_buffered().is_some() {}
            Ok(())
        }
        None => std::future::pending().await,
    }
}
