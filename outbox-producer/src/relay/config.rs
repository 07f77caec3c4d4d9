use std::time::Duration;

use outbox_core::TableNames;

/// What happens to a row once Kafka has acknowledged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AfterPublish {
    /// Keep it with status `published` (prune later with [`crate::prune_published`]).
    #[default]
    Mark,
    /// Delete it.
    Delete,
}

/// Whether a quarantined row holds back the later rows of its aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QuarantinePolicy {
    /// Later rows of the key are published; the quarantined one waits for an operator.
    /// Consumers then see a gap in that aggregate's history, never a reordering of what
    /// was published. The default: one poison row never stalls an aggregate.
    #[default]
    SkipQuarantined,
    /// Later rows of the key wait until the quarantined row is requeued or discarded.
    /// Choose it when consumers must never see an aggregate's events with one missing.
    BlockKey,
}

/// Settings of a [`crate::Relay`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Table names.
    pub tables: TableNames,
    /// Rows claimed and published per batch.
    pub batch_size: u32,
    /// How often to look for rows when no notification arrives.
    pub poll_interval: Duration,
    /// Wake up on the `NOTIFY` that `enqueue` sends at commit (polling still runs as fallback).
    pub listen: bool,
    /// Attempts before a row with transient failures is quarantined.
    pub max_attempts: u32,
    /// First retry delay; doubled per attempt, with jitter.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// What to do with acknowledged rows.
    pub after_publish: AfterPublish,
    /// Whether quarantined rows block their aggregate.
    pub quarantine_policy: QuarantinePolicy,
    /// How long shutdown waits for the Kafka producer to flush.
    pub shutdown_timeout: Duration,
    /// Accept a pool, or Kafka settings, that could hand a password to whoever answers on the
    /// network (see [`outbox_core::check_database_tls`], [`outbox_core::check_kafka_tls`]);
    /// refused otherwise. Off by default.
    pub insecure_transport: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            tables: TableNames::default(),
            batch_size: 500,
            poll_interval: Duration::from_secs(1),
            listen: true,
            max_attempts: 10,
            backoff_base: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            after_publish: AfterPublish::default(),
            quarantine_policy: QuarantinePolicy::default(),
            shutdown_timeout: Duration::from_secs(10),
            insecure_transport: false,
        }
    }
}

impl RelayConfig {
    /// Sets [`Self::batch_size`].
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch_size = n;
        self
    }
    /// Sets [`Self::poll_interval`].
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }
    /// Sets [`Self::listen`].
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }
    /// Sets [`Self::insecure_transport`].
    pub fn insecure_transport(mut self, on: bool) -> Self {
        self.insecure_transport = on;
        self
    }
    /// Sets [`Self::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }
    /// Sets [`Self::backoff_base`] and [`Self::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }
    /// Sets [`Self::after_publish`].
    pub fn after_publish(mut self, what: AfterPublish) -> Self {
        self.after_publish = what;
        self
    }
    /// Sets [`Self::quarantine_policy`].
    pub fn quarantine_policy(mut self, policy: QuarantinePolicy) -> Self {
        self.quarantine_policy = policy;
        self
    }
    /// Sets [`Self::tables`].
    pub fn tables(mut self, tables: TableNames) -> Self {
        self.tables = tables;
        self
    }
    /// Sets [`Self::shutdown_timeout`].
    pub fn shutdown_timeout(mut self, d: Duration) -> Self {
        self.shutdown_timeout = d;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), crate::ProducerError> {
        let bad = |m: &str| Err(crate::ProducerError::Config(m.to_owned()));
        if self.batch_size == 0 {
            return bad("batch_size must be at least 1");
        }
        if self.max_attempts == 0 {
            return bad("max_attempts must be at least 1");
        }
        if self.backoff_base > self.backoff_max {
            return bad("backoff_base must not exceed backoff_max");
        }
        Ok(())
    }
}
