//! The dispatcher: performs each decided action itself (calls the billing API, sends the
//! mail), with the action's event id as idempotency key, and records what the destination
//! answered with the row. An agent that calls tools needs only PostgreSQL.
//!
//! ```text
//! agent's transaction:  UPDATE task ...; INSERT action (topic dispatch:billing)   -- atomic
//! dispatcher:           claim + lease (commit) → executor(action) → record the answer (fenced)
//! agent's next turn:    outcome(conn, tables, action id) → Done({"invoice_id": ...})
//! ```
//!
//! # Delivery semantics
//! - **At least once, effectively once by the key**: an action is marked done only after its
//!   executor said [`Outcome::Done`]. A crash (or a shutdown, or a timeout) between the call
//!   and that record leaves the action pending, and it is called again **with the same
//!   [`Action::idempotency_key`]**: a destination that honours idempotency keys (payment
//!   APIs do) applies it once. One that does not may apply it twice.
//! - **No transaction across a call**: a claim leases its actions and commits; each answer is
//!   recorded as it arrives (many per transaction), fenced by the lease. A dispatcher that
//!   dies mid-call leaves its actions leased until `call_timeout` (times their place in the
//!   key's run) and a margin of 10 s have passed; then another takes them over, asking the
//!   executor's [`Executor::verify`] first.
//! - **Order per key**: a key's (`aggregatetype`, `aggregateid`) actions are called one at a
//!   time in commit order, with any number of dispatchers; different keys run side by side,
//!   up to [`DispatcherConfig::max_in_flight`] calls. A slow call holds its own key and call
//!   slot, nothing else. A key held back (waiting for a retry, or quarantined under
//!   [`QuarantinePolicy::BlockKey`](crate::QuarantinePolicy), the dispatcher's default) never
//!   holds back the others.
//! - **Whose failure**: a failure every call gets (a 5xx, a timeout, no connection, 401/403)
//!   is the destination's. A failed call is charged to its action (counted against
//!   `max_attempts`) only if another call succeeded after it started; after three failures
//!   in a row with none, the destination is **down**: nothing is charged, nothing more is
//!   claimed, and one action at a time probes it (backoff up to 30 s) until a call succeeds.
//!   A 429 ([`Outcome::RateLimited`]) slows every call down (and
//!   [`DispatcherConfig::max_rate`] caps them), and its `Retry-After` holds every call back
//!   for as long as asked, in full, charging nothing.
//! - **Outcomes**: [`Outcome::Done`] stores the answer with the row ([`outcome`] reads it;
//!   an answer over [`DispatcherConfig::max_answer_bytes`] or nested deeper than 127 levels
//!   is stored as `{"outbox_answer_omitted": {"reason": ..., "bytes": n or null, "start":
//!   ...}}`); [`Outcome::Retry`] retries after a backoff (at least what the destination asked
//!   for); [`Outcome::Rejected`] quarantines at once with the answer; [`Outcome::NotSent`]
//!   quarantines at once as never sent. A call is bounded by `call_timeout`, and a panic is
//!   caught: a timeout counts as a retry, a panic as the action's own failure.
//! - **Every action ends**: done, rejected, or given up after `max_attempts` charged
//!   attempts or once [`DispatcherConfig::max_age`] (23 h) after its decision has passed,
//!   whichever first (within a minute of it for an action no claim reaches: held behind a
//!   quarantined one, or waiting out a pause). A wait a destination asks for is cut to
//!   `max_age`.
//!   [`outcome`] then tells [`ActionState::NeverSent`] (no call could have applied it: safe
//!   to decide again) from [`ActionState::Unknown`] (a call may have applied it: ask the API
//!   with the key). Before giving up an action that was called, the dispatcher asks
//!   [`Executor::verify`].
//! - **Start-up**: [`Dispatcher::run`] first checks that the schema has every column it
//!   writes and its role may write them ([`Dispatcher::check`]), and fails with a
//!   [`ProducerError::Config`] naming what is missing instead of calling what it cannot
//!   record.
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
mod health;
#[cfg(feature = "http")]
pub mod http;
mod outcome;
mod preflight;
mod run;

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
use health::Health;

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
    /// A dispatcher of `config.destination`'s actions. The pool needs 3 connections: one
    /// claims, one records, one LISTENs (2 with `listen(false)`).
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
        let health = Health::new(
            config.max_rate,
            config.lane.backoff_base,
            metrics.labels.clone(),
        );
        let calls = Calls::new(executor, config, health);
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

    /// Why the destination is down, while it is (the failure that took it down, escaped).
    pub fn last_error(&self) -> Option<String> {
        self.lane.destination.health.reason()
    }

    /// Whether the destination is up: `false` from the moment its calls all fail until one
    /// succeeds (also the gauge `outbox_dispatch_destination_up`).
    pub fn destination_up(&self) -> bool {
        self.lane.destination.health.reason().is_none()
    }

    /// Checks that this dispatcher can record what it calls: the outbox table has every
    /// column it writes (the migrations ran) and its role may read and write them. A
    /// [`ProducerError::Config`] names what is missing. [`Self::run`] checks this first.
    pub async fn check(&self) -> Result<(), ProducerError> {
        let mut conn = self.lane.pool.acquire().await?;
        preflight::check(&mut conn, &self.lane.config.tables.outbox).await
    }

    /// Claims up to `batch_size` actions, performs them and records what became of each.
    /// Tests drive the dispatcher with this (it does not wait for a destination that is down).
    pub async fn run_once(&self) -> Result<BatchReport, ProducerError> {
        run::run_once(&self.lane).await
    }

    /// Runs until `shutdown` is cancelled: claims up to `batch_size` actions, leased and
    /// committed at once, whenever fewer than that wait for one of the `max_in_flight` call
    /// slots; performs each key's on a task of its own once it has a slot; records each
    /// verdict as it arrives. While the destination is down it claims
    /// nothing but one probe at a time. Wakes on a committing writer's `NOTIFY`, or every
    /// `poll_interval`.
    ///
    /// Fails at once with [`ProducerError::Config`] if [`Self::check`] finds the schema or
    /// the role unable to record an answer. Shutdown takes at most `shutdown_timeout`: calls
    /// still in flight then are dropped and their actions released, to be called again with
    /// the same key.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProducerError> {
        let mut failures = 0_u32;
        loop {
            match self.check().await {
                Ok(()) => break,
                Err(error @ ProducerError::Config(_)) => return Err(error),
                // The database is unreachable: try again, as a claim would.
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay = outbox_core::backoff(
                        self.lane.config.backoff_base,
                        std::time::Duration::from_secs(30),
                        failures - 1,
                    );
                    tracing::warn!(%error, retry_in = ?delay, "dispatcher start-up check failed");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        run::run(&self.lane, shutdown).await
    }

    /// Makes the next call's result go unrecorded, as a crash between the call and its record
    /// would: [`Self::run_once`] then records nothing of its batch and fails with
    /// [`ProducerError::InjectedFault`]; the actions keep their leases and are called again,
    /// same keys, once the leases end. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_call(&self) {
        self.lane.destination.crash_after_next_call();
    }
}
