//! The relay: moves committed outbox rows to Kafka, at least once, in order per key.
//!
//! # How a batch runs
//! An aggregate is (`aggregatetype`, `aggregateid`): `invoice/42` and `customer/42` are two.
//!
//! 1. In one transaction, lock up to `batch_size` due pending rows (`FOR UPDATE SKIP LOCKED`)
//!    among those no earlier row of their aggregate holds back (a row waiting for its retry
//!    or for its partition to take writes again, or under [`QuarantinePolicy::BlockKey`] a quarantined one), so however many rows one
//!    key holds back, the batch fills with other keys' rows. Of those, keep the rows with no
//!    earlier unpublished row of the same aggregate outside the batch.
//! 2. Send them with an idempotent producer (`enable.idempotence=true`, `acks=all`): each
//!    aggregate's rows in sequence order, one at a time (a row leaves the client only once the
//!    previous row of its aggregate was acknowledged), aggregates side by side; wait for every
//!    delivery report.
//! 3. Only then mark the acknowledged rows published (or delete them) and record failures,
//!    and commit. A crash anywhere before the commit leaves the rows pending and unlocked:
//!    they are published again (same event id), never lost.
//!
//! The transaction sets its own `statement_timeout` (5 minutes) and
//! `idle_in_transaction_session_timeout` (30 s), whatever the server, database or role sets,
//! and runs a statement every 2 s while it waits for Kafka: a short server setting (common on
//! managed Postgres) can neither cancel the claim nor end the transaction after Kafka
//! acknowledged its rows, and a relay that stalls releases its rows within 30 s.
//!
//! # Per-key order, with any number of relays
//! A row is published only when every earlier row of its aggregate is published. Rows
//! another relay has locked count as unpublished until that relay commits, so two relays
//! never publish one aggregate's rows concurrently, and a row waiting for its retry holds its
//! later rows back. A claim skips, before its LIMIT, the aggregates another relay is
//! publishing (a transaction-scoped advisory lock per aggregate), so that relay's busy
//! aggregate does not fill the others' batches with rows they cannot publish. Within a batch, an aggregate has one row in flight at a time: if it fails
//! (before it leaves the client, or in its delivery report), the aggregate's later rows in the
//! batch are not sent. Sending them together would leave their order to librdkafka, which is
//! not gap-less by default: when one produce request of a partition fails for good, it
//! delivers the later requests after an epoch bump, so rows split over requests (any
//! `batch.num.messages`, `batch.size` or linger) could pass a failed or quarantined row.
//!
//! # Failures: the row's, or the relay's
//! A row is charged an attempt only for its own failure. Permanent ones (too large, invalid
//! topic, not authorized, `headers` not a JSON object of strings or naming a contract header)
//! quarantine it at once with the reason. Transient ones (a broker refused it for another
//! reason, such as a topic that does not exist) retry with exponential backoff and jitter, and quarantine after `max_attempts`. Other
//! aggregates keep flowing either way; [`QuarantinePolicy`] says whether the same aggregate
//! does. A partition that cannot take writes while the cluster answers (no leader, fewer
//! in-sync replicas than `min.insync.replicas`, a delivery that timed out on a topic the
//! cluster knows) is an outage of that partition: its rows are charged nothing, wait
//! (`backoff_max`, at most 30 s) holding their aggregates, and other partitions flow, however
//! long it lasts. The relay remembers the partition as out: later batches do not send its
//! rows (they would hold every batch for `message.timeout.ms`) but leave them waiting the same
//! way, except one probe row after each such pause; the first row acknowledged there ends the
//! outage (metrics `outbox_relay_partitions_out`, `outbox_relay_waiting_total`). So the other
//! partitions lose one `message.timeout.ms` per pause, not one per batch. When no broker answers at all, the failure is the relay's: the rows stay
//! exactly as they were (no attempt charged) and [`Relay::run`] waits for the cluster.
//! A fatal producer error (an idempotent producer that lost its sequence state) is not a
//! row's failure: the batch is left pending as it was and the relay stops with
//! [`ProducerError::FatalProducer`], to be restarted with a new producer.

mod config;
mod failure;
mod grace;
mod kafka;
mod outages;
mod publish;
mod record;
mod row;
mod run_loop;
mod stats_export;
mod transaction;

use std::collections::HashMap;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rdkafka::ClientConfig;
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::producer::{FutureProducer, Producer};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use config::{AfterPublish, QuarantinePolicy, RelayConfig};
use kafka::TopicAnswer;
pub use kafka::producer_config;

