//! What the relay and the dispatcher share: claiming a batch of due pending rows of one lane
//! (the relay's: every topic but `dispatch:...`; a dispatcher's: its `dispatch:<destination>`)
//! with per-key hold-back, handing it to a [`Destination`] (the relay's batch, in the claim's
//! transaction) or leasing it (a dispatcher's, committed at once, its verdicts recorded
//! later, fenced by the lease), recording each row's [`Verdict`] (done, retried with backoff,
//! quarantined, waiting out an outage, untouched or released), and the relay's run loop
//! around it (NOTIFY wake-up, polling, pausing while the destination does not answer, bounded
//! shutdown, gauges).
//!
//! A lane's per-key order holds against the rows of its own lane: a relay and a dispatcher
//! serving one table never hold each other's keys back.

mod answer;
mod batch;
mod grace;
mod lease;
mod record;
mod row;
mod run_loop;
mod stats_export;
mod transaction;

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub(crate) use grace::Grace;
pub(crate) use lease::LEASE_MARGIN;
pub(crate) use record::outage_wait;
#[cfg(test)]
pub(crate) use row::test_row;
pub(crate) use row::{OutboxRow, chains};
pub(crate) use run_loop::{SHUTDOWN_DB_MARGIN, bounded};

use crate::ProducerError;
use crate::relay::RelayConfig;
use crate::sql::RelaySql;

/// Which rows of the table a lane claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LaneRows {
    /// Events for Kafka: every topic that is not a dispatch topic.
    Relay,
    /// The actions of one destination: rows whose topic is this `dispatch:<destination>`
    /// (validated by `outbox_core::wire::dispatch_topic`).
    Dispatch(String),
}

/// Whose failure a row's failure is, once the destination said what it could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The row's own, for good: quarantined at once.
    Permanent,
    /// The row's own, for now: charged an attempt, retried after a backoff, quarantined
    /// after `max_attempts`.
    Transient,
    /// Not the row's: where it goes cannot take it now while the destination answers (a
    /// partition without a leader, an endpoint refusing connections while others answer).
    /// Charged nothing; the row waits, holding its key, and is tried again.
    Outage,
}

/// What became of one row of a batch.
#[derive(Debug, Clone)]
pub(crate) enum Verdict {
    /// Performed (acknowledged by Kafka, done by the executor), with the destination's
    /// answer to store as the row's outcome.
    Done(Option<serde_json::Value>),
    /// Not tried: an earlier row of its key in this batch was not done.
    Deferred,
    /// No answer before shutdown's grace period ended: left exactly as it was.
    Unconfirmed,
    /// The destination as a whole did not answer: left exactly as it was, and the lane
    /// pauses ([`Destination::wait_until_answers`]).
    Unreachable,
    /// Failed.
    Failed(Failed),
}

/// A failed row.
#[derive(Debug, Clone)]
pub(crate) struct Failed {
    pub(crate) kind: Failure,
    pub(crate) error: String,
    /// The least wait before the next attempt that the destination asked for.
    pub(crate) retry_after: Option<Duration>,
    /// The destination's answer, stored as the row's outcome (a rejection's body).
    pub(crate) answer: Option<serde_json::Value>,
    /// For an outage: the row was not even tried (its partition was known to be out), and
    /// the outage was logged when it was found.
    pub(crate) unsent: bool,
    /// For an outage: the whole destination did not answer in this batch, so the lane
    /// pauses ([`Destination::wait_until_answers`]) besides the row waiting.
    pub(crate) silent: bool,
}

impl Failed {
    pub(crate) fn new(kind: Failure, error: impl Into<String>) -> Self {
        Self {
            kind,
            error: error.into(),
            retry_after: None,
            answer: None,
            unsent: false,
            silent: false,
        }
    }
}

/// Where a lane's rows go: Kafka (the relay) or the user's executor (a dispatcher).
pub(crate) trait Destination: Send + Sync + 'static {
    /// Performs `rows` (in sequence order) and says what became of each, one verdict per
    /// row. A row whose verdict is not `Done` stops its key's later rows in the batch
    /// (`Deferred`). Once `expired` (shutdown's grace period ended), rows without an answer
    /// are `Unconfirmed`. An error leaves the whole batch pending as it was; a fatal one
    /// ([`ProducerError::FatalProducer`]) stops the lane.
    fn deliver(
        &self,
        rows: &[OutboxRow],
        expired: &CancellationToken,
    ) -> impl Future<Output = Result<Vec<Verdict>, ProducerError>> + Send;

    /// After a batch in which the destination did not answer at all: returns when it might
    /// answer again, or on shutdown.
    fn wait_until_answers(&self, shutdown: &CancellationToken) -> impl Future<Output = ()> + Send;

    /// Called once when the lane stops, with what is left of the grace period.
    fn finish(&self, remaining: Duration)
    -> impl Future<Output = Result<(), ProducerError>> + Send;

    /// Why the destination does not answer, when it says (escaped, never a secret).
    fn last_error(&self) -> Option<String>;
}

/// Metric names and labels of one lane.
#[derive(Debug, Clone)]
pub(crate) struct LaneMetrics {
    pub(crate) done: &'static str,
    pub(crate) failed: &'static str,
    pub(crate) quarantined: &'static str,
    pub(crate) unconfirmed: &'static str,
    pub(crate) waiting: &'static str,
    pub(crate) latency: &'static str,
    /// Gauges: the lane's pending rows, the age of its oldest, its quarantined rows.
    pub(crate) pending: &'static str,
    pub(crate) oldest_pending: &'static str,
    pub(crate) quarantined_now: &'static str,
    pub(crate) labels: Vec<(&'static str, String)>,
}

/// One lane: its rows, settings and destination.
pub(crate) struct Lane<D> {
    pub(crate) pool: PgPool,
    pub(crate) config: RelayConfig,
    pub(crate) sql: RelaySql,
    pub(crate) destination: D,
    pub(crate) metrics: LaneMetrics,
    /// Batches run side by side by [`Lane::run`], each with its own transaction.
    pub(crate) workers: usize,
    /// Longest answer stored as it is (a longer one is stored as a marker).
    pub(crate) max_answer_bytes: usize,
}

impl<D> std::fmt::Debug for Lane<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("config", &self.config)
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl<D> Lane<D> {
    /// Validates `config` and the pool's size (one connection per worker, one to LISTEN).
    pub(crate) fn new(
        pool: PgPool,
        config: RelayConfig,
        rows: &LaneRows,
        destination: D,
        metrics: LaneMetrics,
        workers: usize,
    ) -> Result<Self, ProducerError> {
        config.validate()?;
        if !config.insecure_transport {
            outbox_core::check_database_tls(&pool.connect_options())?;
        }
        let workers = workers.max(1);
        let needed = u32::try_from(workers)
            .unwrap_or(u32::MAX)
            .saturating_add(u32::from(config.listen));
        let max = pool.options().get_max_connections();
        if max < needed {
            // With fewer, a batch would wait on the pool for a connection the others hold.
            return Err(ProducerError::Config(format!(
                "needs a pool of at least {needed} connections ({workers} for its batches{}), \
                 this one has {max}",
                if config.listen { ", one to LISTEN" } else { "" }
            )));
        }
        let sql = RelaySql::new(&config.tables.outbox, config.quarantine_policy, rows);
        Ok(Self {
            pool,
            config,
            sql,
            destination,
            metrics,
            workers,
            max_answer_bytes: usize::MAX,
        })
    }
}
