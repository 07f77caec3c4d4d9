//! The Kafka loop around [`DedupConsumer::process`]: one ordered worker per partition, a
//! bounded number running at once, offsets stored only after a message is fully handled.

use std::collections::HashMap;
use std::sync::Arc;

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext};
use serde::de::DeserializeOwned;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::assignment::DedupContext;
use crate::consumer::Outcome;
use crate::partition_queue::{PartitionReceiver, PartitionSender, Queued, partition_queue};
use crate::permit::Turn;
use crate::{ConsumerError, DedupConsumer, Handler};

/// Settings the consumer's guarantees rest on, applied over the caller's.
const REQUIRED: &[(&str, &str)] = &[
    // Offsets are stored by us, after the handler's transaction committed...
    ("enable.auto.offset.store", "false"),
    // ...and librdkafka commits what was stored, in the background.
    ("enable.auto.commit", "true"),
];

/// A consumer configuration for `bootstrap_servers` and group `group_id`, with the settings
/// [`dedup_consume`](crate::dedup_consume) requires, reading new groups from the earliest offset.
pub fn consumer_config(bootstrap_servers: &str, group_id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap_servers)
        .set("group.id", group_id)
        .set("auto.offset.reset", "earliest");
    enforce_required(&mut config);
    config
}

