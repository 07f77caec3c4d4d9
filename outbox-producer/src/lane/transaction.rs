//! The batch's transaction, which stays open from the claim, across the wait for Kafka, to
//! the mark. Its timeouts are the relay's own, whatever the server, database or role sets:
//! managed Postgres often sets `idle_in_transaction_session_timeout`, and a value below the
//! Kafka wait ended the transaction after Kafka had acknowledged the rows, so they were never
//! marked and every batch published them again; a low `statement_timeout` cancelled the claim
//! whenever it waited for a lock, so nothing was published.

use std::future::Future;
use std::time::Duration;

use sqlx::{PgConnection, PgPool, Postgres, Transaction};

/// Set at the start of every batch, for its transaction only.
///
/// JIT off: the claim's cost estimate grows with the backlog, so past a few million pending
/// rows Postgres JIT-compiled it: 268 ms of compiling for 4 ms of work per batch at 3M
/// pending (bench P7). It never pays here.
///
/// Custom plans only: the claim is planned with its batch size on every run (see
/// `run_batch`); Postgres's generic plan of it scanned the backlog.
///
/// Sorts off: the claim reads its rows in `seq` order from an index and stops at its batch.
/// On a table of a few dozen rows Postgres sorted a sequential scan instead, which ran the
/// claim's filter, and so its per-key advisory lock, on every due row: a batch of 32 held all
/// 50 keys of the table until it committed, and the batches beside it claimed nothing. A sort
/// that no plan can do without (the claim's last step orders its batch) is still made, its
/// cost estimate raised by the setting far past JIT's thresholds: JIT off is what keeps that
/// from compiling it.
///
/// A statement may wait that long (for a lock a migration holds, say) before it fails.
///
/// A transaction lasts at most 15 minutes (PostgreSQL 17's `transaction_timeout`; a server,
/// database or role value below the Kafka wait would end the batch after Kafka acknowledged
/// its rows, as an idle bound did): longer than a batch's Kafka wait (librdkafka's
/// `message.timeout.ms`, 5 minutes at most by default) and its statements. Set to 0 first:
/// PostgreSQL starts that timer when the transaction begins, and a new value only starts a
/// timer that is not running; 0 stops the server's, then 15 minutes starts the relay's (the
/// values are set in the order listed).
///
/// A transaction idle that long ends: the bound of a relay that stopped (a stalled process
/// keeps its connection, and the locks on its claimed rows, which hold their keys back from
/// every other relay). A waiting relay is never idle that long: it touches the transaction
/// every [`KEEPALIVE`], however long Kafka takes.
///
/// Sent with the `BEGIN`, in one round trip (the simple-query protocol takes several
/// statements): a batch's cycle is a few milliseconds, and a round trip of its own cost
/// 0.3 ms of it (bench P9, 2026-12-06). Set with `set_config(..., true)` (`SET LOCAL`) only
/// where the server knows the setting, so that this cannot fail on an older server (see
/// [`begin`]; PostgreSQL 12 is the oldest with `plan_cache_mode`, which the claim needs).
const BEGIN_WITH_SETTINGS: &str = "BEGIN; \
    SELECT set_config(s.name, s.value, true) \
    FROM (VALUES ('jit', 'off'), ('plan_cache_mode', 'force_custom_plan'), \
                 ('enable_sort', 'off'), ('statement_timeout', '5min'), \
                 ('idle_in_transaction_session_timeout', '30s'), \
                 ('transaction_timeout', '0'), ('transaction_timeout', '15min')) AS s(name, value) \
    WHERE current_setting(s.name, true) IS NOT NULL";

/// How often a batch waiting for Kafka runs a statement in its transaction; well below the
/// idle bound in [`BEGIN_WITH_SETTINGS`].
const KEEPALIVE: Duration = Duration::from_secs(2);

/// Begins a batch's transaction, with the lane's own settings, in one round trip. The
/// settings cannot fail on a server that lacks one of them: sqlx counts the transaction only
/// once its `BEGIN` statement succeeded, so a failure after the `BEGIN` would put the
/// connection back in the pool inside an aborted transaction.
pub(super) async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    pool.begin_with(BEGIN_WITH_SETTINGS).await
}

/// Awaits `wait` (the Kafka wait), touching `conn`'s transaction every [`KEEPALIVE`] so it
/// is never idle for long, however long the wait.
pub(super) async fn keep_alive<T>(
    conn: &mut PgConnection,
    wait: impl Future<Output = T>,
) -> Result<T, sqlx::Error> {
    let mut wait = std::pin::pin!(wait);
    loop {
        tokio::select! {
            done = &mut wait => return Ok(done),
            () = tokio::time::sleep(KEEPALIVE) => {
                sqlx::query("SELECT 1").execute(&mut *conn).await?;
            }
        }
    }
}
