//! The consumer: its settings and counters, what happened to a message, its quarantine, and
//! the entry points for hand-driven loops (a batch's path is in `batch.rs`, one
//! message's retries in `dedup_transaction.rs`).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use moka::future::Cache;
use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use serde::de::DeserializeOwned;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::permit::Turn;
use crate::slice::{KnownSlices, Placement};
use crate::sql::ConsumerSql;
use crate::{ConsumerConfig, ConsumerError, Handler, quarantine};

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its transaction committed with the dedup row.
    Processed,
    /// The id was in the in-memory cache: skipped without touching the database.
    DuplicateCached,
    /// The dedup table already had the id: skipped.
    DuplicateStored,
    /// Stored in the quarantine table, with this reason: the record breaks the contract or a
    /// limit (`missing_id`, `invalid_id`, `ambiguous_id`, `ambiguous_type`, `invalid_header`,
    /// `invalid_header_name`: a header name that is not UTF-8 or has a NUL inside,
    /// `invalid_requeue_header`: an `outbox-requeue-for` header naming no consumer (no value,
    /// an empty one, or one that is not UTF-8), `requeue_unseen`: a copy requeued for another
    /// consumer, of an event this one never recorded,
    /// `invalid_key`, `missing_payload`, `invalid_json`, `wrong_shape`, `unknown_type`,
    /// `too_large`, `id_ahead`: a UUIDv7 id dated more than a day ahead of this machine's
    /// clock), or its attempts ran out (`handler_failed`: the handler returned an error
    /// or panicked; `handler_rejected`: it said [`HandlerError::Quarantine`](crate::HandlerError::Quarantine); `commit_failed`: the database rejected the COMMIT, e.g. a deferred
    /// constraint; `transaction_failed`: it rejected the consumer's own dedup statement).
    /// `quarantine_refused`: the database refused the full quarantine row; the message's
    /// bytes are stored alone, the original reason in the row's `error`.
    Quarantined(&'static str),
    /// Under [`HandlerFailurePolicy::ParkKey`](crate::HandlerFailurePolicy::ParkKey): stored
    /// in the park table behind its key, with this reason: one of [`Self::Quarantined`]'s,
    /// for the record that parked its key, or `key_parked` for a later record of a key
    /// parked already. Its offset is stored; the record is handled when the key is released.
    Parked(&'static str),
    /// Shutdown came while a blocked handler was still retrying; the offset is not stored.
    Abandoned,
    /// Not handled: its partition was revoked from this member after it was fetched (the
    /// partition's new owner reads it again from the committed offset).
    Revoked,
    /// Skipped: a copy an operator requeued for another consumer (its
    /// [`wire::HEADER_REQUEUE_FOR`](outbox_core::wire::HEADER_REQUEUE_FOR) names another), of
    /// an event this consumer recorded: no handler; its offset is stored.
    NotForUs,
}

/// Counters of a [`DedupConsumer`], cumulative since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Messages whose handler committed.
    pub processed: u64,
    /// Duplicates caught by the in-memory cache.
    pub duplicates_cached: u64,
    /// Duplicates caught by the dedup table.
    pub duplicates_stored: u64,
    /// Messages quarantined.
    pub quarantined: u64,
    /// Messages parked behind their key ([`Outcome::Parked`]).
    pub parked: u64,
    /// Parked messages replayed after their key's release, whatever came of each.
    pub replayed: u64,
    /// Failed attempts: a handler error, or its transaction rejected by the database (each
    /// attempt; an unreachable database is not counted).
    pub handler_errors: u64,
    /// Database transactions begun.
    pub transactions: u64,
    /// Queued messages dropped because their partition was revoked from this member before
    /// they were handled (the partition's next owner reads them again).
    pub revoked_skipped: u64,
    /// Requeued copies skipped because they were for another consumer ([`Outcome::NotForUs`]).
    pub not_for_us: u64,
    /// Bytes of fetched messages held now, not yet handled (see
    /// [`ConsumerConfig::prefetch_budget_bytes`]).
    pub prefetched_bytes: u64,
    /// The most [`Self::prefetched_bytes`] has been.
    pub prefetched_bytes_peak: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicates_cached: AtomicU64,
    pub(crate) duplicates_stored: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) parked: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) handler_errors: AtomicU64,
    pub(crate) transactions: AtomicU64,
    pub(crate) revoked_skipped: AtomicU64,
    pub(crate) not_for_us: AtomicU64,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Counts `outcome` for `consumer` in the process's metrics recorder (a no-op without one).