use crate::ProducerError;
use crate::sql::RelaySql;
use failure::{FailureKind, classify, outage_wait};
use outages::Outages;
use outbox_core::{LastClientError as LastError, RecordingContext as RelayContext};
use publish::Outcome;
use row::OutboxRow;

/// How long the relay waits for a broker to answer after a batch failed with no answer.
const BROKER_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

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
    /// Rows left pending exactly as they were (no attempt charged): no broker answered for
    /// them, or shutdown's grace period ended before their delivery report.
    pub unconfirmed: usize,
    /// Rows whose partition could not take writes while the cluster answered (no leader,
    /// too few in-sync replicas): left pending with no attempt charged, tried again after a
    /// pause.
    pub waiting: usize,
    /// No broker answered: the batch's failures were the relay's, not its rows'.
    pub broker_unreachable: bool,
}

/// Publishes committed outbox rows to Kafka. Cheap to clone; `Send + Sync`. Run one or many
/// (in one process or several) against the same table: order per key holds either way.
///
/// `C` is the producer's client context: the application's, for what it provides to the
/// client (an OAUTHBEARER token, its own logging), through [`Relay::with_context`].
pub struct Relay<C: ClientContext + 'static = DefaultClientContext> {
    inner: Arc<Inner<C>>,
}

impl<C: ClientContext + 'static> Clone for Relay<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<C: ClientContext + 'static> {
    pool: PgPool,
    producer: FutureProducer<RelayContext<C>>,
    /// What the producer's context last heard from librdkafka.
    client_error: LastError,
    config: RelayConfig,
    sql: RelaySql,
    /// Partitions known to be out, and partition counts, across batches.
    outages: Mutex<Outages>,
    #[cfg(feature = "fault-injection")]
    crash_after_ack: AtomicBool,
}

impl<C: ClientContext + 'static> Inner<C> {
    fn outages(&self) -> MutexGuard<'_, Outages> {
        self.outages.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<C: ClientContext + 'static> std::fmt::Debug for Relay<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay with a producer built from `kafka`, with `enable.idempotence=true`,
    /// `acks=all` and `partitioner=murmur2_random` (Java's, which Debezium uses) enforced
    /// (see [`producer_config`] for a starting point). An error building the producer names the
    /// key it refused, never its value (see [`outbox_core::kafka_secrets`]).
    pub fn new(
        pool: PgPool,
        kafka: &ClientConfig,
        config: RelayConfig,
    ) -> Result<Self, ProducerError> {
        Self::with_context(pool, kafka, DefaultClientContext, config)
    }
}

impl<C: ClientContext + 'static> Relay<C> {
    /// [`Relay::new`] with the application's client context for the producer.
    pub fn with_context(
        pool: PgPool,
        kafka: &ClientConfig,
        context: C,
        config: RelayConfig,
    ) -> Result<Self, ProducerError> {
        let mut kafka = kafka.clone();
        kafka::enforce_required(&mut kafka);
        config.validate()?;
        let context = RelayContext::new(context);
        let client_error = context.last_error();
        let producer = outbox_core::kafka_secrets::create_with_context(&kafka, context)?;
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
                client_error,
                config,
                sql,
                outages: Mutex::default(),
                #[cfg(feature = "fault-injection")]
                crash_after_ack: AtomicBool::new(false),
            }),
        })
    }

    /// The last client error librdkafka reported to the producer (a refused password, a TLS
    /// handshake that failed, a broker connection lost), escaped: why no broker answers when
    /// [`BatchReport::broker_unreachable`] is set. Never a secret: librdkafka names the
    /// mechanism and the step that failed.
    pub fn last_client_error(&self) -> Option<String> {
        self.inner.client_error.get()
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
        self.run_batch(true, &CancellationToken::new()).await
    }

    /// Claims and marks one batch as published **without sending it**: the relay's own SQL
    /// cycle, the ceiling benchmarks compare publishing against. Never use it on real data.
    #[cfg(feature = "bench")]
    #[doc(hidden)]
    pub async fn run_once_without_publishing(&self) -> Result<BatchReport, ProducerError> {
        self.run_batch(false, &CancellationToken::new()).await
    }

    /// One batch; `expired` ends the wait for delivery reports (shutdown's grace period).
    async fn run_batch(
        &self,
        publish: bool,
        expired: &CancellationToken,
    ) -> Result<BatchReport, ProducerError> {
        let inner = &*self.inner;
        let mut tx = transaction::begin(&inner.pool).await?;
        // Not a named prepared statement: after five runs Postgres may switch one to a generic
        // plan, and the claim's generic plan scanned the backlog (18 s per batch at 10M
        // pending, bench P7); an unnamed statement is planned with its parameter every time.
        let rows: Vec<OutboxRow> = sqlx::query_as(inner.sql.claim.clone())
            .bind(i64::from(inner.config.batch_size))
            .persistent(false)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let (outcomes, answers) = if publish {
            let gate = inner.outages().gate(&rows);
            // The questions to the cluster run inside the keep-alive too: they can take
            // seconds, and the transaction must not sit idle meanwhile.
            let work = async {
                let outcomes = publish::publish(&inner.producer, &rows, &gate, expired).await;
                let answers = ask_about_failures(inner, &rows, &outcomes).await;
                (outcomes, answers)
            };
            transaction::keep_alive(&mut tx, work).await?
        } else {
            (
                rows.iter().map(|_| Outcome::Delivered(-1)).collect(),
                HashMap::new(),
            )
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
        if publish {
            learn(inner, &rows, &outcomes, &answers);
        }
        let report = record::record(
            &mut tx,
            &inner.config,
            &inner.sql,
            &rows,
            outcomes,
            &answers,
        )
        .await?;
        tx.commit().await?;
        tracing::debug!(
            claimed = report.claimed,
            published = report.published,
            retried = report.retried,
            quarantined = report.quarantined,
            deferred = report.deferred,
            unconfirmed = report.unconfirmed,
            waiting = report.waiting,
            "relay batch"
        );
        Ok(report)
    }
}

