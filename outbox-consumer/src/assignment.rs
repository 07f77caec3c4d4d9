//! Which partition assignment a fetched message belongs to. A message fetched before its
//! partition was revoked must not be handled after the revocation: another member owns the
//! partition by then and re-reads it from the committed offset, and if the partition comes
//! back, a fresh fetch delivers the message again in order.

use std::collections::HashMap;
use std::sync::Mutex;

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
#[derive(Debug, Default)]
pub struct DedupContext<C = DefaultClientContext> {
    /// Revocations per topic and partition.
    epochs: Mutex<HashMap<String, HashMap<i32, u64>>>,
    inner: C,
}

impl<C> DedupContext<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            epochs: Mutex::default(),
            inner,
        }
    }

    /// The application's context.
    pub fn inner(&self) -> &C {
        &self.inner
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
        if let Rebalance::Revoke(partitions) = rebalance {
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
    }
}

/// Creates the `StreamConsumer` [`DedupConsumer::run`](crate::DedupConsumer::run) takes, from
/// `kafka` with the settings the consumer's guarantees rest on enforced (see
/// [`consumer_config`](crate::consumer_config)). Subscribe or assign it before running.
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
    Ok(kafka.create_with_context(DedupContext::new(context))?)
}
