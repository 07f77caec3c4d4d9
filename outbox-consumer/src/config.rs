use std::collections::BTreeSet;
use std::time::Duration;

use outbox_core::TableNames;

use crate::ConsumerError;

/// What happens when a handler keeps failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HandlerFailurePolicy {
    /// After `max_attempts`, store the message in the quarantine table with the error and
    /// move on. The default: one bad message never stalls its partition.
    #[default]
    Quarantine,
    /// Retry forever (with capped backoff); the partition waits. For handlers whose effects
    /// must never be skipped or reordered, at the price of a stall an operator must clear.
    Block,
    /// After `max_attempts` (or at once for a record that breaks the contract or that the
    /// handler rejects), park the record's Kafka key: the record and every later record of
    /// the same key on that partition are stored, in offset order, in the park table
    /// (`<quarantine>_parked`, migration 0016), while the partition's other keys flow on and
    /// its offset advances. Order per key holds, and nothing waits in memory: a restart or a
    /// rebalance finds the key parked. `outbox parked release` has the partition's consumer
    /// replay the key's records through the handler, in order (each once), after which the key
    /// flows again; `outbox parked skip` drops a record, audited, and releases the rest. A
    /// record without a key has no order to keep and is quarantined as under `Quarantine`.
    ParkKey,
}

/// Settings of a [`crate::DedupConsumer`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// Scope of deduplication: each name handles each event id once. `None` means the Kafka
    /// `group.id` (with [`crate::dedup_consume`]).
    pub name: Option<String>,
    /// Table names.
    pub tables: TableNames,
    /// Event ids remembered in memory.
    pub cache_capacity: u64,
    /// How long an id stays in memory. Never longer than `dedup_ttl`.
    pub cache_ttl: Duration,
    /// How long the dedup table keeps ids (what [`crate::prune`] should be run with). The
    /// consumer bounds `cache_ttl` by it, and makes dedup slices only for the days it spans
    /// back from today: an id dated earlier is recorded in the slice of the day it is handled
    /// (see [`crate::prune`] for what that promises). Give every member of one consumer name
    /// the same value.
    pub dedup_ttl: Duration,
    /// Handler attempts per message before the failure policy applies.
    pub max_attempts: u32,
    /// First retry delay; doubled per attempt, with jitter.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// What to do when a handler keeps failing.
    pub on_handler_failure: HandlerFailurePolicy,
    /// Partitions processed concurrently (order within a partition always holds).
    pub max_concurrent_partitions: usize,
    /// Most messages of one partition handled in one transaction. A batch is what is queued
    /// when the partition's worker is ready; it never waits for more, so at low load a batch
    /// is one message and latency does not grow. `1` is one transaction per message.
    pub max_batch_size: usize,
    /// Larger payloads are quarantined without decoding.
    pub max_payload_bytes: usize,
    /// When set, events whose `type` header is not listed are quarantined.
    pub event_types: Option<BTreeSet<String>>,
    /// Bound on the final offset commit at shutdown.
    pub shutdown_timeout: Duration,
    /// Most bytes (payloads, keys and headers) of fetched messages the member holds before
    /// handling them, shared by the partitions it owns whatever their number: each may hold
    /// its share (this divided by the partitions assigned), and is paused beyond it until its
    /// worker has handled half of it. librdkafka's per-partition prefetch
    /// (`queued.max.messages.kbytes`) no longer multiplies with the partition count; what a
    /// fetch response brings in at once (`fetch.max.bytes`) comes on top.
    pub prefetch_budget_bytes: usize,
    /// Under [`HandlerFailurePolicy::ParkKey`]: past this many records parked under one key,
    /// its later records are still parked (never dropped), and the consumer says so: a
    /// warning, `outbox_consumer_parked_over_limit_total`, and `outbox status`.
    pub max_parked_per_key: u64,
    /// Accept a pool that could hand a password to whoever answers on the network (see
    /// [`outbox_core::check_database_tls`]); refused otherwise. Off by default.
    pub insecure_transport: bool,
}

