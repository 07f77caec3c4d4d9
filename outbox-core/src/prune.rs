use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgConnection};

/// Runs `delete` until a run deletes fewer than `batch` rows. Each run is its own short
/// transaction, so pruning never holds many locks for long and can run beside relays and
/// consumers. Returns the total.
///
/// `delete` takes `$1` = age in milliseconds, `$2` = row limit and `$3` = the least prune key
/// (a `timestamptz`, NULL on the first run) and returns one row: how many rows it deleted
/// (`bigint`) and the greatest key among them. It must take its rows in key order from an
/// index on the key, with `key >= coalesce($3, '-infinity')`: each run then starts its index
/// scan where the previous one stopped. Without that bound every run walks the entries of
/// the rows already deleted (dead until vacuum) from the start of the index, and a run of
/// N batches costs O(N²) (bench P7: 17 ms per batch of 1,000 after 1.2M rows, 0.9 ms with
/// it). A row skipped because another transaction held it, or published behind the bound
/// while the run went on, waits for the next run.
///
/// One instance at a time prunes `table` (the table the name resolves to on this connection,
/// keyed by its oid, so outboxes in other schemas prune independently): the others find its
/// session advisory lock taken and return 0 at once, instead of deleting the same rows side
/// by side (which in peers' experience contended and deadlocked at volume).
///
/// Shared by the framework's prune functions; `delete` must be built only from validated
/// [`crate::Ident`]s.
pub async fn delete_in_batches(
    conn: &mut PgConnection,
    table: &crate::Ident,
    delete: String,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    if !try_prune_lock(conn, table).await? {
        return Ok(0);
    }
    let pruned = delete_while_full(conn, delete, older_than, batch).await;
    let unlocked = prune_unlock(conn, table).await;
    let pruned = pruned?;
    unlocked?;
    Ok(pruned)
}

/// Takes the session advisory lock that lets one instance at a time prune `table` (resolved on
/// this connection, keyed by its oid); `false`, and a log line, when another instance holds
/// it. Release it with [`prune_unlock`].
pub async fn try_prune_lock(
    conn: &mut PgConnection,
    table: &crate::Ident,
) -> Result<bool, sqlx::Error> {
    let locked: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtext('outbox_prune'), hashtext($1::regclass::oid::text))",
    )
    .bind(table.as_str())
    .fetch_one(&mut *conn)
    .await?;
    if !locked {
        tracing::info!(
            table = table.as_str(),
            "another instance is pruning; skipped"
        );
    }
    Ok(locked)
}

/// Releases what [`try_prune_lock`] took.
pub async fn prune_unlock(
    conn: &mut PgConnection,
    table: &crate::Ident,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT pg_advisory_unlock(hashtext('outbox_prune'), hashtext($1::regclass::oid::text))",
    )
    .bind(table.as_str())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Runs `delete` as [`delete_in_batches`] does, without taking the lock (the caller holds it).
pub async fn delete_while_full(
    conn: &mut PgConnection,
    delete: String,
    older_than: Duration,
    batch: u32,
) -> Result<u64, sqlx::Error> {
    let batch = i64::from(batch.max(1));
    let mut removed = 0;
    let mut from: Option<DateTime<Utc>> = None;
    loop {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // Planned once, generically: a plan made for each batch looks up the actual least
        // value of an indexed column for its estimates (the outbox's `seq`), walking its index
        // from the start through the entries of every row deleted so far (5,471 blocks of planning per batch after 2M rows
        // pruned; the newer half of P7's large prune read 1.6 x the blocks per row of the
        // older half).
        sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
            .execute(&mut *tx)
            .await?;
        let (n, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(AssertSqlSafe(delete.clone()))
            .bind(older_than.as_secs_f64() * 1000.0)
            .bind(batch)
            .bind(from)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        removed += u64::try_from(n).unwrap_or(0);
        if n < batch {
            return Ok(removed);
        }
        from = last;
    }
}
