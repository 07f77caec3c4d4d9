//! P9: the dispatcher against a real HTTP billing API (`outbox_examples::billing_api`).
//!
//! - P9a: against an API that answers at once, the dispatcher (`Dispatcher::run` with the
//!   HTTP executor) vs the hand-written loop of issue 28 (claim `FOR UPDATE SKIP LOCKED`,
//!   call, mark, commit) with a reqwest client of the same settings and the same
//!   concurrency, 64 calls in flight: 2 loops claiming 32 rows each (the most a dispatcher's
//!   claim takes) and calling a batch's rows at once.
//! - P9b: at 20 ms of API latency with `max_in_flight` 64, the dispatcher's actions/s against
//!   the bound that concurrency across keys allows, 64 / 20 ms = 3,200/s, with each key's
//!   charges in the API's ledger checked to be in commit order, once each.
//! - P9c and P9d (`p9_tail_and_limit`): a slow tail of calls, and an API that limits its rate.
//!
//! The dispatcher claims (leasing its actions, and committing) on one connection as call
//! slots free up, calls each key's actions on a task of its own outside any transaction, and
//! records the verdicts as they arrive on another connection, many per transaction.
//!
//! Every run gets a fresh schema with the same actions (many keys, several actions per key,
//! enqueued key after key so that a claim holds different keys) and a fresh API.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use futures::future::try_join_all;
use outbox_examples::billing_api::{BillingApi, Charge};
use outbox_producer::NewEvent;
use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Executor, HttpExecutor};
use outbox_tests::TestDb;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::cpu::{self, CpuTimes};
use crate::p2_relay::wait_drained;
use crate::sample::{Figure, Sample};
use crate::sql_times;

const DESTINATION: &str = "bench";
const TOPIC: &str = "dispatch:bench";
/// Actions per key.
const PER_KEY: usize = 4;
/// The dispatcher's calls in flight (its default).
pub(crate) const MAX_IN_FLIGHT: usize = 64;
/// Connections opened before each run: the most the dispatcher holds at once (one claiming,
/// one recording, its `LISTEN`, its gauges' query) and `wait_drained`'s check; the loops
/// use 2.
const WARM_CONNECTIONS: usize = 5;
/// P9b's API latency.
pub(crate) const LATENCY: Duration = Duration::from_millis(20);

/// The dispatcher's settings in every figure: the defaults (claims of up to 32 actions,
/// never more than the free call slots; 64 calls in flight; no rate limit of its own).
pub(crate) fn config() -> DispatcherConfig {
    DispatcherConfig::new(DESTINATION).max_in_flight(MAX_IN_FLIGHT)
}

/// The `actions` actions' (key, number) in enqueue order: `PER_KEY` per key, key after key
/// (k0 #0, k1 #0, ..., k0 #1, ...).
pub(crate) fn enqueue_order(actions: usize) -> Vec<(usize, usize)> {
    let keys = actions.div_ceil(PER_KEY);
    (0..PER_KEY)
        .flat_map(|n| (0..keys).map(move |k| (k, n)))
        .take(actions)
        .collect()
}

/// The invoice of key `k`'s action number `n` (what its charge in the ledger names).
pub(crate) fn invoice(k: usize, n: usize) -> String {
    format!("k{k}/{n}")
}