impl ConsumerConfig {
    /// Defaults, with the consumer name `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..Self::default()
        }
    }

    /// Sets the in-memory cache size and lifetime.
    pub fn cache(mut self, capacity: u64, ttl: Duration) -> Self {
        self.cache_capacity = capacity;
        self.cache_ttl = ttl;
        self
    }
    /// Sets [`Self::dedup_ttl`].
    pub fn dedup_ttl(mut self, ttl: Duration) -> Self {
        self.dedup_ttl = ttl;
        self
    }
    /// Sets [`Self::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }
    /// Sets the retry backoff.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }
    /// Sets [`Self::on_handler_failure`].
    pub fn on_handler_failure(mut self, policy: HandlerFailurePolicy) -> Self {
        self.on_handler_failure = policy;
        self
    }
    /// Sets [`Self::max_concurrent_partitions`].
    pub fn max_concurrent_partitions(mut self, n: usize) -> Self {
        self.max_concurrent_partitions = n;
        self
    }
    /// Sets [`Self::max_batch_size`].
    pub fn max_batch_size(mut self, n: usize) -> Self {
        self.max_batch_size = n;
        self
    }
    /// Sets [`Self::max_payload_bytes`].
    pub fn max_payload_bytes(mut self, n: usize) -> Self {
        self.max_payload_bytes = n;
        self
    }
    /// Sets [`Self::prefetch_budget_bytes`].
    pub fn prefetch_budget_bytes(mut self, bytes: usize) -> Self {
        self.prefetch_budget_bytes = bytes;
        self
    }
    /// Sets [`Self::max_parked_per_key`].
    pub fn max_parked_per_key(mut self, n: u64) -> Self {
        self.max_parked_per_key = n;
        self
    }
    /// Sets [`Self::insecure_transport`].
    pub fn insecure_transport(mut self, on: bool) -> Self {
        self.insecure_transport = on;
        self
    }
    /// Accepts only these event types.
    pub fn event_types<I: IntoIterator<Item = S>, S: Into<String>>(mut self, types: I) -> Self {
        self.event_types = Some(types.into_iter().map(Into::into).collect());
        self
    }
    /// Sets [`Self::tables`].
    pub fn tables(mut self, tables: TableNames) -> Self {
        self.tables = tables;
        self
    }

    pub(crate) fn validate(&self) -> Result<String, ConsumerError> {
        let bad = |m: &str| Err(ConsumerError::Config(m.to_owned()));
        let Some(name) = self.name.clone().filter(|n| !n.is_empty()) else {
            return bad(
                "a consumer name is required (or use dedup_consume, which defaults it to group.id)",
            );
        };
        if self.cache_ttl > self.dedup_ttl {
            return bad(
                "cache_ttl must not exceed dedup_ttl, or the cache would outlive the dedup rows",
            );
        }
        if self.max_attempts == 0
            || self.max_concurrent_partitions == 0
            || self.max_batch_size == 0
            || self.prefetch_budget_bytes == 0
        {
            return bad(
                "max_attempts, max_concurrent_partitions, max_batch_size and prefetch_budget_bytes must be at least 1",
            );
        }
        if self.backoff_base > self.backoff_max {
            return bad("backoff_base must not exceed backoff_max");
        }
        Ok(name)
    }
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            name: None,
            tables: TableNames::default(),
            cache_capacity: 100_000,
            cache_ttl: Duration::from_secs(3600),
            dedup_ttl: Duration::from_secs(7 * 24 * 3600),
            max_attempts: 5,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            on_handler_failure: HandlerFailurePolicy::default(),
            max_concurrent_partitions: 8,
            max_batch_size: 256,
            max_payload_bytes: 1024 * 1024,
            event_types: None,
            shutdown_timeout: Duration::from_secs(10),
            prefetch_budget_bytes: 64 * 1024 * 1024,
            max_parked_per_key: 10_000,
            insecure_transport: false,
        }
    }
}
