//! What an executor is given ([`Action`]) and what it answers ([`Outcome`]).

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::EventId;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

/// One decided action, as the agent enqueued it: handed to the [`Executor`] once per attempt.
#[derive(Debug, Clone)]
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
    /// The payload, as its stored JSON text: numbers keep every digit (`100000000000000000001`
    /// is not rounded to `1e20`), however deep it nests. Read it with [`Self::payload_as`].
    pub payload: Box<RawValue>,
    /// The application's headers, as their stored JSON text (any JSON the row holds).
    pub headers: Box<RawValue>,
    /// When the transaction that decided it wrote it.
    pub created_at: DateTime<Utc>,
    /// Attempts made before this one (0 on the first call). An attempt that ended without an
    /// answer (a timeout, a crash) counts too when it was recorded, so a call with
    /// `attempt > 0` may find its effect already applied: the idempotency key is what makes
    /// it apply once.
    pub attempt: u32,
}

/// Equal when every field is, the payload and headers as their stored JSON text.
impl PartialEq for Action {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.destination == other.destination
            && self.aggregate_type == other.aggregate_type
            && self.key == other.key
            && self.action_type == other.action_type
            && self.payload.get() == other.payload.get()
            && self.headers.get() == other.headers.get()
            && self.created_at == other.created_at
            && self.attempt == other.attempt
    }
}

impl Action {
    /// The key that makes repeated calls of this action apply once: its event id, the same on
    /// every attempt and after any crash. Send it as the API's idempotency key
    /// (`Idempotency-Key` for HTTP APIs).
    pub fn idempotency_key(&self) -> String {
        self.id.to_string()
    }

    /// The payload as `T` (`serde_json::Value` for any JSON; deeper than 127 levels or a
    /// number outside `f64` fails here, for this action alone).
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.payload.get())
    }

    /// The headers as `T` (see [`Self::payload_as`]).
    pub fn headers_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.headers.get())
    }
}

/// What became of one call, as the executor tells it.
///
/// Whose failure it is decides what it costs: a failure every call of the destination gets (a
/// [`Outcome::Retry`] while no other call succeeds, [`Outcome::Unavailable`],
/// [`Outcome::RateLimited`]) is the destination's, and charges the action nothing; a failure
/// while the destination answers other calls is the action's own, charged an attempt.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The effect is applied; `answer` is the destination's answer (an invoice id, a status),
    /// stored with the action in the statement that marks it done, and read back with
    /// [`super::outcome`].
    Done(serde_json::Value),
    /// The outcome is unknown or the call failed for now (a 5xx, a timeout, a reset
    /// connection): the same call is made again, with the same key, after a backoff (at least
    /// `after` when the destination said so). Counted against `max_attempts` only while the
    /// destination answers other calls; while it fails them all, it is down: nothing is
    /// charged and the dispatcher probes it until a call succeeds.
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
    /// The destination did not take the call, and it was not applied (connection refused,
    /// no route, a TLS failure, credentials refused with 401/403/407): nothing is charged to
    /// the action. The dispatcher counts it against the destination's health (see
    /// [`Outcome`]); the action waits, its key held back, and is tried again.
    Unavailable {
        /// Why; logged and stored as the row's `last_error`.
        reason: String,
    },
    /// The destination limits the rate of calls (HTTP 429): not applied, nothing charged.
    /// The dispatcher slows down all its calls to the destination (halving its rate, then
    /// raising it again as calls succeed) and calls none before `after` has passed.
    RateLimited {
        /// Why; stored as the row's `last_error`.
        reason: String,
        /// The wait the destination asked for (`Retry-After`), honoured in full.
        after: Option<Duration>,
    },
    /// The executor refused the action before sending anything, and retrying cannot change
    /// that (a request that cannot be built, a plain-HTTP URL to another host): quarantined
    /// at once, and the agent reads [`super::ActionState::NeverSent`].
    NotSent {
        /// Why; stored as the row's `last_error`.
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

    /// [`Outcome::RateLimited`].
    pub fn rate_limited(reason: impl Into<String>, after: Option<Duration>) -> Self {
        Self::RateLimited {
            reason: reason.into(),
            after,
        }
    }

    /// [`Outcome::NotSent`].
    pub fn not_sent(reason: impl Into<String>) -> Self {
        Self::NotSent {
            reason: reason.into(),
        }
    }
}

/// Performs actions: a plain `async fn(Action) -> Outcome` is one, and so is any type with
/// this trait (the HTTP executor, feature `http`).
///
/// The dispatcher calls it at least once per action; a call can be repeated after a timeout,
/// a crash between the call and the record, or a shutdown during the call, always with the
/// same [`Action::idempotency_key`]. It bounds each call by `call_timeout` (a timeout counts
/// as [`Outcome::Retry`]) and catches a panic (the action's own failure, charged).
pub trait Executor: Send + Sync + 'static {
    /// Performs `action` and says what became of it.
    fn execute(&self, action: Action) -> impl Future<Output = Outcome> + Send;

    /// Asks the destination what became of `action`'s idempotency key, without performing
    /// it: `Some(Outcome::Done(answer))` if it was applied, `Some(Outcome::NotSent { .. })` if
    /// the destination knows it was not, `None` when it cannot tell (the default: no way to
    /// ask). The dispatcher asks before it gives up on an action whose calls may have applied
    /// (`max_attempts` or `max_age` reached) and before it calls again an action whose
    /// previous dispatcher stopped during its call (an expired lease).
    fn verify(&self, action: &Action) -> impl Future<Output = Option<Outcome>> + Send {
        let _ = action;
        std::future::ready(None)
    }
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
