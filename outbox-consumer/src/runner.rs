//! The Kafka loop around [`DedupConsumer::process`]: one ordered worker per assigned
//! partition, reading the partition's own queue, a bounded number handling batches at once,
//! offsets stored only after the commit that covers them.

use std::sync::Arc;

use rdkafka::consumer::{CommitMode, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext};
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::assignment::DedupContext;
use crate::consumer::Outcome;
use crate::partition_stream::{
    Change, Fetched, PartitionStream, prefetch, stop_watching, watch_rebalances,
};
use crate::permit::Turn;
use crate::prefetch::{Held, Share};
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
        .set("auto.offset.reset", "earliest")
        // librdkafka's default, pinned: a commit written behind an unacknowledged fetch must
        // not wait for the broker's delayed ACK.
        .set("socket.nagle.disable", "true");
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
    crate::prefetch::librdkafka_defaults(config);
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
    /// and must be subscribed, not assigned: partitions are taken on as the group assigns them.
    ///
    /// Each assigned partition gets its own queue and worker; up to `max_concurrent_partitions`
    /// workers handle batches at once, each partition in order. A worker that falls behind
    /// holds back only its own partition's fetch (the partition is paused once it holds its
    /// share of `prefetch_budget_bytes`, the budget divided by the partitions assigned), never
    /// the poll loop, so heartbeats, rebalances and the other partitions go on. A revoked
    /// partition's worker handles nothing after the message in hand; what was fetched for it
    /// is dropped, and the partition's next owner reads it from the committed offset. On shutdown, batches being
    /// handled finish, queued messages are left for redelivery, stored offsets are committed
    /// within `shutdown_timeout`, and the client is closed off the async runtime, so a dead
    /// broker cannot hang the caller. A message waiting out a retry backoff does not count
    /// against `max_concurrent_partitions` while it waits.
    ///
    /// Returns `Ok` after shutdown; [`ConsumerError::KafkaFatal`] when the Kafka client hit a
    /// fatal error (it would fetch nothing more), and the error of a partition worker that
    /// stopped on a fault; in both cases the other partitions stop after their current
    /// batch, and the stored offsets are committed as on shutdown. [`ConsumerError::Config`]
    /// when `consumer` has partitions assigned by hand.
    pub async fn run<C: ClientContext + 'static>(
        &self,
        consumer: StreamConsumer<DedupContext<C>>,
        shutdown: CancellationToken,
    ) -> Result<(), ConsumerError> {
        let consumer = Arc::new(consumer);
        if consumer.assignment().is_ok_and(|a| a.count() > 0) {
            return Err(ConsumerError::Config(
                "run takes a subscribed consumer; its partitions were assigned by hand".to_owned(),
            ));
        }
        // The server's version, if it answers at start (an outage is waited out later, as
        // any): on one too old every event would be quarantined.
        if let Ok(Ok(mut conn)) =
            tokio::time::timeout(std::time::Duration::from_secs(5), self.inner.pool.acquire()).await
        {
            match outbox_core::check_server_version(&mut conn).await {
                Err(error @ outbox_core::CoreError::UnsupportedServer(_)) => {
                    return Err(error.into());
                }
                Err(error) => tracing::warn!(%error, "cannot read the server's version"),
                Ok(()) => {}
            }
        }
        let mut changes = watch_rebalances(&consumer);
        let permits = Arc::new(Semaphore::new(self.inner.config.max_concurrent_partitions));
        let mut workers = JoinSet::new();
        // Workers stop at this token, which is also cut when the loop stops on a fault: their
        // queued messages are then redelivered, not handled by a consumer that is going away.
        let stop = shutdown.child_token();
        let result = loop {
            tokio::select! {
                () = stop.cancelled() => break Ok(()),
                Some(joined) = workers.join_next(), if !workers.is_empty() => {
                    // Workers only stop early on a fault; later offsets must not be stored
                    // past the message it left unhandled, so the whole consumer stops.
                    break flatten(joined);
                }
                Some(change) = changes.recv() => match change {
                    Change::Split { topic, partition, queue } => {
                        workers.spawn(self.clone().partition_worker(
                            Arc::clone(&consumer),
                            (topic, partition),
                            queue,
                            Arc::clone(&permits),
                            stop.clone(),
                        ));
                    }
                    Change::Unsplit { topic, partition } => {
                        break Err(ConsumerError::Worker(format!(
                            "no queue of its own for {topic}/{partition}: cannot consume it in order"
                        )));
                    }
                },
                received = consumer.recv() => match received {
                    // Every assigned partition has its own queue: the main one only serves
                    // events. A message here is one no worker sees; stopping (its offset is not
                    // stored) redelivers it, handling it here could break its partition's order.
                    Ok(message) => {
                        break Err(ConsumerError::Worker(format!(
                            "a message of {}/{} arrived outside its partition's queue",
                            message.topic(),
                            message.partition()
                        )));
                    }
                    Err(error) => {
                        // A fatal error is reported once, and the client fetches nothing after
                        // it: going on would look alive while consuming nothing.
                        if let Some(fatal) = fatal(&consumer, &error) {
                            tracing::error!(%fatal, "fatal kafka consumer error; stopping");
                            break Err(fatal);
                        }
                        tracing::warn!(%error, "kafka consumer error");
                    }
                },
            }
        };
        stop.cancel();
        stop_watching(&consumer);
        // Queues not yet handed to a worker hold the consumer too: it must close last.
        drop(changes);
        let mut result = result;
        while let Some(joined) = workers.join_next().await {
            if let Err(error) = flatten(joined) {
                result = result.and(Err(error));
            }
        }
        self.close(consumer).await;
        result
    }

    /// Handles the messages of `partition`'s own queue in batches, in order, until `stop` or a
    /// fault, while [`prefetch`] takes them from the queue within the partition's share of the
    /// prefetch budget.
    async fn partition_worker<C: ClientContext + 'static>(
        self,
        consumer: Arc<StreamConsumer<DedupContext<C>>>,
        partition: (String, i32),
        queue: PartitionStream<C>,
        permits: Arc<Semaphore>,
        stop: CancellationToken,
    ) -> Result<(), ConsumerError> {
        let (topic, partition) = (partition.0.as_str(), partition.1);
        let (budget, share) = (&self.inner.prefetch, Share::default());
        let (sender, fetched) = mpsc::unbounded_channel();
        let result = tokio::select! {
            result = self.handle_partition(&consumer, (topic, partition), fetched, &share, &permits, &stop) => result,
            never = prefetch(&consumer, topic, partition, queue, budget, &share, sender, &stop) => match never {},
        };
        // What it had taken and not handled is dropped with it.
        share.release_all(budget);
        result
    }

    /// The worker of [`Self::partition_worker`]. Each message comes with the partition's
    /// revocation count when it was taken: a batch is one count's messages, and is handled only
    /// while the partition is still owned at that count.
    async fn handle_partition<C: ClientContext + 'static>(
        &self,
        consumer: &StreamConsumer<DedupContext<C>>,
        (topic, partition): (&str, i32),
        mut fetched: mpsc::UnboundedReceiver<Fetched>,
        share: &Share,
        permits: &Semaphore,
        stop: &CancellationToken,
    ) -> Result<(), ConsumerError> {
        let config = &self.inner.config;
        let context = consumer.context();
        // A message taken at another count than the batch before it: it starts the next one.
        let mut carried: Option<Fetched> = None;
        // The revocation count at which this partition's parked keys were loaded (`park.rs`):
        // they are loaded again after each revocation, and released keys replayed while the
        // partition is owned, whether records come or not.
        let mut parks_of: Option<u64> = None;
        let mut park_poll = tokio::time::interval(crate::park::RELEASE_POLL);
        park_poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let first = match carried.take() {
                Some(taken) => taken,
                None => tokio::select! {
                    biased;
                    () = stop.cancelled() => return Ok(()),
                    _ = park_poll.tick() => {
                        if !self.tend_parks(context, (topic, partition), &mut parks_of, permits, stop).await? {
                            return Ok(());
                        }
                        continue;
                    }
                    next = fetched.recv() => match next {
                        Some(taken) => taken,
                        None => return Ok(()),
                    },
                },
            };
            let epoch = first.epoch;
            if parks_of != Some(epoch) {
                // Revoked since they were loaded: another member may have parked keys meanwhile
                // (`handle_batch` loads them again).
                self.inner.parks.forget(topic, partition);
                parks_of = Some(epoch);
            }
            // What is queued now, never waiting for more: at low load a batch is one message.
            let mut held = Held {
                share,
                budget: &self.inner.prefetch,
                bytes: first.bytes,
            };
            let mut messages = vec![first.message];
            while messages.len() < config.max_batch_size {
                match fetched.try_recv() {
                    Ok(next) if next.epoch == epoch => {
                        held.bytes += next.bytes;
                        messages.push(next.message);
                    }
                    Ok(next) => {
                        carried = Some(next);
                        break;
                    }
                    Err(_) => break,
                }
            }
            let owned = || context.epoch(topic, partition) == epoch;
            if !owned() {
                // Fetched before the partition was revoked: whoever owns it now reads them
                // again from the committed offset.
                for _ in &messages {
                    self.inner.note_revoked_skip();
                }
                continue;
            }
            let last = messages
                .last()
                .unwrap_or_else(|| unreachable!("a batch has a first message"));
            let mut turn = Turn::take(permits).await?;
            let mut failures = 0;
            let outcomes = loop {
                match self.handle_batch(&messages, stop, &mut turn, &owned).await {
                    Ok(outcomes) => break outcomes,
                    Err(error) => {
                        // The database is unavailable: retry these messages, never skip them
                        // (what committed meanwhile is found deduplicated).
                        tracing::warn!(error = %outbox_core::escape(&error.to_string()), topic, partition, offset = last.offset(),
                            messages = messages.len(), "cannot handle messages; retrying");
                        let delay =
                            outbox_core::backoff(config.backoff_base, config.backoff_max, failures);
                        if !turn.back_off(delay, stop).await? {
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
                && owned()
            {
                store_offset(consumer, message);
            }
            if outcomes.contains(&Outcome::Abandoned) {
                return Ok(());
            }
        }
    }

    /// While the partition is owned: loads its parked keys (again after a revocation), and
    /// replays those released (`park.rs`) on a turn of its own. A database that cannot be
    /// reached is tried again at the next poll. `Ok(false)`: shutdown came meanwhile.
    async fn tend_parks<C: ClientContext + 'static>(
        &self,
        context: &DedupContext<C>,
        (topic, partition): (&str, i32),
        parks_of: &mut Option<u64>,
        permits: &Semaphore,
        stop: &CancellationToken,
    ) -> Result<bool, ConsumerError> {
        let epoch = context.epoch(topic, partition);
        if !context.owns(topic, partition) || *parks_of != Some(epoch) {
            self.inner.parks.forget(topic, partition);
            *parks_of = context.owns(topic, partition).then_some(epoch);
        }
        if parks_of.is_none() {
            return Ok(true);
        }
        let owned = || context.epoch(topic, partition) == epoch && context.owns(topic, partition);
        let tended = async {
            self.load_parks(topic, partition).await?;
            if !self.inner.parks.any(topic, partition) {
                return Ok(true);
            }
            let mut turn = Turn::take(permits).await?;
            self.replay_keys((topic, partition), stop, &mut turn, &owned)
                .await
        };
        match tended.await {
            Ok(going) => Ok(going),
            Err(error) => {
                tracing::warn!(error = %outbox_core::escape(&error.to_string()), topic, partition,
                    "cannot load or replay the parked keys; trying again");
                Ok(true)
            }
        }
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
