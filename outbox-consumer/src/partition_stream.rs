//! Each partition assigned to a running consumer gets its own librdkafka queue
//! (`split_partition_queue`), split in the rebalance callback before the assignment starts
//! fetching, so none of its messages reaches the consumer's main queue. The partition's
//! [`prefetch`] takes its messages from that queue as they arrive, for as long as the consumer
//! runs (through revocations and re-assignments: the queue stays the partition's), and hands
//! them to the partition's worker, counted against the member's prefetch budget
//! (`prefetch.rs`). A partition holding its share is paused, and resumed once its worker has
//! handled half of it. A pause drops what librdkafka had queued for the partition and
//! refetches it on resume; taken at once, little is queued there, and a partition pauses only
//! with its share in hand (this consumer once paused at 1,024 queued messages, dropping a whole
//! prefetch each time, which held it to a sixth of its speed).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};

use futures::{FutureExt, StreamExt};
use rdkafka::consumer::stream_consumer::{MessageStream, StreamPartitionQueue};
use rdkafka::consumer::{Consumer, Rebalance, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientContext, TopicPartitionList};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::assignment::{DedupContext, Watcher};
use crate::prefetch::{Budget, Share, size};

/// A partition's own queue.
pub(crate) type PartitionStream<C> = StreamPartitionQueue<DedupContext<C>>;

/// A partition assigned to this member for the first time since it began running.
pub(crate) enum Change<C: ClientContext + 'static> {
    /// Its messages arrive on `queue`, from now on.
    Split {
        topic: String,
        partition: i32,
        queue: PartitionStream<C>,
    },
    /// librdkafka could not give the partition a queue of its own: its messages would arrive
    /// on the main queue, out of the workers' reach.
    Unsplit { topic: String, partition: i32 },
}

/// What the consumer's context runs before each rebalance takes effect: splits the queue of
/// each partition assigned for the first time and reports it on `changes`. A partition is
/// split once: its queue outlives revocations, and a second split would take the first
/// handle's wake-ups away. Holds the consumer weakly: the context that holds this lives
/// inside the consumer.
pub(crate) fn watcher<C: ClientContext + 'static>(
    consumer: Weak<StreamConsumer<DedupContext<C>>>,
    changes: mpsc::UnboundedSender<Change<C>>,
) -> Watcher {
    let split: Mutex<HashSet<(String, i32)>> = Mutex::default();
    Box::new(move |rebalance: &Rebalance<'_>| {
        let Rebalance::Assign(partitions) = rebalance else {
            return;
        };
        let Some(consumer) = consumer.upgrade() else {
            return;
        };
        let mut split = split.lock().unwrap_or_else(|p| p.into_inner());
        for element in partitions.elements() {
            let (topic, partition) = (element.topic().to_owned(), element.partition());
            if !split.insert((topic.clone(), partition)) {
                continue;
            }
            let change = match consumer.split_partition_queue(&topic, partition) {
                Some(queue) => Change::Split {
                    topic,
                    partition,
                    queue,
                },
                None => Change::Unsplit { topic, partition },
            };
            // Closed only once the run loop has stopped: nobody is left to tell.
            let _ = changes.send(change);
        }
    })
}

/// The next message of `topic`/`partition`'s own queue, with the partition's revocation count
/// when it was taken (see [`DedupContext::poll_at_epoch`]).
pub(crate) fn next_at_epoch<'a, C: ClientContext + 'static>(
    stream: &'a mut MessageStream<'_, DedupContext<C>>,
    context: &'a DedupContext<C>,
    topic: &'a str,
    partition: i32,
) -> impl Future<Output = (Option<KafkaResult<OwnedMessage>>, u64)> + 'a {
    std::future::poll_fn(move |cx| {
        context.poll_at_epoch(cx, topic, partition, |cx| {
            stream
                .poll_next_unpin(cx)
                .map(|next| next.map(|taken| taken.map(|m| m.detach())))
        })
    })
}

