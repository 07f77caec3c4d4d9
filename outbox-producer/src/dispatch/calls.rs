//! Performing a key's leased actions: one call after the other, each bounded by
//! `call_timeout`, paced by the destination's rate, and judged by the destination's health
//! (whose failure it was); each action's verdict is handed on as soon as it is known.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::FutureExt;
use serde_json::value::RawValue;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::health::{Admission, Blame, Health, Turn};
use super::{Action, DispatcherConfig, Executor, Outcome};
use crate::lane::{Failed, Failure, LEASE_MARGIN, OutboxRow, Verdict};

/// Where a key's verdicts go: the dispatcher's recorder.
pub(crate) type Results = mpsc::UnboundedSender<(OutboxRow, Verdict)>;

pub(crate) struct Calls<E> {
    executor: E,
    pub(super) config: DispatcherConfig,
    /// One permit per key being performed (its calls run one at a time).
    pub(super) in_flight: Arc<Semaphore>,
    pub(super) health: Health,
    #[cfg(feature = "fault-injection")]
    crash_after_call: AtomicBool,
    /// The injected crash fired: `run_once` records nothing of its batch, as a dead process.
    #[cfg(feature = "fault-injection")]
    pub(super) crashed: AtomicBool,
}

/// Where a row's lease ends: its claim's start, and its place in its key's run (1 for the
/// first), each place adding a `call_timeout` to the lease.
#[derive(Debug, Clone, Copy)]
struct Lease {
    claimed_at: Instant,
    place: u32,
}

/// What became of one call.
enum Call {
    Answered(Outcome),
    /// The executor did not answer within `call_timeout`.
    TimedOut,
    /// The executor panicked.
    Panicked(String),
}

impl<E: Executor> Calls<E> {
    pub(super) fn new(executor: E, config: DispatcherConfig, health: Health) -> Self {
        Self {
            executor,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            config,
            health,
            #[cfg(feature = "fault-injection")]
            crash_after_call: AtomicBool::new(false),
            #[cfg(feature = "fault-injection")]
            crashed: AtomicBool::new(false),
        }
    }

    #[cfg(feature = "fault-injection")]
    pub(super) fn crash_after_next_call(&self) {
        self.crash_after_call.store(true, Ordering::SeqCst);
    }

    /// Performs a key's rows (leased, in sequence order) one after the other, and stops at
    /// the first not done, or once the destination is down or paused, or at shutdown's end:
    /// the rows not called then are released untried.
    pub(super) async fn run_chain(
        &self,
        rows: Vec<OutboxRow>,
        claimed_at: Instant,
        expired: &CancellationToken,
        results: &Results,
    ) {
        let mut rows = rows.into_iter().zip(1_u32..);
        for (row, place) in rows.by_ref() {
            let lease = Lease { claimed_at, place };
            let Some(verdict) = self.perform(&row, lease, expired).await else {
                // Recorded by nobody, as a crash there would: the lease runs out and the
                // action is called again with the same key.
                break;
            };
            let go_on = matches!(verdict, Verdict::Done(_))
                && self.health.is_open()
                && !expired.is_cancelled();
            // A send fails only once the recorder is gone (the dispatcher stopped): the lease
            // then runs out and the action is called again with the same key.
            let _ = results.send((row, verdict));
            if !go_on {
                break;
            }
        }
        for (row, _) in rows {
            let _ = results.send((row, Verdict::Deferred));
        }
    }

    /// Whether a call of `lease`'s row, started now and lasting up to `call_timeout`, still
    /// ends with time to record it before the lease does: after it, another dispatcher may
    /// have taken the action over (a rate limit's wait, a `verify` and the calls before it in
    /// its key's run all come out of the lease).
    fn lease_allows_a_call(&self, lease: Lease) -> bool {
        let timeout = self.config.call_timeout;
        let ends = lease.claimed_at + timeout.saturating_mul(lease.place) + LEASE_MARGIN;
        Instant::now() + timeout + LEASE_MARGIN / 2 <= ends
    }

