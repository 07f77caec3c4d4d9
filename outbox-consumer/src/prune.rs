//! Bounding the dedup table: whole day slices dropped, the timeless slice pruned row by row.
//! Where a row goes, and why a consumer makes slices only for its window, is in `slice.rs`.

use std::time::Duration;

use outbox_core::{Ident, TableNames};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::ConsumerError;
use crate::slice::{day_of, today};

/// What [`prune`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DedupPruned {
    /// Day slices dropped whole (each a table: no rows deleted, nothing left for vacuum).
    pub slices_dropped: u64,
    /// Rows deleted from the timeless slice (ids that carry no time, and those of days that
    /// had no slice when they were handled).
    pub timeless_rows: u64,
    /// Day slices made ahead, for yesterday to [`SLICES_AHEAD`](crate::SLICES_AHEAD) days
    /// after today.
    pub slices_made: u64,
}

/// Bounds the dedup table to `older_than`, one instance at a time (another finds it running
/// and returns at once with nothing removed), beside running consumers:
///
/// - A day slice (UUIDv7 ids, by the day of their timestamp: the event's time) is dropped once
///   the whole day is older than `older_than`: detached with `DETACH PARTITION .. CONCURRENTLY`
///   (consumers' inserts never wait for it) and dropped. Its cost does not depend on how many
///   rows it holds.
/// - The timeless slice (ids that carry no time) is pruned by processing time, at most `batch`
///   rows per statement, each its own short transaction.
/// - The day slices of yesterday to [`SLICES_AHEAD`](crate::SLICES_AHEAD) days after today
///   are made where missing, so that consumers that may not make slices find them (see
///   "Roles" in the guide's operating page). Dropping and making slices needs the dedup table's owner.
///
/// Run it with the consumers' `dedup_ttl` (`ConsumerConfig::dedup_ttl`): they record an id
/// in its own day's slice only while that day is inside their window (the TTL back from
/// today), so that with the same TTL no slice a consumer inserts into is pruned under it, and
/// a slice is made only for the TTL's days (+ 2), whatever days the ids name.
///
/// **What the TTL promises.** A redelivered event is a duplicate (no second effect) when it
/// comes:
///
/// - within the TTL of the event's time (a UUIDv7 id's timestamp), however late it was first
///   handled: its row is in its day's slice, dropped once that whole day is older than the
///   TTL (up to about two days more: slices are whole days), or in a later day's; or
/// - within the TTL of its first handling, if its day was already the TTL (in whole days) old
///   when it was first handled: its row is in the slice of the day it was handled, dropped
///   with that day. This is a new consumer name replaying a topic kept longer than the TTL,
///   or events held back longer than the TTL: they are handled, once each, not quarantined
///   for their age (a new consumer is expected to see the topic's history), and a crash or
///   rebalance in the middle of such a replay redelivers them as duplicates;
/// - for an id that carries no time, within the TTL of its first handling (the timeless slice
///   is pruned by processing time).
///
/// An event first handled inside the window near its edge (its day the TTL less a day old) is
/// kept until its day expires: at least the rest of the day it was handled and the next. So
/// pick `older_than` longer than the longest time an event can be redelivered after it was
/// decided: the topic's retention (or how far back a group could be reset), plus the relay's
/// longest retry window. An event redelivered after its dedup row was pruned is handled again
/// (it looks new); its handler should then rely on the event id as an idempotency key with
/// outside systems.
pub async fn prune(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
) -> Result<DedupPruned, ConsumerError> {
    let dedup = &tables.consumer_dedup;
    if !outbox_core::try_prune_lock(conn, dedup).await? {
        return Ok(DedupPruned::default());
    }
    let pruned = prune_locked(conn, tables, older_than, batch).await;
    let unlocked = outbox_core::prune_unlock(conn, dedup).await;
    let pruned = pruned?;
    unlocked?;
    Ok(pruned)
}

async fn prune_locked(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
) -> Result<DedupPruned, ConsumerError> {
    let dedup = &tables.consumer_dedup;
    // A day is past once its end is: day + 1 <= today - whole days of `older_than`, counted
    // in milliseconds so that a TTL of a day and a half keeps the day it reaches into.
    let ttl_days = i64::try_from(older_than.as_millis().div_ceil(86_400_000)).unwrap_or(i64::MAX);
    let last_expired = i64::from(today())
        .saturating_sub(ttl_days)
        .saturating_sub(1);
    let mut slices_dropped = 0;
    for (table, detaching) in slices(conn, dedup).await? {
        let Some(day) = day_of(dedup, &table) else {
            continue;
        };
        if i64::from(day) > last_expired {
            continue;
        }
        let part = Ident::new(&table)?;
        // A detach interrupted earlier (its connection lost) is finished, not restarted.
        let detach = if detaching {
            format!("ALTER TABLE {dedup} DETACH PARTITION {part} FINALIZE")
        } else {
            format!("ALTER TABLE {dedup} DETACH PARTITION {part} CONCURRENTLY")
        };
        // Outside any transaction block, as DETACH .. CONCURRENTLY requires.
        sqlx::raw_sql(AssertSqlSafe(detach))
            .execute(&mut *conn)
            .await?;
        sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {part}")))
            .execute(&mut *conn)
            .await?;
        tracing::info!(table = part.as_str(), day, "dropped a dedup slice");
        slices_dropped += 1;
    }
    let timeless = Ident::new(format!("{}_timeless", dedup.as_str()))?;
    // ctid lets each batch delete exactly the rows it selected, via the processed_at index,
    // in its order from where the previous batch stopped (see delete_while_full).
    let delete = format!(
        "WITH gone AS ( \
            DELETE FROM {timeless} WHERE ctid = ANY(ARRAY( \
                SELECT ctid FROM {timeless} \
                WHERE processed_at < now() - $1 * interval '1 millisecond' \
                  AND processed_at >= coalesce($3, '-infinity'::timestamptz) \
                ORDER BY processed_at LIMIT $2)) \
            RETURNING processed_at) \
         SELECT count(*), max(processed_at) FROM gone"
    );
    let timeless_rows = outbox_core::delete_while_full(conn, delete, older_than, batch).await?;
    let now = today();
    let slices_made =
        crate::ensure_dedup_slices(conn, tables, now - 1..=now + crate::SLICES_AHEAD).await?;
    Ok(DedupPruned {
        slices_dropped,
        timeless_rows,
        slices_made,
    })
}

/// The slices of `dedup` (name, whether a detach of it is pending), oldest first.
async fn slices(
    conn: &mut PgConnection,
    dedup: &Ident,
) -> Result<Vec<(String, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT c.relname::text, i.inhdetachpending FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = $1::regclass ORDER BY c.relname",
    )
    .bind(dedup.as_str())
    .fetch_all(conn)
    .await
}
