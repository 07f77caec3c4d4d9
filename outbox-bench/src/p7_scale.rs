//! P7: the relay's stats, its claim and pruning at 10M pending and 10M published rows, each
//! against the same operation on a small outbox measured in the same run (interleaved), and
//! P2's claim+mark SQL with and without the partial index on `published_at`.
//!
//! The outboxes are the real table, created by the migrations in schemas of their own; the
//! large one is loaded with `INSERT ... SELECT generate_series` with its indexes dropped, then
//! recreated from the definitions the migrations gave them (read back from `pg_indexes`) and
//! checked identical, then `VACUUM ANALYZE`d. The statements measured are the framework's own:
//! `stats()` and `prune_published()` are called; the claim's text is captured from sqlx's
//! statement log while a relay runs one batch, then executed as the relay does (unnamed, in a
//! transaction rolled back so every sample claims the same rows). Plans (`EXPLAIN (ANALYZE,
//! BUFFERS)`, custom and generic) are written next to the JSON results (`p7_explain.txt`).
//!
//! Takes about 15 minutes with 10M + 10M rows (loading is most of it), ~8 GB of disk while it
//! runs; the large schemas are dropped at the end. Not in the default set: `--only p7`.
//!
//! Figures of one run (2 cores shared with another workload, PostgreSQL 15, 128 MB shared
//! buffers): see the "P7" section of the guide's benchmarks page.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use outbox_producer::{
    OutboxStats, Relay, RelayConfig, STATS_COUNT_CAP, TableNames, producer_config,
};
use outbox_tests::{TestDb, kafka_bootstrap, table_blocks_accessed};
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, Row};
use tracing::instrument::WithSubscriber;

use crate::Settings;
use crate::p2_relay::fill;
use crate::sample::{Figure, Sample};

/// Pending rows, and published rows, of the small outbox (the baseline of stats and claim).
const SMALL: i64 = 10_000;
/// Published rows of the prune baseline.
const MEDIUM: i64 = 100_000;
/// Rows each interleaved prune sample deletes (the oldest; rounds x SLICE must leave the
/// 100k outbox rows older than a week for the `--older-than 7d` run).
const SLICE: i64 = 5_000;
/// Rows per prune statement: the CLI's default.
const PRUNE_BATCH: u32 = 1_000;
/// The relay batch whose claim is timed.
const CLAIM_BATCH: u32 = 500;
/// Published rows' `published_at` spans this many days, up to now.
const HISTORY_DAYS: i64 = 14;
/// `prune published --older-than 7d`.
const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);
const TOPIC: &str = "outbox.bench.p7";
/// Rows of each drain planned from stale statistics (each claim can cost O(rows x batch)).
const STALE_EVENTS: usize = 10_000;

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Seconds spent on each step of a load.
#[derive(Debug, Clone, Copy)]
struct Load {
    insert: f64,
    index: f64,
    vacuum: f64,
}

impl Load {
    fn total(&self) -> f64 {
        self.insert + self.index + self.vacuum
    }
}

/// The names and definitions of the outbox's indexes in `schema`.
async fn indexes(conn: &mut PgConnection, schema: &str) -> Result<Vec<(String, String)>> {
    Ok(sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes \
         WHERE schemaname = $1 AND tablename = 'outbox_events' ORDER BY indexname",
    )
    .bind(schema)
    .fetch_all(conn)
    .await?)
}

/// Published rows older than a week.
async fn due(conn: &mut PgConnection) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox_events WHERE status = 'published' \
         AND published_at < now() - interval '7 days'",
    )
    .fetch_one(conn)
    .await?)
}