    fn action(&self, row: &OutboxRow) -> Result<Action, Failed> {
        // Kept as their stored text: JSONB takes numbers and depths serde_json's `Value`
        // refuses or rounds, and a row that cannot be read must fail alone.
        let raw = |what: &str, text: &str| {
            RawValue::from_string(text.to_owned()).map_err(|e| {
                let mut failed = Failed::new(Failure::Permanent, format!("{what}: {e}"));
                failed.unsent = true;
                failed
            })
        };
        Ok(Action {
            id: row.id,
            destination: self.config.destination.clone(),
            aggregate_type: row.aggregatetype.clone(),
            key: row.aggregateid.clone(),
            action_type: row.event_type.clone(),
            payload: raw("payload", &row.payload)?,
            headers: raw("headers", &row.headers)?,
            created_at: row.created_at,
            attempt: u32::try_from(row.calls).unwrap_or(0),
        })
    }

    /// Performs one row: `None` only for an injected crash.
    async fn perform(
        &self,
        row: &OutboxRow,
        lease: Lease,
        expired: &CancellationToken,
    ) -> Option<Verdict> {
        let action = match self.action(row) {
            Ok(action) => action,
            Err(failed) => return Some(Verdict::Failed(failed)),
        };
        let age = (chrono::Utc::now() - row.created_at)
            .to_std()
            .unwrap_or_default();
        if age > self.config.max_age {
            return Some(
                self.give_up(row, &action, "older than max_age", expired)
                    .await,
            );
        }
        if row.orphaned
            && let Some(Outcome::Done(answer)) = self.verify(&action, expired).await
        {
            // The dispatcher that leased it stopped during its call, which had applied it.
            return Some(Verdict::Done(Some(answer)));
        }
        // Released untried while the destination asked for a wait (another key's 429) or
        // is between probes: calls already claimed must keep to it too; and when the lease no
        // longer allows a call, before a rate-limit turn is booked for nothing.
        if expired.is_cancelled()
            || matches!(self.health.admission(), Admission::PausedUntil(_))
            || !self.lease_allows_a_call(lease)
        {
            return Some(Verdict::Deferred);
        }
        let turn = tokio::select! {
            turn = self.health.start_call() => turn,
            () = expired.cancelled() => return Some(Verdict::Deferred),
        };
        // The rate limit's wait may have outlasted a pause asked for meanwhile, or the lease.
        if matches!(self.health.admission(), Admission::PausedUntil(_))
            || !self.lease_allows_a_call(lease)
        {
            return Some(Verdict::Deferred);
        }
        let call = tokio::time::timeout(
            self.config.call_timeout,
            // Inside the async block, so that an executor that panics before it returns its
            // future is caught too.
            AssertUnwindSafe(async { self.executor.execute(action.clone()).await }).catch_unwind(),
        );
        // Dropping a call in flight at the end of the grace period may leave its effect
        // applied and unrecorded: the action is released and called again, same key.
        let call = tokio::select! {
            called = call => match called {
                Ok(Ok(outcome)) => Call::Answered(outcome),
                Ok(Err(panic)) => Call::Panicked(panic_message(&*panic)),
                Err(_elapsed) => Call::TimedOut,
            },
            () = expired.cancelled() => return Some(Verdict::Unconfirmed),
        };
        #[cfg(feature = "fault-injection")]
        if self.crash_after_call.swap(false, Ordering::SeqCst) {
            self.crashed.store(true, Ordering::SeqCst);
            return None;
        }
        let verdict = self.judge(row, turn, call);
        Some(match verdict {
            // Its own failure, and its last attempt: ask the destination before giving up.
            Verdict::Failed(failed)
                if failed.kind == Failure::Transient
                    && u32::try_from(row.attempts).unwrap_or(0) + 1
                        >= self.config.lane.max_attempts =>
            {
                match self.verify(&action, expired).await {
                    Some(Outcome::Done(answer)) => Verdict::Done(Some(answer)),
                    _ => Verdict::Failed(failed),
                }
            }
            verdict => verdict,
        })
    }

