//! A partition's batch: the messages queued when its worker got its turn, handled on one
//! transaction. Their ids go into the dedup table in one statement, and the handlers of the
//! new ones run in offset order on that transaction; one COMMIT covers them all, then the ids
//! are cached (the caller stores the offsets). Records that break the contract are quarantined
//! on the same transaction.
//!
//! Ids the cache does not know are almost always new (a redelivery follows a crash or a
//! rebalance), so the batch first inserts them plainly: `ON CONFLICT DO NOTHING` inserts each
//! row speculatively and confirms it, which made the dedup insert about 1.4 times as costly
//! (pgbench: 200 ids a transaction, 4 clients). An id already recorded fails that insert as a
//! unique violation; the batch is then rolled back and tried again with `ON CONFLICT DO
//! NOTHING RETURNING` (the ids returned are new), as are the consumer's batches after it until
//! one finds no id recorded.
//!
//! A failing handler must take no other message's effect with it and let none commit twice.
//! A savepoint per message would cost two more statements per message on every batch, failing
//! or not; instead the batch is rolled back and replayed: the messages before the failing one
//! as a batch again, the failing one alone under the failure policy (its failed run counted as
//! its first attempt), the rest as a new batch. A batch whose COMMIT (or one of the consumer's
//! own statements) the database rejects does not say which message is at fault, so each of its
//! messages is replayed alone, and the one at fault fails alone. So is a batch a handler left
//! unable to commit while returning `Ok` (it ignored a failed statement, or held the
//! connection until the server ended the session): a later handler's statement then fails
//! with 25P02 or 25P03, which blames no one, or the statement run before COMMIT does
//! (`ConsumerSql::holds_dedup_row`; without it, COMMIT would answer `ROLLBACK` silently).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;

