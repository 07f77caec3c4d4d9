//! The dedup table's time slices (its range partitions). A row's slice is, for almost every
//! id, a function of the id alone, so a redelivered id meets its earlier row in the same slice
//! through the primary key: the day since the Unix epoch of a UUIDv7 id's timestamp, or
//! [`TIMELESS`] for an id that carries no time. Pruning drops whole day slices (`prune.rs`);
//! this file makes sure a slice exists before a row needs it, so a consumer never fails for a
//! missing one.
//!
//! **Ids dated before the window.** A slice per day an id names would let ids on past days
//! (a new consumer replaying a topic kept longer than the TTL, a producer's clock far behind,
//! crafted ids) make a table per day, 20,000 for 20,000 days. So a consumer makes slices only
//! for the days of its window, `[today - (TTL days - 1), today + 1]` ([`Placement`]): at most
//! the TTL in whole days + 2 tables a day, whatever the ids. An id dated before the window is
//! recorded in the slice of the day it is handled (the receipt day, which is in the window),
//! so it is kept the TTL after it was handled, like a timeless id, and is never quarantined
//! for its age (a replay of a long-kept topic is handled, once). An id dated on the window's
//! oldest day or before is *late*: its row may be in any slice (its own day's, if it was
//! handled while that day was in the window; a receipt day's otherwise), so before it is
//! recorded it is looked for in every slice (the live ones, bounded as above), under a
//! transaction advisory lock on (dedup table, consumer, id) so that two transactions handling
//! it at once cannot both miss the other's row. Ids share 64 such locks per consumer (a
//! transaction's locks stay within Postgres's lock table whatever its batch size): the
//! batches of old ids of one consumer's partitions mostly take turns, while batches of ids
//! inside the window take no lock at all.
//!
//! The window's oldest day (`place_from`) is itself placed in its own slice, never in the
//! receipt day's: a transaction that takes an id of that day for in-window (by a clock a
//! moment earlier, across midnight) inserts it into the same slice as one that takes it for
//! late, and the primary key makes one of them wait for the other and find its row. Members of
//! one consumer name must share `dedup_ttl` (and `prune`'s TTL should be the same): members
//! whose windows differ by more than a day could record the same id in two slices at once.
//!
//! **A consumer that may not make slices.** Making a slice (`ATTACH PARTITION`) needs the
//! dedup table's owner, so a least-privileged consumer (INSERT, SELECT, DELETE on the dedup
//! table) relies on the owner's jobs to make them ahead (`outbox migrate`, `outbox prune
//! dedup`, [`DedupPruner`](crate::DedupPruner): [`SLICES_AHEAD`] days). When a day's slice is
//! missing all the same, the consumer does not wait for it: it records that day's ids in the
//! timeless slice under the slice value `-day` ([`fallback`]), and says so once (a warning)
//! and per row (`outbox_consumer_dedup_fallback_total`). Deduplication is unchanged, because
//! a day's ids are never split between its slice and its fallback: a transaction that uses
//! the fallback holds a shared advisory lock on the dedup table and sees, after taking it,
//! that the day's slice is still missing; a creator of slices holds the same lock exclusively
//! and makes no slice for a day that has fallback rows (`ensure_slice`). So each id of a day
//! goes to one slice value, `day` or `-day`, and the primary key finds its earlier row there.
//! Fallback rows are pruned with the timeless slice, by processing time: kept the TTL after
//! they were handled.

use std::collections::HashSet;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_core::{Ident, TableNames};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use uuid::Uuid;

const DAY_MS: u64 = 86_400_000;

/// The slice of ids that carry no time (not UUIDv7): pruned by processing time.
pub const TIMELESS: i32 = 0;

/// How many days after today the owner's jobs (`outbox migrate`, `outbox prune dedup`,
/// [`DedupPruner`](crate::DedupPruner)) make dedup slices ahead, so that consumers that may
/// not make them find them made: a pruner that runs daily can miss a week.
pub const SLICES_AHEAD: i32 = 7;

/// The slice value under which day `day`'s ids are recorded, in the timeless slice, while
/// that day has no slice that this consumer may make (module docs).
pub(crate) fn fallback(day: i32) -> i32 {
    -day
}

