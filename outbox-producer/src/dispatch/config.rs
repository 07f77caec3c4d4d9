use std::time::Duration;

use outbox_core::TableNames;

use crate::relay::{AfterPublish, QuarantinePolicy, RelayConfig};

/// Longest [`DispatcherConfig::max_age`]: every wait a destination asks for is cut to
/// `max_age`, and deadlines that far ahead stay representable.
const MAX_AGE_LIMIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Least [`DispatcherConfig::max_rate`]: one call every 11.6 days.
const MIN_MAX_RATE: f64 = 1e-6;

/// Largest [`DispatcherConfig::max_answer_bytes`].
const MAX_ANSWER_BYTES: usize = 32 << 20;
/// Largest `batch_size` x `max_answer_bytes`.
pub(super) const MAX_BATCH_ANSWER_BYTES: usize = 512 << 20;

/// Settings of a [`super::Dispatcher`].
///
/// Claiming, retrying, quarantining, waking up and shutting down work as the relay's do, with
/// the same settings ([`RelayConfig`], in [`Self::lane`]); a dispatcher claims at most 32
/// actions at a time by default, ahead of its free call slots, and claims again once fewer
/// than that wait for a slot.
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
    /// nested deeper than 127 levels, is stored as
    /// `{"outbox_answer_omitted": {"reason": ..., "bytes": n, "start": "<its first KiB>"}}`
    /// (`bytes` null for a too deep one) and the action is still done (or rejected):
    /// PostgreSQL refuses JSONB values over 255 MiB (the binary form, several times the
    /// text of a dense array) and nesting deeper than its stack allows, and a record that
    /// fails would make the calls again. The default, 8 MiB, holds the HTTP executor's
    /// largest answer (a 1 MiB body, escaped); at most 32 MiB, and a batch's answers
    /// (`batch_size` times this) at most 512 MiB, under PostgreSQL's 1 GiB message limit.
    pub max_answer_bytes: usize,
    /// Most calls per second to the destination, shared by this dispatcher's calls (a token
    /// bucket); `None` (the default) for no limit of its own. Either way, a 429 slows the
    /// dispatcher down (multiplicative decrease, then additive increase while calls succeed,
    /// up to this limit), and its `Retry-After` holds every call back for as long as asked.
    pub max_rate: Option<f64>,
    /// Oldest action still called: past it (from the decision's commit, `created_at`), a
    /// pending action is given up instead, so that no call is ever made after the API forgot
    /// its idempotency key (Stripe keeps keys 24 hours). The agent then reads
    /// [`super::ActionState::NeverSent`] if no call was ever made, or
    /// [`super::ActionState::Unknown`]. 23 hours by default.
    pub max_age: Duration,
    /// Claim, retry, quarantine, wake-up and shutdown settings, as the relay's.
    /// `after_publish` must stay [`AfterPublish::Mark`]: a done action keeps its outcome
    /// until it is pruned.
    pub lane: RelayConfig,
}

impl DispatcherConfig {
    /// The defaults for `destination`: 64 calls in flight, 30 s per call, no rate limit of
    /// its own, actions given up 23 hours after their decision, claims of up to 32, up to 10
    /// attempts charged with backoff from 500 ms to 5 minutes, and
    /// [`QuarantinePolicy::BlockKey`]: a key's later actions wait for an operator when one is
    /// quarantined (a declined "charge" must not let its "ship" run).
    pub fn new(destination: impl Into<String>) -> Self {
        Self {
            destination: destination.into(),
            max_in_flight: 64,
            call_timeout: Duration::from_secs(30),
            max_answer_bytes: 8 << 20,
            max_rate: None,
            max_age: Duration::from_secs(23 * 3600),
            lane: RelayConfig::default()
                .batch_size(32)
                .quarantine_policy(QuarantinePolicy::BlockKey),
        }
    }

    /// Sets [`Self::max_rate`].
    pub fn max_rate(mut self, calls_per_second: f64) -> Self {
        self.max_rate = Some(calls_per_second);
        self
    }
    /// Sets [`Self::max_age`].
    pub fn max_age(mut self, d: Duration) -> Self {
        self.max_age = d;
        self
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
    /// Sets [`RelayConfig::insecure_transport`] (the pool's settings).
    pub fn insecure_transport(mut self, on: bool) -> Self {
        self.lane.insecure_transport = on;
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

    /// Connections a dispatcher holds besides LISTEN: one claims, one records.
    pub(crate) fn workers(&self) -> usize {
        2
    }

    pub(crate) fn validate(&self) -> Result<String, crate::ProducerError> {
        let bad = |m: String| Err(crate::ProducerError::Config(m));
        let topic = outbox_core::wire::dispatch_topic(&self.destination)?;
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be at least 1".into());
        }
        // Below a call every 11.6 days, the time between calls is past what an instant holds.
        if self
            .max_rate
            .is_some_and(|rate| !rate.is_finite() || rate < MIN_MAX_RATE)
        {
            return bad(format!(
                "max_rate must be at least {MIN_MAX_RATE} calls per second (a finite number)"
            ));
        }
        if self.max_age.is_zero() || self.max_age > MAX_AGE_LIMIT {
            return bad("max_age must be more than zero and at most 365 days".into());
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