pub(crate) fn record_metric(consumer: &str, outcome: &Outcome) {
    let consumer = consumer.to_owned();
    match outcome {
        Outcome::Processed => {
            metrics::counter!("outbox_consumer_processed_total", "consumer" => consumer)
                .increment(1)
        }
        Outcome::DuplicateCached => {
            metrics::counter!("outbox_consumer_duplicates_total", "consumer" => consumer, "via" => "cache").increment(1);
        }
        Outcome::DuplicateStored => {
            metrics::counter!("outbox_consumer_duplicates_total", "consumer" => consumer, "via" => "table").increment(1);
        }
        Outcome::Quarantined(reason) => {
            metrics::counter!("outbox_consumer_quarantined_total", "consumer" => consumer, "reason" => *reason).increment(1);
        }
        Outcome::Parked(reason) => {
            metrics::counter!("outbox_consumer_parked_total", "consumer" => consumer, "reason" => *reason).increment(1);
        }
        Outcome::NotForUs => {
            metrics::counter!("outbox_consumer_not_for_us_total", "consumer" => consumer)
                .increment(1);
        }
        Outcome::Abandoned | Outcome::Revoked => {}
    }
}

/// Runs a handler once per (consumer name, event id), however often Kafka delivers the event.
///
/// For each batch of one partition's messages: decode under the wire contract (or quarantine);
/// skip ids in the in-memory cache; in one transaction, insert the other ids into the dedup
/// table (a plain insert; when an id is already recorded, the batch is done again with `ON
/// CONFLICT DO NOTHING RETURNING`: an id not returned is a duplicate, skipped) and run the
/// handler of each new one on the same transaction, then commit and remember the ids.
/// Cheap to clone.
pub struct DedupConsumer<P, H> {
    pub(crate) inner: Arc<Inner<P, H>>,
}

impl<P, H> Clone for DedupConsumer<P, H> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<P, H> std::fmt::Debug for DedupConsumer<P, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupConsumer")
            .field("name", &self.inner.name)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner<P, H> {
    pub(crate) name: String,
    pub(crate) config: ConsumerConfig,
    pub(crate) pool: PgPool,
    pub(crate) handler: H,
    pub(crate) cache: Cache<Uuid, ()>,
    /// The statements, unqualified: until [`Self::session`] is known.
    pub(crate) sql: ConsumerSql,
    pub(crate) session: std::sync::OnceLock<Session>,
    pub(crate) slices: KnownSlices,
    pub(crate) counters: Counters,
    /// Whether a recent batch met an id already recorded: batches then insert their ids with
    /// `ON CONFLICT DO NOTHING` until one finds none recorded (`batch.rs`).
    pub(crate) expect_duplicates: std::sync::atomic::AtomicBool,
    /// Bytes fetched and not yet handled, against `prefetch_budget_bytes`.
    pub(crate) prefetch: crate::prefetch::Budget,
    /// Connections cut from outside under each message's transaction, in a row
    /// (`dedup_transaction::Cuts`).
    pub(crate) cuts: crate::dedup_transaction::Cuts,
    /// The keys parked on each partition this member handled (`park.rs`).
    pub(crate) parks: crate::park::Parks,
    _payload: std::marker::PhantomData<fn() -> P>,
    #[cfg(feature = "fault-injection")]
    pub(crate) crash_after_commit: std::sync::atomic::AtomicBool,
    #[cfg(feature = "fault-injection")]
    pub(crate) crash_after_commit_of: std::sync::Mutex<Option<Uuid>>,
}

/// What the consumer's statements must not take from the session a handler may have changed:
/// the schema of its tables, and the `search_path` its connections start with. A handler that
/// runs `SET search_path` (schema-per-tenant code does) changes it on its connection for the
/// rest of its transaction, and for the session once it commits: the consumer's later
/// statements would have resolved its tables elsewhere (a dedup row recorded in another
/// schema's table, the event handled twice). So its statements name the schema, and the check
/// before each `COMMIT` sets the `search_path` back to this one.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) sql: ConsumerSql,
    pub(crate) search_path: String,
}