/// Fills `db`'s outbox with `published` rows published over the last `HISTORY_DAYS` days
/// (older rows first, as a relay leaves them) followed by `pending` rows, 1,000 keys.
async fn load(db: &TestDb, pending: i64, published: i64) -> Result<Load> {
    let mut conn = db.pool.acquire().await?;
    sqlx::query("SET maintenance_work_mem = '512MB'")
        .execute(&mut *conn)
        .await?;
    let before = indexes(&mut conn, &db.schema).await?;
    ensure!(
        before.len() == 5,
        "expected the migrations' 5 indexes, found {before:?}"
    );
    let primary_key: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = 'outbox_events'::regclass AND conname = 'outbox_events_pkey'",
    )
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_pkey")
        .execute(&mut *conn)
        .await?;
    for (name, _) in before.iter().filter(|(n, _)| n != "outbox_events_pkey") {
        sqlx::query(AssertSqlSafe(format!("DROP INDEX {name}")))
            .execute(&mut *conn)
            .await?;
    }

    let started = Instant::now();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, \
                                    created_at, status, attempts, next_attempt_at, published_at) \
         SELECT gen_random_uuid(), 'invoice', 'k' || (g % 1000), 'Decided', \
                jsonb_build_object('n', g, 'decision', 'send_invoice', 'cents', 1200), $3, \
                t.at - interval '1 second', 'published', 1, t.at - interval '1 second', t.at \
         FROM generate_series(1, $1::bigint) AS g, \
              LATERAL (SELECT now() - $2 * interval '1 day' \
                              + (g / $1::float8) * ($2 * interval '1 day')) AS t(at)",
    )
    .bind(published)
    .bind(HISTORY_DAYS as f64)
    .bind(TOPIC)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, \
                                    created_at, next_attempt_at) \
         SELECT gen_random_uuid(), 'invoice', 'k' || (g % 1000), 'Decided', \
                jsonb_build_object('n', g, 'decision', 'send_invoice', 'cents', 1200), $2, \
                t.at, t.at \
         FROM generate_series(1, $1::bigint) AS g, \
              LATERAL (SELECT now() - ($1 - g) * interval '1 millisecond') AS t(at)",
    )
    .bind(pending)
    .bind(TOPIC)
    .execute(&mut *conn)
    .await?;
    let insert = started.elapsed().as_secs_f64();

    let started = Instant::now();
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_pkey {primary_key}"
    )))
    .execute(&mut *conn)
    .await?;
    for (_, definition) in before.iter().filter(|(n, _)| n != "outbox_events_pkey") {
        sqlx::query(AssertSqlSafe(definition.clone()))
            .execute(&mut *conn)
            .await?;
    }
    let index = started.elapsed().as_secs_f64();
    let after = indexes(&mut conn, &db.schema).await?;
    ensure!(
        after == before,
        "indexes differ from the migrations': {after:?} vs {before:?}"
    );

    let started = Instant::now();
    sqlx::query("VACUUM ANALYZE outbox_events")
        .execute(&mut *conn)
        .await?;
    let vacuum = started.elapsed().as_secs_f64();
    let counts: (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'pending'), \
                count(*) FILTER (WHERE status = 'published') FROM outbox_events",
    )
    .fetch_one(&mut *conn)
    .await?;
    ensure!(
        counts == (pending, published),
        "loaded {counts:?}, wanted {pending} pending and {published} published"
    );
    Ok(Load {
        insert,
        index,
        vacuum,
    })
}

/// The framework's claim, stats and prune statements, as sqlx sent them.
struct Statements {
    claim: String,
    stats: String,
    prune: String,
}

async fn statements() -> Result<Statements> {
    let probe = TestDb::with_pool_size(1).await?;
    fill(&probe.pool, TOPIC, 1).await?;
    let relay = Relay::new(
        probe.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().batch_size(CLAIM_BATCH).listen(false),
    )?;
    let captured = outbox_tests::Statements::default();
    async {
        relay.run_once_without_publishing().await?;
        let mut conn = probe.pool.acquire().await?;
        outbox_producer::stats(&mut conn, &TableNames::default()).await?;
        outbox_producer::prune_published(&mut conn, &TableNames::default(), WEEK, PRUNE_BATCH)
            .await?;
        anyhow::Ok(())
    }
    .with_subscriber(tracing::Dispatch::new(captured.clone()))
    .await?;
    Ok(Statements {
        claim: captured.containing("claimed AS")?,
        stats: captured.containing("oldest_pending_age_ms")?,
        prune: captured.containing("DELETE FROM")?,
    })
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of `statement` with `args` as a custom and as a generic plan,
/// in transactions rolled back. `setup` runs first in each (e.g. a `SET LOCAL`).
async fn explain(
    conn: &mut PgConnection,
    statement: &str,
    types: &str,
    args: &str,
    setup: &str,
) -> Result<Vec<(String, Vec<String>)>> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "PREPARE p7_explained({types}) AS {statement}"
    )))
    .execute(&mut *conn)
    .await?;
    let mut plans = Vec::new();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "BEGIN; SET LOCAL plan_cache_mode = {mode}; {setup}"
        )))
        .execute(&mut *conn)
        .await?;
        let rows = sqlx::raw_sql(AssertSqlSafe(format!(
            "EXPLAIN (ANALYZE, BUFFERS) EXECUTE p7_explained({args})"
        )))
        .fetch_all(&mut *conn)
        .await;
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
        let lines = rows?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<Vec<_>, _>>()?;
        plans.push((mode.trim_start_matches("force_").to_owned(), lines));
    }
    sqlx::raw_sql("DEALLOCATE p7_explained")
        .execute(&mut *conn)
        .await?;
    Ok(plans)
}

