//! The dispatcher: performs each decided action itself (calls the billing API, sends the
//! mail), with the action's event id as idempotency key, and records what the destination
//! answered with the row. An agent that calls tools needs only PostgreSQL.
//!
//! ```text
//! agent's transaction:  UPDATE task ...; INSERT action (topic dispatch:billing)   -- atomic
//! dispatcher:           claim → executor(action) → mark done + store the answer  -- one tx
//! agent's next turn:    outcome(conn, tables, action id) → Done({"invoice_id": ...})
//! ```
//!
//! # Delivery semantics
//! - **At least once, effectively once by the key**: an action is marked done only after its
//!   executor said [`Outcome::Done`], in the transaction that claimed it. A crash (or a
//!   shutdown, or a timeout) between the call and that commit leaves the action pending, and
//!   it is called again **with the same [`Action::idempotency_key`]**: a destination that
//!   honours idempotency keys (payment APIs do) applies it once. One that does not may apply
//!   it twice.
//! - **Order per key**: a key's (`aggregatetype`, `aggregateid`) actions are called one at a
//!   time in commit order, with any number of dispatchers; different keys run side by side,
//!   up to [`DispatcherConfig::max_in_flight`] calls. A key held back (waiting for a retry,
//!   or quarantined under [`QuarantinePolicy::BlockKey`](crate::QuarantinePolicy)) never holds
//!   back the others.
//! - **Outcomes**: [`Outcome::Done`] stores the answer with the row ([`outcome`] reads it;
//!   an answer over [`DispatcherConfig::max_answer_bytes`] or nested deeper than 128 levels
//!   is stored as `{"outbox_answer_omitted": {"reason": ..., "bytes": n or null, "start":
//!   ...}}`);
//!   [`Outcome::Retry`] retries after a backoff (at least what the destination asked for),
//!   counted against `max_attempts`, then quarantines; [`Outcome::Rejected`] quarantines at
//!   once with the answer; [`Outcome::Unavailable`] charges nothing: when no call of a batch
//!   got an answer the dispatcher pauses as a whole (backoff up to 30 s) and tries again.
//!   A call is bounded by `call_timeout`, and a panic is caught: both count as a retry.
//! - **A slow call** holds back the record of its own batch (`batch_size` rows, 32 by
//!   default) until it ends, never the other batches: the dispatcher runs
//!   `max_in_flight / batch_size` batches side by side, and one more that claims and records
//!   while the others call (calls stay capped at `max_in_flight`).
//!
//! A relay and dispatchers serve one table side by side: the relay never claims rows whose
//! topic is `dispatch:...`, a dispatcher only its own destination's. Order holds per lane (a
//! key's Kafka events and its actions of a destination are ordered separately). Upgrade every
//! relay (and run the migrations) before the first action is enqueued: a relay from before
//! the dispatcher would try to publish `dispatch:...` as a Kafka topic and quarantine it.
//!
//! ```no_run
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Outcome};
//! use outbox_producer::{NewEvent, Outbox};
//!
//! async fn charge(action: Action) -> Outcome {
//!     // Call the API with `action.idempotency_key()`; say what happened.
//!     Outcome::done(serde_json::json!({ "invoice_id": "in_1" }))
//! }
//!
//! // In the agent's transaction, with its state change:
//! let mut tx = pool.begin().await?;
//! let action = NewEvent::new("task", "42", "charge", &serde_json::json!({ "cents": 500 }))?
//!     .for_dispatcher("billing")?;
//! Outbox::default().enqueue(&mut tx, &action).await?;
//! tx.commit().await?;
//!
//! let dispatcher = Dispatcher::new(pool, DispatcherConfig::new("billing"), charge)?;
//! dispatcher.run(tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

mod action;
mod calls;
mod config;
#[cfg(feature = "http")]
pub mod http;
mod outcome;

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use action::{Action, Executor, Outcome};
pub use config::DispatcherConfig;
#[cfg(feature = "http")]
pub use http::HttpExecutor;
pub use outcome::{ActionState, outcome};

use crate::ProducerError;
use crate::lane::{Lane, LaneMetrics, LaneRows};
use crate::relay::BatchReport;
use calls::Calls;

/// Performs the actions of one destination with an [`Executor`]. Cheap to clone; run one or
/// many (in one process or several): order per key holds either way.
pub struct Dispatcher<E: Executor> {
    lane: Arc<Lane<Calls<E>>>,
}

impl<E: Executor> Clone for Dispatcher<E> {
    fn clone(&self) -> Self {
        Self {
            lane: Arc::clone(&self.lane),
        }
    }
}

impl<E: Executor> std::fmt::Debug for Dispatcher<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("config", &self.lane.destination.config)
            .finish_non_exhaustive()
    }
}

impl<E: Executor> Dispatcher<E> {
    /// A dispatcher of `config.destination`'s actions. The pool needs a connection per batch
    /// run side by side (`max_in_flight / batch_size`, rounded up, and one more) and one to
    /// LISTEN: 4 with the defaults.
    pub fn new(pool: PgPool, config: DispatcherConfig, executor: E) -> Result<Self, ProducerError> {
        let topic = config.validate()?;
        let metrics = LaneMetrics {
            done: "outbox_dispatch_done_total",
            failed: "outbox_dispatch_failed_total",
            quarantined: "outbox_dispatch_quarantined_total",
            unconfirmed: "outbox_dispatch_unconfirmed_total",
            waiting: "outbox_dispatch_waiting_total",
            latency: "outbox_dispatch_latency_seconds",
            pending: "outbox_dispatch_pending",
            oldest_pending: "outbox_dispatch_oldest_pending_age_seconds",
            quarantined_now: "outbox_dispatch_quarantined",
            labels: vec![
                ("table", config.lane.tables.outbox.as_str().to_owned()),
                ("destination", config.destination.clone()),
            ],
        };
        let (lane_config, workers) = (config.lane.clone(), config.workers());
        let max_answer_bytes = config.max_answer_bytes;
        let calls = Calls::new(executor, config);
        let mut lane = Lane::new(
            pool,
            lane_config,
            &LaneRows::Dispatch(topic),
            calls,
            metrics,
            workers,
        )?;
        lane.max_answer_bytes = max_answer_bytes;
        Ok(Self {
            lane: Arc::new(lane),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DispatcherConfig {
        &self.lane.destination.config
    }

    /// Why the destination does not answer, while it does not (the last
    /// [`Outcome::Unavailable`] reason, escaped).
    pub fn last_error(&self) -> Option<String> {
        use crate::lane::Destination;
        self.lane.destination.last_error()
    }

    /// Claims, performs and records one batch. Tests drive the dispatcher with this.
    pub async fn run_once(&self) -> Result<BatchReport, ProducerError> {
        self.lane.run_batch(true, &CancellationToken::new()).await
    }

    /// Runs batches until `shutdown` is cancelled (see [`crate::Relay::run`]: the same loop),
    /// `max_in_flight / batch_size` (and one more) side by side. Shutdown takes at most
    /// `shutdown_timeout`: calls still in flight then are dropped and their actions stay
    /// pending, to be called again with the same key.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProducerError> {
        self.lane.run(shutdown).await
    }

    /// Makes the next batch fail after its calls and before their outcomes are recorded, as
    /// a crash there would. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_call(&self) {
        self.lane.destination.crash_after_next_call();
    }
}
