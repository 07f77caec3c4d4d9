//! P8: the dedup store in day slices (issue 16). Each figure against a baseline of the same
//! run:
//! - dedup inserts per second (the consumer's own batch path, `process_batch` with a handler
//!   that does nothing, new UUIDv7 ids of today) with `--dedup-rows` rows retained over the
//!   past week against an empty store, interleaved;
//! - pruning one day's slice of `--slice-rows` rows (`prune`, which detaches and drops it)
//!   against the batched `DELETE` of the unsliced table the framework used before (the same
//!   rows, its old prune statement), in time and in WAL bytes;
//! - bytes per retained id (table and indexes) of a day slice against the unsliced table
//!   holding the same ids;
//! - the consumer's batch latency while a slice is dropped against the same loop just before.
//!
//! Rows are loaded with `INSERT ... SELECT generate_series`, ids in time order within a day.
//! Takes about 10 minutes and ~6 GB of disk at 20M + 2 x 5M rows; the schemas are dropped at
//! the end. Not in the default set: `--only p8`.

use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_consumer::{ConsumerConfig, DedupConsumer, Event, TableNames, ensure_dedup_slices};
use outbox_core::EventId;
use outbox_tests::{TestDb, event_message, unique};
use rdkafka::message::OwnedMessage;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::sample::{Figure, Sample, percentile};

const DAY_MS: i64 = 86_400_000;
/// Days of history the large store holds (up to yesterday), as a week's TTL keeps.
const HISTORY_DAYS: i64 = 7;
/// Messages per timed insert sample, in batches of the consumer's default size.
const INSERTS: usize = 20_000;
const BATCH: usize = 256;
/// Messages per batch in the latency loop beside a prune.
const LATENCY_BATCH: usize = 16;

async fn noop(_: &Event<serde_json::Value>, _: &mut PgConnection) -> Result<(), sqlx::Error> {
    Ok(())
}

fn today() -> i64 {
    i64::from(outbox_consumer::today())
}

/// The SQL for `rows` UUIDv7 ids of day `day`, in time order, from `generate_series` `g`.
fn ids_of_day(day: i64, rows: i64) -> String {
    // 12 hex digits of milliseconds, the version, 3 + 16 hex digits of md5 with the variant.
    format!(
        "(lpad(to_hex({day}::bigint * {DAY_MS} + (g::bigint - 1) * {DAY_MS} / {rows}), 12, '0') \
          || '7' || substr(md5(g::text), 1, 3) || '8' || substr(md5(g::text), 4, 15))::uuid"
    )
}

/// Loads `rows` dedup rows of `day` into the sliced store of `db` (the slice made first).
async fn fill_slice(db: &TestDb, day: i64, rows: i64) -> Result<()> {
    let mut conn = db.pool.acquire().await?;
    let d = i32::try_from(day)?;
    ensure_dedup_slices(&mut conn, &TableNames::default(), [d]).await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice, processed_at) \
         SELECT 'bench', {}, {day}, now() FROM generate_series(1, {rows}) AS g",
        ids_of_day(day, rows)
    )))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A schema with the tables as migrations 1-3 left them (the unsliced dedup table), holding
/// `rows` rows of `day`, the same ids as [`fill_slice`] gives.
async fn unsliced(day: i64, rows: i64) -> Result<TestDb> {
    let db = TestDb::before_migration(4).await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, processed_at) \
         SELECT 'bench', {}, now() - interval '8 days' FROM generate_series(1, {rows}) AS g",
        ids_of_day(day, rows)
    )))
    .execute(&db.pool)
    .await?;
    Ok(db)
}

async fn vacuum_analyze(pool: &PgPool) -> Result<()> {
    sqlx::query("VACUUM ANALYZE outbox_consumer_dedup")
        .execute(pool)
        .await?;
    Ok(())
}

async fn drop_schema(db: TestDb) -> Result<()> {
    let schema = db.schema.clone();
    let pool = db.pool.clone();
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(())
}