/// The dedup slice of `id`: the day (since the Unix epoch) of a UUIDv7 id's timestamp, or
/// [`TIMELESS`]. The same value as the SQL function `outbox_consumer_dedup_slice(uuid)` that
/// the migration creates.
pub fn dedup_slice(id: &Uuid) -> i32 {
    let bytes = id.as_bytes();
    if bytes[6] >> 4 != 7 {
        return TIMELESS;
    }
    let millis = bytes[..6]
        .iter()
        .fold(0_u64, |acc, b| (acc << 8) | u64::from(*b));
    // 48 bits of milliseconds are under 2^48 / DAY_MS days: an i32 holds every one.
    i32::try_from(millis / DAY_MS).unwrap_or(i32::MAX)
}

/// Where a consumer records ids today, by its TTL (`ConsumerConfig::dedup_ttl`) and this
/// machine's clock: see the module docs. Taken once per transaction, so that every statement
/// of it (the slices made, the rows inserted, those deleted again) agrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    today: i32,
    /// The window's oldest day: ids of this day or later (or timeless) go to their own slice.
    place_from: i32,
}

impl Placement {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self::at(today(), ttl)
    }

    fn at(today: i32, ttl: Duration) -> Self {
        // Whole days, as `prune` counts them: a slice of day d lives until day d + TTL days
        // + 1 begins. The oldest day placed in its own slice lives at least to the end of
        // tomorrow (or of today, for a TTL of a day or less).
        let ttl_days =
            i32::try_from(ttl.as_millis().div_ceil(u128::from(DAY_MS))).unwrap_or(i32::MAX);
        let keep = ttl_days.saturating_sub(1).max(1);
        Self {
            today,
            place_from: today.saturating_sub(keep),
        }
    }

    /// Whether `id` may have its row outside its own day's slice, so that it must be looked
    /// for in every slice, under its lock, before it is recorded: a UUIDv7 id dated on the
    /// window's oldest day or before.
    pub(crate) fn is_late(&self, id: &Uuid) -> bool {
        let day = dedup_slice(id);
        day != TIMELESS && day <= self.place_from
    }

    /// The slice `id`'s row goes to if it is new: its own day's inside the window (or the
    /// timeless slice), today's (the receipt day's) before it.
    pub(crate) fn slice(&self, id: &Uuid) -> i32 {
        match dedup_slice(id) {
            day if day == TIMELESS || day >= self.place_from => day,
            _ => self.today,
        }
    }
}

/// Takes the transaction's advisory locks on the late ids `ids` (in one order, so that
/// transactions locking overlapping ids cannot deadlock on them) and returns those already
/// recorded for `consumer` in any slice. In two statements: the look must see what a
/// transaction that held a lock committed while this one waited for it, and a statement sees
/// only what had committed when it began (READ COMMITTED, the consumer's isolation).
pub(crate) async fn recorded_late(
    conn: &mut PgConnection,
    sql: &crate::sql::ConsumerSql,
    dedup: &Ident,
    consumer: &str,
    ids: &[Uuid],
) -> Result<HashSet<Uuid>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    wait_for_locks(
        conn,
        sqlx::query(sql.lock_late_ids.clone())
            .bind(dedup.as_str())
            .bind(consumer)
            .bind(ids),
    )
    .await?;
    let recorded: Vec<Uuid> = sqlx::query_scalar(sql.find_recorded.clone())
        .bind(consumer)
        .bind(ids)
        .fetch_all(&mut *conn)
        .await?;
    Ok(recorded.into_iter().collect())
}

/// Runs `lock`, a statement that waits for advisory locks other transactions hold. Waiting
/// for another batch's lock is contention, not this message's failure: a role's
/// `lock_timeout` or `statement_timeout` (managed Postgres sets them) must not cut the wait
/// and charge the message an attempt. They are set aside for the wait only: the handlers then
/// run under the role's settings.
async fn wait_for_locks(
    conn: &mut PgConnection,
    lock: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> Result<(), sqlx::Error> {
    let (lock_timeout, statement_timeout, _, _): (String, String, String, String) =
        sqlx::query_as(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), \
                    set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true)",
        )
        .fetch_one(&mut *conn)
        .await?;
    lock.execute(&mut *conn).await?;
    sqlx::query(
        "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)",
    )
    .bind(lock_timeout)
    .bind(statement_timeout)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Today's slice, by this machine's clock.
pub fn today() -> i32 {
    let millis = u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or(0);
    i32::try_from(millis / DAY_MS).unwrap_or(i32::MAX)
}