/// One line per plan: its scans, the top node's buffers and the execution time.
fn summary(plan: &[String]) -> String {
    let scans: Vec<&str> = plan
        .iter()
        .map(|l| l.trim().trim_start_matches("->").trim())
        .filter(|l| l.contains("Scan"))
        .map(|l| l.split("  (").next().unwrap_or(l))
        .collect();
    let buffers = plan
        .iter()
        .find(|l| l.trim().starts_with("Buffers:"))
        .map_or("", |l| l.trim());
    let time = plan
        .iter()
        .find(|l| l.starts_with("Execution Time"))
        .map_or("", String::as_str);
    // JIT compiles plans whose estimated cost passes `jit_above_cost`: on large tables, the
    // compile can outweigh the scan.
    let jit = plan
        .iter()
        .find(|l| l.trim().starts_with("Timing: Generation"))
        .and_then(|l| l.split("Total ").nth(1))
        .map_or_else(String::new, |t| format!(" | JIT {t}"));
    format!("{} | top {buffers} | {time}{jit}", scans.join("; "))
}

async fn explain_and_record(
    report: &mut String,
    title: &str,
    conn: &mut PgConnection,
    statement: &str,
    types: &str,
    args: &str,
    setup: &str,
) -> Result<()> {
    writeln!(report, "=== {title}\n{statement}\n")?;
    for (mode, plan) in explain(conn, statement, types, args, setup).await? {
        eprintln!("P7 EXPLAIN {title} ({mode}): {}", summary(&plan));
        writeln!(report, "--- {mode} plan\n{}\n", plan.join("\n"))?;
    }
    Ok(())
}

async fn time_stats(conn: &mut PgConnection) -> Result<(f64, OutboxStats)> {
    let started = Instant::now();
    let stats = outbox_producer::stats(conn, &TableNames::default()).await?;
    Ok((ms(started), stats))
}

/// One claim of `CLAIM_BATCH` rows as the relay runs it (JIT off for its transaction), rolled
/// back.
async fn time_claim(conn: &mut PgConnection, claim: &str) -> Result<f64> {
    let mut tx = conn.begin().await?;
    sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
    let started = Instant::now();
    let rows = sqlx::query(AssertSqlSafe(claim.to_owned()))
        .bind(i64::from(CLAIM_BATCH))
        .persistent(false)
        .fetch_all(&mut *tx)
        .await?;
    let elapsed = ms(started);
    tx.rollback().await?;
    ensure!(
        rows.len() == CLAIM_BATCH as usize,
        "claimed {} rows",
        rows.len()
    );
    Ok(elapsed)
}

/// One relay SQL cycle (claim, mark published, commit) of `CLAIM_BATCH` rows.
async fn time_cycle(relay: &Relay) -> Result<f64> {
    let started = Instant::now();
    let report = relay.run_once_without_publishing().await?;
    let elapsed = ms(started);
    ensure!(
        report.claimed == CLAIM_BATCH as usize,
        "claimed {}",
        report.claimed
    );
    Ok(elapsed)
}

/// Prunes the `SLICE` oldest published rows with `prune_published`; milliseconds per 10k rows.
async fn time_prune_slice(conn: &mut PgConnection) -> Result<f64> {
    let older_ms: f64 = sqlx::query_scalar(
        "SELECT (extract(epoch FROM now() - published_at) * 1000)::float8 FROM outbox_events \
         WHERE status = 'published' ORDER BY published_at OFFSET $1 LIMIT 1",
    )
    .bind(SLICE)
    .fetch_one(&mut *conn)
    .await?;
    let older_than = Duration::from_secs_f64(older_ms / 1000.0);
    let started = Instant::now();
    let pruned =
        outbox_producer::prune_published(conn, &TableNames::default(), older_than, PRUNE_BATCH)
            .await?;
    let elapsed = ms(started);
    ensure!(
        pruned.abs_diff(SLICE as u64) <= 10,
        "pruned {pruned} rows, wanted {SLICE}"
    );
    Ok(elapsed * 10_000.0 / pruned as f64)
}

