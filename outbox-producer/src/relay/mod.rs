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
mod destination;
mod failure;
mod kafka;
mod outages;
mod publish;
mod row;

use std::sync::Arc;

use rdkafka::ClientConfig;
use rdkafka::client::{ClientContext, DefaultClientContext};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use config::{AfterPublish, QuarantinePolicy, RelayConfig};
pub use kafka::producer_config;

use crate::ProducerError;
use crate::lane::{Lane, LaneMetrics, LaneRows};
use destination::Kafka;
use outbox_core::RecordingContext as RelayContext;

/// What one [`Relay::run_once`] (or `Dispatcher::run_once`) did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows acknowledged by Kafka (a dispatcher's: performed by its executor) and marked
    /// published (or deleted).
    pub published: usize,
    /// Rows that failed and will be retried.
    pub retried: usize,
    /// Rows moved to quarantine.
    pub quarantined: usize,
    /// Rows not sent because an earlier row of their aggregate failed in this batch.
    pub deferred: usize,
    /// Rows left pending exactly as they were (no attempt charged): the destination did not
    /// answer for them, or shutdown's grace period ended before their answer.
    pub unconfirmed: usize,
    /// Rows whose destination could not take them while it answered (a partition with no
    /// leader or too few in-sync replicas; an executor's `Unavailable` while other calls
    /// were answered): left pending with no attempt charged, tried again after a pause.
    pub waiting: usize,
    /// The destination did not answer at all (no broker; no call answered): the batch's
    /// failures were the lane's, not its rows'.
    pub broker_unreachable: bool,
    /// A dispatcher's results not recorded because their lease had passed to another
    /// dispatcher (that one calls them again, with the same key).
    pub lease_lost: usize,
}

/// Publishes committed outbox rows to Kafka. Cheap to clone; `Send + Sync`. Run one or many
/// (in one process or several) against the same table: order per key holds either way.
///
/// `C` is the producer's client context: the application's, for what it provides to the
/// client (an OAUTHBEARER token, its own logging), through [`Relay::with_context`].
pub struct Relay<C: ClientContext + 'static = DefaultClientContext> {
    lane: Arc<Lane<Kafka<C>>>,
}

impl<C: ClientContext + 'static> Clone for Relay<C> {
    fn clone(&self) -> Self {
        Self {
            lane: Arc::clone(&self.lane),
        }
    }
}

impl<C: ClientContext + 'static> std::fmt::Debug for Relay<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.lane.config)
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
        if !config.insecure_transport {
            outbox_core::check_kafka_tls_with(&kafka, C::ENABLE_REFRESH_OAUTH_TOKEN)?;
        }
        let context = RelayContext::new(context);
        let client_error = context.last_error();
        let producer = outbox_core::kafka_secrets::create_with_context(&kafka, context)?;
        let table = config.tables.outbox.as_str().to_owned();
        let metrics = LaneMetrics {
            done: "outbox_relay_published_total",
            failed: "outbox_relay_failed_total",
            quarantined: "outbox_relay_quarantined_total",
            unconfirmed: "outbox_relay_unconfirmed_total",
            waiting: "outbox_relay_waiting_total",
            latency: "outbox_relay_publish_latency_seconds",
            pending: "outbox_pending",
            oldest_pending: "outbox_oldest_pending_age_seconds",
            quarantined_now: "outbox_quarantined",
            labels: vec![("table", table.clone())],
        };
        let destination = Kafka::new(producer, client_error, &config);
        let lane = Lane::new(pool, config, &LaneRows::Relay, destination, metrics, 1)?;
        Ok(Self {
            lane: Arc::new(lane),
        })
    }

    /// The last client error librdkafka reported to the producer (a refused password, a TLS
    /// handshake that failed, a broker connection lost), escaped: why no broker answers when
    /// [`BatchReport::broker_unreachable`] is set. Never a secret: librdkafka names the
    /// mechanism and the step that failed.
    pub fn last_client_error(&self) -> Option<String> {
        self.lane.destination.client_error.get()
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.lane.config
    }

    /// Makes the next batch fail after Kafka acknowledged it and before the rows are marked,
    /// as a crash there would. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_ack(&self) {
        self.lane.destination.crash_after_next_ack();
    }

    /// Claims, publishes and marks one batch. Tests drive the relay with this.
    pub async fn run_once(&self) -> Result<BatchReport, ProducerError> {
        self.lane.run_batch(true, &CancellationToken::new()).await
    }

    /// Claims and marks one batch as published **without sending it**: the relay's own SQL
    /// cycle, the ceiling benchmarks compare publishing against. Never use it on real data.
    #[cfg(feature = "bench")]
    #[doc(hidden)]
    pub async fn run_once_without_publishing(&self) -> Result<BatchReport, ProducerError> {
        self.lane.run_batch(false, &CancellationToken::new()).await
    }

    /// Runs batches until `shutdown` is cancelled: immediately while batches come back full,
    /// otherwise on a `NOTIFY` from a committing writer or every `poll_interval`.
    ///
    /// When no broker answers, the relay stops claiming and asks the cluster every second
    /// whether it is back; the rows keep their attempt counts, however long the outage.
    ///
    /// Shutdown takes at most `shutdown_timeout` from the signal: a batch in flight is
    /// recorded with what was acknowledged by then (the rest stays pending and is published
    /// again later, same event ids), then the producer is flushed with what time is left. A
    /// batch the database does not answer for is left to finish or roll back on its own
    /// (half a second past `shutdown_timeout`): its rows stay pending until then.
    ///
    /// Returns [`ProducerError::FatalProducer`] when the producer can no longer be used;
    /// restart the relay with a new producer (its rows are still pending).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProducerError> {
        self.lane.run(shutdown).await
    }
}