/// Starts reporting `consumer`'s rebalances, and splitting its assigned partitions' queues,
/// on the returned channel, until [`stop_watching`].
pub(crate) fn watch_rebalances<C: ClientContext + 'static>(
    consumer: &Arc<StreamConsumer<DedupContext<C>>>,
) -> mpsc::UnboundedReceiver<Change<C>> {
    let (tx, rx) = mpsc::unbounded_channel();
    consumer
        .context()
        .watch(Some(watcher(Arc::downgrade(consumer), tx)));
    rx
}

/// Stops what [`watch_rebalances`] started: before the consumer closes, whose revocations
/// nobody acts on any more.
pub(crate) fn stop_watching<C: ClientContext + 'static>(
    consumer: &StreamConsumer<DedupContext<C>>,
) {
    consumer.context().watch(None);
}

/// A message taken from its partition's queue, with the partition's revocation count when it
/// was taken and the bytes it holds against the budget.
#[derive(Debug)]
pub(crate) struct Fetched {
    pub(crate) message: OwnedMessage,
    pub(crate) epoch: u64,
    pub(crate) bytes: u64,
}

/// Takes `topic`/`partition`'s messages from its own `queue` as they arrive and sends them to
/// its worker on `fetched`, keeping the partition within its share of `budget` (see
/// `prefetch.rs`). Runs until `stop`; never returns, so that the worker beside it decides when
/// the partition is done.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn prefetch<C: ClientContext + 'static>(
    consumer: &StreamConsumer<DedupContext<C>>,
    topic: &str,
    partition: i32,
    queue: PartitionStream<C>,
    budget: &Budget,
    share: &Share,
    fetched: mpsc::UnboundedSender<Fetched>,
    stop: &CancellationToken,
) -> std::convert::Infallible {
    let context = consumer.context();
    let mut stream = queue.stream();
    let mut paused = false;
    let forward = |taken: Option<KafkaResult<OwnedMessage>>, epoch: u64| match taken {
        Some(Ok(message)) => {
            let bytes = size(&message);
            share.take(budget, bytes);
            // Closed only when the worker stopped: nothing is handled after that.
            let _ = fetched.send(Fetched {
                message,
                epoch,
                bytes,
            });
            true
        }
        Some(Err(error)) => {
            tracing::warn!(%error, topic, partition, "kafka partition queue error");
            true
        }
        None => false,
    };
    'fetching: while !stop.is_cancelled() {
        let limit = budget.share(context.owned());
        // Paused, it waits for its worker to handle half its share before fetching again.
        let room = if paused { limit / 2 } else { limit }.max(1);
        if share.held() >= room {
            if !paused {
                pause(consumer, topic, partition, true);
                paused = true;
                // What librdkafka queued before the pause is stale now (it refetches from
                // after the last message taken): drop it now, not on resume, since each
                // message keeps its whole fetch response's buffer alive.
                while let Some((taken, epoch)) =
                    next_at_epoch(&mut stream, context, topic, partition).now_or_never()
                {
                    if !forward(taken, epoch) {
                        break 'fetching;
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = share.released() => continue,
            }
        }
        if paused {
            pause(consumer, topic, partition, false);
            paused = false;
        }
        let (taken, epoch) = tokio::select! {
            () = stop.cancelled() => break,
            taken = next_at_epoch(&mut stream, context, topic, partition) => taken,
        };
        if !forward(taken, epoch) {
            break;
        }
    }
    // The worker sees the channel closed once it has taken what was sent.
    drop(fetched);
    std::future::pending().await
}

/// Pauses (or resumes) fetching `topic`/`partition`.
fn pause<C: ClientContext + 'static>(
    consumer: &StreamConsumer<DedupContext<C>>,
    topic: &str,
    partition: i32,
    pause: bool,
) {
    let mut list = TopicPartitionList::new();
    list.add_partition(topic, partition);
    let done = if pause {
        consumer.pause(&list)
    } else {
        consumer.resume(&list)
    };
    match done {
        Ok(()) => tracing::debug!(topic, partition, pause, "prefetch share reached or freed"),
        Err(error) => tracing::warn!(%error, topic, partition, pause, "cannot pause or resume"),
    }
}
