//! The member's prefetch budget. librdkafka bounds what it prefetches per partition queue
//! (`queued.max.messages.kbytes`, 64 MiB by default), and each assigned partition has a queue
//! of its own, so its bound grows with the partition count: 48 partitions with a backlog may
//! hold 3 GiB. Instead, each partition's messages are taken from librdkafka's queue as soon as
//! they arrive and counted here until their batch is handled; a partition holding its share
//! of the budget (the budget divided by the partitions assigned) is paused, so that librdkafka
//! fetches no more of it, and resumed once its worker has handled half its share. What the
//! member holds is then the budget, whatever the partition count, plus a message per partition
//! (the one that crossed its share) and what librdkafka holds: the fetch response being read,
//! and per partition at most its small queue (see [`librdkafka_defaults`]) and one fetch.

use std::sync::atomic::{AtomicU64, Ordering};

use rdkafka::ClientConfig;
use rdkafka::message::{Message, OwnedMessage};
use tokio::sync::Notify;

/// librdkafka's settings the budget relies on, unless the application set them. Messages
/// leave librdkafka's queues as they arrive, so a small queue per partition costs no speed;
/// it keeps librdkafka from fetching round after round into a partition before its messages
/// are taken and the partition paused: librdkafka then holds, per partition, this much and one
/// fetch of it (`max.partition.fetch.bytes`) at most, where its 64 MiB default let 48
/// partitions hold 3 GiB. A queue over it postpones the partition's next fetch by
/// `fetch.queue.backoff.ms`, 1 s by default: long enough to starve a partition whose messages
/// are taken in microseconds.
const LIBRDKAFKA_DEFAULTS: &[(&str, &str)] = &[
    ("queued.max.messages.kbytes", "64"),
    ("fetch.queue.backoff.ms", "10"),
];

pub(crate) fn librdkafka_defaults(config: &mut ClientConfig) {
    for (key, value) in LIBRDKAFKA_DEFAULTS {
        if config.get(key).is_none() {
            config.set(*key, *value);
        }
    }
}

/// Bytes held by the whole member.
#[derive(Debug)]
pub(crate) struct Budget {
    bytes: u64,
    held: AtomicU64,
    peak: AtomicU64,
}

impl Budget {
    pub(crate) fn new(bytes: usize) -> Self {
        Self {
            bytes: u64::try_from(bytes).unwrap_or(u64::MAX),
            held: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// The most bytes held at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// What one of `owned` partitions may hold.
    pub(crate) fn share(&self, owned: usize) -> u64 {
        self.bytes / u64::try_from(owned.max(1)).unwrap_or(u64::MAX)
    }
}

/// Bytes held for one partition: taken when its messages leave librdkafka's queue, released
/// when their batch is done. Wakes the partition's fetch when they drop.
#[derive(Debug, Default)]
pub(crate) struct Share {
    held: AtomicU64,
    released: Notify,
}

impl Share {
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    pub(crate) fn take(&self, budget: &Budget, bytes: u64) {
        self.held.fetch_add(bytes, Ordering::Relaxed);
        let total = budget.held.fetch_add(bytes, Ordering::Relaxed) + bytes;
        budget.peak.fetch_max(total, Ordering::Relaxed);
    }

    pub(crate) fn release(&self, budget: &Budget, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::Relaxed);
        budget.held.fetch_sub(bytes, Ordering::Relaxed);
        self.released.notify_one();
    }

    /// Releases all this partition holds: its worker stopped, and dropped what it held.
    pub(crate) fn release_all(&self, budget: &Budget) {
        let bytes = self.held.swap(0, Ordering::Relaxed);
        budget.held.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Resolves after the next [`Self::release`] (or at once if one came since the last wait).
    pub(crate) async fn released(&self) {
        self.released.notified().await;
    }
}

/// Releases a batch's bytes when it is done with, however the worker leaves it.
#[derive(Debug)]
pub(crate) struct Held<'a> {
    pub(crate) share: &'a Share,
    pub(crate) budget: &'a Budget,
    pub(crate) bytes: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.share.release(self.budget, self.bytes);
    }
}

/// What a fetched message holds in memory, as counted against the budget: its payload, key,
/// topic name and headers, plus what each message and header costs besides its bytes (the
/// message's structs and the queue's slot, librdkafka's header list), so that a flood of empty
/// records still fills the budget.
pub(crate) fn size(message: &OwnedMessage) -> u64 {
    let headers: usize = crate::headers::read(message)
        .into_iter()
        .map(|header| HEADER_OVERHEAD + header.len())
        .sum();
    let bytes = MESSAGE_OVERHEAD
        + message.topic().len()
        + message.payload().map_or(0, <[u8]>::len)
        + message.key().map_or(0, <[u8]>::len)
        + headers;
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Bytes a message costs besides its own: `OwnedMessage` and the prefetch queue's entry
/// (about 200 bytes on 64-bit targets) and the allocator's rounding, rounded up.
const MESSAGE_OVERHEAD: usize = 256;
/// Bytes a header costs besides its name and value (librdkafka's and rdkafka's entries).
const HEADER_OVERHEAD: usize = 48;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::test_message;

    #[test]
    fn an_empty_record_still_costs_budget_and_each_header_adds_its_entry() {
        // Counted at 0 bytes, a flood of empty records never paused its partition.
        let empty = size(&test_message(&[]));
        assert!(empty >= MESSAGE_OVERHEAD as u64, "{empty}");
        let with_headers = size(&test_message(&[("", None); 10]));
        assert_eq!(with_headers - empty, 10 * HEADER_OVERHEAD as u64);
    }
}