/// Fresh messages: today's UUIDv7 ids.
fn messages(n: usize) -> Vec<OwnedMessage> {
    (0..n)
        .map(|i| event_message("t", i as i64, EventId::new(), r#"{"n":1}"#))
        .collect()
}

/// Dedup inserts per second through the consumer's batch path.
async fn insert_rate(pool: &PgPool) -> Result<f64> {
    let consumer = DedupConsumer::new(pool.clone(), ConsumerConfig::new(unique("c")), noop)?;
    let all = messages(INSERTS);
    let none = CancellationToken::new();
    // The day's slice exists before the clock starts, as it does after the day's first batch.
    consumer.process_batch(&all[..1], &none).await?;
    let started = Instant::now();
    for batch in all[1..].chunks(BATCH) {
        consumer.process_batch(batch, &none).await?;
    }
    Ok((INSERTS - 1) as f64 / started.elapsed().as_secs_f64())
}

/// Bytes of table and indexes per row of the dedup table of `pool` (all its slices).
async fn bytes_per_row(pool: &PgPool) -> Result<f64> {
    let (bytes, rows): (i64, i64) = sqlx::query_as(
        // A table that is not partitioned has no partition tree: then its own size.
        "SELECT coalesce((SELECT sum(pg_total_relation_size(relid))::bigint \
                          FROM pg_partition_tree('outbox_consumer_dedup'::regclass) WHERE isleaf), \
                         pg_total_relation_size('outbox_consumer_dedup')), \
                (SELECT count(*) FROM outbox_consumer_dedup)",
    )
    .fetch_one(pool)
    .await?;
    Ok(bytes as f64 / rows.max(1) as f64)
}

async fn wal_lsn(pool: &PgPool) -> Result<String> {
    Ok(
        sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
            .fetch_one(pool)
            .await?,
    )
}

async fn wal_since(pool: &PgPool, lsn: &str) -> Result<f64> {
    Ok(sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::float8",
    )
    .bind(lsn)
    .fetch_one(pool)
    .await?)
}

/// Milliseconds per `process_batch` of [`LATENCY_BATCH`] fresh ids, until `stop`.
async fn batch_latencies(pool: PgPool, stop: CancellationToken) -> Result<Vec<f64>> {
    let consumer = DedupConsumer::new(pool, ConsumerConfig::new(unique("l")), noop)?;
    let none = CancellationToken::new();
    let mut latencies = Vec::new();
    while !stop.is_cancelled() {
        let batch = messages(LATENCY_BATCH);
        let started = Instant::now();
        consumer.process_batch(&batch, &none).await?;
        latencies.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(latencies)
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let today = today();
    let per_day = settings.dedup_rows / HISTORY_DAYS;
    let started = Instant::now();
    let big = TestDb::new().await?;
    for day in today - HISTORY_DAYS..today {
        fill_slice(&big, day, per_day).await?;
    }
    vacuum_analyze(&big.pool).await?;
    let empty = TestDb::new().await?;
    eprintln!(
        "P8 loaded {} rows over {HISTORY_DAYS} days in {:.0} s",
        per_day * HISTORY_DAYS,
        started.elapsed().as_secs_f64()
    );
    let (mut retained, mut fresh) = (Sample::default(), Sample::default());
    for round in 0..settings.rounds {
        let (a, b) = if round % 2 == 0 {
            let a = insert_rate(&big.pool).await?;
            (a, insert_rate(&empty.pool).await?)
        } else {
            let b = insert_rate(&empty.pool).await?;
            (insert_rate(&big.pool).await?, b)
        };
        eprintln!(
            "P8 round {round}: inserts/s with {}M retained {a:.0}, empty {b:.0}",
            settings.dedup_rows / 1_000_000
        );
        retained.push(a);
        fresh.push(b);
    }
    drop_schema(big).await?;
    drop_schema(empty).await?;

    // One day of `--slice-rows` rows, eight days old, in both layouts.
    let rows = settings.slice_rows;
    let day = today - 8;
    let sliced = TestDb::new().await?;
    fill_slice(&sliced, day, rows).await?;
    vacuum_analyze(&sliced.pool).await?;
    let old = unsliced(day, rows).await?;
    vacuum_analyze(&old.pool).await?;
    let (new_bytes, old_bytes) = (
        bytes_per_row(&sliced.pool).await?,
        bytes_per_row(&old.pool).await?,
    );

    // The consumer's batches just before the prune, then during it.
    let quiet_stop = CancellationToken::new();
    let quiet = tokio::spawn(batch_latencies(sliced.pool.clone(), quiet_stop.clone()));
    tokio::time::sleep(Duration::from_secs(3)).await;
    quiet_stop.cancel();
    let quiet = quiet.await??;
    let busy_stop = CancellationToken::new();
    let busy = tokio::spawn(batch_latencies(sliced.pool.clone(), busy_stop.clone()));
    let lsn = wal_lsn(&sliced.pool).await?;
    let clock = Instant::now();
    let mut conn = sliced.pool.acquire().await?;
    let pruned = outbox_consumer::prune(
        &mut conn,
        &TableNames::default(),
        Duration::from_secs(7 * 24 * 3600),
        1_000,
    )
    .await?;
    let drop_s = clock.elapsed().as_secs_f64();
    let drop_wal = wal_since(&sliced.pool, &lsn).await?;
    busy_stop.cancel();
    let busy = busy.await??;
    drop(conn);
    anyhow::ensure!(
        pruned.slices_dropped == 1,
        "the day's slice was dropped: {pruned:?}"
    );

    let lsn = wal_lsn(&old.pool).await?;
    let clock = Instant::now();
    let mut conn = old.pool.acquire().await?;
    // The statements `prune` ran on the unsliced table before issue 16, as it ran them.
    let mut deleted = 0;
    loop {
        let n = sqlx::query(
            "DELETE FROM outbox_consumer_dedup WHERE ctid = ANY(ARRAY( \
                SELECT ctid FROM outbox_consumer_dedup \
                WHERE processed_at < now() - $1 * interval '1 millisecond' LIMIT $2))",
        )
        .bind(7.0 * 24.0 * 3600.0 * 1000.0)
        .bind(1_000_i64)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        deleted += n;
        if n < 1_000 {
            break;
        }
    }
    let delete_s = clock.elapsed().as_secs_f64();
    let delete_wal = wal_since(&old.pool, &lsn).await?;
    drop(conn);
    anyhow::ensure!(
        deleted == u64::try_from(rows)?,
        "the batched DELETE removed {deleted} rows"
    );
    drop_schema(sliced).await?;
    drop_schema(old).await?;
    eprintln!(
        "P8 prune of {rows} rows: drop {drop_s:.3} s, {drop_wal:.0} WAL bytes; batched DELETE {delete_s:.1} s, {delete_wal:.0} WAL bytes; \
         batches beside it: {} (max {:.1} ms), before it: {} (max {:.1} ms)",
        busy.len(),
        busy.iter().copied().fold(0.0, f64::max),
        quiet.len(),
        quiet.iter().copied().fold(0.0, f64::max),
    );
    let one = |v: f64| Sample { values: vec![v] };
    Ok(vec![
        Figure::at_least(
            "P8",
            format!(
                "dedup inserts, {}M ids retained",
                settings.dedup_rows / 1_000_000
            ),
            "ids/s",
            retained,
            "empty dedup store",
            fresh,
            Some(0.9),
        ),
        Figure::at_most(
            "P8",
            format!("prune a day's slice of {}M ids", rows / 1_000_000),
            "s",
            one(drop_s),
            "batched DELETE of the same ids (before)",
            one(delete_s),
            None,
        ),
        Figure::at_most(
            "P8",
            format!("WAL of pruning {}M ids, slice dropped", rows / 1_000_000),
            "bytes",
            one(drop_wal),
            "batched DELETE of the same ids (before)",
            one(delete_wal),
            None,
        ),
        Figure::at_most(
            "P8",
            "bytes per retained id, day slice",
            "bytes",
            one(new_bytes),
            "unsliced table (before)",
            one(old_bytes),
            None,
        ),
        Figure::at_most(
            "P8",
            "consumer batch p99 while a slice is dropped",
            "ms",
            one(percentile(&busy, 0.99)),
            "same loop, no prune",
            one(percentile(&quiet, 0.99)),
            None,
        ),
        Figure::at_most(
            "P8",
            "consumer batch max while a slice is dropped",
            "ms",
            one(busy.iter().copied().fold(0.0, f64::max)),
            "same loop, no prune",
            one(quiet.iter().copied().fold(0.0, f64::max)),
            None,
        ),
    ])
}
