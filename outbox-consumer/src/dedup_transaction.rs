//! The dedup transaction: the event id's row and the handler's effect commit together or not
//! at all, so a redelivered event finds its row and is skipped, and a failed attempt leaves
//! neither behind. Attempts that fail are retried with backoff until the failure policy says
//! otherwise; see [`crate::failure`] for what counts as a failed attempt.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdkafka::message::OwnedMessage;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use sqlx::PgConnection;
use uuid::Uuid;

use crate::consumer::bump;
use crate::failure::{
    AttemptError, Lost, describe, handler_sql_error, is_connection_lost, is_outage, lost_alone,
};
use crate::permit::Turn;
use crate::slice::{SLICE_RETRIES, is_missing_slice};
use crate::{
    ConsumerError, DedupConsumer, Event, Handler, HandlerError, HandlerFailurePolicy, Outcome,
};

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// Attempts `event` until it commits, is found to be a duplicate, or the failure policy
    /// gives up on it (quarantine, or its key parked). `Err` only when the database cannot be reached.
    /// `failed` is an attempt that already failed (in a batch), counted as the first.
    /// Once `owned` says the partition was revoked, it stops ([`Outcome::Revoked`]): the new
    /// owner handles the message, and a quarantine row here could contradict what it did.
    pub(crate) async fn handle_until_done(
        &self,
        message: &OwnedMessage,
        event: &Event<P>,
        shutdown: &CancellationToken,
        turn: &mut Turn<'_>,
        owned: &(dyn Fn() -> bool + Send + Sync),
        mut failed: Option<(&'static str, String, bool)>,
    ) -> Result<Outcome, ConsumerError> {
        let inner = &*self.inner;
        let config = &inner.config;
        let mut attempt = 0_u32;
        loop {
            attempt += 1;
            if !owned() {
                return Ok(Outcome::Revoked);
            }
            let (reason, error, retry) = match failed.take() {
                Some(failure) => failure,
                None => match self.attempt(event).await {
                    Ok(outcome) => return Ok(outcome),
                    Err(AttemptError::Unavailable(error)) => return Err(error.into()),
                    Err(AttemptError::Failed {
                        reason,
                        error,
                        retry,
                    }) => (reason, error, retry),
                },
            };
            self.count_failure(event, attempt, reason, &error);
            if !owned() {
                return Ok(Outcome::Revoked);
            }
            if !retry {
                return self
                    .set_aside(message, Some(*event.id.as_uuid()), reason, &error)
                    .await;
            }
            if config.on_handler_failure != HandlerFailurePolicy::Block
                && attempt >= config.max_attempts
            {
                let error = format!("after {attempt} attempts: {error}");
                return self
                    .set_aside(message, Some(*event.id.as_uuid()), reason, &error)
                    .await;
            }
            let delay = outbox_core::backoff(config.backoff_base, config.backoff_max, attempt - 1);
            if !turn.back_off(delay, shutdown).await? {
                return Ok(Outcome::Abandoned);
            }
        }
    }

    fn count_failure(&self, event: &Event<P>, attempt: u32, reason: &str, error: &str) {
        let inner = &*self.inner;
        bump(&inner.counters.handler_errors);
        metrics::counter!("outbox_consumer_handler_errors_total", "consumer" => inner.name.clone())
            .increment(1);
        // Handlers' errors quote their input (a header, payload text) as often as not.
        tracing::warn!(consumer = %inner.name, event_id = %event.id, attempt, reason,
            error = %outbox_core::escape(error), "attempt failed");
    }

    /// One transaction: the dedup row, the handler, COMMIT. Never raced against shutdown: an
    /// attempt that has begun runs to its commit or rollback.
    async fn attempt(&self, event: &Event<P>) -> Result<Outcome, AttemptError> {
        let mut dropped = 0;
        loop {
            match self.attempt_once(event).await {
                // Its slice was pruned since it was seen: the next try makes it again.
                Err(AttemptError::Unavailable(error))
                    if is_missing_slice(&error) && dropped < SLICE_RETRIES =>
                {
                    dropped += 1;
                }
                other => return other,
            }
        }
    }

    async fn attempt_once(&self, event: &Event<P>) -> Result<Outcome, AttemptError> {
        let inner = &*self.inner;
        let id = *event.id.as_uuid();
        let statement = |e| AttemptError::from_statement("transaction_failed", e);
        let place = inner.placement();
        let slice = place.slice(&id);
        let missing = inner
            .ensure_slices([slice])
            .await
            .map_err(AttemptError::Unavailable)?;
        let mut conn = acquire_clean(&inner.pool).await.map_err(statement)?;
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(statement)?;
        let began = Instant::now();
        bump(&inner.counters.transactions);
        // Its day's slice missing, and not ours to make: its fallback (`slice.rs`).
        let slice = inner
            .fall_back(&mut tx, &missing, vec![slice])
            .await
            .map_err(statement)?[0];
        // A late id (dated on the window's oldest day or before) found in any slice is a
        // duplicate (`slice.rs`).
        let (unrecorded, _) = inner
            .without_recorded_late(&mut tx, &place, vec![id], vec![slice])
            .await
            .map_err(statement)?;
        let inserted = if unrecorded.is_empty() {
            0
        } else {
            sqlx::query(inner.sql().insert_dedup.clone())
                .bind(&inner.name)
                .bind(id)
                .bind(slice)
                .execute(&mut *tx)
                .await
                .map_err(|e| {
                    if inner.missing_slice(&e) {
                        AttemptError::Unavailable(e)
                    } else {
                        statement(e)
                    }
                })?
                .rows_affected()
        };
        if inserted == 0 {
            // Whatever the rollback says, the committed row proves the event was handled.
            if let Err(error) = tx.rollback().await {
                tracing::debug!(%error, "rollback after a duplicate failed");
            }
            inner.cache.insert(id, ()).await;
            bump(&inner.counters.duplicates_stored);
            tracing::debug!(consumer = %inner.name, event_id = %event.id, "duplicate (dedup table)");
            return Ok(Outcome::DuplicateStored);
        }
        let verdict = match run_handler(&inner.handler, event, &mut tx).await {
            Err(error) => Err(handler_failure(inner, id, error, began.elapsed()).await),
            Ok(()) => check_open(inner, &mut tx, id, slice, Some(began)).await,
        };
        if let Err(failure) = verdict {
            let rolled_back = tx.rollback().await;
            left_open(&mut conn);
            if let Err(error) = rolled_back
                && is_outage(&inner.pool, &error).await
            {
                return Err(AttemptError::Unavailable(error));
            }
            return Err(failure);
        }
        // A failed COMMIT has ended the transaction on the server; dropping `tx` only sends a
        // ROLLBACK that finds nothing to undo.
        tx.commit()
            .await
            .map_err(|e| AttemptError::from_statement("commit_failed", e))?;
        if left_open(&mut conn) {
            return Err(AttemptError::Failed {
                reason: "handler_failed",
                error: "the handler left a transaction of its own open on the connection (a \
                        sqlx Transaction it neither committed nor dropped: mem::forget?), so \
                        the consumer's COMMIT only released its savepoint: nothing was \
                        committed, and the connection is closed"
                    .to_owned(),
                retry: true,
            });
        }
        inner.cache.insert(id, ()).await;
        bump(&inner.counters.processed);
        tracing::debug!(consumer = %inner.name, event_id = %event.id, topic = %event.topic,
            partition = event.partition, offset = event.offset, "processed");
        Ok(Outcome::Processed)
    }
}