    /// What a call's result makes of its row, and what it tells of the destination.
    fn judge(&self, row: &OutboxRow, turn: Turn, call: Call) -> Verdict {
        let started = turn.started;
        let health = &self.health;
        let backoff_max = self.config.lane.backoff_max;
        // A wait asked for is honoured in full, up to `max_age`: past it the action is given
        // up anyway, and an absurd `Retry-After` must not overflow a deadline.
        let max_wait = self.config.max_age;
        // A failure that every call of a failing destination gets: the action's only while
        // the destination answers others; a wait asked for past `backoff_max` is charged
        // nothing either way.
        let shared = |reason: String, after: Option<Duration>| {
            let after = after.map(|a| a.min(max_wait));
            if let Some(after) = after {
                health.wait_asked(after);
            }
            let blame = health.failed(row.id, started, &reason);
            let kind = if blame == Blame::Action && after.is_none_or(|a| a <= backoff_max) {
                Failure::Transient
            } else {
                Failure::Outage
            };
            let mut failed = Failed::new(kind, reason);
            failed.retry_after = after;
            Verdict::Failed(failed)
        };
        match call {
            Call::Answered(Outcome::Done(answer)) => {
                health.succeeded();
                Verdict::Done(Some(answer))
            }
            Call::Answered(Outcome::Rejected { reason, answer }) => {
                health.succeeded();
                let mut failed = Failed::new(Failure::Permanent, reason);
                failed.answer = Some(answer);
                Verdict::Failed(failed)
            }
            Call::Answered(Outcome::Retry { reason, after }) => shared(reason, after),
            Call::TimedOut => shared(
                format!(
                    "no answer within call_timeout ({:?}): the outcome is unknown, the call is \
                     made again with the same key",
                    self.config.call_timeout
                ),
                None,
            ),
            Call::Answered(Outcome::Unavailable { reason }) => {
                health.failed(row.id, started, &reason);
                let mut failed = Failed::new(Failure::Outage, reason);
                failed.unsent = true;
                Verdict::Failed(failed)
            }
            Call::Answered(Outcome::RateLimited { reason, after }) => {
                let after = after.map(|a| a.min(max_wait));
                let wait = health.rate_limited(turn, after);
                let mut failed = Failed::new(Failure::Outage, reason);
                failed.unsent = true;
                // Its turn at the slower rate, not an outage's wait: a 429 without
                // `Retry-After` parked each key for 15-30 s (bench P9d).
                failed.retry_after = Some(wait);
                Verdict::Failed(failed)
            }
            Call::Answered(Outcome::NotSent { reason }) => {
                let mut failed = Failed::new(Failure::Permanent, reason);
                failed.unsent = true;
                Verdict::Failed(failed)
            }
            Call::Panicked(message) => {
                tracing::error!(event_id = %row.id, "the executor panicked");
                Verdict::Failed(Failed::new(
                    Failure::Transient,
                    format!("the executor panicked: {message}"),
                ))
            }
        }
    }

    /// Gives `row` up without calling it: done if the destination says its key was applied,
    /// otherwise quarantined (the agent reads `NeverSent` if no call was ever made, `Unknown`
    /// otherwise).
    async fn give_up(
        &self,
        row: &OutboxRow,
        action: &Action,
        why: &str,
        expired: &CancellationToken,
    ) -> Verdict {
        if (row.calls > 0 || row.orphaned)
            && let Some(Outcome::Done(answer)) = self.verify(action, expired).await
        {
            return Verdict::Done(Some(answer));
        }
        let reason = format!(
            "{why} ({:?}): not called again, {}",
            self.config.max_age,
            if row.calls > 0 || row.orphaned {
                "an earlier call may have applied it"
            } else {
                "it was never sent"
            }
        );
        let mut failed = Failed::new(Failure::Permanent, reason);
        failed.unsent = true;
        Verdict::Failed(failed)
    }

    /// The executor's [`Executor::verify`], bounded by `call_timeout` and shutdown's grace
    /// period; `None` on a timeout or a panic.
    async fn verify(&self, action: &Action, expired: &CancellationToken) -> Option<Outcome> {
        let verify = AssertUnwindSafe(async { self.executor.verify(action).await }).catch_unwind();
        tokio::select! {
            verified = tokio::time::timeout(self.config.call_timeout, verify) => match verified {
                Ok(Ok(found)) => found,
                Ok(Err(_)) | Err(_) => None,
            },
            () = expired.cancelled() => None,
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