impl<P, H> Inner<P, H> {
    /// The consumer's statements: schema-qualified once [`Self::session`] is known.
    pub(crate) fn sql(&self) -> &ConsumerSql {
        self.session.get().map_or(&self.sql, |session| &session.sql)
    }

    /// The `search_path` the consumer's connections start with, once known.
    pub(crate) fn search_path(&self) -> Option<&str> {
        self.session
            .get()
            .map(|session| session.search_path.as_str())
    }

    /// Learns [`Session`] once: where the dedup and quarantine tables are, and the
    /// `search_path` that found them.
    /// `Err` when the database cannot be reached; a missing table leaves it unknown (the
    /// statements then fail, saying so).
    pub(crate) async fn know_session(&self) -> Result<(), sqlx::Error> {
        if self.session.get().is_some() {
            return Ok(());
        }
        let schema_of = "(SELECT n.nspname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = pg_catalog.to_regclass";
        let found: (String, Option<String>, Option<String>) =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT pg_catalog.current_setting('search_path'), {schema_of}($1)), \
                        {schema_of}($2))"
            )))
            .bind(self.config.tables.consumer_dedup.as_str())
            .bind(self.config.tables.consumer_quarantine.as_str())
            .fetch_one(&self.pool)
            .await?;
        if let (search_path, Some(dedup), Some(quarantine)) = found {
            let _ = self.session.set(Session {
                sql: ConsumerSql::new(&self.config.tables, Some((&dedup, &quarantine))),
                search_path,
            });
        }
        Ok(())
    }

    /// Makes sure the dedup slices `days` exist before a transaction inserts into them, and
    /// returns those that are missing and may not be made here (`slice.rs`): the transaction
    /// passes them to [`Self::fall_back`]. Callers treat a failure as the database being
    /// unavailable: it is no message's fault, so the messages wait and none is quarantined
    /// for it.
    pub(crate) async fn ensure_slices(
        &self,
        days: impl IntoIterator<Item = i32>,
    ) -> Result<HashSet<i32>, sqlx::Error> {
        self.slices
            .ensure(&self.pool, &self.config.tables.consumer_dedup, days)
            .await
            .inspect_err(|error| tracing::warn!(%error, "cannot create a dedup slice"))
    }

    /// `slices` with those of the days `missing` that are still missing, now that this
    /// transaction holds the fallback lock, replaced by their fallback (`slice.rs`).
    pub(crate) async fn fall_back(
        &self,
        conn: &mut sqlx::PgConnection,
        missing: &HashSet<i32>,
        mut slices: Vec<i32>,
    ) -> Result<Vec<i32>, sqlx::Error> {
        if missing.is_empty() {
            return Ok(slices);
        }
        let dedup = &self.config.tables.consumer_dedup;
        let fallen = crate::slice::still_missing(conn, dedup, missing).await?;
        let mut moved = 0_u64;
        for slice in slices.iter_mut().filter(|s| fallen.contains(s)) {
            *slice = crate::slice::fallback(*slice);
            moved += 1;
        }
        if moved > 0 {
            tracing::debug!(consumer = %self.name, rows = moved,
                "dedup rows recorded in the timeless slice: their day has no slice");
            metrics::counter!("outbox_consumer_dedup_fallback_total", "consumer" => self.name.clone())
                .increment(moved);
        }
        Ok(slices)
    }

    /// Where this transaction records its ids (`slice.rs`), by `dedup_ttl` and today's date.
    pub(crate) fn placement(&self) -> Placement {
        Placement::new(self.config.dedup_ttl)
    }

    /// `ids` and their `slices` without those recorded already outside their own day's slice:
    /// the ids `place` says may be (`slice.rs`) are locked for this transaction and looked for
    /// in every slice, and those found are left out (duplicates: not inserted again). The
    /// others are found by their insert, as always.
    pub(crate) async fn without_recorded_late(
        &self,
        conn: &mut sqlx::PgConnection,
        place: &Placement,
        ids: Vec<Uuid>,
        slices: Vec<i32>,
    ) -> Result<(Vec<Uuid>, Vec<i32>), sqlx::Error> {
        let late: Vec<Uuid> = ids.iter().copied().filter(|id| place.is_late(id)).collect();
        let dedup = &self.config.tables.consumer_dedup;
        let found = crate::slice::recorded_late(conn, self.sql(), dedup, &self.name, &late).await?;
        if found.is_empty() {
            return Ok((ids, slices));
        }
        Ok(ids
            .into_iter()
            .zip(slices)
            .filter(|(id, _)| !found.contains(id))
            .unzip())
    }

    /// A dedup insert that found no slice for its row (one was pruned since it was seen):
    /// forget the slices known, so the retry creates it again.
    pub(crate) fn missing_slice(&self, error: &sqlx::Error) -> bool {
        let missing = crate::slice::is_missing_slice(error);
        if missing {
            self.slices.forget();
        }
        missing
    }

    /// Counts a queued message dropped because its partition was revoked.
    pub(crate) fn note_revoked_skip(&self) {
        bump(&self.counters.revoked_skipped);
        metrics::counter!("outbox_consumer_revoked_skipped_total", "consumer" => self.name.clone())
            .increment(1);
    }
}

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// A consumer named `config.name` (required here) running `handler`.
    ///
    /// ```no_run
    /// # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_consumer::ConsumerError> {
    /// use outbox_consumer::{ConsumerConfig, DedupConsumer, Event};
    /// use sqlx::PgConnection;
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Invoice { cents: i64 }
    ///
    /// async fn charge(event: &Event<Invoice>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    ///     sqlx::query("INSERT INTO charges (idempotency_key, cents) VALUES ($1, $2)")
    ///         .bind(event.idempotency_key())
    ///         .bind(event.payload.cents)
    ///         .execute(conn)
    ///         .await?;
    ///     Ok(())
    /// }
    ///
    /// let consumer = DedupConsumer::new(pool, ConsumerConfig::new("billing"), charge)?;
    /// # Ok(()) }
    /// ```
    pub fn new(pool: PgPool, config: ConsumerConfig, handler: H) -> Result<Self, ConsumerError> {
        let name = config.validate()?;
        if !config.insecure_transport {
            outbox_core::check_database_tls(&pool.connect_options())?;
        }
        crate::headers::self_test().map_err(ConsumerError::Config)?;
        let cache = Cache::builder()
            .max_capacity(config.cache_capacity)
            .time_to_live(config.cache_ttl)
            .build();
        let prefetch = crate::prefetch::Budget::new(config.prefetch_budget_bytes);
        Ok(Self {
            inner: Arc::new(Inner {
                name,
                sql: ConsumerSql::new(&config.tables, None),
                session: std::sync::OnceLock::new(),
                slices: KnownSlices::default(),
                config,
                pool,
                handler,
                cache,
                counters: Counters::default(),
                expect_duplicates: std::sync::atomic::AtomicBool::new(false),
                prefetch,
                cuts: crate::dedup_transaction::Cuts::default(),
                parks: crate::park::Parks::default(),
                _payload: std::marker::PhantomData,
                #[cfg(feature = "fault-injection")]
                crash_after_commit: std::sync::atomic::AtomicBool::new(false),
                #[cfg(feature = "fault-injection")]
                crash_after_commit_of: std::sync::Mutex::new(None),
            }),
        })
    }

    /// The consumer name that scopes deduplication.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ConsumerStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerStats {
            processed: get(&c.processed),
            duplicates_cached: get(&c.duplicates_cached),
            duplicates_stored: get(&c.duplicates_stored),
            quarantined: get(&c.quarantined),
            parked: get(&c.parked),
            replayed: get(&c.replayed),
            handler_errors: get(&c.handler_errors),
            transactions: get(&c.transactions),
            revoked_skipped: get(&c.revoked_skipped),
            not_for_us: get(&c.not_for_us),
            prefetched_bytes: self.inner.prefetch.held(),
            prefetched_bytes_peak: self.inner.prefetch.peak(),
        }
    }

    /// Makes the next committed message stop the consumer before its offset is stored, as a
    /// crash there would. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_next_commit(&self) {
        self.inner.crash_after_commit.store(true, Ordering::SeqCst);
    }

    /// Makes the consumer stop, as a crash would, after the commit that covers event `id`
    /// (its batch's) and before that batch's offsets are stored. For tests.
    #[cfg(feature = "fault-injection")]
    pub fn crash_after_commit_of(&self, id: outbox_core::EventId) {
        *self
            .inner
            .crash_after_commit_of
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(*id.as_uuid());
    }

    /// Handles one message end to end (everything but storing its offset). `Err` means the
    /// database was unavailable (it could not be reached, see the guide's "Failures" page, "What counts as a
    /// failure"): nothing was skipped, and the message should be retried. A transaction the
    /// database rejected is not an `Err`: it counts as a failed attempt, like a handler error.
    pub async fn process(
        &self,
        message: &OwnedMessage,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, ConsumerError> {
        let outcomes = self
            .process_batch(std::slice::from_ref(message), shutdown)
            .await?;
        Ok(outcomes.into_iter().next().unwrap_or(Outcome::Abandoned))
    }

    /// Handles `messages` of one partition, in offset order, as one batch: one transaction
    /// for all of them unless a handler fails (see the crate docs), everything but storing the
    /// offsets. Returns their outcomes in order; it ends early after an
    /// [`Outcome::Abandoned`] one (shutdown under `Block`), whose offset and later ones must
    /// not be stored. `Err` as for [`Self::process`].
    pub async fn process_batch(
        &self,
        messages: &[OwnedMessage],
        shutdown: &CancellationToken,
    ) -> Result<Vec<Outcome>, ConsumerError> {
        self.handle_batch(messages, shutdown, &mut Turn::unlimited(), &|| true)
            .await
    }

    /// Sets `message` aside on its own transaction: parks its key under `ParkKey` when it has
    /// one, quarantines it otherwise (see [`quarantine::store`]). `Err` only when the database
    /// is unavailable.
    pub(crate) async fn set_aside(
        &self,
        message: &OwnedMessage,
        event_id: Option<Uuid>,
        reason: &'static str,
        error: &str,
    ) -> Result<Outcome, ConsumerError> {
        let aside = crate::park::Aside::of(&self.inner, message);
        self.set_aside_as(aside, message, event_id, reason, error)
            .await
    }

    /// [`Self::set_aside`], `aside` as said.
    pub(crate) async fn set_aside_as(
        &self,
        aside: crate::park::Aside,
        message: &OwnedMessage,
        event_id: Option<Uuid>,
        reason: &'static str,
        error: &str,
    ) -> Result<Outcome, ConsumerError> {
        let inner = &*self.inner;
        let mut conn = inner.pool.acquire().await?;
        let entry = quarantine::Entry {
            consumer: &inner.name,
            event_id,
            reason,
            error,
        };
        let reason = quarantine::store(&mut conn, aside.sql(inner), message, entry).await?;
        Ok(self.set(aside, message, reason, error))
    }

    /// Counts and logs `message`, set `aside` (committed) with `reason`; its outcome.
    pub(crate) fn set(
        &self,
        aside: crate::park::Aside,
        message: &OwnedMessage,
        reason: &'static str,
        error: &str,
    ) -> Outcome {
        let inner = &*self.inner;
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        match aside {
            crate::park::Aside::Quarantine => {
                bump(&inner.counters.quarantined);
                tracing::error!(consumer = %inner.name, topic, partition, offset, reason,
                    error = %outbox_core::escape(error), "quarantined message");
                Outcome::Quarantined(reason)
            }
            crate::park::Aside::Park { head } => {
                bump(&inner.counters.parked);
                let key = crate::park::key_of(message).unwrap_or_default();
                let parked = inner.parks.add(topic, partition, key);
                if head {
                    tracing::error!(consumer = %inner.name, topic, partition, offset, reason,
                        error = %outbox_core::escape(error), "parked the message's key");
                } else {
                    tracing::debug!(consumer = %inner.name, topic, partition, offset, "parked behind its key");
                }
                if parked == inner.config.max_parked_per_key.saturating_add(1) {
                    metrics::counter!("outbox_consumer_parked_over_limit_total", "consumer" => inner.name.clone())
                        .increment(1);
                    tracing::warn!(consumer = %inner.name, topic, partition,
                        key = %outbox_core::escape(&String::from_utf8_lossy(key)),
                        limit = inner.config.max_parked_per_key,
                        "a parked key holds more records than max_parked_per_key; they are all kept: release or skip its head");
                }
                Outcome::Parked(reason)
            }
        }
    }
}
