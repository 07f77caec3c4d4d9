//! The producer workload: transactions that change state rows and enqueue their events.
//!
//! Before each transaction the ids it is about to try are recorded in `chaos_attempts` in
//! autocommit, so the checker knows every id that was ever attempted and can prove that the
//! ones that never committed appear nowhere. Some transactions roll back on purpose; when
//! told to, the process dies with its transaction open, or right after its commit.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_core::{EventId, NewEvent};
use outbox_producer::Outbox;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    AGGREGATE_TYPE, ChaosPayload, Common, EVENT_TYPE, EXIT_PRODUCER_AFTER_COMMIT,
    EXIT_PRODUCER_BEFORE_COMMIT, crash,
};

/// Where an injected producer crash lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CrashPoint {
    /// With the transaction's rows written but not committed.
    BeforeCommit,
    /// Right after the commit returned.
    AfterCommit,
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Number of aggregate keys (`k000`, `k001`, ...).
    #[arg(long)]
    pub(crate) keys: u32,
    /// Concurrent writer tasks.
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: u32,
    /// Pause between a writer's transactions, lower bound (ms).
    #[arg(long, default_value_t = 5)]
    pub(crate) pause_min_ms: u64,
    /// Pause between a writer's transactions, upper bound (ms).
    #[arg(long, default_value_t = 25)]
    pub(crate) pause_max_ms: u64,
    /// Percentage of transactions rolled back on purpose.
    #[arg(long, default_value_t = 5)]
    pub(crate) rollback_percent: u32,
    /// Crash at this transaction (counted across writers, from 1).
    #[arg(long)]
    pub(crate) crash_at_txn: Option<u64>,
    /// Where that crash lands.
    #[arg(long, value_enum, default_value = "before-commit")]
    pub(crate) crash_point: CrashPoint,
}

/// The name of key `n`.
pub(crate) fn key_name(n: u32) -> String {
    format!("k{n:03}")
}

pub(crate) async fn run(args: Args) -> Result<()> {
    let pool = args.common.pool(args.workers + 1)?;
    let outbox = Outbox::new(&args.common.tables()?);
    let shutdown = super::shutdown_token();
    let counter = Arc::new(AtomicU64::new(0));
    let args = Arc::new(args);
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..args.workers {
        writers.spawn(writer(
            Arc::clone(&args),
            pool.clone(),
            outbox.clone(),
            Arc::clone(&counter),
            StdRng::seed_from_u64(args.common.seed ^ (u64::from(w) << 32)),
            shutdown.clone(),
        ));
    }
    while writers.join_next().await.is_some() {}
    tracing::info!(
        transactions = counter.load(Ordering::SeqCst),
        "producer stopped"
    );
    Ok(())
}

async fn writer(
    args: Arc<Args>,
    pool: PgPool,
    outbox: Outbox,
    counter: Arc<AtomicU64>,
    mut rng: StdRng,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        let crash_point = (args.crash_at_txn == Some(n)).then_some(args.crash_point);
        if let Err(error) = transaction(&args, &pool, &outbox, &mut rng, crash_point).await {
            // Connection terminated, Postgres busy, ...: the attempt is simply not committed
            // (or, if the commit reached the server, committed: the checker asks the table).
            tracing::warn!(%error, "producer transaction failed");
        }
        let pause = rng.random_range(args.pause_min_ms..=args.pause_max_ms.max(args.pause_min_ms));
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
        }
    }
}

async fn transaction(
    args: &Args,
    pool: &PgPool,
    outbox: &Outbox,
    rng: &mut StdRng,
    crash_point: Option<CrashPoint>,
) -> Result<()> {
    let count = rng.random_range(1..=3_usize);
    let mut keys: Vec<String> = (0..count)
        .map(|_| key_name(rng.random_range(0..args.keys)))
        .collect();
    // One lock order for every writer: no deadlocks between them.
    keys.sort();
    let ids: Vec<Uuid> = keys.iter().map(|_| *EventId::new().as_uuid()).collect();
    sqlx::query(
        "INSERT INTO chaos_attempts (event_id, key) SELECT * FROM UNNEST($1::uuid[], $2::text[])",
    )
    .bind(&ids)
    .bind(&keys)
    .execute(pool)
    .await?;
    let mut tx = pool.begin().await?;
    for (id, key) in ids.iter().zip(&keys) {
        let pad = "x".repeat(rng.random_range(0..200));
        write_event(&mut tx, outbox, &args.common.topic, *id, key, pad).await?;
    }
    if crash_point == Some(CrashPoint::BeforeCommit) {
        crash(EXIT_PRODUCER_BEFORE_COMMIT, "producer: transaction open");
    }
    if rng.random_range(0..100) < args.rollback_percent {
        tx.rollback().await?;
        return Ok(());
    }
    tx.commit().await?;
    if crash_point == Some(CrashPoint::AfterCommit) {
        crash(EXIT_PRODUCER_AFTER_COMMIT, "producer: just committed");
    }
    Ok(())
}

/// One state change and its event, on `conn`'s transaction: the key's version goes up by one,
/// the change is logged, and the event (carrying the new version and `pad`) is enqueued.
/// The id must have been recorded in `chaos_attempts` before the transaction began. The
/// orchestrator writes through this too (the long-fault phase's stuck key).
pub(crate) async fn write_event(
    conn: &mut PgConnection,
    outbox: &Outbox,
    topic: &str,
    id: Uuid,
    key: &str,
    pad: String,
) -> Result<i64> {
    let version: i64 = sqlx::query_scalar(
        "UPDATE chaos_state SET version = version + 1 WHERE key = $1 RETURNING version",
    )
    .bind(key)
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("INSERT INTO chaos_state_log (event_id, key, version) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(key)
        .bind(version)
        .execute(&mut *conn)
        .await?;
    let payload = ChaosPayload {
        key: key.to_owned(),
        version,
        pad,
    };
    let event = NewEvent::new(AGGREGATE_TYPE, key, EVENT_TYPE, &payload)?
        .with_id(EventId::from_uuid(id))
        .with_topic(topic)?;
    outbox.enqueue(conn, &event).await?;
    Ok(version)
}
