//! Which partition assignment a fetched message belongs to. A message fetched before its
//! partition was revoked must not be handled after the revocation: another member owns the
//! partition by then and re-reads it from the committed offset, and if the partition comes
//! back, a fresh fetch delivers the message again in order.

use std::collections::HashMap;
use std::sync::Mutex;

use rdkafka::ClientConfig;
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance, StreamConsumer};

use crate::ConsumerError;

/// The [`ConsumerContext`] [`DedupConsumer::run`](crate::DedupConsumer::run) needs: it counts
/// revocations per partition, so that queued messages of a revoked partition are dropped
/// (and redelivered) rather than handled by a member that no longer owns them.
#[derive(Debug, Default)]
pub struct DedupContext {
    /// Revocations per topic and partition.
    epochs: Mutex<HashMap<String, HashMap<i32, u64>>>,
}

impl DedupContext {
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

impl ClientContext for DedupContext {}

impl ConsumerContext for DedupContext {
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
/// let consumer = DedupConsumer::new(pool, ConsumerConfig::new("billing"),
///     |event: &Event<serde_json::Value>, tx| Box::pin(async move {
///         sqlx::query("INSERT INTO seen (id) VALUES ($1)").bind(event.id).execute(&mut **tx).await?;
///         Ok(())
///     }))?;
/// let stream = stream_consumer(consumer_config("127.0.0.1:9092", "billing").set("session.timeout.ms", "10000"))?;
/// stream.subscribe(&["outbox.event.invoice"])?;
/// consumer.run(stream, CancellationToken::new()).await
/// # }
/// ```
pub fn stream_consumer(
    kafka: &ClientConfig,
) -> Result<StreamConsumer<DedupContext>, ConsumerError> {
    let mut kafka = kafka.clone();
    crate::runner::enforce_required(&mut kafka);
    Ok(kafka.create_with_context(DedupContext::default())?)
}
