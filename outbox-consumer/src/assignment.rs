//! Which partition assignment a fetched message belongs to. A message fetched before its
//! partition was revoked must not be handled after the revocation: another member owns the
//! partition by then and re-reads it from the committed offset, and if the partition comes
//! back, a fresh fetch delivers the message again in order. The context also tells a running
//! consumer of each rebalance as it happens (see `partition_stream.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::task::{Poll, Waker};

use rdkafka::client::{DefaultClientContext, OAuthToken};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, ClientContext, Statistics};

use crate::ConsumerError;

/// The [`ConsumerContext`] [`DedupConsumer::run`](crate::DedupConsumer::run) needs: it counts
/// revocations per partition, so that queued messages of a revoked partition are dropped
/// (and redelivered) rather than handled by a member that no longer owns them.
///
/// It wraps the application's own [`ClientContext`] (`C`), to which it forwards everything a
/// client context does: logs, statistics, errors and OAUTHBEARER token refresh. Bring one
/// with [`stream_consumer_with_context`] or [`DedupConsume::context`](crate::DedupConsume::context).
#[derive(Default)]
pub struct DedupContext<C = DefaultClientContext> {
    /// Revocations per topic and partition.
    epochs: Mutex<HashMap<String, HashMap<i32, u64>>>,
    /// The partitions assigned now, whose number divides the prefetch budget.
    owned: Mutex<HashSet<(String, i32)>>,
    /// Called before each rebalance takes effect, while a consumer runs.
    watcher: Mutex<Option<Watcher>>,
    /// Closed while a revocation takes effect (see [`Self::poll_at_epoch`]).
    gate: Mutex<Gate>,
    /// What librdkafka last reported as a client error.
    /// The application's context, recording librdkafka's client errors.
    inner: outbox_core::RecordingContext<C>,
}

#[derive(Debug, Default)]
struct Gate {
    revoking: bool,
    waiting: Vec<Waker>,
}

/// What a running consumer does with a rebalance before it takes effect.
pub(crate) type Watcher = Box<dyn Fn(&Rebalance<'_>) + Send + Sync>;

impl<C> DedupContext<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            epochs: Mutex::default(),
            owned: Mutex::default(),
            watcher: Mutex::default(),
            gate: Mutex::default(),
            inner: outbox_core::RecordingContext::new(inner),
        }
    }

    /// librdkafka's last client error (a refused password, a failed TLS handshake, a lost
    /// broker), escaped; take the handle before [`DedupConsumer::run`](crate::DedupConsumer::run)
    /// takes the consumer: it keeps seeing what the context records.
    pub fn last_client_error(&self) -> outbox_core::LastClientError {
        self.inner.last_error()
    }

    /// Sets (or, with `None`, clears) what runs before each rebalance takes effect.
    pub(crate) fn watch(&self, watcher: Option<Watcher>) {
        *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) = watcher;
    }

    /// The application's context.
    pub fn inner(&self) -> &C {
        self.inner.inner()
    }

    /// Polls `take` (a non-blocking take from `topic`/`partition`'s own queue) and gives what
    /// it took with the partition's revocation count at that moment, which is exact: no take
    /// runs between a revocation's count and librdkafka's dropping of what the revoked
    /// assignment had fetched (which happens inside the rebalance callback, between
    /// [`ConsumerContext::pre_rebalance`] and [`ConsumerContext::post_rebalance`]). So a message
    /// taken is either of the assignment its count names or of a later one, never of an earlier
    /// one counted as current.
    pub(crate) fn poll_at_epoch<T>(
        &self,
        cx: &mut std::task::Context<'_>,
        topic: &str,
        partition: i32,
        take: impl FnOnce(&mut std::task::Context<'_>) -> Poll<T>,
    ) -> Poll<(T, u64)> {
        let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
        if gate.revoking {
            gate.waiting.push(cx.waker().clone());
            return Poll::Pending;
        }
        let epoch = self.epoch(topic, partition);
        take(cx).map(|taken| (taken, epoch))
    }

    /// How many partitions are assigned to this member now.
    pub(crate) fn owned(&self) -> usize {
        self.owned.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether `topic`/`partition` is assigned to this member now.
    pub(crate) fn owns(&self, topic: &str, partition: i32) -> bool {
        self.owned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(topic.to_owned(), partition))
    }

    /// How many times `topic`/`partition` has been revoked from this member.
    pub(crate) fn epoch(&self, topic: &str, partition: i32) -> u64 {
        let epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        epochs
            .get(topic)
            .and_then(|partitions| partitions.get(&partition))
            .copied()
            .unwrap_or(0)
    }
}