/// Whether the connection is still in a transaction after the consumer's `COMMIT`: a handler
/// leaked a transaction it began (`conn.begin()`, then `mem::forget`), sqlx counted it, and
/// turned the consumer's `COMMIT` into a `RELEASE SAVEPOINT`. Nothing is committed then; the
/// connection is closed rather than returned to the pool, which rolls the whole transaction
/// back on the server (returned, it would have rolled back later, after the offsets were
/// stored: the messages lost).
pub(crate) fn left_open(conn: &mut sqlx::pool::PoolConnection<sqlx::Postgres>) -> bool {
    if !sqlx::Connection::is_in_transaction(&**conn) {
        return false;
    }
    conn.close_on_drop();
    tracing::warn!(
        "a handler left a transaction open; nothing it ran was committed, and its connection is closed"
    );
    true
}

/// A connection of `pool` that is in no transaction. One in a transaction was left so by a
/// handler that leaked one and then failed (its rollback undid only the leaked savepoint) or
/// by the application's own code: begun on it, the consumer's transaction would be a savepoint
/// of that one, and everything it did would roll back when the connection closes. Such a
/// connection is closed, and another taken.
pub(crate) async fn acquire_clean(
    pool: &sqlx::PgPool,
) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
    loop {
        let mut conn = pool.acquire().await?;
        if !left_open(&mut conn) {
            return Ok(conn);
        }
    }
}

/// Runs `handler` on `conn`. A panicking handler is a failing handler: it must not take the
/// partition down, whether it panics in its future or while making it.
pub(crate) async fn run_handler<P, H: Handler<P>>(
    handler: &H,
    event: &Event<P>,
    conn: &mut PgConnection,
) -> Result<(), HandlerError> {
    AssertUnwindSafe(async { handler.handle(event, conn).await })
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| {
            Err(HandlerError::retry(format!(
                "handler panicked: {}",
                panic_message(&*panic)
            )))
        })
}

/// Cuts from outside a message's transaction may take in a row before each further one
/// counts as an attempt: a network reset or a failover costs a message nothing, but a proxy's
/// or a NAT's idle limit below how long its handler holds the transaction (PgBouncer's
/// `idle_transaction_timeout`, SQLSTATE 08P01 to the client) cuts every try, and uncharged the
/// message was retried forever, its partition stalled with no handler error counted.
pub(crate) const CUTS_UNCHARGED: u32 = 5;