/// Enqueues `actions` actions in [`enqueue_order`], in transactions of 1,000.
async fn fill(pool: &PgPool, actions: usize) -> Result<()> {
    for chunk in enqueue_order(actions).chunks(1_000) {
        let batch = chunk
            .iter()
            .map(|&(k, n)| {
                let key = format!("k{k}");
                let payload =
                    json!({ "invoice": invoice(k, n), "cents": 1200, "key": key, "n": n });
                Ok(NewEvent::new("task", key, "Charge", &payload)?.for_dispatcher(DESTINATION)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tx = pool.begin().await?;
        outbox_producer::enqueue_all(&mut tx, &batch).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// A fresh schema holding `actions` pending actions, and a fresh API with `latency`.
pub(crate) async fn fixture(
    actions: usize,
    latency: Option<Duration>,
) -> Result<(TestDb, BillingApi)> {
    let db = TestDb::with_pool_size(12).await?;
    fill(&db.pool, actions).await?;
    sqlx::query("VACUUM ANALYZE outbox_events")
        .execute(&db.pool)
        .await?;
    // Both variants start from a pool that holds the connections they use, as a running
    // service's pool does: opening four (TLS, SCRAM) took 108 ms on this 2-core machine, and
    // with the two the fixture leaves open the dispatcher of the time (three batches side by
    // side) opened up to four inside a timed run of under a second, the loops none (P9a
    // 0.78-0.81 before in three runs of 3 rounds; after, 0.88-1.02 and a median of 0.94 in
    // thirteen runs of 5 rounds; 2026-12-06).
    let warm = try_join_all((0..WARM_CONNECTIONS).map(|_| db.pool.acquire())).await?;
    drop(warm);
    let api = BillingApi::start().await?;
    if let Some(latency) = latency {
        // A range of one microsecond: every request waits 20 ms.
        api.set_latency(latency..latency + Duration::from_micros(1));
    }
    Ok((db, api))
}

/// Every action done once, and each key's charges in its actions' order.
pub(crate) fn check_ledger(charges: &[Charge], actions: usize) -> Result<()> {
    ensure!(
        charges.len() == actions,
        "{} charges for {actions} actions",
        charges.len()
    );
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut out_of_order = 0;
    for charge in charges {
        let (key, n) = charge
            .invoice
            .rsplit_once('/')
            .and_then(|(k, n)| Some((k, n.parse::<usize>().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("invoice {}", charge.invoice))?;
        if last.insert(key, n).is_some_and(|previous| previous >= n) {
            out_of_order += 1;
        }
    }
    ensure!(out_of_order == 0, "{out_of_order} charges out of key order");
    Ok(())
}

/// The durations of the executor's calls (the breakdown's executor wraps the HTTP one).
#[derive(Debug, Clone, Default)]
struct CallTimes(Arc<Mutex<Vec<f64>>>);

impl CallTimes {
    fn push(&self, d: Duration) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(d.as_secs_f64());
    }

    fn mean_ms(&self) -> f64 {
        let all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        1000.0 * all.iter().sum::<f64>() / all.len().max(1) as f64
    }
}

/// How long `executor`'s dispatcher takes to perform every action of a fresh fixture.
pub(crate) async fn dispatcher_run<E: Executor>(
    db: &TestDb,
    api: &BillingApi,
    executor: E,
    actions: usize,
) -> Result<Duration> {
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    wait_drained(&db.pool).await?;
    let elapsed = started.elapsed();
    shutdown.cancel();
    running.await??;
    let done: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE status = 'published'")
            .fetch_one(&db.pool)
            .await?;
    ensure!(done as usize == actions, "{done} of {actions} actions done");
    check_ledger(&api.charges(), actions)?;
    Ok(elapsed)
}

/// Actions per second for the dispatcher to perform every action of a fresh fixture.
async fn dispatcher_rate(actions: usize, latency: Option<Duration>) -> Result<f64> {
    let (db, api) = fixture(actions, latency).await?;
    let executor = HttpExecutor::post_json(client_builder(), api.charges_url().parse()?)?;
    let elapsed = dispatcher_run(&db, &api, executor, actions).await?;
    Ok(actions as f64 / elapsed.as_secs_f64())
}

/// The settings of the executor's client and of the hand-written loops' client.
pub(crate) fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
}

/// How a hand-written loop holds its batch across the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// In the claim's transaction, open across the calls (row locks, snapshot).
    Transaction,
    /// By a lease written and committed with the claim (no transaction across the calls),
    /// then the marking `UPDATE` in a transaction of its own: what the dispatcher does,
    /// without its per-key order, retries or health.
    Lease,
}

/// One hand-written loop: claim a batch, call its rows at once, mark them with the answers,
/// commit; until a claim finds nothing. Returns the actions it performed. `times`, if any,
/// gets each call's duration, and `phases` each batch's calls phase (from the claim's end to
/// the last answer).
async fn hand_loop(
    pool: &PgPool,
    client: &reqwest::Client,
    url: &str,
    batch: i64,
    hold: Hold,
    times: Option<(&CallTimes, &CallTimes)>,
) -> Result<usize> {
    let mut done = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows: Vec<(i64, uuid::Uuid, String)> = match hold {
            Hold::Transaction => sqlx::query_as(
                "SELECT seq, id, payload::text FROM outbox_events \
                 WHERE status = 'pending' AND topic = $1 ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED",
            ),
            Hold::Lease => sqlx::query_as(
                "UPDATE outbox_events AS e SET lease = gen_random_uuid(), calls = e.calls + 1, \
                        next_attempt_at = clock_timestamp() + interval '40 s' \
                 FROM (SELECT seq FROM outbox_events \
                       WHERE status = 'pending' AND topic = $1 AND next_attempt_at <= now() \
                       ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED) AS c \
                 WHERE e.seq = c.seq RETURNING e.seq, e.id, e.payload::text",
            ),
        }
        .bind(TOPIC)
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        if rows.is_empty() {
            tx.commit().await?;
            // Leased rows of another loop are not due: the table is drained once none is
            // pending.
            let pending: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_events WHERE status = 'pending' AND topic = $1",
            )
            .bind(TOPIC)
            .fetch_one(pool)
            .await?;
            if hold == Hold::Transaction || pending == 0 {
                return Ok(done);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        if hold == Hold::Lease {
            tx.commit().await?;
            tx = pool.begin().await?;
        }
        let calls_started = Instant::now();
        let answers = try_join_all(rows.iter().map(|(_, id, payload)| async move {
            let started = Instant::now();
            let response = client
                .post(url)
                .header("Idempotency-Key", id.to_string())
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(payload.clone())
                .send()
                .await?;
            ensure!(response.status().is_success(), "{}", response.status());
            let body = response.text().await?;
            if let Some((calls, _)) = times {
                calls.push(started.elapsed());
            }
            Ok(body)
        }))
        .await?;
        if let Some((_, phases)) = times {
            phases.push(calls_started.elapsed());
        }
        let seqs: Vec<i64> = rows.iter().map(|(seq, _, _)| *seq).collect();
        sqlx::query(match hold {
            Hold::Transaction => {
                "UPDATE outbox_events AS e SET status = 'published', published_at = clock_timestamp(), \
                        attempts = e.attempts + 1, outcome = d.outcome::jsonb \
                 FROM unnest($1::bigint[], $2::text[]) AS d(seq, outcome) WHERE e.seq = d.seq"
            }
            Hold::Lease => {
                "UPDATE outbox_events AS e SET status = 'published', published_at = clock_timestamp(), \
                        attempts = e.attempts + 1, outcome = d.outcome::jsonb, lease = NULL \
                 FROM unnest($1::bigint[], $2::text[]) AS d(seq, outcome) \
                 WHERE e.seq = d.seq AND e.lease IS NOT NULL"
            }
        })
        .bind(&seqs)
        .bind(&answers)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        done += rows.len();
    }
}

/// As many hand-written loops as 64 calls in flight fill with the most a dispatcher's claim
/// takes (its `batch_size`), and that batch size.
fn loops() -> (usize, i64) {
    let config = config();
    (
        MAX_IN_FLIGHT.div_ceil(config.lane.batch_size as usize),
        i64::from(config.lane.batch_size),
    )
}

/// How long the hand-written loops take to perform every action of a fresh fixture.
async fn hand_loop_run(
    db: &TestDb,
    api: &BillingApi,
    client: &reqwest::Client,
    actions: usize,
    hold: Hold,
    times: Option<(&CallTimes, &CallTimes)>,
) -> Result<Duration> {
    let (loops, batch) = loops();
    let url = api.charges_url();
    let started = Instant::now();
    let done: usize =
        try_join_all((0..loops).map(|_| hand_loop(&db.pool, client, &url, batch, hold, times)))
            .await?
            .into_iter()
            .sum();
    let elapsed = started.elapsed();
    ensure!(done == actions, "{done} of {actions} actions done");
    ensure!(api.charges().len() == actions, "charges");
    Ok(elapsed)
}

/// Actions per second for the hand-written loops.
async fn hand_loop_rate(
    client: &reqwest::Client,
    actions: usize,
    latency: Option<Duration>,
    hold: Hold,
) -> Result<f64> {
    let (db, api) = fixture(actions, latency).await?;
    let elapsed = hand_loop_run(&db, &api, client, actions, hold, None).await?;
    Ok(actions as f64 / elapsed.as_secs_f64())
}

/// Where the time goes, per action: each kind of statement (client-side, from sending it to
/// its last row; `BEGIN`, which sqlx does not log, is not in them), how many actions a claim
/// and a recording `UPDATE` carry, how often a claimer claims, the mean call, and the CPU.
#[derive(Debug, Default)]
struct Breakdown {
    /// Claim statements (the last ones of a run come back empty, and the dispatcher's after a
    /// wake-up with nothing due).
    claims: u64,
    rows_per_claim: f64,
    /// Claimers × elapsed / claims: the time between one claimer's claims, in ms (the
    /// dispatcher has one claiming connection; each hand loop claims, calls and marks).
    claim_cycle: f64,
    /// Actions per `UPDATE` that marks them done (the dispatcher's recorder takes what
    /// arrived; a hand loop marks its batch).
    per_record: f64,
    /// Microseconds of each kind of statement per action.
    claim: f64,
    mark: f64,
    commit: f64,
    /// The mean call, in ms.
    call: f64,
    /// The hand loop's mean calls phase (claim's end to last answer); NaN for the dispatcher.
    calls_phase: f64,
    /// CPU per action, in microseconds: PostgreSQL's processes, and this one's (the library
    /// or the loop, the client and the API).
    postgres_cpu: f64,
    process_cpu: f64,
}

impl Breakdown {
    fn of(
        statements: &std::collections::BTreeMap<String, sql_times::Statement>,
        claimers: usize,
        (elapsed, cpu): (Duration, CpuTimes),
        actions: usize,
        call: f64,
        calls_phase: f64,
    ) -> Self {
        let sum = |prefixes: &[&str]| {
            statements
                .iter()
                .filter(|(summary, _)| prefixes.iter().any(|p| summary.starts_with(p)))
                .fold(sql_times::Statement::default(), |a, (_, s)| {
                    sql_times::Statement {
                        count: a.count + s.count,
                        secs: a.secs + s.secs,
                        rows: a.rows + s.rows,
                    }
                })
        };
        let claims = sum(&["WITH claimed AS", "SELECT seq, id, payload::text"]);
        // The dispatcher's name the table quoted.
        let marks = sum(&["UPDATE"]);
        let per_action = |s: sql_times::Statement| 1e6 * s.secs / actions as f64;
        Self {
            claims: claims.count,
            rows_per_claim: claims.rows as f64 / claims.count.max(1) as f64,
            claim_cycle: 1000.0 * claimers as f64 * elapsed.as_secs_f64()
                / claims.count.max(1) as f64,
            per_record: actions as f64 / marks.count.max(1) as f64,
            claim: per_action(claims),
            mark: per_action(marks),
            commit: per_action(sum(&["COMMIT"])),
            call,
            calls_phase,
            postgres_cpu: 1e6 * cpu.postgres.as_secs_f64() / actions as f64,
            process_cpu: 1e6 * cpu.this.as_secs_f64() / actions as f64,
        }
    }

    fn line(&self, who: &str) -> String {
        format!(
            "{who:<11} {:>6} claims of {:>4.1} rows, one every {:.2} ms per claimer, {:.1} \
             actions per mark; per action (us): claim {:.0}, mark {:.0}, commit {:.0}; mean \
             call {:.2} ms, calls phase {:.2} ms; CPU per action: PostgreSQL {:.0} us, this \
             process {:.0} us",
            self.claims,
            self.rows_per_claim,
            self.claim_cycle,
            self.per_record,
            self.claim,
            self.mark,
            self.commit,
            self.call,
            self.calls_phase,
            self.postgres_cpu,
            self.process_cpu
        )
    }
}

/// Every kind of statement timed, on stderr: its first words, count, rows and total time.
fn log_statements(
    who: &str,
    statements: &std::collections::BTreeMap<String, sql_times::Statement>,
) {
    for (summary, s) in statements {
        eprintln!(
            "    {who}: {:>6} x {:>8.1} ms total, {:>7} rows: {}",
            s.count,
            1000.0 * s.secs,
            s.rows,
            summary.chars().take(70).collect::<String>()
        );
    }
}

/// One run of each variant on a fresh fixture with every statement and every call timed
/// (not part of the figures: the timing costs a little): where the time goes.
async fn breakdown(
    client: &reqwest::Client,
    actions: usize,
    latency: Option<Duration>,
) -> Result<(Breakdown, Breakdown)> {
    let (loops, _) = loops();
    let (db, api) = fixture(actions, latency).await?;
    let calls = CallTimes::default();
    let executor = {
        let (http, calls) = (
            HttpExecutor::post_json(client_builder(), api.charges_url().parse()?)?,
            calls.clone(),
        );
        move |action: Action| {
            let (http, calls) = (http.clone(), calls.clone());
            async move {
                let started = Instant::now();
                let outcome = http.execute(action).await;
                calls.push(started.elapsed());
                outcome
            }
        }
    };
    let server = cpu::postmaster(&db.pool).await;
    sql_times::start();
    let cpu = CpuTimes::now(server);
    let elapsed = dispatcher_run(&db, &api, executor, actions).await;
    let cpu = CpuTimes::now(server).since(cpu);
    let statements = sql_times::stop();
    log_statements("dispatcher", &statements);
    // One claiming connection.
    let dispatcher = Breakdown::of(
        &statements,
        1,
        (elapsed?, cpu),
        actions,
        calls.mean_ms(),
        f64::NAN,
    );

    let (db, api) = fixture(actions, latency).await?;
    let (calls, phases) = (CallTimes::default(), CallTimes::default());
    sql_times::start();
    let cpu = CpuTimes::now(server);
    let elapsed = hand_loop_run(
        &db,
        &api,
        client,
        actions,
        Hold::Transaction,
        Some((&calls, &phases)),
    )
    .await;
    let cpu = CpuTimes::now(server).since(cpu);
    let statements = sql_times::stop();
    log_statements("hand loop", &statements);
    let hand = Breakdown::of(
        &statements,
        loops,
        (elapsed?, cpu),
        actions,
        calls.mean_ms(),
        phases.mean_ms(),
    );
    Ok((dispatcher, hand))
}

/// The breakdown's figures: each part of the dispatcher's against the same part of the hand
/// loop's (no targets).
fn breakdown_figures(id: &'static str, dispatcher: &Breakdown, hand: &Breakdown) -> Vec<Figure> {
    type Part = (&'static str, &'static str, fn(&Breakdown) -> f64);
    let value = |b: &Breakdown, of: fn(&Breakdown) -> f64| Sample {
        values: vec![of(b)],
    };
    // More is better.
    let carried: [Part; 2] = [
        ("rows per claim", "rows", |b| b.rows_per_claim),
        ("actions per mark", "rows", |b| b.per_record),
    ];
    // Less is better.
    let costs: [Part; 7] = [
        ("claim cycle, per claimer", "ms", |b| b.claim_cycle),
        ("claim", "us/act", |b| b.claim),
        ("mark", "us/act", |b| b.mark),
        ("commit", "us/act", |b| b.commit),
        ("mean call", "ms/call", |b| b.call),
        ("PostgreSQL's CPU", "us/act", |b| b.postgres_cpu),
        ("this process's CPU", "us/act", |b| b.process_cpu),
    ];
    let carried = carried.iter().map(|(part, unit, of)| {
        Figure::at_least(
            id,
            format!("breakdown: {part}"),
            unit,
            value(dispatcher, *of),
            "hand loop's",
            value(hand, *of),
            None,
        )
    });
    let costs = costs.iter().map(|(part, unit, of)| {
        Figure::at_most(
            id,
            format!("breakdown: {part}"),
            unit,
            value(dispatcher, *of),
            "hand loop's",
            value(hand, *of),
            None,
        )
    });
    carried.chain(costs).collect()
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let actions = settings.actions;
    // The loops' client has the executor's settings (the executor builds its own, without
    // redirects), so that both variants' calls go through the same connection pool settings.
    let client = client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let [
        mut dispatched,
        mut looped,
        mut looped_leasing,
        mut dispatched_slow,
        mut looped_slow,
    ]: [Sample; 5] = Default::default();
    for round in 0..settings.rounds {
        dispatched.push(dispatcher_rate(actions, None).await?);
        looped.push(hand_loop_rate(&client, actions, None, Hold::Transaction).await?);
        looped_leasing.push(hand_loop_rate(&client, actions, None, Hold::Lease).await?);
        dispatched_slow.push(dispatcher_rate(actions, Some(LATENCY)).await?);
        looped_slow.push(hand_loop_rate(&client, actions, Some(LATENCY), Hold::Transaction).await?);
        eprintln!(
            "P9 round {round}: dispatcher {:.0}, hand loop {:.0}, leasing hand loop {:.0} \
             actions/s; at {LATENCY:?}: dispatcher {:.0}, hand loop {:.0} actions/s",
            dispatched.values[round],
            looped.values[round],
            looped_leasing.values[round],
            dispatched_slow.values[round],
            looped_slow.values[round],
        );
    }
    // Where the time goes, at once and at 20 ms.
    let (at_once, at_once_hand) = breakdown(&client, actions, None).await?;
    let (slow, slow_hand) = breakdown(&client, actions, Some(LATENCY)).await?;
    for (what, dispatcher, hand) in [
        ("API at once", &at_once, &at_once_hand),
        ("API at 20 ms", &slow, &slow_hand),
    ] {
        eprintln!("P9 breakdown, {what}:");
        eprintln!("  {}", dispatcher.line("dispatcher"));
        eprintln!("  {}", hand.line("hand loop"));
    }
    let bound = MAX_IN_FLIGHT as f64 / LATENCY.as_secs_f64();
    let mut figures = vec![
        Figure::at_least(
            "P9a",
            "dispatcher, API answering at once",
            "act/s",
            dispatched.clone(),
            "hand loop, same client and concurrency",
            looped,
            Some(0.9),
        ),
        Figure::at_least(
            "P9a",
            "dispatcher, API answering at once",
            "act/s",
            dispatched,
            "hand loop leasing, no transaction across calls",
            looped_leasing,
            None,
        ),
        Figure::at_least(
            "P9b",
            "dispatcher, API at 20 ms, 64 in flight",
            "act/s",
            dispatched_slow.clone(),
            "bound 64 / 20 ms",
            Sample {
                values: vec![bound],
            },
            Some(0.8),
        ),
        Figure::at_least(
            "P9b",
            "dispatcher, API at 20 ms, 64 in flight",
            "act/s",
            dispatched_slow,
            "hand loop at 20 ms",
            looped_slow,
            None,
        ),
    ];
    figures.extend(breakdown_figures("P9a", &at_once, &at_once_hand));
    figures.extend(breakdown_figures("P9b", &slow, &slow_hand));
    Ok(figures)
}
