//! Reading an action's outcome back: the effect ledger.

use outbox_core::{EventId, TableNames};
use sqlx::PgConnection;

use crate::ProducerError;

/// Where an action stands, as its row says.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ActionState {
    /// Not performed yet: waiting for its turn, or for a retry after `attempts` attempts.
    Pending {
        /// Attempts charged so far.
        attempts: u32,
        /// Why the last attempt failed, if one did.
        last_error: Option<String>,
    },
    /// Performed; the destination's answer.
    Done(serde_json::Value),
    /// The destination rejected it ([`super::Outcome::Rejected`]); quarantined with the
    /// answer. An operator may requeue it (`outbox quarantine requeue`) or discard it.
    Rejected {
        /// The destination's answer.
        answer: serde_json::Value,
        /// Why (the row's `last_error`).
        reason: String,
    },
    /// Quarantined without an answer: retried `max_attempts` times, or refused for good
    /// before a call was made.
    GaveUp {
        /// Why (the row's `last_error`).
        reason: String,
    },
}

/// The state of the action with event id `id` in the outbox of `tables`, or `None` when no
/// dispatched action has that id (never enqueued, enqueued in a transaction that rolled back,
/// or pruned after it was done). Read it on the agent's connection, in its own transaction or
/// not: the state is committed (the dispatcher records a call's answer when it commits).
pub async fn outcome(
    conn: &mut PgConnection,
    tables: &TableNames,
    id: EventId,
) -> Result<Option<ActionState>, ProducerError> {
    let t = &tables.outbox;
    // The predicate of `outbox_events_dispatch_id_idx` (migration 0013), word for word.
    let row: Option<(String, i32, Option<String>, Option<serde_json::Value>)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT status, attempts, last_error, outcome FROM {t} \
             WHERE id = $1 AND topic LIKE 'dispatch:%' ORDER BY seq DESC LIMIT 1"
        )))
        .bind(id)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(
        |(status, attempts, last_error, outcome)| match (status.as_str(), outcome) {
            ("published", answer) => ActionState::Done(answer.unwrap_or(serde_json::Value::Null)),
            ("quarantined", Some(answer)) => ActionState::Rejected {
                answer,
                reason: last_error.unwrap_or_default(),
            },
            ("quarantined", None) => ActionState::GaveUp {
                reason: last_error.unwrap_or_default(),
            },
            _ => ActionState::Pending {
                attempts: u32::try_from(attempts).unwrap_or(0),
                last_error,
            },
        },
    ))
}