/// What the cluster says about each topic with a record that went unanswered (whether it
/// answers at all; whether the topic is there), or that failed for its partition while the
/// topic's partition count is not known: one metadata request within one deadline,
/// [`BROKER_CHECK_TIMEOUT`]. Partition counts are kept for the next batches.
async fn ask_about_failures<C: ClientContext + 'static>(
    inner: &Inner<C>,
    rows: &[OutboxRow],
    outcomes: &[Outcome],
) -> HashMap<String, TopicAnswer> {
    let mut topics: Vec<String> = Vec::new();
    {
        let outages = inner.outages();
        for (row, outcome) in rows.iter().zip(outcomes) {
            let ask = match outcome {
                Outcome::Failed(e, _) => match classify(e) {
                    FailureKind::NoAnswer => true,
                    FailureKind::Outage => !outages.knows_partitions_of(&row.topic),
                    _ => false,
                },
                _ => false,
            };
            if ask && !topics.contains(&row.topic) {
                topics.push(row.topic.clone());
            }
        }
    }
    if topics.is_empty() {
        return HashMap::new();
    }
    let answers = kafka::ask_about(&inner.producer, topics, BROKER_CHECK_TIMEOUT).await;
    let mut outages = inner.outages();
    for (topic, answer) in &answers {
        if let TopicAnswer::Known(count) = answer {
            outages.set_partition_count(topic, *count);
        }
    }
    answers
}

/// Learns from a batch's outcomes which partitions are out (a record failed there for its
/// partition) and which take writes again (a record was acknowledged there).
fn learn<C: ClientContext + 'static>(
    inner: &Inner<C>,
    rows: &[OutboxRow],
    outcomes: &[Outcome],
    answers: &HashMap<String, TopicAnswer>,
) {
    let mut outages = inner.outages();
    let now = std::time::Instant::now();
    for (row, outcome) in rows.iter().zip(outcomes) {
        match outcome {
            Outcome::Delivered(partition) => {
                if outages.mark_up(&row.topic, *partition) {
                    tracing::info!(topic = %outbox_core::escape(&row.topic), partition, "partition takes writes again");
                }
                if outages
                    .partition_of(row)
                    .is_some_and(|computed| computed != *partition)
                {
                    // The topic has more partitions than the relay knew.
                    outages.forget_partition_count(&row.topic);
                }
            }
            Outcome::Failed(error, partition) => {
                let outage = match classify(error) {
                    FailureKind::Outage => true,
                    FailureKind::NoAnswer => {
                        matches!(answers.get(&row.topic), Some(TopicAnswer::Known(_)))
                    }
                    _ => false,
                };
                if let Some(partition) = partition
                    .or_else(|| outages.partition_of(row))
                    .filter(|_| outage)
                {
                    let wait = outage_wait(&inner.config);
                    tracing::warn!(topic = %outbox_core::escape(&row.topic), partition, probe_in = ?wait, %error, "partition out: its rows wait unsent until a probe is acknowledged");
                    outages.mark_out(&row.topic, partition, now + wait);
                }
            }
            _ => {}
        }
    }
    #[allow(clippy::cast_precision_loss)]
    metrics::gauge!("outbox_relay_partitions_out", "table" => inner.config.tables.outbox.as_str().to_owned())
        .set(outages.len() as f64);
}