/// One of the two runs of the large prune.
#[derive(Debug, Clone, Copy, Default)]
struct Half {
    rows: u64,
    ms: f64,
    /// Heap and index blocks of the outbox table read or found in shared buffers.
    blocks: i64,
}

/// Whether some session of this database holds the prune lock of the `outbox_events` table
/// this pool's schema resolves to (the lock is keyed by the table's oid).
async fn prune_lock_held(pool: &PgPool) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND classid = hashtext('outbox_prune')::oid AND objid = hashtext('outbox_events'::regclass::oid::text)::oid \
           AND objsubid = 2)",
    )
    .fetch_one(pool)
    .await?)
}

/// Claim+mark SQL (no Kafka) rows per second for `relay` to empty `events` fresh rows.
/// The table's statistics are refreshed after the fill, so that both variants plan the claim
/// from what the table holds (see `stale_drain_rate` for when they do not).
async fn sql_drain_rate(pool: &PgPool, relay: &Relay, events: usize) -> Result<f64> {
    sqlx::query("TRUNCATE outbox_events").execute(pool).await?;
    fill(pool, TOPIC, events).await?;
    sqlx::query("ANALYZE outbox_events").execute(pool).await?;
    drain_rate(relay, events).await
}

/// The same drain where the statistics last saw the table with every row published (a quiet
/// outbox autovacuum analyzed, then a burst): what the claim plans from then. With `analyze`,
/// the baseline: the statistics refreshed after the burst.
async fn stale_drain_rate(
    pool: &PgPool,
    relay: &Relay,
    events: usize,
    analyze: bool,
) -> Result<f64> {
    sqlx::query("TRUNCATE outbox_events").execute(pool).await?;
    fill(pool, TOPIC, events).await?;
    sqlx::query(
        "UPDATE outbox_events SET status = 'published', published_at = now(), attempts = 1",
    )
    .execute(pool)
    .await?;
    sqlx::query("ANALYZE outbox_events").execute(pool).await?;
    sqlx::query("TRUNCATE outbox_events").execute(pool).await?;
    fill(pool, TOPIC, events).await?;
    if analyze {
        sqlx::query("ANALYZE outbox_events").execute(pool).await?;
    }
    drain_rate(relay, events).await
}

/// Claim+mark cycles until the outbox is empty; rows per second.
async fn drain_rate(relay: &Relay, events: usize) -> Result<f64> {
    let started = Instant::now();
    let mut moved = 0;
    loop {
        let report = relay.run_once_without_publishing().await?;
        if report.claimed == 0 {
            break;
        }
        moved += report.published;
    }
    let elapsed = started.elapsed();
    ensure!(moved == events, "relay moved {moved} of {events} rows");
    Ok(events as f64 / elapsed.as_secs_f64())
}

fn single(v: f64) -> Sample {
    Sample { values: vec![v] }
}