/// The table that holds day slice `day` of `dedup`.
pub(crate) fn slice_table(dedup: &Ident, day: i32) -> Result<Ident, outbox_core::CoreError> {
    Ident::new(format!("{}_d{day}", dedup.as_str()))
}

/// The day of a slice table of `dedup`, from its name; `None` for other tables.
pub(crate) fn day_of(dedup: &Ident, table: &str) -> Option<i32> {
    table
        .strip_prefix(dedup.as_str())?
        .strip_prefix("_d")?
        .parse()
        .ok()
}

/// Creates the day slices `days` of the dedup table where missing, each in its own short
/// transaction, so that no consumer waits to create one: `outbox migrate` and `outbox prune
/// dedup` run it as the table's owner for the days around today ([`SLICES_AHEAD`]), and
/// consumers that may (the owner) for any day they meet. A day whose ids a consumer already
/// recorded in its fallback (module docs) gets no slice. Returns how many slices it made.
pub async fn ensure_dedup_slices(
    conn: &mut PgConnection,
    tables: &TableNames,
    days: impl IntoIterator<Item = i32>,
) -> Result<u64, crate::ConsumerError> {
    let mut made = 0;
    for day in days {
        let state = ensure_slice(conn, &tables.consumer_dedup, day)
            .await
            .map_err(|e| match e {
                SliceError::Sql(e) => crate::ConsumerError::Database(e),
                SliceError::Name(e) => crate::ConsumerError::Core(e),
            })?;
        if state == Slice::Made {
            made += 1;
        }
    }
    Ok(made)
}

#[derive(Debug)]
pub(crate) enum SliceError {
    Sql(sqlx::Error),
    Name(outbox_core::CoreError),
}

impl From<sqlx::Error> for SliceError {
    fn from(error: sqlx::Error) -> Self {
        Self::Sql(error)
    }
}

/// What [`ensure_slice`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slice {
    Existed,
    Made,
    /// Missing, and left so: the day's ids are in its fallback.
    FallenBack,
}

/// The advisory lock that creators of `dedup`'s slices take exclusively and transactions
/// using a fallback take shared (module docs). `$1` is the dedup table.
const SLICES_LOCK: &str = "hashtext('outbox_dedup_slices'), hashtext($1::regclass::oid::text)";

async fn ensure_slice(
    conn: &mut PgConnection,
    dedup: &Ident,
    day: i32,
) -> Result<Slice, SliceError> {
    if day == TIMELESS {
        return Ok(Slice::Existed);
    }
    let part = slice_table(dedup, day).map_err(SliceError::Name)?;
    let mut tx = sqlx::Connection::begin(conn).await?;
    // One creator per table at a time (two consumers meeting the same new day would otherwise
    // both try to attach it), and none while a transaction may be writing a day's fallback.
    sqlx::query(AssertSqlSafe(format!(
        "SELECT pg_advisory_xact_lock({SLICES_LOCK})"
    )))
    .bind(dedup.as_str())
    .execute(&mut *tx)
    .await?;
    let attached: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_inherits \
         WHERE inhparent = $1::regclass AND inhrelid = to_regclass($2))",
    )
    .bind(dedup.as_str())
    .bind(part.as_str())
    .fetch_one(&mut *tx)
    .await?;
    if attached {
        tx.commit().await?;
        return Ok(Slice::Existed);
    }
    // A literal, so that the plan reads only the timeless slice, through its partial index on
    // fallback rows (migration 0011).
    let fallen_back: bool = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM {dedup} WHERE slice = {})",
        fallback(day)
    )))
    .fetch_one(&mut *tx)
    .await?;
    if fallen_back {
        tx.commit().await?;
        tracing::info!(
            table = dedup.as_str(),
            day,
            "no dedup slice made: the day's ids are recorded in the timeless slice already"
        );
        return Ok(Slice::FallenBack);
    }
    // Created apart and then attached: `CREATE TABLE .. PARTITION OF` would lock the whole
    // dedup table against the consumers' inserts; ATTACH does not.
    let (from, to) = (i64::from(day), i64::from(day) + 1);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {part} (LIKE {dedup} INCLUDING DEFAULTS); \
         ALTER TABLE {dedup} ATTACH PARTITION {part} FOR VALUES FROM ({from}) TO ({to})"
    )))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(table = part.as_str(), day, "created a dedup slice");
    Ok(Slice::Made)
}

