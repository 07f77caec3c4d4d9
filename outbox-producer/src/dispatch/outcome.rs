//! Reading an action's outcome back: the effect ledger.

use outbox_core::{EventId, TableNames};
use sqlx::PgConnection;

use crate::ProducerError;

/// Where an action stands, as its row says. Every action ends in one of `Done`, `Rejected`,
/// `NeverSent` or `Unknown` (within `max_age` of its decision); only `NeverSent` lets the
/// agent decide again without asking the API.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ActionState {
    /// Not performed yet: waiting for its turn, its call in flight, or waiting for a retry.
    Pending {
        /// Attempts charged so far (a call in flight counts once it failed).
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
    /// Given up, and no call was ever made that could have applied it (refused before any
    /// call, or every call refused unsent): deciding again is safe.
    NeverSent {
        /// Why (the row's `last_error`).
        reason: String,
    },
    /// Given up after calls that may have applied it (timeouts, 5xx, cut connections, and the
    /// destination could not say): resolve it by asking the API with the action's idempotency
    /// key, never by deciding again (a new decision is a new key, and may apply twice).
    Unknown {
        /// Calls made that may have applied it.
        attempts: u32,
        /// Why it was given up (the row's `last_error`).
        last_error: String,
    },
}

/// The state of the action with event id `id` in the outbox of `tables`, or `None` when no
/// dispatched action has that id (never enqueued, enqueued in a transaction that rolled back,
/// or pruned after it was done). Read it on the agent's connection, in its own transaction or
/// not: the state is committed (the dispatcher records a call's answer when it commits). An
/// answer serde_json cannot read (another writer's JSONB) fails this call alone.
pub async fn outcome(
    conn: &mut PgConnection,
    tables: &TableNames,
    id: EventId,
) -> Result<Option<ActionState>, ProducerError> {
    let t = &tables.outbox;
    // The predicate of `outbox_events_dispatch_id_idx` (migration 0013), word for word.
    // status, attempts, calls, last_error, outcome (as text: parsed here, for this row alone)
    type Row = (String, i32, i32, Option<String>, Option<String>);
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, attempts - CASE WHEN lease IS NULL THEN 0 ELSE 1 END, calls, \
                last_error, outcome::text FROM {t} \
             WHERE id = $1 AND topic LIKE 'dispatch:%' ORDER BY seq DESC LIMIT 1"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?;
    let Some((status, attempts, calls, last_error, answer)) = row else {
        return Ok(None);
    };
    let answer = answer
        .map(|text| serde_json::from_str(&text))
        .transpose()
        .map_err(|e| ProducerError::Unreadable(format!("the answer of action {id}: {e}")))?;
    let count = |n: i32| u32::try_from(n).unwrap_or(0);
    Ok(Some(match (status.as_str(), answer) {
        ("published", answer) => ActionState::Done(answer.unwrap_or(serde_json::Value::Null)),
        ("quarantined", Some(answer)) => ActionState::Rejected {
            answer,
            reason: last_error.unwrap_or_default(),
        },
        ("quarantined", None) if calls == 0 => ActionState::NeverSent {
            reason: last_error.unwrap_or_default(),
        },
        ("quarantined", None) => ActionState::Unknown {
            attempts: count(calls),
            last_error: last_error.unwrap_or_default(),
        },
        _ => ActionState::Pending {
            attempts: count(attempts),
            last_error,
        },
    }))
}