fn count(n: i64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let rounds = settings.rounds;
    ensure!(
        rounds as i64 * SLICE <= MEDIUM / 4,
        "P7 runs at most {} rounds",
        MEDIUM / 4 / SLICE
    );
    let big_n = settings.scale_rows;
    let (big_name, cap_name) = (count(big_n), count(STATS_COUNT_CAP));
    let mut report = String::new();
    let mut figures = Vec::new();

    // P2 re-check first, on small tables: what the partial index on published_at costs the
    // claim+mark SQL (every marked row adds an entry).
    let with_index = TestDb::new().await?;
    let without_index = TestDb::new().await?;
    sqlx::query("DROP INDEX outbox_events_published_at_idx")
        .execute(&without_index.pool)
        .await?;
    let stale = TestDb::new().await?;
    // Only the bench refreshes these tables' statistics, each sample the same way.
    for db in [&with_index, &without_index, &stale] {
        sqlx::query("ALTER TABLE outbox_events SET (autovacuum_enabled = false)")
            .execute(&db.pool)
            .await?;
    }
    let relay_with = crate::p2_relay::relay(&with_index.pool, settings)?;
    let relay_without = crate::p2_relay::relay(&without_index.pool, settings)?;
    let [mut marked_with, mut marked_without]: [Sample; 2] = Default::default();
    for round in 0..rounds {
        let first_with = round % 2 == 0;
        for with in [first_with, !first_with] {
            if with {
                marked_with
                    .push(sql_drain_rate(&with_index.pool, &relay_with, settings.events).await?);
            } else {
                marked_without.push(
                    sql_drain_rate(&without_index.pool, &relay_without, settings.events).await?,
                );
            }
        }
        eprintln!(
            "P7 round {round}: claim+mark SQL {:.0} ev/s with the published_at index, {:.0} without",
            marked_with.values[round], marked_without.values[round]
        );
    }
    figures.push(Figure::at_least(
        "P7",
        "claim+mark SQL, with published_at index",
        "ev/s",
        marked_with,
        "same, index dropped",
        marked_without,
        Some(0.9),
    ));
    let relay_stale = crate::p2_relay::relay(&stale.pool, settings)?;
    let [mut stale_rate, mut fresh_rate]: [Sample; 2] = Default::default();
    for round in 0..rounds {
        let stale_first = round % 2 == 0;
        for analyze in [!stale_first, stale_first] {
            let rate = stale_drain_rate(&stale.pool, &relay_stale, STALE_EVENTS, analyze).await?;
            if analyze {
                fresh_rate.push(rate);
            } else {
                stale_rate.push(rate);
            }
        }
        eprintln!(
            "P7 round {round}: claim+mark SQL of {STALE_EVENTS} rows {:.0} ev/s when the statistics saw only published rows, {:.0} after ANALYZE",
            stale_rate.values[round], fresh_rate.values[round]
        );
    }
    figures.push(Figure::at_least(
        "P7",
        "claim+mark SQL, statistics of all-published",
        "ev/s",
        stale_rate,
        "same after ANALYZE",
        fresh_rate,
        Some(0.5),
    ));

    let sql = statements().await?;
    let big = TestDb::new().await?;
    let capped = TestDb::new().await?;
    let medium = TestDb::new().await?;
    let small = TestDb::new().await?;
    eprintln!("P7 setup: loading {big_n} pending + {big_n} published rows");
    let big_load = load(&big, big_n, big_n).await?;
    eprintln!(
        "P7 setup: {big_n} + {big_n} rows loaded in {:.0} s (insert {:.0} s, indexes {:.0} s, vacuum analyze {:.0} s)",
        big_load.total(),
        big_load.insert,
        big_load.index,
        big_load.vacuum
    );
    let small_load = load(&small, SMALL, SMALL).await?;
    load(&capped, STATS_COUNT_CAP, SMALL).await?;
    load(&medium, SMALL, MEDIUM).await?;
    writeln!(
        report,
        "load of {big_n} pending + {big_n} published rows: insert {:.1} s, indexes {:.1} s, vacuum analyze {:.1} s",
        big_load.insert, big_load.index, big_load.vacuum
    )?;
    figures.push(Figure::cost(
        "P7",
        format!("load {big_name}+{big_name} rows (insert,index,vacuum)"),
        "s",
        single(big_load.total()),
        "load 10k+10k rows",
        single(small_load.total()),
        None,
    ));

    let mut big_conn = big.pool.acquire().await?;
    let mut capped_conn = capped.pool.acquire().await?;
    let mut medium_conn = medium.pool.acquire().await?;
    let mut small_conn = small.pool.acquire().await?;

    // stats(): interleaved, after one warm-up call each (the statement's preparation).
    for conn in [&mut big_conn, &mut capped_conn, &mut small_conn] {
        time_stats(conn).await?;
    }
    let [mut stats_big, mut stats_capped, mut stats_small]: [Sample; 3] = Default::default();
    for round in 0..rounds {
        let (ms_big, s) = time_stats(&mut big_conn).await?;
        ensure!(
            s.pending == STATS_COUNT_CAP.min(big_n),
            "stats counted {} pending",
            s.pending
        );
        let (ms_capped, _) = time_stats(&mut capped_conn).await?;
        let (ms_small, s) = time_stats(&mut small_conn).await?;
        ensure!(s.pending == SMALL, "stats counted {} pending", s.pending);
        stats_big.push(ms_big);
        stats_capped.push(ms_capped);
        stats_small.push(ms_small);
        eprintln!(
            "P7 round {round}: stats() {ms_big:.1} ms at {big_name} pending, {ms_capped:.1} ms at {cap_name}, {ms_small:.1} ms at 10k"
        );
    }
    figures.push(Figure::cost(
        "P7",
        format!("stats() at {big_name} pending"),
        "ms",
        stats_big.clone(),
        "stats() at 10k pending",
        stats_small,
        None,
    ));
    figures.push(Figure::cost(
        "P7",
        format!("stats() at {big_name} pending"),
        "ms",
        stats_big,
        format!("stats() at {cap_name} pending (count cap)"),
        stats_capped,
        Some(1.5),
    ));
    explain_and_record(
        &mut report,
        &format!("stats() at {big_name} pending"),
        &mut big_conn,
        &sql.stats,
        "bigint",
        &STATS_COUNT_CAP.to_string(),
        "",
    )
    .await?;
    explain_and_record(
        &mut report,
        &format!("stats() at {big_name} pending, no index-only scan (visibility map unset)"),
        &mut big_conn,
        &sql.stats,
        "bigint",
        &STATS_COUNT_CAP.to_string(),
        "SET LOCAL enable_indexonlyscan = off",
    )
    .await?;

    // The claim of one batch, rolled back: every sample claims the same rows. Beside it, the
    // claim as it was before this benchmark: its held-rows check free to become an anti-join
    // (no `OFFSET 0`), which the planner ran as a scan of the backlog.
    let held_check = " OFFSET 0) ORDER BY seq LIMIT $1";
    ensure!(
        sql.claim.matches(held_check).count() == 1,
        "the claim's text changed: {}",
        sql.claim
    );
    let per_row_claim = sql.claim.replace(held_check, ") ORDER BY seq LIMIT $1");
    for conn in [&mut big_conn, &mut small_conn] {
        time_claim(conn, &sql.claim).await?;
        time_claim(conn, &per_row_claim).await?;
    }
    let [
        mut claim_big,
        mut claim_small,
        mut per_row_big,
        mut per_row_small,
    ]: [Sample; 4] = Default::default();
    for round in 0..rounds {
        let big_first = round % 2 == 0;
        for is_big in [big_first, !big_first] {
            if is_big {
                claim_big.push(time_claim(&mut big_conn, &sql.claim).await?);
                per_row_big.push(time_claim(&mut big_conn, &per_row_claim).await?);
            } else {
                claim_small.push(time_claim(&mut small_conn, &sql.claim).await?);
                per_row_small.push(time_claim(&mut small_conn, &per_row_claim).await?);
            }
        }
        eprintln!(
            "P7 round {round}: claim of {CLAIM_BATCH} {:.1} ms at {big_name} pending, {:.1} ms at 10k; \
             as an anti-join (before) {:.1} ms at {big_name}, {:.1} ms at 10k",
            claim_big.values[round],
            claim_small.values[round],
            per_row_big.values[round],
            per_row_small.values[round]
        );
    }
    figures.push(Figure::cost(
        "P7",
        format!("claim of {CLAIM_BATCH} rows at {big_name} pending"),
        "ms",
        claim_big.clone(),
        "same at 10k pending",
        claim_small,
        Some(2.0),
    ));
    figures.push(Figure::cost(
        "P7",
        format!("claim, held check as an anti-join (before), at {big_name}"),
        "ms",
        per_row_big.clone(),
        "same at 10k pending",
        per_row_small,
        Some(2.0),
    ));
    figures.push(Figure::cost(
        "P7",
        format!("claim, held check as an anti-join (before), at {big_name}"),
        "ms",
        per_row_big,
        format!("the framework's claim at {big_name}"),
        claim_big,
        None,
    ));
    for (title, claim) in [
        (
            format!("claim of {CLAIM_BATCH} at {big_name} pending"),
            &sql.claim,
        ),
        (
            format!(
                "claim of {CLAIM_BATCH} at {big_name} pending, held check as an anti-join (before)"
            ),
            &per_row_claim,
        ),
    ] {
        explain_and_record(
            &mut report,
            &title,
            &mut big_conn,
            claim,
            "bigint",
            &CLAIM_BATCH.to_string(),
            "",
        )
        .await?;
    }

    // A whole SQL cycle of the relay: claim, mark published, commit (rows leave pending).
    let relay_config = RelayConfig::default().batch_size(CLAIM_BATCH);
    let producer = producer_config(&kafka_bootstrap());
    let relay_big = Relay::new(big.pool.clone(), &producer, relay_config.clone())?;
    let relay_small = Relay::new(small.pool.clone(), &producer, relay_config)?;
    let [mut cycle_big, mut cycle_small]: [Sample; 2] = Default::default();
    for round in 0..rounds {
        let big_first = round % 2 == 0;
        for is_big in [big_first, !big_first] {
            if is_big {
                cycle_big.push(time_cycle(&relay_big).await?);
            } else {
                cycle_small.push(time_cycle(&relay_small).await?);
            }
        }
        eprintln!(
            "P7 round {round}: claim+mark+commit of {CLAIM_BATCH} {:.1} ms at {big_name}, {:.1} ms at 10k",
            cycle_big.values[round], cycle_small.values[round]
        );
    }
    figures.push(Figure::cost(
        "P7",
        format!("claim+mark+commit {CLAIM_BATCH} at {big_name}+{big_name}"),
        "ms",
        cycle_big,
        "same at 10k+10k",
        cycle_small,
        None,
    ));

    // Pruning: the SLICE oldest published rows per sample, at 10M and at 100k published.
    let [mut prune_big, mut prune_medium]: [Sample; 2] = Default::default();
    for round in 0..rounds {
        let big_first = round % 2 == 0;
        for is_big in [big_first, !big_first] {
            if is_big {
                prune_big.push(time_prune_slice(&mut big_conn).await?);
            } else {
                prune_medium.push(time_prune_slice(&mut medium_conn).await?);
            }
        }
        eprintln!(
            "P7 round {round}: prune {:.1} ms per 10k rows at {big_name} published, {:.1} ms at 100k",
            prune_big.values[round], prune_medium.values[round]
        );
    }
    figures.push(Figure::cost(
        "P7",
        format!("prune, per 10k rows, at {big_name} published"),
        "ms",
        prune_big,
        "same at 100k published",
        prune_medium,
        Some(1.5),
    ));
    let week_ms = (WEEK.as_millis() as f64).to_string();
    for (at, conn) in [
        (big_name.as_str(), &mut big_conn),
        ("100k", &mut medium_conn),
    ] {
        explain_and_record(
            &mut report,
            &format!("prune DELETE (older than 7d, batch {PRUNE_BATCH}) at {at} published"),
            conn,
            &sql.prune,
            "float8, bigint, timestamptz",
            &format!("{week_ms}, {PRUNE_BATCH}, NULL"),
            "",
        )
        .await?;
    }

    // `prune published --older-than 7d` for real: about half the published rows, first at
    // 100k published, then at 10M. While the latter runs, a second pruner of the same table,
    // and one of another schema's outbox_events.
    let started = Instant::now();
    let pruned_medium = outbox_producer::prune_published(
        &mut medium_conn,
        &TableNames::default(),
        WEEK,
        PRUNE_BATCH,
    )
    .await?;
    let week_medium_ms = ms(started);
    ensure!(pruned_medium > 0, "nothing to prune at 100k");
    // A pruner with nothing due, for the cost of a call that does no work.
    let started = Instant::now();
    let nothing = outbox_producer::prune_published(
        &mut medium_conn,
        &TableNames::default(),
        WEEK,
        PRUNE_BATCH,
    )
    .await?;
    let nothing_ms = ms(started);
    ensure!(nothing == 0, "pruned {nothing} rows twice");

    let path = settings.json.with_file_name("p7_explain.txt");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&path, &report)?;
    let big_due = due(&mut big_conn).await?;
    eprintln!("P7: prune --older-than 7d of {big_due} rows at {big_name} published");
    // In two runs, the older half first (older than 10.5 of the 14 days): if a run's work grew
    // with what it had already deleted, the second half would read more blocks per row than
    // the first, on the same table.
    let big_schema = big.schema.clone();
    // Autovacuum would start on the table midway (a fifth of its rows dead) and count its own
    // reads of the whole table, and its I/O, into the second half.
    sqlx::query("ALTER TABLE outbox_events SET (autovacuum_enabled = false)")
        .execute(&mut *big_conn)
        .await?;
    let first = tokio::spawn(async move {
        let mut halves = [Half::default(); 2];
        for (half, older_than) in halves.iter_mut().zip([WEEK * 3 / 2, WEEK]) {
            let blocks = table_blocks_accessed(&mut big_conn, &big_schema, "outbox_events").await?;
            let started = Instant::now();
            half.rows = outbox_producer::prune_published(
                &mut big_conn,
                &TableNames::default(),
                older_than,
                PRUNE_BATCH,
            )
            .await?;
            half.ms = ms(started);
            half.blocks =
                table_blocks_accessed(&mut big_conn, &big_schema, "outbox_events").await? - blocks;
        }
        anyhow::Ok(halves)
    });
    let waiting = Instant::now();
    while !prune_lock_held(&big.pool).await? {
        ensure!(
            waiting.elapsed() < Duration::from_secs(30),
            "the first pruner never took its lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut second_conn = big.pool.acquire().await?;
    let started = Instant::now();
    let second = outbox_producer::prune_published(
        &mut second_conn,
        &TableNames::default(),
        WEEK,
        PRUNE_BATCH,
    )
    .await?;
    let second_ms = ms(started);
    let first_running = !first.is_finished();
    let small_due = due(&mut small_conn).await?;
    let other = outbox_producer::prune_published(
        &mut small_conn,
        &TableNames::default(),
        WEEK,
        PRUNE_BATCH,
    )
    .await?;
    let other_while_running = !first.is_finished();
    eprintln!(
        "P7: second pruner of the same table returned {second} in {second_ms:.1} ms (first still running: {first_running}); \
         a pruner of another schema's outbox_events ({small_due} rows due) returned {other} (first still running: {other_while_running})"
    );
    let halves = first.await??;
    let (pruned, week_big_ms) = (halves[0].rows + halves[1].rows, halves[0].ms + halves[1].ms);
    let per_10k = |v: f64, rows: u64| v * 10_000.0 / rows.max(1) as f64;
    // Rows keep turning a week old while it runs (one every 121 ms at 10M over 14 days).
    ensure!(
        pruned >= big_due as u64,
        "pruned {pruned} of the {big_due} due"
    );
    eprintln!(
        "P7: prune --older-than 7d: {pruned} rows in {:.1} s at {big_name} published (older half {:?}, newer {:?}), {pruned_medium} rows in {:.2} s at 100k",
        week_big_ms / 1000.0,
        halves[0],
        halves[1],
        week_medium_ms / 1000.0
    );
    writeln!(
        report,
        "prune --older-than 7d: {pruned} rows in {week_big_ms:.0} ms at {big_name} published; {pruned_medium} rows in {week_medium_ms:.0} ms at 100k\n\
         second pruner of the same table: {second} rows in {second_ms:.1} ms (first running: {first_running}); \
         pruner of another schema's outbox_events: {other} of {small_due} due (first running: {other_while_running})"
    )?;
    let [older, newer] = halves;
    figures.push(Figure::cost(
        "P7",
        format!("prune 7d, newer {}, blocks per 10k", count_rows(newer.rows)),
        "blocks",
        single(per_10k(newer.blocks as f64, newer.rows)),
        format!("its older {}, run first", count_rows(older.rows)),
        single(per_10k(older.blocks as f64, older.rows)),
        Some(1.5),
    ));
    // Time is not the target: the halves' times also hold the writing back of what the run
    // dirtied (gigabytes of heap through 128 MB of shared buffers, and checkpoints), which
    // the first half leaves to the second; 35k rows stay in memory.
    figures.push(Figure::cost(
        "P7",
        format!(
            "prune 7d, newer {}, per 10k, at {big_name}",
            count_rows(newer.rows)
        ),
        "ms",
        single(per_10k(newer.ms, newer.rows)),
        format!("its older {}, run first", count_rows(older.rows)),
        single(per_10k(older.ms, older.rows)),
        None,
    ));
    figures.push(Figure::cost(
        "P7",
        format!("prune 7d ({}), per 10k, at {big_name}", count_rows(pruned)),
        "ms",
        single(per_10k(week_big_ms, pruned)),
        format!("prune 7d ({}) at 100k", count_rows(pruned_medium)),
        single(per_10k(week_medium_ms, pruned_medium)),
        None,
    ));
    let mut concurrent = Figure::cost(
        "P7",
        "second pruner while one prunes (same table)",
        "ms",
        single(second_ms),
        "a pruner with nothing due",
        single(nothing_ms),
        None,
    );
    concurrent.target = "returns 0 at once".into();
    concurrent.met = Some(second == 0 && first_running);
    figures.push(concurrent);
    let mut other_schema = Figure::at_least(
        "P7",
        "pruner of another schema's outbox_events",
        "rows",
        single(other as f64),
        "its rows due",
        single(small_due as f64),
        None,
    );
    other_schema.target = "prunes its own table".into();
    other_schema.met = Some(other as i64 == small_due);
    figures.push(other_schema);

    std::fs::write(&path, report)?;
    eprintln!("P7 plans written to {}", path.display());
    for db in [&big, &capped] {
        sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", db.schema)))
            .execute(&small.pool)
            .await?;
    }
    Ok(figures)
}

fn count_rows(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{:.1}M rows", n as f64 / 1e6)
    } else {
        format!("{:.0}k rows", n as f64 / 1e3)
    }
}
