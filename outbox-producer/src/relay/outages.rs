//! Partitions the relay knows to be out (no leader, too few in-sync replicas), so that their
//! rows wait without being sent. A batch commits only once every row it sent is answered, and
//! a record for a partition that cannot take writes is answered only after
//! `message.timeout.ms`: sent in every batch, the rows of one dead partition would slow every
//! other partition to one batch per timeout. Instead, once a row's delivery showed its
//! partition out, that partition's rows wait unsent (charged nothing, holding their
//! aggregates), and after a pause one row probes it; the first one acknowledged there ends
//! the outage.
//!
//! A row's partition is known before it is sent: the relay enforces `murmur2_random`, Java's
//! partitioner, so it is [`outbox_core::java_partition`] of the key among the topic's
//! partitions, whose count the relay learns from the cluster's metadata.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use crate::lane::OutboxRow;

/// What the relay knows about partitions, kept across batches.
#[derive(Debug, Default)]
pub(crate) struct Outages {
    /// Out partitions, each with the time its next probe may go.
    out: HashMap<(String, i32), Instant>,
    /// Partition counts from the cluster's metadata, per topic.
    partitions: HashMap<String, i32>,
}

impl Outages {
    /// The partition `row`'s record goes to, if the relay knows its topic's partition count.
    pub(crate) fn partition_of(&self, row: &OutboxRow) -> Option<i32> {
        let count = *self.partitions.get(&row.topic)?;
        (count > 0).then(|| outbox_core::java_partition(row.aggregateid.as_bytes(), count))
    }

    pub(crate) fn knows_partitions_of(&self, topic: &str) -> bool {
        self.partitions.contains_key(topic)
    }

    pub(crate) fn set_partition_count(&mut self, topic: &str, count: i32) {
        if self.partitions.get(topic) != Some(&count) {
            self.partitions.insert(topic.to_owned(), count);
        }
    }

    /// A record landed elsewhere than its computed partition: the count is stale (the topic
    /// grew). Forget it until the next metadata answer.
    pub(crate) fn forget_partition_count(&mut self, topic: &str) {
        self.partitions.remove(topic);
    }

    /// `topic`'s `partition` cannot take writes; probe it again after `until`.
    pub(crate) fn mark_out(&mut self, topic: &str, partition: i32, until: Instant) {
        self.out.insert((topic.to_owned(), partition), until);
    }

    /// A record was acknowledged on `partition` of `topic`: it takes writes.
    pub(crate) fn mark_up(&mut self, topic: &str, partition: i32) -> bool {
        self.out.remove(&(topic.to_owned(), partition)).is_some()
    }

    /// How many partitions are out.
    pub(crate) fn len(&self) -> usize {
        self.out.len()
    }

    /// The gate for one batch of `rows`: each row's partition, and which out partitions may
    /// be probed now.
    pub(crate) fn gate(&self, rows: &[OutboxRow]) -> Gate {
        let now = Instant::now();
        let mut due = HashSet::new();
        let partitions = rows
            .iter()
            .map(|row| {
                let p = self.partition_of(row)?;
                let key = (row.topic.clone(), p);
                match self.out.get(&key) {
                    None => None,
                    Some(until) => {
                        if *until <= now {
                            due.insert(key);
                        }
                        Some(p)
                    }
                }
            })
            .collect();
        Gate {
            out: partitions,
            due: Mutex::new(due),
        }
    }
}

/// Which rows of a batch go to an out partition, and the probes still to send.
#[derive(Debug)]
pub(crate) struct Gate {
    /// Per row: its partition, when that partition is out.
    out: Vec<Option<i32>>,
    /// Out partitions whose probe may go in this batch, until a row takes it.
    due: Mutex<HashSet<(String, i32)>>,
}

impl Gate {
    /// Whether row `i` (of `topic`) may be sent: its partition is not out, or it is the
    /// partition's probe. `Err` holds the out partition the row waits for.
    pub(crate) fn admit(&self, i: usize, topic: &str) -> Result<(), i32> {
        let Some(p) = self.out.get(i).copied().flatten() else {
            return Ok(());
        };
        let mut due = self
            .due
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if due.remove(&(topic.to_owned(), p)) {
            Ok(())
        } else {
            Err(p)
        }
    }
}
