//! What an executor is given ([`Action`]) and what it answers ([`Outcome`]).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::EventId;
use serde::de::DeserializeOwned;

/// One decided action, as the agent enqueued it: handed to the [`Executor`] once per attempt.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Action {
    /// The event id: the same on every attempt, forwarded as the idempotency key.
    pub id: EventId,
    /// The destination this action was enqueued for (`NewEvent::for_dispatcher`).
    pub destination: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id: a key's actions are performed one at a time, in commit order.
    pub key: String,
    /// The action's type (the event type).
    pub action_type: String,
    /// The payload, as enqueued.
    pub payload: serde_json::Value,
    /// The application's headers, as enqueued (any JSON the row holds).
    pub headers: serde_json::Value,
    /// When the transaction that decided it wrote it.
    pub created_at: DateTime<Utc>,
    /// Attempts made before this one (0 on the first call). An attempt that ended without an
    /// answer (a timeout, a crash) counts too when it was recorded, so a call with
    /// `attempt > 0` may find its effect already applied: the idempotency key is what makes
    /// it apply once.
    pub attempt: u32,
}

impl Action {
    /// The key that makes repeated calls of this action apply once: its event id, the same on
    /// every attempt and after any crash. Send it as the API's idempotency key
    /// (`Idempotency-Key` for HTTP APIs).
    pub fn idempotency_key(&self) -> String {
        self.id.to_string()
    }

    /// The payload as `T`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.payload)
    }
}

/// What became of one call, as the executor tells it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The effect is applied; `answer` is the destination's answer (an invoice id, a status),
    /// stored with the action in the statement that marks it done, and read back with
    /// [`super::outcome`].
    Done(serde_json::Value),
    /// The outcome is unknown or the call failed for now (a 5xx, a timeout, a reset
    /// connection): the same call is made again, with the same key, after a backoff (at least
    /// `after` when the destination said so), counted against `max_attempts`.
    Retry {
        /// Why; stored as the row's `last_error`.
        reason: String,
        /// The wait the destination asked for (`Retry-After`), if any.
        after: Option<Duration>,
    },
    /// The destination refused this call and retrying cannot change that (a 4xx): the action
    /// is quarantined at once with the answer.
    Rejected {
        /// Why; stored as the row's `last_error`.
        reason: String,
        /// The destination's answer, stored as the action's outcome.
        answer: serde_json::Value,
    },
    /// The destination did not answer at all (connection refused, no route): nothing is known
    /// about this action, and nothing is charged to it. When no call of a batch got an answer,
    /// the dispatcher pauses as a whole and tries again; when others did, this action waits
    /// (its key held back) like one whose call was refused for now.
    Unavailable {
        /// Why; logged and stored as the row's `last_error`.
        reason: String,
    },
}

impl Outcome {
    /// [`Outcome::Done`].
    pub fn done(answer: impl Into<serde_json::Value>) -> Self {
        Self::Done(answer.into())
    }

    /// [`Outcome::Retry`] with no wait asked for.
    pub fn retry(reason: impl Into<String>) -> Self {
        Self::Retry {
            reason: reason.into(),
            after: None,
        }
    }

    /// [`Outcome::Retry`] after at least `after`.
    pub fn retry_after(reason: impl Into<String>, after: Duration) -> Self {
        Self::Retry {
            reason: reason.into(),
            after: Some(after),
        }
    }

    /// [`Outcome::Rejected`].
    pub fn rejected(reason: impl Into<String>, answer: impl Into<serde_json::Value>) -> Self {
        Self::Rejected {
            reason: reason.into(),
            answer: answer.into(),
        }
    }

    /// [`Outcome::Unavailable`].
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable {
            reason: reason.into(),
        }
    }
}

/// Performs actions: a plain `async fn(Action) -> Outcome` is one, and so is any type with
/// this trait (the HTTP executor, feature `http`).
///
/// The dispatcher calls it at least once per action; a call can be repeated after a timeout,
/// a crash between the call and the record, or a shutdown during the call, always with the
/// same [`Action::idempotency_key`]. It bounds each call by `call_timeout` and catches a
/// panic (both count as [`Outcome::Retry`]).
pub trait Executor: Send + Sync + 'static {
    /// Performs `action` and says what became of it.
    fn execute(&self, action: Action) -> impl Future<Output = Outcome> + Send;
}

impl<F, Fut> Executor for F
where
    F: Fn(Action) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send,
{
    fn execute(&self, action: Action) -> impl Future<Output = Outcome> + Send {
        self(action)
    }
}