pub(crate) fn enforce_required(config: &mut ClientConfig) {
    for (key, value) in REQUIRED {
        if config.get(key).is_some_and(|v| v != *value) {
            tracing::warn!(
                key,
                value,
                "overriding consumer setting dedup_consume requires"
            );
        }
        config.set(*key, *value);
    }
}

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// Receives one message from `consumer`, handles it and stores its offset. For tests and
    /// hand-driven loops; `consumer` must have `enable.auto.offset.store=false`.
    pub async fn run_once<C: ConsumerContext + 'static>(
        &self,
        consumer: &StreamConsumer<C>,
    ) -> Result<Outcome, ConsumerError> {
        let message = consumer.recv().await?.detach();
        let outcome = self.process(&message, &CancellationToken::new()).await?;
        store_offset(consumer, &message);
        Ok(outcome)
    }

    /// Consumes until `shutdown` is cancelled. `consumer` comes from [`stream_consumer`](crate::stream_consumer)
    /// and must be subscribed (or assigned).
    ///
    /// Partitions are handled concurrently (up to `max_concurrent_partitions`), each in
    /// order. A partition with `max_queued_per_partition` messages queued has its fetch
    /// paused rather than the poll loop blocked, and messages of a partition revoked from this member are dropped from
    /// its queue (the partition's next owner reads them from the committed offset). On
    /// shutdown, messages being handled finish, queued ones are left for redelivery, stored
    /// offsets are committed within `shutdown_timeout`, and the client is closed off the
    /// async runtime, so a dead broker cannot hang the caller. A message waiting out a retry
    /// backoff does not count against `max_concurrent_partitions` while it waits.
    ///
    /// Returns `Ok` after shutdown; [`ConsumerError::KafkaFatal`] when the Kafka client hit a
    /// fatal error (it would fetch nothing more), and the error of a partition worker that
    /// stopped on a fault; in both cases the other partitions stop after their current
    /// message, and the stored offsets are committed as on shutdown.
    pub async fn run<C: ClientContext + 'static>(
        &self,
        consumer: StreamConsumer<DedupContext<C>>,
        shutdown: CancellationToken,
    ) -> Result<(), ConsumerError> {
        let consumer = Arc::new(consumer);
        let permits = Arc::new(Semaphore::new(self.inner.config.max_concurrent_partitions));
        let mut queues: HashMap<(String, i32), PartitionSender> = HashMap::new();
        let mut workers = JoinSet::new();
        // Workers stop at this token, which is also cut when the loop stops on a fault: their
        // queued messages are then redelivered, not handled by a consumer that is going away.
        let stop = shutdown.child_token();
        let result = loop {
            let received = tokio::select! {
                () = stop.cancelled() => break Ok(()),
                Some(joined) = workers.join_next(), if !workers.is_empty() => {
                    // Workers only stop early on a fault; later offsets must not be stored
                    // past the message it left unhandled, so the whole consumer stops.
                    break flatten(joined);
                }
                received = consumer.recv() => received,
            };
            let message = match received {
                Ok(m) => m.detach(),
                Err(error) => {
                    // A fatal error is reported once, and the client fetches nothing after it:
                    // going on would look alive while consuming nothing.
                    if let Some(fatal) = fatal(&consumer, &error) {
                        tracing::error!(%fatal, "fatal kafka consumer error; stopping");
                        break Err(fatal);
                    }
                    tracing::warn!(%error, "kafka consumer error");
                    continue;
                }
            };
            let epoch = consumer
                .context()
                .epoch(message.topic(), message.partition());
            let queue = queues
                .entry((message.topic().to_owned(), message.partition()))
                .or_insert_with(|| {
                    let (tx, rx) = partition_queue(
                        message.topic(),
                        message.partition(),
                        self.inner.config.max_queued_per_partition,
                    );
                    workers.spawn(self.clone().partition_worker(
                        Arc::clone(&consumer),
                        rx,
                        Arc::clone(&permits),
                        stop.clone(),
                    ));
                    tx
                });
            // An `Err` means the worker stopped; join_next reports why.
            if let Ok(true) = queue.push(&consumer, Queued { message, epoch }) {
                self.count_pause();
            }
        };
        if result.is_err() {
            stop.cancel();
        }
        drop(queues);
        let mut result = result;
        while let Some(joined) = workers.join_next().await {
            if let Err(error) = flatten(joined) {
                result = result.and(Err(error));
            }
        }
        self.close(consumer).await;
        result
    }

    async fn partition_worker<C: ClientContext + 'static>(
        self,
        consumer: Arc<StreamConsumer<DedupContext<C>>>,
        mut queue: PartitionReceiver,
        permits: Arc<Semaphore>,
        shutdown: CancellationToken,
    ) -> Result<(), ConsumerError> {
        let config = &self.inner.config;
        let current = |message: &OwnedMessage| {
            consumer
                .context()
                .epoch(message.topic(), message.partition())
        };
        while let Some(first) = queue.next(&consumer).await {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            // What is queued now, never waiting for more: at low load a batch is one message.
            let mut batch = vec![first];
            while batch.len() < config.max_batch_size {
                match queue.try_next(&consumer) {
                    Some(queued) => batch.push(queued),
                    None => break,
                }
            }
            // Fetched before the partition was revoked: whoever owns it now reads them again
            // from the committed offset.
            let mut epoch = 0;
            let messages: Vec<OwnedMessage> = batch
                .into_iter()
                .filter_map(|queued| {
                    if queued.epoch == current(&queued.message) {
                        epoch = queued.epoch;
                        Some(queued.message)
                    } else {
                        self.inner.note_revoked_skip();
                        None
                    }
                })
                .collect();
            let Some(last) = messages.last() else {
                continue;
            };
            let mut turn = Turn::take(&permits).await?;
            let mut failures = 0;
            let outcomes = loop {
                let owned = || current(last) == epoch;
                match self
                    .handle_batch(&messages, &shutdown, &mut turn, &owned)
                    .await
                {
                    Ok(outcomes) => break outcomes,
                    Err(error) => {
                        // The database is unavailable: retry these messages, never skip them
                        // (what committed meanwhile is found deduplicated).
                        tracing::warn!(%error, topic = last.topic(), partition = last.partition(),
                            offset = last.offset(), messages = messages.len(),
                            "cannot handle messages; retrying");
                        let delay =
                            outbox_core::backoff(config.backoff_base, config.backoff_max, failures);
                        if !turn.back_off(delay, &shutdown).await? {
                            return Ok(());
                        }
                        failures = failures.saturating_add(1);
                    }
                }
            };
            drop(turn);
            #[cfg(feature = "fault-injection")]
            self.crash_if_due(&messages, &outcomes)?;
            for _ in outcomes.iter().filter(|o| **o == Outcome::Revoked) {
                self.inner.note_revoked_skip();
            }
            // Offsets up to the last message fully handled; an abandoned or revoked one and
            // those after it are redelivered.
            let done = outcomes
                .iter()
                .take_while(|o| !matches!(o, Outcome::Abandoned | Outcome::Revoked))
                .count();
            // Revoked while they were handled: storing now could move a newer owner's (or a
            // re-fetch's) committed offset backwards. Their redelivery is deduplicated.
            if let Some(message) = done.checked_sub(1).map(|i| &messages[i])
                && epoch == current(message)
            {
                store_offset(&consumer, message);
            }
            if outcomes.contains(&Outcome::Abandoned) {
                return Ok(());
            }
        }
        Ok(())
    }

    #[cfg(feature = "fault-injection")]
    fn crash_if_due(
        &self,
        messages: &[OwnedMessage],
        outcomes: &[Outcome],
    ) -> Result<(), ConsumerError> {
        use rdkafka::message::Headers;
        use std::sync::atomic::Ordering::SeqCst;
        let inner = &self.inner;
        let processed = outcomes.contains(&Outcome::Processed);
        let mut target = inner
            .crash_after_commit_of
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let covered = target.is_some_and(|id| {
            messages.iter().zip(outcomes).any(|(m, o)| {
                *o == Outcome::Processed
                    && outbox_core::wire::event_id(
                        m.headers()
                            .into_iter()
                            .flat_map(|h| h.iter())
                            .map(|h| (h.key, h.value)),
                    )
                    .is_ok_and(|e| *e.as_uuid() == id)
            })
        });
        if covered {
            *target = None;
        }
        if covered || (processed && inner.crash_after_commit.swap(false, SeqCst)) {
            return Err(ConsumerError::InjectedFault(
                "crash after commit, before storing the offset",
            ));
        }
        Ok(())
    }

    async fn close<C: ClientContext + 'static>(
        &self,
        consumer: Arc<StreamConsumer<DedupContext<C>>>,
    ) {
        let timeout = self.inner.config.shutdown_timeout;
        // Committing and dropping can block on an unreachable broker: do both on a blocking
        // thread and stop waiting after `timeout`.
        let closing = tokio::task::spawn_blocking(move || {
            match consumer.commit_consumer_state(CommitMode::Sync) {
                Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
                Err(error) => {
                    tracing::warn!(%error, "final offset commit failed; uncommitted messages will be redelivered")
                }
            }
            drop(consumer);
        });
        if tokio::time::timeout(timeout, closing).await.is_err() {
            tracing::warn!(
                ?timeout,
                "consumer did not close in time; leaving it to close in the background"
            );
        }
    }
}

fn store_offset<C: ConsumerContext>(consumer: &StreamConsumer<C>, message: &OwnedMessage) {
    if let Err(error) =
        consumer.store_offset(message.topic(), message.partition(), message.offset())
    {
        // After a rebalance the partition may belong to another member: it will redeliver,
        // and the dedup table absorbs that.
        tracing::warn!(%error, topic = message.topic(), partition = message.partition(),
            offset = message.offset(), "could not store offset");
    }
}

/// The error `run` stops with, if `error` (or the client's state) is fatal.
fn fatal<C: ConsumerContext>(
    consumer: &StreamConsumer<C>,
    error: &KafkaError,
) -> Option<ConsumerError> {
    let (code, reason) = match (consumer.client().fatal_error(), error) {
        (Some(fatal), _) => fatal,
        (None, KafkaError::MessageConsumptionFatal(code)) => (*code, error.to_string()),
        (None, _) => return None,
    };
    Some(ConsumerError::KafkaFatal { code, reason })
}

fn flatten(
    joined: Result<Result<(), ConsumerError>, tokio::task::JoinError>,
) -> Result<(), ConsumerError> {
    joined.map_err(|e| ConsumerError::Worker(e.to_string()))?
}