use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use serde::de::DeserializeOwned;
use sqlx::error::ErrorKind;
use sqlx::{Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::consumer::bump;
use crate::decode::{self, Rejected};
use crate::dedup_transaction::{acquire_clean, check_open, left_open, run_handler};
use crate::failure::{
    AttemptError, handler_sql_error, is_connection_lost, is_inherited, is_outage, is_unavailable,
};
use crate::park::Aside;
use crate::permit::Turn;
use crate::slice::{SLICE_RETRIES, is_missing_slice};
use crate::{ConsumerError, DedupConsumer, Event, Handler, Outcome, quarantine, span};

/// A message, decoded, before a requeued copy for another consumer is settled.
pub(crate) enum Decoded<P> {
    Item(Item<P>),
    /// A copy requeued for other consumers (`requeue.rs`): their names, escaped, and its event
    /// id when one can be read. Skipped if this consumer handled that event, else quarantined.
    Copy(String, Option<Uuid>),
}

/// A message, decoded.
pub(crate) enum Item<P> {
    Rejected(Rejected),
    Cached,
    /// A requeued copy for another consumer (`requeue.rs`).
    NotForUs,
    Event(Event<P>),
    /// Behind its parked key (`park.rs`).
    Parked,
}

/// A failed attempt: the quarantine reason, the error, whether retrying could help.
type Failure = (&'static str, String, bool);

/// Why a batch did not commit (it was rolled back).
enum BatchFailure {
    /// The handler of the message at this index (in the batch) failed.
    Handler(usize, Failure),
    /// The database rejected the batch itself (its COMMIT, or one of the consumer's own
    /// statements): which message is at fault is unknown.
    Rejected,
    /// The database cannot be reached.
    Unavailable(sqlx::Error),
    /// The plain insert met an id already recorded: try again with `ON CONFLICT`.
    Recorded,
}

impl BatchFailure {
    fn from_statement(error: sqlx::Error) -> Self {
        if is_unavailable(&error) {
            Self::Unavailable(error)
        } else {
            // A statement's error can quote what a handler wrote (record text).
            tracing::warn!(error = %outbox_core::escape(&error.to_string()),
                "batch rejected by the database; replaying its messages one at a time");
            Self::Rejected
        }
    }
}

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// Handles `messages` (one partition's, in offset order) and returns their outcomes in
    /// order, ending early after an [`Outcome::Abandoned`] one. Once `owned` says the
    /// partition was revoked, no further message is handled: the rest are
    /// [`Outcome::Revoked`]. `Err` when the database cannot be reached: what had committed
    /// before stays committed (a retry finds it deduplicated), nothing is skipped.
    pub(crate) async fn handle_batch(
        &self,
        messages: &[OwnedMessage],
        shutdown: &CancellationToken,
        turn: &mut Turn<'_>,
        owned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Vec<Outcome>, ConsumerError> {
        let started = std::time::Instant::now();
        self.inner.know_session().await?;
        let mut items = self.decode_items(messages).await?;
        if let Some(first) = messages.first() {
            self.load_parks(first.topic(), first.partition()).await?;
            self.mark_parked(messages, &mut items, 0);
        }
        let n = items.len();
        let mut outcomes = Vec::with_capacity(n);
        let mut start = 0;
        // A handler that failed in a batch: where, and how. Its message is next handled alone.
        // Several can wait: a replay of the messages before one can fail another.
        let mut failed: BTreeMap<usize, Failure> = BTreeMap::new();
        let mut dropped = 0;
        // Set once a plain insert of this call met a recorded id, so it is not tried again
        // whatever other partitions' batches found meanwhile.
        let mut recorded = false;
        while start < n {
            if !owned() {
                outcomes.resize(n, Outcome::Revoked);
                break;
            }
            if let Some(failure) = failed.remove(&start) {
                let outcome = self
                    .alone(
                        &messages[start],
                        &items[start],
                        shutdown,
                        turn,
                        owned,
                        Some(failure),
                    )
                    .await?;
                start += 1;
                let abandoned = outcome == Outcome::Abandoned;
                if matches!(outcome, Outcome::Parked(_)) {
                    self.mark_parked(messages, &mut items, start);
                }
                outcomes.push(outcome);
                if abandoned {
                    break;
                }
                continue;
            }
            let end = failed.keys().next().copied().unwrap_or(n);
            match self
                .try_batch(&messages[start..end], &items[start..end], owned, recorded)
                .await
            {
                // Ended early: the partition was revoked (seen at the loop's top).
                Ok(done) => {
                    start += done.len();
                    outcomes.extend(done);
                }
                // Its slice was pruned since it was seen: the next try makes it again.
                Err(BatchFailure::Unavailable(error))
                    if is_missing_slice(&error) && dropped < SLICE_RETRIES =>
                {
                    dropped += 1;
                }
                Err(BatchFailure::Unavailable(error)) => return Err(error.into()),
                Err(BatchFailure::Recorded) => recorded = true,
                Err(BatchFailure::Handler(index, failure)) => {
                    failed.insert(start + index, failure);
                }
                Err(BatchFailure::Rejected) => {
                    while start < end && owned() {
                        let outcome = self
                            .alone(&messages[start], &items[start], shutdown, turn, owned, None)
                            .await?;
                        if matches!(outcome, Outcome::Parked(_)) {
                            self.mark_parked(messages, &mut items, start + 1);
                        }
                        let abandoned = outcome == Outcome::Abandoned;
                        outcomes.push(outcome);
                        if abandoned {
                            return Ok(self.metered(outcomes, started));
                        }
                        start += 1;
                    }
                }
            }
        }
        Ok(self.metered(outcomes, started))
    }

    /// Records the metrics of a call's final `outcomes`, and the counters of the outcomes
    /// that involve no transaction: a batch decoded again after an outage, or revoked, counts
    /// nothing twice.
    fn metered(&self, outcomes: Vec<Outcome>, started: std::time::Instant) -> Vec<Outcome> {
        let inner = &*self.inner;
        let name = &inner.name;
        let seconds = started.elapsed().as_secs_f64();
        for outcome in &outcomes {
            match outcome {
                Outcome::DuplicateCached => bump(&inner.counters.duplicates_cached),
                Outcome::NotForUs => bump(&inner.counters.not_for_us),
                _ => {}
            }
            crate::consumer::record_metric(name, outcome);
            metrics::histogram!("outbox_consumer_message_seconds", "consumer" => name.clone())
                .record(seconds);
        }
        outcomes
    }

    /// Marks the items from `from` on whose key is parked, or is parked by a record before
    /// them that breaks the contract (it parks its key when set aside): they are parked
    /// behind it, in order. Rolled back with their batch, they are marked the same again.
    fn mark_parked(&self, messages: &[OwnedMessage], items: &mut [Item<P>], from: usize) {
        let Some(first) = messages.first() else {
            return;
        };
        let (topic, partition) = (first.topic(), first.partition());
        let parks = &self.inner.parks;
        // A record that breaks the contract parks its key under `ParkKey` only; keys parked
        // before stay parked under any policy.
        let heads = self.inner.config.on_handler_failure == crate::HandlerFailurePolicy::ParkKey;
        // The common case, with nothing parked: one look.
        let rejected = || {
            items[from..]
                .iter()
                .any(|item| matches!(item, Item::Rejected(_)))
        };
        let may_park = parks.any(topic, partition) || (heads && rejected());
        if !may_park {
            return;
        }
        let mut parking: HashSet<&[u8]> = HashSet::new();
        for (message, item) in messages.iter().zip(items.iter_mut()).skip(from) {
            let Some(key) = crate::park::key_of(message) else {
                continue;
            };
            // A copy requeued for another consumer is not in this consumer's order of the key.
            if matches!(item, Item::Cached | Item::NotForUs)
                || matches!(item, Item::Rejected(rejected) if !rejected.parks())
            {
                continue;
            }
            if parking.contains(key) || parks.contains(topic, partition, key) {
                *item = Item::Parked;
            } else if heads && matches!(item, Item::Rejected(_)) {
                parking.insert(key);
            }
        }
    }

    /// `messages` decoded, and the copies among them requeued for other consumers settled
    /// (`requeue.rs`): skipped where this consumer recorded the event's id, quarantined as
    /// `requeue_unseen` where it did not. `Err` when the database cannot be reached.
    pub(crate) async fn decode_items(
        &self,
        messages: &[OwnedMessage],
    ) -> Result<Vec<Item<P>>, ConsumerError> {
        let decoded: Vec<Decoded<P>> = messages.iter().map(|m| self.decode_item(m)).collect();
        let ids: Vec<Uuid> = decoded
            .iter()
            .filter_map(|d| match d {
                Decoded::Copy(_, id) => *id,
                Decoded::Item(_) => None,
            })
            .collect();
        let inner = &*self.inner;
        let mut recorded: HashSet<Uuid> = if ids.is_empty() {
            HashSet::new()
        } else {
            // On a connection no handler left a transaction open on: its snapshot could be
            // older than the original's dedup row.
            let mut conn = crate::dedup_transaction::acquire_clean(&inner.pool).await?;
            sqlx::query_scalar(inner.sql().find_recorded.clone())
                .bind(&inner.name)
                .bind(&ids)
                .fetch_all(&mut *conn)
                .await?
                .into_iter()
                .collect()
        };
        // An original earlier in this batch is this consumer's to handle now: its copy is
        // seen (a consumer behind by more than the requeue fetches both at once).
        let settle = |(message, decoded): (&OwnedMessage, Decoded<P>)| match decoded {
            Decoded::Item(item) => {
                if let Item::Event(event) = &item {
                    recorded.insert(*event.id.as_uuid());
                }
                item
            }
            Decoded::Copy(targets, Some(id)) if recorded.contains(&id) => {
                tracing::info!(consumer = %inner.name, topic = message.topic(),
                    partition = message.partition(), offset = message.offset(),
                    for_consumers = %targets, "requeued copy for another consumer; skipped");
                Item::NotForUs
            }
            Decoded::Copy(targets, id) => Item::Rejected(crate::requeue::unseen(&targets, id)),
        };
        Ok(messages.iter().zip(decoded).map(settle).collect())
    }

    fn decode_item(&self, message: &OwnedMessage) -> Decoded<P> {
        let inner = &*self.inner;
        // Read once: the requeue check and the decoder look at the same headers.
        let read = crate::headers::read(message);
        if let Some(targets) = crate::requeue::for_another(&inner.name, &read) {
            let id = crate::requeue::event_id(&read);
            return match id {
                Some(id) if inner.cache.contains_key(&id) => Decoded::Item(Item::NotForUs),
                id => Decoded::Copy(targets, id),
            };
        }
        Decoded::Item(match decode::decode(&inner.config, message, &read) {
            Err(rejected) => Item::Rejected(rejected),
            Ok(event) if inner.cache.contains_key(event.id.as_uuid()) => {
                tracing::debug!(consumer = %inner.name, event_id = %event.id, "duplicate (cache)");
                Item::Cached
            }
            Ok(event) => Item::Event(event),
        })
    }

    /// One message on its own transaction, retried under the failure policy while the
    /// partition is `owned`.
    pub(crate) async fn alone(
        &self,
        message: &OwnedMessage,
        item: &Item<P>,
        shutdown: &CancellationToken,
        turn: &mut Turn<'_>,
        owned: &(dyn Fn() -> bool + Send + Sync),
        failed: Option<Failure>,
    ) -> Result<Outcome, ConsumerError> {
        if !owned() {
            return Ok(Outcome::Revoked);
        }
        match item {
            Item::Cached => Ok(Outcome::DuplicateCached),
            Item::NotForUs => Ok(Outcome::NotForUs),
            Item::Rejected(rejected) => {
                let Rejected {
                    reason,
                    error,
                    event_id,
                } = rejected;
                let aside = self.aside_for(message, rejected);
                self.set_aside_as(aside, message, *event_id, reason, error)
                    .await
            }
            Item::Parked => {
                self.set_aside_as(
                    Aside::Park { head: false },
                    message,
                    None,
                    crate::park::KEY_PARKED,
                    "its key is parked",
                )
                .await
            }
            Item::Event(event) => {
                self.handle_until_done(message, event, shutdown, turn, owned, failed)
                    .instrument(span::message_span(&self.inner.name, message))
                    .await
            }
        }
    }

    /// One transaction for every message of `items` (up to where `owned` turns false), or
    /// none. `recorded`: some of the ids may be recorded already (see the module's docs).
    async fn try_batch(
        &self,
        messages: &[OwnedMessage],
        items: &[Item<P>],
        owned: &(dyn Fn() -> bool + Send + Sync),
        recorded: bool,
    ) -> Result<Vec<Outcome>, BatchFailure> {
        let inner = &*self.inner;
        let mut ids: Vec<Uuid> = Vec::with_capacity(items.len());
        let mut seen = HashSet::with_capacity(items.len());
        for item in items {
            if let Item::Event(event) = item
                && seen.insert(*event.id.as_uuid())
            {
                ids.push(*event.id.as_uuid());
            }
        }
        if ids.is_empty()
            && !items
                .iter()
                .any(|i| matches!(i, Item::Rejected(_) | Item::Parked))
        {
            let skipped = |i: &Item<P>| match i {
                Item::NotForUs => Outcome::NotForUs,
                _ => Outcome::DuplicateCached,
            };
            return Ok(items.iter().map(skipped).collect());
        }
        let place = inner.placement();
        let slices: Vec<i32> = ids.iter().map(|id| place.slice(id)).collect();
        let missing = inner
            .ensure_slices(slices.iter().copied())
            .await
            .map_err(BatchFailure::Unavailable)?;
        let mut conn = acquire_clean(&inner.pool)
            .await
            .map_err(BatchFailure::from_statement)?;
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(BatchFailure::from_statement)?;
        bump(&inner.counters.transactions);
        // Days whose slice is missing, and not ours to make: their fallback (`slice.rs`).
        let slices = inner
            .fall_back(&mut tx, &missing, slices)
            .await
            .map_err(BatchFailure::from_statement)?;
        // Late ids (dated on the window's oldest day or before) found in any slice are
        // duplicates (`slice.rs`).
        let (ids, slices) = inner
            .without_recorded_late(&mut tx, &place, ids, slices)
            .await
            .map_err(BatchFailure::from_statement)?;
        let new = match self.insert_ids(&mut tx, &ids, &slices, recorded).await {
            Ok(new) => new,
            Err(failure) => {
                if matches!(failure, BatchFailure::Recorded) {
                    tx.rollback().await.map_err(BatchFailure::from_statement)?;
                }
                return Err(failure);
            }
        };
        let mut outcomes = self
            .run_items(&mut tx, messages, items, &new, (&ids, &slices), owned)
            .await;
        // The first message processed: its dedup row tells whether the transaction open now
        // is the one that inserted the batch's rows.
        let first = outcomes.as_ref().ok().and_then(|done| {
            let at = done.iter().position(|o| *o == Outcome::Processed)?;
            let Item::Event(event) = &items[at] else {
                return None;
            };
            let id = *event.id.as_uuid();
            Some((id, slices[ids.iter().position(|i| *i == id)?]))
        });
        let processed: Vec<usize> = outcomes.as_ref().map_or_else(
            |_| Vec::new(),
            |done| {
                (0..done.len())
                    .filter(|&i| done[i] == Outcome::Processed)
                    .collect()
            },
        );
        if let Some((id, slice)) = first {
            outcomes = match check_open(inner, &mut tx, id, slice, None).await {
                Ok(()) => outcomes,
                Err(AttemptError::Unavailable(error)) => Err(BatchFailure::Unavailable(error)),
                // With one handler run, this was its attempt (counted as the one-message path
                // counts it, so `max_attempts` means handler runs either way).
                Err(AttemptError::Failed {
                    reason,
                    error,
                    retry,
                }) if processed.len() == 1 => {
                    Err(BatchFailure::Handler(processed[0], (reason, error, retry)))
                }
                // Which handler left it so is unknown: each message is replayed alone, and
                // that one's check fails there.
                Err(AttemptError::Failed { error, .. }) => {
                    tracing::warn!(consumer = %inner.name, error = %outbox_core::escape(&error),
                        "a handler left the batch's transaction unable to commit; replaying its messages one at a time");
                    Err(BatchFailure::Rejected)
                }
            };
        }
        let outcomes = match outcomes {
            Ok(outcomes) => outcomes,
            Err(failure) => {
                // Dropping the transaction would roll it back too, but later: the connection
                // goes back to the pool clean (or closed, if a handler left a transaction of
                // its own open: `left_open`), or the outage is known now.
                let rolled_back = tx.rollback().await;
                left_open(&mut conn);
                if let Err(error) = rolled_back
                    && is_outage(&inner.pool, &error).await
                {
                    return Err(BatchFailure::Unavailable(error));
                }
                return Err(failure);
            }
        };
        if first.is_none() && !new.is_empty() {
            // Ids recorded, none processed (their handlers were cut short by a revocation):
            // no check ran to let this COMMIT through the gate (migration 0015).
            sqlx::query(inner.sql().allow_commit.clone())
                .bind(inner.search_path())
                .execute(&mut *tx)
                .await
                .map_err(BatchFailure::from_statement)?;
        }
        tx.commit().await.map_err(BatchFailure::from_statement)?;
        if left_open(&mut conn) {
            // Which handler did it is unknown: each message is replayed alone.
            return Err(BatchFailure::Rejected);
        }
        self.committed(messages, items, &outcomes).await;
        Ok(outcomes)
    }

    /// Records `ids` in the dedup table and returns those that were new: all of them with a
    /// plain insert, unless `recorded` or a recent batch says some may not be.
    async fn insert_ids(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        ids: &[Uuid],
        slices: &[i32],
        recorded: bool,
    ) -> Result<HashSet<Uuid>, BatchFailure> {
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        let inner = &*self.inner;
        let failed = |e: sqlx::Error| {
            if inner.missing_slice(&e) {
                BatchFailure::Unavailable(e)
            } else {
                BatchFailure::from_statement(e)
            }
        };
        if recorded || inner.expect_duplicates.load(Ordering::Relaxed) {
            let new: HashSet<Uuid> = sqlx::query_scalar(inner.sql().insert_dedup_batch.clone())
                .bind(&inner.name)
                .bind(ids)
                .bind(slices)
                .fetch_all(&mut **tx)
                .await
                .map_err(failed)?
                .into_iter()
                .collect();
            if new.len() == ids.len() {
                inner.expect_duplicates.store(false, Ordering::Relaxed);
            }
            return Ok(new);
        }
        match sqlx::query(inner.sql().insert_new_dedup_batch.clone())
            .bind(&inner.name)
            .bind(ids)
            .bind(slices)
            .execute(&mut **tx)
            .await
        {
            Ok(_) => Ok(ids.iter().copied().collect()),
            Err(sqlx::Error::Database(e)) if e.kind() == ErrorKind::UniqueViolation => {
                tracing::debug!(consumer = %inner.name, "batch meets a recorded id; inserting with ON CONFLICT");
                inner.expect_duplicates.store(true, Ordering::Relaxed);
                Err(BatchFailure::Recorded)
            }
            Err(e) => Err(failed(e)),
        }
    }

    /// Every message's statements, in offset order: the handlers of the ids `new` holds (once
    /// each), the quarantine rows of rejected records. Stops before the first message found
    /// revoked (`owned`): the dedup rows of those not handled are deleted again.
    async fn run_items(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        messages: &[OwnedMessage],
        items: &[Item<P>],
        new: &HashSet<Uuid>,
        (ids, slices): (&[Uuid], &[i32]),
        owned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Vec<Outcome>, BatchFailure> {
        let inner = &*self.inner;
        let mut outcomes = Vec::with_capacity(items.len());
        let mut handled = HashSet::with_capacity(new.len());
        for (index, (message, item)) in messages.iter().zip(items).enumerate() {
            if !owned() {
                let unhandled: Vec<Uuid> = new.difference(&handled).copied().collect();
                // Each where it was inserted (its own slice, or a fallback).
                let slices: Vec<i32> = unhandled
                    .iter()
                    .filter_map(|id| Some(slices[ids.iter().position(|i| i == id)?]))
                    .collect();
                sqlx::query(inner.sql().delete_dedup_batch.clone())
                    .bind(&inner.name)
                    .bind(&unhandled)
                    .bind(&slices)
                    .execute(&mut **tx)
                    .await
                    .map_err(BatchFailure::from_statement)?;
                break;
            }
            let outcome = match item {
                Item::Cached => Outcome::DuplicateCached,
                Item::NotForUs => Outcome::NotForUs,
                Item::Rejected(rejected) => self.record_rejected(tx, message, rejected).await?,
                Item::Parked => self.record_parked(tx, message).await?,
                Item::Event(event)
                    if new.contains(event.id.as_uuid()) && handled.insert(*event.id.as_uuid()) =>
                {
                    let handled = run_handler(&inner.handler, event, tx)
                        .instrument(span::message_span(&inner.name, message))
                        .await;
                    if let Err(error) = handled {
                        return Err(self.handler_failed(index, error).await);
                    }
                    Outcome::Processed
                }
                Item::Event(_) => Outcome::DuplicateStored,
            };
            outcomes.push(outcome);
        }
        Ok(outcomes)
    }

    /// The handler of the message at `index` failed. An error saying the transaction was
    /// unable to commit before its statement (aborted, or its session ended) may be an earlier
    /// handler's doing, one that returned `Ok`: the batch is then replayed a message at a
    /// time, so that the one at fault fails alone.
    async fn handler_failed(&self, index: usize, error: crate::HandlerError) -> BatchFailure {
        if let Some(sql) = handler_sql_error(&error) {
            if is_inherited(sql) {
                return BatchFailure::Rejected;
            }
            // Its connection was lost with the database still answering: the session may
            // have been ended while an earlier handler held it.
            if is_connection_lost(sql) && !is_outage(&self.inner.pool, sql).await {
                return BatchFailure::Rejected;
            }
        }
        match AttemptError::from_handler(error) {
            AttemptError::Unavailable(error) => BatchFailure::Unavailable(error),
            AttemptError::Failed {
                reason,
                error,
                retry,
            } => BatchFailure::Handler(index, (reason, error, retry)),
        }
    }

    /// Sets a record that breaks the contract aside on the batch's transaction: its outcome
    /// once that commits.
    async fn record_rejected(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: &OwnedMessage,
        rejected: &Rejected,
    ) -> Result<Outcome, BatchFailure> {
        let entry = quarantine::Entry {
            consumer: &self.inner.name,
            event_id: rejected.event_id,
            reason: rejected.reason,
            error: &rejected.error,
        };
        self.record_aside(tx, message, self.aside_for(message, rejected), entry)
            .await
    }

    /// Where a record that breaks the contract goes: it parks its key under `ParkKey`, unless
    /// it is a copy requeued for another consumer (`requeue.rs`), which has no place in this
    /// consumer's order of the key.
    fn aside_for(&self, message: &OwnedMessage, rejected: &Rejected) -> Aside {
        if rejected.parks() {
            Aside::of(&self.inner, message)
        } else {
            Aside::Quarantine
        }
    }

    /// Parks a record behind its parked key on the batch's transaction.
    async fn record_parked(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: &OwnedMessage,
    ) -> Result<Outcome, BatchFailure> {
        let entry = quarantine::Entry {
            consumer: &self.inner.name,
            event_id: None,
            reason: crate::park::KEY_PARKED,
            error: "its key is parked",
        };
        self.record_aside(tx, message, Aside::Park { head: false }, entry)
            .await
    }

    async fn record_aside(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: &OwnedMessage,
        aside: Aside,
        entry: quarantine::Entry<'_>,
    ) -> Result<Outcome, BatchFailure> {
        let reason = quarantine::store(tx, aside.sql(&self.inner), message, entry)
            .await
            .map_err(BatchFailure::from_statement)?;
        Ok(match aside {
            Aside::Quarantine => Outcome::Quarantined(reason),
            Aside::Park { .. } => Outcome::Parked(reason),
        })
    }

    /// After the batch's COMMIT: remember its ids, count and log what it did.
    async fn committed(&self, messages: &[OwnedMessage], items: &[Item<P>], outcomes: &[Outcome]) {
        let inner = &*self.inner;
        for ((message, item), outcome) in messages.iter().zip(items).zip(outcomes) {
            match (item, outcome) {
                (Item::Event(event), Outcome::Processed) => {
                    inner.cache.insert(*event.id.as_uuid(), ()).await;
                    bump(&inner.counters.processed);
                    tracing::debug!(consumer = %inner.name, event_id = %event.id, topic = %event.topic,
                        partition = event.partition, offset = event.offset, "processed");
                }
                (Item::Event(event), _) => {
                    inner.cache.insert(*event.id.as_uuid(), ()).await;
                    bump(&inner.counters.duplicates_stored);
                    tracing::debug!(consumer = %inner.name, event_id = %event.id, "duplicate (dedup table)");
                }
                (Item::Rejected(rejected), Outcome::Quarantined(reason)) => {
                    self.set(Aside::Quarantine, message, reason, &rejected.error);
                }
                (Item::Rejected(rejected), Outcome::Parked(reason)) => {
                    self.set(Aside::Park { head: true }, message, reason, &rejected.error);
                }
                (Item::Parked, Outcome::Parked(reason)) => {
                    self.set(Aside::Park { head: false }, message, reason, "");
                }
                (Item::Rejected(_) | Item::Parked | Item::Cached | Item::NotForUs, _) => {}
            }
        }
    }
}