/// Which of the day slices `days` of `dedup` exist now.
async fn existing(
    conn: &mut PgConnection,
    dedup: &Ident,
    days: &[i32],
) -> Result<HashSet<i32>, sqlx::Error> {
    let found: Vec<i32> = sqlx::query_scalar(
        "SELECT d FROM unnest($2::int[]) AS d WHERE EXISTS (SELECT 1 FROM pg_inherits \
         WHERE inhparent = $1::regclass AND inhrelid = to_regclass($1 || '_d' || d))",
    )
    .bind(dedup.as_str())
    .bind(days)
    .fetch_all(conn)
    .await?;
    Ok(found.into_iter().collect())
}

/// Of the days `missing` (their slices were missing when the transaction's caller looked),
/// those still missing once this transaction holds the fallback lock (module docs): their
/// ids go to their [`fallback`]. The lock is held to the transaction's end, so no slice is
/// made for them before it commits. Waiting for a creator is no message's failure
/// ([`wait_for_locks`]).
pub(crate) async fn still_missing(
    conn: &mut PgConnection,
    dedup: &Ident,
    missing: &HashSet<i32>,
) -> Result<HashSet<i32>, sqlx::Error> {
    if missing.is_empty() {
        return Ok(HashSet::new());
    }
    let lock = format!("SELECT pg_advisory_xact_lock_shared({SLICES_LOCK})");
    wait_for_locks(conn, sqlx::query(AssertSqlSafe(lock)).bind(dedup.as_str())).await?;
    // A statement of its own: it must see a slice that a creator committed while this one
    // waited for the lock.
    let days: Vec<i32> = missing.iter().copied().collect();
    let made = existing(conn, dedup, &days).await?;
    Ok(missing.difference(&made).copied().collect())
}

/// How often a transaction is tried again at once when its row's slice was dropped meanwhile
/// (pruned, and made again by the next try), before it waits like any other failure.
pub(crate) const SLICE_RETRIES: u32 = 3;

/// The day slices a consumer knows to exist, so that only a new day costs a look.
#[derive(Debug, Default)]
pub(crate) struct KnownSlices {
    days: RwLock<HashSet<i32>>,
    /// Days found missing with their ids in their fallback: they get no slice while those
    /// rows live, so they cost no creator's lock again.
    fallen: RwLock<HashSet<i32>>,
    /// The database refused this consumer's role the making of a slice (42501): it looks for
    /// slices from then on, and uses fallbacks for the missing ones, without trying again.
    refused: AtomicBool,
}