impl<C: std::fmt::Debug> std::fmt::Debug for DedupContext<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupContext")
            .field("epochs", &self.epochs)
            .field("inner", self.inner.inner())
            .finish_non_exhaustive()
    }
}

impl<C: ClientContext> ClientContext for DedupContext<C> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = C::ENABLE_REFRESH_OAUTH_TOKEN;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.inner.log(level, fac, log_message);
    }

    fn stats(&self, statistics: Statistics) {
        self.inner.stats(statistics);
    }

    fn stats_raw(&self, statistics: &[u8]) {
        self.inner.stats_raw(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.inner.error(error, reason);
    }

    fn generate_oauth_token(
        &self,
        oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.inner.generate_oauth_token(oauthbearer_config)
    }
}

impl<C: ClientContext> ConsumerContext for DedupContext<C> {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        // Eager rebalances revoke and assign whole assignments, cooperative ones a change:
        // either way this set is what is assigned once the rebalance took effect.
        {
            let mut owned = self.owned.lock().unwrap_or_else(|p| p.into_inner());
            match rebalance {
                Rebalance::Assign(partitions) => owned.extend(
                    partitions
                        .elements()
                        .iter()
                        .map(|e| (e.topic().to_owned(), e.partition())),
                ),
                Rebalance::Revoke(partitions) => {
                    for e in partitions.elements() {
                        owned.remove(&(e.topic().to_owned(), e.partition()));
                    }
                }
                Rebalance::Error(_) => {}
            }
        }
        if let Rebalance::Revoke(partitions) = rebalance {
            // Taken under the gate: a take in progress finishes first, and none starts until
            // post_rebalance, after librdkafka dropped the revoked assignment's messages.
            self.gate.lock().unwrap_or_else(|p| p.into_inner()).revoking = true;
            let mut epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
            for element in partitions.elements() {
                *epochs
                    .entry(element.topic().to_owned())
                    .or_default()
                    .entry(element.partition())
                    .or_default() += 1;
            }
            tracing::info!(
                revoked = partitions.count(),
                "partitions revoked; their queued messages will be redelivered"
            );
        }
        // After the epochs moved, so a partition assigned now is seen at its new epoch.
        if let Some(watcher) = &*self.watcher.lock().unwrap_or_else(|p| p.into_inner()) {
            watcher(rebalance);
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(_) = rebalance {
            let waiting = {
                let mut gate = self.gate.lock().unwrap_or_else(|p| p.into_inner());
                gate.revoking = false;
                std::mem::take(&mut gate.waiting)
            };
            waiting.into_iter().for_each(Waker::wake);
        }
    }
}

/// Creates the `StreamConsumer` [`DedupConsumer::run`](crate::DedupConsumer::run) takes, from
/// `kafka` with the settings the consumer's guarantees rest on enforced (see
/// [`consumer_config`](crate::consumer_config)). Subscribe or assign it before running. An
/// error names the key librdkafka refused, never its value (see
/// [`outbox_core::kafka_secrets`]).
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_consumer::ConsumerError> {
/// use outbox_consumer::{ConsumerConfig, DedupConsumer, Event, consumer_config, stream_consumer};
/// use rdkafka::consumer::Consumer;
/// use tokio_util::sync::CancellationToken;
///
/// async fn record(event: &Event<serde_json::Value>, conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO seen (id) VALUES ($1)").bind(event.id).execute(conn).await?;
///     Ok(())
/// }
/// let consumer = DedupConsumer::new(pool, ConsumerConfig::new("billing"), record)?;
/// let stream = stream_consumer(consumer_config("127.0.0.1:9092", "billing").set("session.timeout.ms", "10000"))?;
/// stream.subscribe(&["outbox.event.invoice"])?;
/// consumer.run(stream, CancellationToken::new()).await
/// # }
/// ```
pub fn stream_consumer(
    kafka: &ClientConfig,
) -> Result<StreamConsumer<DedupContext>, ConsumerError> {
    stream_consumer_with_context(kafka, DefaultClientContext)
}

/// [`stream_consumer`] with the application's own client context (statistics, logging,
/// OAUTHBEARER token refresh), which the consumer's [`DedupContext`] wraps.
pub fn stream_consumer_with_context<C: ClientContext + 'static>(
    kafka: &ClientConfig,
    context: C,
) -> Result<StreamConsumer<DedupContext<C>>, ConsumerError> {
    let mut kafka = kafka.clone();
    crate::runner::enforce_required(&mut kafka);
    Ok(outbox_core::kafka_secrets::create_with_context(
        &kafka,
        DedupContext::new(context),
    )?)
}
