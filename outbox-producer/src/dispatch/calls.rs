//! The executor as a lane's destination: each key's actions called one after the other,
//! keys side by side up to `max_in_flight`, every call bounded by `call_timeout`.

use std::panic::AssertUnwindSafe;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use futures::future::join_all;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Action, DispatcherConfig, Executor, Outcome};
use crate::ProducerError;
use crate::lane::{Destination, Failed, Failure, OutboxRow, Verdict, chains};

/// Longest pause while no call gets an answer.
const PAUSE_MAX: Duration = Duration::from_secs(30);

/// While the destination does not answer: when to try again, and how many batches in a row
/// got no answer.
#[derive(Debug, Default)]
struct Pause {
    until: Option<Instant>,
    batches: u32,
    reason: Option<String>,
}

pub(crate) struct Calls<E> {
    executor: E,
    pub(super) config: DispatcherConfig,
    in_flight: Semaphore,
    pause: Mutex<Pause>,
    #[cfg(feature = "fault-injection")]
    crash_after_call: AtomicBool,
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
    pub(super) fn new(executor: E, config: DispatcherConfig) -> Self {
        Self {
            executor,
            in_flight: Semaphore::new(config.max_in_flight),
            config,
            pause: Mutex::default(),
            #[cfg(feature = "fault-injection")]
            crash_after_call: AtomicBool::new(false),
        }
    }

    #[cfg(feature = "fault-injection")]
    pub(super) fn crash_after_next_call(&self) {
        self.crash_after_call.store(true, Ordering::SeqCst);
    }

    fn pause(&self) -> std::sync::MutexGuard<'_, Pause> {
        self.pause.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Calls the executor for `row`, bounded by `call_timeout`; `None` once `expired`.
    async fn call(
        &self,
        row: &OutboxRow,
        expired: &CancellationToken,
    ) -> Option<Result<Call, Failed>> {
        let payload = match serde_json::from_str(&row.payload) {
            Ok(payload) => payload,
            // The column is JSONB: a payload that does not parse is another writer's defect.
            Err(e) => {
                return Some(Err(Failed::new(
                    Failure::Permanent,
                    format!("payload: {e}"),
                )));
            }
        };
        let action = Action {
            id: row.id,
            destination: self.config.destination.clone(),
            aggregate_type: row.aggregatetype.clone(),
            key: row.aggregateid.clone(),
            action_type: row.event_type.clone(),
            payload,
            headers: row.headers.0.clone(),
            created_at: row.created_at,
            attempt: u32::try_from(row.attempts).unwrap_or(0),
        };
        let _permit = tokio::select! {
            permit = self.in_flight.acquire() => permit.ok()?,
            () = expired.cancelled() => return None,
        };
        let call = tokio::time::timeout(
            self.config.call_timeout,
            // Inside the async block, so that an executor that panics before it returns its
            // future is caught too.
            AssertUnwindSafe(async { self.executor.execute(action).await }).catch_unwind(),
        );
        // Dropping a call in flight at the end of the grace period may leave its effect
        // applied and unrecorded: the action stays pending and is called again, same key.
        tokio::select! {
            called = call => Some(Ok(match called {
                Ok(Ok(outcome)) => Call::Answered(outcome),
                Ok(Err(panic)) => Call::Panicked(panic_message(&*panic)),
                Err(_elapsed) => Call::TimedOut,
            })),
            () = expired.cancelled() => None,
        }
    }

    /// Calls a key's rows one after the other; stops at the first not done, and before a
    /// further call once every other key of the batch is done (`others` counts the chains
    /// still running): the batch then commits, and the key's later rows go to the next one,
    /// so a slow key's run of actions never holds back the record of the other keys.
    async fn run_chain(
        &self,
        rows: &[OutboxRow],
        chain: &[usize],
        running: &Running,
        expired: &CancellationToken,
    ) -> Vec<(usize, Result<Call, Failed>)> {
        let mut calls = Vec::new();
        for &i in chain {
            if !calls.is_empty() && alone_of_several(running) {
                break;
            }
            let Some(call) = self.call(&rows[i], expired).await else {
                break;
            };
            let done = matches!(call, Ok(Call::Answered(Outcome::Done(_))));
            calls.push((i, call));
            if !done {
                break;
            }
        }
        running.left.fetch_sub(1, Ordering::SeqCst);
        calls
    }
}

/// The chains of a batch: how many there are, and how many are still running.
struct Running {
    chains: usize,
    left: AtomicUsize,
}

