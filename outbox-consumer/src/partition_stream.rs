//! Each partition assigned to a running consumer gets its own librdkafka queue
//! (`split_partition_queue`), split in the rebalance callback before the assignment starts
//! fetching, so none of its messages reaches the consumer's main queue. The partition's worker
//! takes its batches straight from that queue, for as long as the consumer runs (through
//! revocations and re-assignments: the queue stays the partition's). A worker that falls
//! behind is flow-controlled by librdkafka itself: it stops fetching that partition once its
//! queue holds `queued.min.messages` messages or `queued.max.messages.kbytes`, and carries on
//! from where it stopped. Pausing the fetch instead (as this consumer once did) drops what
//! librdkafka prefetched and refetches it on resume: about 0.9 s without a transaction each
//! time, which held the consumer to a sixth of its speed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};

use futures::StreamExt;
use rdkafka::ClientContext;
use rdkafka::consumer::stream_consumer::{MessageStream, StreamPartitionQueue};
use rdkafka::consumer::{Consumer, Rebalance, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::OwnedMessage;
use tokio::sync::mpsc;

use crate::assignment::{DedupContext, Watcher};

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