impl KnownSlices {
    /// Makes sure the day slices `days` exist, and for today's or a later day also the next
    /// day's, ahead of time (made now, not by the first insert of a busy midnight). Returns
    /// those of `days` that are missing and stay so (this role may not make them, or their
    /// ids are in their fallback already): the transaction checks them again under the
    /// fallback lock ([`still_missing`]).
    pub(crate) async fn ensure(
        &self,
        pool: &PgPool,
        dedup: &Ident,
        days: impl IntoIterator<Item = i32>,
    ) -> Result<HashSet<i32>, sqlx::Error> {
        let mut missing: Vec<i32> = {
            let known = self.days.read().unwrap_or_else(|p| p.into_inner());
            days.into_iter()
                .filter(|day| *day != TIMELESS && !known.contains(day))
                .collect()
        };
        if missing.is_empty() {
            return Ok(HashSet::new());
        }
        missing.sort_unstable();
        missing.dedup();
        let mut conn = pool.acquire().await?;
        let today = today();
        let wanted: Vec<i32> = missing
            .iter()
            .flat_map(|&day| {
                std::iter::once(day).chain((day >= today).then(|| day.saturating_add(1)))
            })
            .collect();
        // Looked for first, without the creators' lock: made ahead, they cost one look.
        let found = existing(&mut conn, dedup, &wanted).await?;
        self.remember(found.iter().copied());
        let mut left = HashSet::new();
        for day in wanted.into_iter().filter(|day| !found.contains(day)) {
            let fallen = self
                .fallen
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&day);
            if fallen || self.refused.load(Ordering::Relaxed) {
                left.insert(day);
                continue;
            }
            match ensure_slice(&mut conn, dedup, day).await {
                Ok(Slice::Existed | Slice::Made) => self.remember([day]),
                Ok(Slice::FallenBack) => {
                    self.fallen
                        .write()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(day);
                    left.insert(day);
                }
                Err(SliceError::Sql(sqlx::Error::Database(error)))
                    if error.code().as_deref() == Some("42501") =>
                {
                    self.refused.store(true, Ordering::Relaxed);
                    tracing::warn!(table = dedup.as_str(), day, %error,
                        "this role may not make dedup slices: ids of days without one are \
                         recorded in the timeless slice; run `outbox prune dedup` (or \
                         `outbox migrate`) as the table's owner to make them ahead");
                    left.insert(day);
                }
                Err(SliceError::Sql(error)) => return Err(error),
                Err(SliceError::Name(error)) => {
                    return Err(sqlx::Error::Configuration(error.into()));
                }
            }
        }
        Ok(missing
            .into_iter()
            .filter(|day| left.contains(day))
            .collect())
    }

    fn remember(&self, days: impl IntoIterator<Item = i32>) {
        self.days
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .extend(days);
    }

    /// Forgets every slice: one was dropped (pruned) since it was seen.
    pub(crate) fn forget(&self) {
        self.days.write().unwrap_or_else(|p| p.into_inner()).clear();
        self.fallen
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

/// Whether `error` says a row had no slice to go to (one was dropped after it was seen).
pub(crate) fn is_missing_slice(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db)
        if db.code().as_deref() == Some("23514") && db.message().starts_with("no partition of relation"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v7_id_falls_in_its_days_slice_and_others_in_the_timeless_one() {
        let at = |ms: u64| Uuid::new_v7(uuid::Timestamp::from_unix_time(ms / 1000, 0, 0, 0));
        assert_eq!(dedup_slice(&at(0)), TIMELESS, "the epoch's first day is 0");
        assert_eq!(dedup_slice(&at(DAY_MS)), 1);
        assert_eq!(dedup_slice(&at(1_764_892_800_000)), 20_427, "2025-12-05");
        assert_eq!(
            dedup_slice(&at(1_764_892_799_000)),
            20_426,
            "a second before"
        );
        assert_eq!(dedup_slice(&Uuid::new_v4()), TIMELESS);
        assert_eq!(dedup_slice(&Uuid::nil()), TIMELESS);
        assert_eq!(dedup_slice(&Uuid::max()), TIMELESS, "version 15");
        let now = dedup_slice(&Uuid::now_v7());
        assert!((today() - 1..=today()).contains(&now));
    }

    #[test]
    fn ids_before_the_window_go_to_the_receipt_days_slice() {
        let on = |day: u64| Uuid::new_v7(uuid::Timestamp::from_unix_time(day * 86_400, 0, 0, 0));
        let week = Duration::from_secs(7 * 86_400);
        let place = Placement::at(20_427, week);
        // The window: 20,421 (today - 6) to tomorrow.
        for (day, late, slice) in [
            (20_428, false, 20_428),
            (20_427, false, 20_427),
            (20_422, false, 20_422),
            (20_421, true, 20_421),
            (20_420, true, 20_427),
            (1, true, 20_427),
        ] {
            assert_eq!(place.is_late(&on(day)), late, "day {day}");
            assert_eq!(place.slice(&on(day)), slice, "day {day}");
        }
        let v4 = Uuid::new_v4();
        assert!(!place.is_late(&v4));
        assert_eq!(place.slice(&v4), TIMELESS);
        // A TTL of a day or less still keeps yesterday in its own slice.
        let short = Placement::at(20_427, Duration::from_secs(3_600));
        assert_eq!(short.slice(&on(20_426)), 20_426);
        assert!(short.is_late(&on(20_426)));
        assert_eq!(short.slice(&on(20_425)), 20_427);
        // A day and a half counts as two, as in `prune`.
        let day_and_a_half = Placement::at(20_427, Duration::from_secs(129_600));
        assert_eq!(day_and_a_half.slice(&on(20_425)), 20_427);
        assert_eq!(day_and_a_half.slice(&on(20_426)), 20_426);
    }

    #[test]
    fn slice_tables_are_named_after_their_day() {
        let dedup = Ident::new("outbox_consumer_dedup").expect("valid");
        let table = slice_table(&dedup, 20_427).expect("valid");
        assert_eq!(table.as_str(), "outbox_consumer_dedup_d20427");
        assert_eq!(day_of(&dedup, table.as_str()), Some(20_427));
        assert_eq!(day_of(&dedup, "outbox_consumer_dedup_timeless"), None);
        assert_eq!(day_of(&dedup, "other_d5"), None);
    }
}