/// Whether every other chain of a batch of several is done.
fn alone_of_several(running: &Running) -> bool {
    running.chains > 1 && running.left.load(Ordering::SeqCst) == 1
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

impl<E: Executor> Destination for Calls<E> {
    async fn deliver(
        &self,
        rows: &[OutboxRow],
        expired: &CancellationToken,
    ) -> Result<Vec<Verdict>, ProducerError> {
        let chains = chains(rows);
        let running = Running {
            chains: chains.len(),
            left: AtomicUsize::new(chains.len()),
        };
        let calls = join_all(
            chains
                .iter()
                .map(|chain| self.run_chain(rows, chain, &running, expired)),
        )
        .await;
        #[cfg(feature = "fault-injection")]
        if self.crash_after_call.swap(false, Ordering::SeqCst) {
            // Dropping the transaction rolls it back, exactly as a dead process would.
            return Err(ProducerError::InjectedFault(
                "crash after the call, before the record",
            ));
        }
        let calls: Vec<_> = calls.into_iter().flatten().collect();
        // Whether the destination answered anything in this batch. When it did not (every
        // call unavailable or timed out), no row is charged: the failure is the
        // destination's, and the dispatcher pauses as a whole.
        let answered = calls.iter().any(|(_, call)| {
            !matches!(
                call,
                Ok(Call::Answered(Outcome::Unavailable { .. }) | Call::TimedOut)
            )
        });
        let mut verdicts: Vec<Option<Verdict>> = rows.iter().map(|_| None).collect();
        let mut silence = None;
        let outage = |reason: String| {
            // Charged nothing; the row waits (holding its key) so that other keys' rows fill
            // the next batches, however many of this key's rows are due.
            let mut failed = Failed::new(Failure::Outage, reason);
            failed.silent = !answered;
            Verdict::Failed(failed)
        };
        for (i, call) in calls {
            let verdict = match call {
                Err(failed) => Verdict::Failed(failed),
                Ok(Call::Answered(Outcome::Done(answer))) => Verdict::Done(Some(answer)),
                Ok(Call::Answered(Outcome::Retry { reason, after })) => {
                    let mut failed = Failed::new(Failure::Transient, reason);
                    failed.retry_after = after;
                    Verdict::Failed(failed)
                }
                Ok(Call::Answered(Outcome::Rejected { reason, answer })) => {
                    let mut failed = Failed::new(Failure::Permanent, reason);
                    failed.answer = Some(answer);
                    Verdict::Failed(failed)
                }
                Ok(Call::Answered(Outcome::Unavailable { reason })) => {
                    silence = Some(reason.clone());
                    outage(reason)
                }
                Ok(Call::TimedOut) => {
                    let reason = format!(
                        "no answer within call_timeout ({:?}): the outcome is unknown, the call \
                         is made again with the same key",
                        self.config.call_timeout
                    );
                    if answered {
                        Verdict::Failed(Failed::new(Failure::Transient, reason))
                    } else {
                        silence = Some(reason.clone());
                        outage(reason)
                    }
                }
                Ok(Call::Panicked(message)) => Verdict::Failed(Failed::new(
                    Failure::Transient,
                    format!("the executor panicked: {message}"),
                )),
            };
            verdicts[i] = Some(verdict);
        }
        {
            let mut pause = self.pause();
            if answered {
                *pause = Pause::default();
            } else if let Some(reason) = silence {
                pause.batches = pause.batches.saturating_add(1);
                let wait = outbox_core::backoff(
                    self.config.lane.backoff_base,
                    self.config.lane.backoff_max.min(PAUSE_MAX),
                    pause.batches - 1,
                );
                let until = Instant::now() + wait;
                // Workers that found the destination silent together resume together.
                pause.until = Some(pause.until.map_or(until, |u| u.max(until)));
                pause.reason = Some(outbox_core::escape(&reason).to_string());
            }
        }
        let unanswered = || {
            if expired.is_cancelled() {
                Verdict::Unconfirmed
            } else {
                Verdict::Deferred
            }
        };
        Ok(verdicts
            .into_iter()
            .map(|v| v.unwrap_or_else(unanswered))
            .collect())
    }

    async fn wait_until_answers(&self, shutdown: &CancellationToken) {
        let until = self.pause().until;
        if let Some(until) = until {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    async fn finish(&self, _remaining: Duration) -> Result<(), ProducerError> {
        Ok(())
    }

    fn last_error(&self) -> Option<String> {
        self.pause().reason.clone()
    }
}
