//! The queue between the poll loop and one partition's worker. The poll loop never waits on
//! it: once `high` messages are queued it pauses the partition's fetch instead, and the
//! worker resumes the fetch when the queue is down to a quarter of that. So polling
//! (heartbeats, rebalances, other partitions) goes on however slow one partition's handler is.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::TopicPartitionList;
use rdkafka::consumer::{Consumer, ConsumerContext, StreamConsumer};
use rdkafka::message::OwnedMessage;
use tokio::sync::mpsc;

/// A message and the revocation count of its partition when it was received.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) message: OwnedMessage,
    pub(crate) epoch: u64,
}

#[derive(Debug)]
struct Flow {
    topic: String,
    partition: i32,
    len: AtomicUsize,
    /// Queued messages at which the fetch is paused...
    high: usize,
    /// ...and at which it resumes.
    low: usize,
    /// Whether we paused the fetch. Pausing and resuming happen under this lock, each after
    /// re-reading `len`, so a pause can never outlive the messages that caused it.
    paused: Mutex<bool>,
}

impl Flow {
    fn set_paused<C: ConsumerContext>(&self, consumer: &StreamConsumer<C>, pause: bool) {
        let mut partitions = TopicPartitionList::new();
        partitions.add_partition(&self.topic, self.partition);
        let result = if pause {
            consumer.pause(&partitions)
        } else {
            consumer.resume(&partitions)
        };
        if let Err(error) = result {
            // The partition was revoked meanwhile; its next assignment starts unpaused.
            tracing::debug!(%error, topic = %self.topic, partition = self.partition, pause,
                "could not pause or resume a partition");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, bool> {
        self.paused.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The poll loop's end.
#[derive(Debug)]
pub(crate) struct PartitionSender {
    tx: mpsc::UnboundedSender<Queued>,
    flow: Arc<Flow>,
}

/// The worker's end.
#[derive(Debug)]
pub(crate) struct PartitionReceiver {
    rx: mpsc::UnboundedReceiver<Queued>,
    flow: Arc<Flow>,
}

/// A queue for `topic`/`partition` that pauses the fetch at `high` queued messages.
pub(crate) fn partition_queue(
    topic: &str,
    partition: i32,
    high: usize,
) -> (PartitionSender, PartitionReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let flow = Arc::new(Flow {
        topic: topic.to_owned(),
        partition,
        len: AtomicUsize::new(0),
        high: high.max(1),
        low: high / 4,
        paused: Mutex::new(false),
    });
    (
        PartitionSender {
            tx,
            flow: Arc::clone(&flow),
        },
        PartitionReceiver { rx, flow },
    )
}

impl PartitionSender {
    /// Queues `item` without waiting; `Ok(true)` when this push paused the partition's fetch,
    /// `Err` gives the item back when the worker has stopped.
    pub(crate) fn push<C: ConsumerContext>(
        &self,
        consumer: &StreamConsumer<C>,
        item: Queued,
    ) -> Result<bool, Queued> {
        // Counted before it is sent, so the worker never takes it out before it is counted.
        let len = self.flow.len.fetch_add(1, Ordering::SeqCst) + 1;
        if let Err(closed) = self.tx.send(item) {
            self.flow.len.fetch_sub(1, Ordering::SeqCst);
            return Err(closed.0);
        }
        let high = self.flow.high;
        if len >= high {
            let mut paused = self.flow.lock();
            // Also re-pause at every further `high` messages: a revoked and re-assigned
            // partition starts unpaused while our flag may still say paused.
            let len = self.flow.len.load(Ordering::SeqCst);
            if len >= high && (!*paused || len.is_multiple_of(high)) {
                self.flow.set_paused(consumer, true);
                let paused_now = !*paused;
                *paused = true;
                return Ok(paused_now);
            }
        }
        Ok(false)
    }
}

impl PartitionReceiver {
    /// The next message, resuming the partition's fetch when the queue has drained enough.
    /// `None` once the poll loop has dropped its end and the queue is empty.
    pub(crate) async fn next<C: ConsumerContext>(
        &mut self,
        consumer: &StreamConsumer<C>,
    ) -> Option<Queued> {
        let item = self.rx.recv().await?;
        self.taken(consumer);
        Some(item)
    }

    /// The next message if one is queued now, without waiting.
    pub(crate) fn try_next<C: ConsumerContext>(
        &mut self,
        consumer: &StreamConsumer<C>,
    ) -> Option<Queued> {
        let item = self.rx.try_recv().ok()?;
        self.taken(consumer);
        Some(item)
    }

    fn taken<C: ConsumerContext>(&self, consumer: &StreamConsumer<C>) {
        let len = self.flow.len.fetch_sub(1, Ordering::SeqCst) - 1;
        if len <= self.flow.low {
            let mut paused = self.flow.lock();
            if *paused && self.flow.len.load(Ordering::SeqCst) <= self.flow.low {
                self.flow.set_paused(consumer, false);
                *paused = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::ClientConfig;
    use rdkafka::Message;
    use rdkafka::message::Timestamp;

    use super::*;

    fn queued(offset: i64) -> Queued {
        let message = OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            offset,
            None,
        );
        Queued { message, epoch: 0 }
    }

    fn paused(rx: &PartitionReceiver) -> bool {
        *rx.flow.lock()
    }

    #[tokio::test]
    async fn pauses_at_high_resumes_at_low_and_keeps_order() {
        // Never connects: pausing a partition it does not own fails quietly, which is all
        // the flags need.
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("group.id", "partition-queue-test")
            .create()
            .expect("client");
        const HIGH: usize = 256;
        const LOW: usize = HIGH / 4;
        let (tx, mut rx) = partition_queue("t", 0, HIGH);
        for offset in 0..HIGH as i64 - 1 {
            assert!(!tx.push(&consumer, queued(offset)).expect("open"));
        }
        assert!(!paused(&rx), "below the high mark");
        assert!(
            tx.push(&consumer, queued(HIGH as i64 - 1)).expect("open"),
            "the push that pauses says so (counted in stats)"
        );
        assert!(paused(&rx), "at the high mark");

        let mut next = 0;
        while rx.flow.len.load(Ordering::SeqCst) > LOW {
            assert!(paused(&rx), "still above the low mark");
            let item = rx.next(&consumer).await.expect("queued");
            assert_eq!(item.message.offset(), next);
            next += 1;
        }
        assert!(!paused(&rx), "resumed at the low mark");
        drop(tx);
        while let Some(item) = rx.next(&consumer).await {
            assert_eq!(item.message.offset(), next);
            next += 1;
        }
        assert_eq!(next, HIGH as i64, "every message, in order");
        assert_eq!(rx.flow.len.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_closed_queue_gives_the_message_back_uncounted() {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("group.id", "partition-queue-test")
            .create()
            .expect("client");
        let (tx, rx) = partition_queue("t", 0, 8);
        let flow = Arc::clone(&rx.flow);
        drop(rx);
        let back = tx.push(&consumer, queued(7)).expect_err("closed");
        assert_eq!(back.message.offset(), 7);
        assert_eq!(flow.len.load(Ordering::SeqCst), 0);
    }
}
