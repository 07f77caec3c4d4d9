use std::time::Duration;

use outbox_core::TableNames;

use crate::relay::{AfterPublish, QuarantinePolicy, RelayConfig};

/// Largest [`DispatcherConfig::max_answer_bytes`].
const MAX_ANSWER_BYTES: usize = 32 << 20;
/// Largest `batch_size` x `max_answer_bytes`.
const MAX_BATCH_ANSWER_BYTES: usize = 512 << 20;

/// Settings of a [`super::Dispatcher`].
///
/// Claiming, retrying, quarantining, waking up and shutting down work as the relay's do, with
/// the same settings ([`RelayConfig`], in [`Self::lane`]); a dispatcher's batches are smaller
/// by default (32 rows), and several run side by side (`max_in_flight / batch_size`, rounded
/// up, and one more), so that a slow call holds back the record of at most its own batch.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DispatcherConfig {
    /// The destination whose actions this dispatcher performs (`NewEvent::for_dispatcher`).
    pub destination: String,
    /// Most calls in flight at once, across keys (a key's actions run one at a time).
    pub max_in_flight: usize,
    /// Longest call: a call without an answer by then counts as [`super::Outcome::Retry`]
    /// (its outcome is unknown; it is made again with the same key).
    pub call_timeout: Duration,
    /// Longest answer (its JSON text) stored as the action's outcome. A longer one, or one
    /// nested deeper than 128 levels, is stored as
    /// `{"outbox_answer_omitted": {"reason": ..., "bytes": n, "start": "<its first KiB>"}}`
    /// (`bytes` null for a too deep one) and the action is still done (or rejected):
    /// PostgreSQL refuses JSONB values over 255 MiB (the binary form, several times the
    /// text of a dense array) and nesting deeper than its stack allows, and a record that
    /// fails would make the calls again. The default, 8 MiB, holds the HTTP executor's
    /// largest answer (a 1 MiB body, escaped); at most 32 MiB, and a batch's answers
    /// (`batch_size` times this) at most 512 MiB, under PostgreSQL's 1 GiB message limit.
    pub max_answer_bytes: usize,
    /// Claim, retry, quarantine, wake-up and shutdown settings, as the relay's.
    /// `after_publish` must stay [`AfterPublish::Mark`]: a done action keeps its outcome
    /// until it is pruned.
    pub lane: RelayConfig,
}

impl DispatcherConfig {
    /// The defaults for `destination`: 64 calls in flight, 30 s per call, batches of 32, up to
    /// 10 attempts with backoff from 500 ms to 5 minutes.
    pub fn new(destination: impl Into<String>) -> Self {
        Self {
            destination: destination.into(),
            max_in_flight: 64,
            call_timeout: Duration::from_secs(30),
            max_answer_bytes: 8 << 20,
            lane: RelayConfig::default().batch_size(32),
        }
    }

    /// Sets [`Self::max_in_flight`].
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }
    /// Sets [`Self::call_timeout`].
    pub fn call_timeout(mut self, d: Duration) -> Self {
        self.call_timeout = d;
        self
    }
    /// Sets [`Self::max_answer_bytes`].
    pub fn max_answer_bytes(mut self, n: usize) -> Self {
        self.max_answer_bytes = n;
        self
    }
    /// Sets the rows claimed per batch ([`RelayConfig::batch_size`]).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.lane.batch_size = n;
        self
    }
    /// Sets [`RelayConfig::max_attempts`].
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.lane.max_attempts = n;
        self
    }
    /// Sets [`RelayConfig::backoff_base`] and [`RelayConfig::backoff_max`].
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.lane = self.lane.backoff(base, max);
        self
    }
    /// Sets [`RelayConfig::poll_interval`].
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.lane.poll_interval = d;
        self
    }
    /// Sets [`RelayConfig::listen`].
    pub fn listen(mut self, on: bool) -> Self {
        self.lane.listen = on;
        self
    }
    /// Sets [`RelayConfig::quarantine_policy`].
    pub fn quarantine_policy(mut self, policy: QuarantinePolicy) -> Self {
        self.lane.quarantine_policy = policy;
        self
    }
    /// Sets [`RelayConfig::tables`].
    pub fn tables(mut self, tables: TableNames) -> Self {
        self.lane.tables = tables;
        self
    }
    /// Sets [`RelayConfig::shutdown_timeout`].
    pub fn shutdown_timeout(mut self, d: Duration) -> Self {
        self.lane.shutdown_timeout = d;
        self
    }

    /// Batches run side by side: as many as `max_in_flight` calls fill, and one more, which
    /// claims and records while the others call. Without it every batch's claim, record and
    /// commit left its share of `max_in_flight` idle: at 20 ms per call, 64 in flight and
    /// batches of 16, 2,175 actions/s (0.68 of 64 / 20 ms); with it 2,660/s (0.83), and two
    /// or four more did no better (outbox-bench P9b, 2026-12-06).
    ///
    /// Batches of 32 (3 side by side at 64 in flight) rather than 16 (5): each batch's claim,
    /// record and commit serve twice the actions, and a slow key's run no longer holds its
    /// batch's record (the other keys commit without it): P9a 0.83-0.85 instead of
    /// 0.74-0.82, P9b 0.85-0.86 instead of 0.84 (2026-12-06, runs of each alternated).
    pub(crate) fn workers(&self) -> usize {
        let batch = usize::try_from(self.lane.batch_size)
            .unwrap_or(usize::MAX)
            .max(1);
        self.max_in_flight.div_ceil(batch).max(1) + 1
    }

    pub(crate) fn validate(&self) -> Result<String, crate::ProducerError> {
        let bad = |m: String| Err(crate::ProducerError::Config(m));
        let topic = outbox_core::wire::dispatch_topic(&self.destination)?;
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be at least 1".into());
        }
        if self.call_timeout.is_zero() {
            return bad("call_timeout must be more than zero".into());
        }
        if self.max_answer_bytes > MAX_ANSWER_BYTES {
            return bad(format!(
                "max_answer_bytes must be at most {MAX_ANSWER_BYTES} (JSONB's limit applies to \
                 the binary form, several times the text)"
            ));
        }
        let batch_answers = self
            .max_answer_bytes
            .saturating_mul(usize::try_from(self.lane.batch_size).unwrap_or(usize::MAX));
        if batch_answers > MAX_BATCH_ANSWER_BYTES {
            return bad(format!(
                "batch_size x max_answer_bytes must be at most {MAX_BATCH_ANSWER_BYTES}: a \
                 batch's answers are stored in one statement, under PostgreSQL's 1 GiB message \
                 limit"
            ));
        }
        if self.lane.after_publish != AfterPublish::Mark {
            return bad(
                "a dispatcher keeps done actions (after_publish = Mark): their outcomes are \
                 read back until they are pruned"
                    .into(),
            );
        }
        Ok(topic)
    }
}