/// Most messages whose cuts [`Cuts`] remembers; past it, it starts over.
const CUTS_REMEMBERED: usize = 1024;

/// Connections cut from outside under each message's transaction, in a row.
#[derive(Debug, Default)]
pub(crate) struct Cuts(std::sync::Mutex<std::collections::HashMap<Uuid, u32>>);

impl Cuts {
    /// Counts a cut under `id`'s transaction; how many in a row it makes.
    fn cut(&self, id: Uuid) -> u32 {
        let mut cuts = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cuts.len() >= CUTS_REMEMBERED && !cuts.contains_key(&id) {
            cuts.clear();
        }
        let n = cuts.entry(id).or_default();
        *n = n.saturating_add(1);
        *n
    }

    fn forget(&self, id: Uuid) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
    }
}

/// What a connection lost under `id`'s transaction (`error`, `held` since it began) counts
/// as ([`lost_alone`]): an outage is retried uncharged, as is a cut from outside, until the
/// message's transactions were cut [`CUTS_UNCHARGED`] times in a row.
async fn lost_under<P, H>(
    inner: &crate::consumer::Inner<P, H>,
    id: Uuid,
    error: sqlx::Error,
    held: Duration,
    failure: impl FnOnce(sqlx::Error) -> AttemptError,
) -> AttemptError {
    match lost_alone(&inner.pool, &error, held).await {
        Lost::Outage => AttemptError::Unavailable(error),
        Lost::Cut => match inner.cuts.cut(id) {
            n if n <= CUTS_UNCHARGED => AttemptError::Unavailable(error),
            n => AttemptError::Failed {
                reason: "handler_failed",
                error: format!(
                    "the connection was cut under the message's transaction {n} times in a row \
                     while the database answered on others (a proxy's or a NAT's idle limit \
                     below how long the handler holds it?): {}",
                    describe(&error)
                ),
                retry: true,
            },
        },
        Lost::Failure => {
            inner.cuts.forget(id);
            failure(error)
        }
    }
}

/// What a handler's error counts as: [`AttemptError::from_handler`], except that the
/// transaction's connection lost under the handler is its failure if the server ended the
/// session for its holding it, or after repeated cuts ([`lost_under`]).
pub(crate) async fn handler_failure<P, H>(
    inner: &crate::consumer::Inner<P, H>,
    id: Uuid,
    error: HandlerError,
    held: Duration,
) -> AttemptError {
    let lost = handler_sql_error(&error)
        .filter(|e| is_connection_lost(e))
        .map(describe);
    match (AttemptError::from_handler(error), lost) {
        (AttemptError::Unavailable(error), Some(lost)) => {
            lost_under(inner, id, error, held, |_| AttemptError::Failed {
                reason: "handler_failed",
                error: lost,
                retry: true,
            })
            .await
        }
        (failure, _) => failure,
    }
}

/// Before COMMIT, after the handlers returned `Ok`: whether the transaction open on `conn`
/// is the one that inserted `id`'s dedup row (in `slice`), and can still commit. Postgres
/// answers COMMIT in an aborted transaction with `ROLLBACK` and no error, and sqlx does not
/// read that answer, so a handler that ignored a failed statement would otherwise pass for
/// committed; a handler that ran `ROLLBACK; BEGIN` would leave a transaction open without the
/// dedup rows or the effects before it. One statement per transaction, not per message.
/// `alone`: when the transaction of one message began (see `lost_under`); a batch's is
/// replayed a message at a time when its connection was lost with the database answering.
pub(crate) async fn check_open<P, H>(
    inner: &crate::consumer::Inner<P, H>,
    conn: &mut PgConnection,
    id: Uuid,
    slice: i32,
    alone: Option<Instant>,
) -> Result<(), AttemptError> {
    match sqlx::query_scalar::<_, bool>(inner.sql().holds_dedup_row.clone())
        .bind(&inner.name)
        .bind(id)
        .bind(slice)
        .bind(inner.search_path())
        .fetch_one(conn)
        .await
    {
        Ok(true) => Ok(()),
        Ok(false) => Err(AttemptError::aborted_by_handler(
            "the handler ended the transaction itself (its dedup row is not in the transaction \
             open at COMMIT)",
        )),
        Err(error) => Err(match alone {
            Some(began) => {
                lost_under(inner, id, error, began.elapsed(), |e| {
                    AttemptError::aborted_by_handler(&describe(&e))
                })
                .await
            }
            None if is_outage(&inner.pool, &error).await => AttemptError::Unavailable(error),
            None => AttemptError::aborted_by_handler(&describe(&error)),
        }),
    }
}

/// A panic's message, or what it was when it had none.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned())
}
