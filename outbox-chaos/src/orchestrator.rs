//! `outbox-chaos run`: one or more runs, each with its own database, broker and topic;
//! the fault phase, the drain, the check, the summary.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, PgPool};
use tokio_util::sync::CancellationToken;

use crate::checker::{self, Target};
use crate::children::action_writer::action_key;
use crate::children::producer::key_name;
use crate::children::relay::Policy;
use crate::cluster::Cluster;
use crate::db::ChaosDb;
use crate::faults::Chaos;
use crate::fleet::{DispatchLaunch, Fleet, Launch, Role, lock, wait_fleet};
use crate::kafka::TopicSpec;
use crate::long_faults::{LongFaultPhase, TOPIC_MAX_MESSAGE_BYTES};
use crate::pg_server::{LocalPg, StopMode};
use crate::profile::{Profile, ProfileName};
use crate::summary::{Kind, Summary};

/// The two consumer groups: several members in the first, one in the second.
const GROUP_A: &str = "chaos-a";
const GROUP_B: &str = "chaos-b";

#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    /// `ci` (≈2–3 min, the test suite's), `cluster` (the same on three brokers, partition
    /// leaders killed), `long` (≈22 min, five runs, the first with the long faults) or
    /// `liveness` (≈5 min, long faults).
    #[arg(long, value_enum, default_value = "ci")]
    profile: ProfileName,
    /// Seed of every random choice (fault kinds and timing, workload); random if absent.
    /// Process scheduling still varies between runs with one seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Number of runs (default: the profile's).
    #[arg(long)]
    runs: Option<u64>,
    /// Postgres server; each run creates (and after passing, drops) its own database on it.
    /// Default: the test suite's server (`OUTBOX_TEST_DATABASE_URL`, else the scripts' own
    /// cluster), its `postgres` database.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Outbox table name; must be a valid identifier (checked through `TableNames`).
    #[arg(long, default_value = "outbox_events")]
    outbox_table: String,
    /// Keep the database and the run directory (logs) even when the run passes.
    #[arg(long)]
    keep: bool,
}

/// Runs the harness and prints the summary line; `Ok(false)` when an invariant failed.
pub(crate) async fn run(args: RunArgs) -> Result<bool> {
    let tables = TableNames::default()
        .with_outbox(&args.outbox_table)
        .context("invalid --outbox-table")?;
    let profile = Profile::named(args.profile);
    let seed = args.seed.unwrap_or_else(rand::random);
    let runs = args.runs.unwrap_or(profile.runs);
    let started = Instant::now();
    let mut total = Summary::default();
    for i in 0..runs {
        let run_seed = seed.wrapping_add(i);
        // Interrupted, the run is dropped: its broker and children are killed on the way out
        // (children also stop on their own when this process goes away).
        let summary = tokio::select! {
            summary = run_one(&args, &profile, &tables, run_seed, i == 0) => summary,
            () = interrupted() => Err(anyhow::anyhow!("interrupted")),
        }
        .with_context(|| format!("run {} (seed {run_seed})", i + 1))?;
        tracing::info!(
            run = i + 1,
            "{}",
            summary.line(profile.name, run_seed, started.elapsed().as_secs())
        );
        total.merge(&summary);
    }
    println!(
        "{}",
        total.line(profile.name, seed, started.elapsed().as_secs())
    );
    Ok(total.passed())
}

/// Resolves on Ctrl-C or SIGTERM.
async fn interrupted() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        Some(()) = async { terminate.as_mut()?.recv().await } => {}
    }
}

/// `--database-url`, else the test suite's server with its `postgres` database.
fn server_url(args: &RunArgs) -> Result<String> {
    match &args.database_url {
        Some(url) => Ok(url.clone()),
        None => outbox_tests::database_url_for("postgres"),
    }
}

/// `first`: the first run of several (the long-fault phase runs in it only).
async fn run_one(
    args: &RunArgs,
    profile: &Profile,
    tables: &TableNames,
    seed: u64,
    first: bool,
) -> Result<Summary> {
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..10].to_owned();
    let dir = std::env::temp_dir().join(format!("outbox-chaos-{run_id}"));
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let long_faults = profile.long_faults.as_ref().filter(|_| first);
    // A run that stops Postgres gets a server of its own: the shared one serves the rest of
    // the test suite.
    let pg_restarts = profile.dispatch.as_ref().map_or(0, |d| d.pg_restarts);
    let mut own_pg = if long_faults.and_then(|l| l.pg_outage).is_some() || pg_restarts > 0 {
        Some(LocalPg::start_new(&dir).await?)
    } else {
        None
    };
    let database_url = match &own_pg {
        Some(pg) => pg.url(),
        None => server_url(args)?,
    };
    let keys: Vec<String> = (0..profile.keys).map(key_name).collect();
    let action_keys: Vec<String> = (0..profile.dispatch.as_ref().map_or(0, |d| d.keys))
        .map(action_key)
        .collect();
    let db = ChaosDb::create(&database_url, tables, &keys, &action_keys).await?;
    // The dispatcher fleet's billing API, served by this process so that it and its ledger
    // outlive every child.
    let api = match &profile.dispatch {
        Some(load) => Some(crate::dispatch::start_api(load).await?),
        None => None,
    };
    let mut broker = Cluster::start(&dir, profile.brokers).await?;
    let brokers = broker.address();
    let topic = format!("chaos.{run_id}");
    let max_message_bytes = TOPIC_MAX_MESSAGE_BYTES.to_string();
    let stuck_key_configs = [("max.message.bytes", max_message_bytes.as_str())];
    let topic_spec = TopicSpec {
        partitions: profile.partitions,
        replication: broker.size(),
        configs: if long_faults.is_some_and(|l| l.stuck_key || l.blocked_key) {
            &stuck_key_configs
        } else {
            &[]
        },
    };
    crate::kafka::create_topic(&brokers, &topic, topic_spec, false).await?;
    tracing::info!(database = %db.name, %brokers, %topic, dir = %dir.display(), seed, "run starting");

    let launch = Launch {
        exe: std::env::current_exe()?,
        logs,
        database_url,
        database: db.name.clone(),
        brokers: brokers.clone(),
        topic: topic.clone(),
        outbox_table: tables.outbox.as_str().to_owned(),
        keys: profile.keys,
        producer_pause_ms: profile.producer_pause_ms,
        relay_retry: profile.relay_retry,
        relay_policy: Policy::default(),
        dispatch: profile
            .dispatch
            .as_ref()
            .zip(api.as_ref())
            .map(|(load, api)| DispatchLaunch {
                api_url: api.charges_url(),
                keys: load.keys,
                writer_pause_ms: load.writer_pause_ms,
                max_in_flight: load.max_in_flight,
                call_timeout: load.call_timeout,
            }),
    };
    let fleet = Arc::new(Mutex::new(Fleet::new(launch, seed)));
    let writers = start_fleet(&fleet, profile)?;
    let supervising = CancellationToken::new();
    let supervisor = tokio::spawn(supervise(Arc::clone(&fleet), supervising.clone()));

    // The dispatchers' connections cut twice a second through the fault phase: a lease must
    // hold across a claim or a record cut midway.
    let fault_phase = CancellationToken::new();
    let terminator = profile.dispatch.is_some().then(|| {
        let (admin, database) = db.admin();
        tokio::spawn(terminate_dispatchers(admin, database, fault_phase.clone()))
    });
    let faults = Chaos::new(&fleet, &mut broker, &db, profile, &topic, GROUP_A, seed)
        .with_api(api.as_ref())
        .with_pg(own_pg.as_mut().filter(|_| pg_restarts > 0))
        .run()
        .await;
    fault_phase.cancel();
    if let Some(terminator) = terminator {
        let rounds = terminator.await?;
        lock(&fleet).counts.add(Kind::DispatcherPgTerminate, rounds);
    }
    faults?;
    let groups = [GROUP_A.to_owned(), GROUP_B.to_owned()];
    let figures = match long_faults {
        Some(plan) => {
            LongFaultPhase {
                fleet: &fleet,
                broker: &mut broker,
                db: &db,
                pg: own_pg.as_mut(),
                tables,
                topic: &topic,
                topic_spec,
                groups: &groups,
                plan,
            }
            .run()
            .await?
        }
        None => Vec::new(),
    };

    // Drain: no more faults; the writers stop; everything committed must come through.
    {
        let mut f = lock(&fleet);
        f.faults_on = false;
        for &writer in &writers {
            f.stop(writer, false);
        }
    }
    wait_fleet(&fleet, Duration::from_secs(30), |f| {
        writers.iter().all(|&w| f.exited(w))
    })
    .await?;
    // The last broker fault may have left it starting: the drain's clock starts once it is up.
    broker.wait_ready().await?;
    let drained = wait_drained(
        &mut broker,
        &db.pool,
        tables,
        &topic,
        &groups,
        profile.drain_timeout,
    )
    .await?;
    supervising.cancel();
    supervisor.await??;
    lock(&fleet).stop_all();
    if !wait_fleet(&fleet, Duration::from_secs(30), Fleet::all_exited).await? {
        lock(&fleet).kill_remaining();
    }

    broker.check_alive().await?;
    let mut summary = checker::check(&Target {
        pool: &db.pool,
        tables,
        brokers: &brokers,
        topic: &topic,
        partitions: profile.partitions,
        groups: &groups,
    })
    .await?;
    if let Some(api) = &api {
        crate::dispatch::check(
            &db.pool,
            tables,
            &api.charges(),
            api.requests().total,
            &mut summary,
        )
        .await?;
        summary.api_rate_limited = api.requests().rate_limited;
    }
    {
        let f = lock(&fleet);
        summary.counts = f.counts.clone();
        summary.unexpected_exits = u64::try_from(f.unexpected.len())?;
    }
    summary.drain_timeouts = u64::from(!drained);
    if let Some(plan) = long_faults {
        for (kind, took) in figures {
            // What flows while a node is down must not need the node back.
            let bound = match (kind, plan.partial_outage) {
                (Kind::PartialOutage, Some(downtime)) => plan.bound.min(downtime),
                _ => plan.bound,
            };
            summary.record_liveness(kind, took, bound);
        }
    }
    broker.stop().await?;
    finish(summary.passed() && !args.keep, db, own_pg.as_mut(), &dir).await?;
    Ok(summary)
}

/// Starts the producer, the relays (one in crash-after-ack mode) and the consumers, and with
/// the dispatcher fleet its action writer and dispatchers (one in crash-after-call mode);
/// returns the writers' indexes (the producer's, the action writer's).
fn start_fleet(fleet: &Mutex<Fleet>, profile: &Profile) -> Result<Vec<usize>> {
    let mut f = lock(fleet);
    let mut writers = vec![f.add("producer", Role::Producer, true)?];
    if let Some(load) = &profile.dispatch {
        writers.push(f.add("action-writer", Role::ActionWriter, true)?);
        f.add(
            "dispatcher-crashy",
            Role::Dispatcher { crash_slot: true },
            true,
        )?;
        for i in 1..=load.dispatchers {
            f.add(
                &format!("dispatcher-{i}"),
                Role::Dispatcher { crash_slot: false },
                true,
            )?;
        }
    }
    f.add("relay-crashy", Role::Relay { crash_slot: true }, true)?;
    for i in 1..=profile.relays {
        f.add(
            &format!("relay-{i}"),
            Role::Relay { crash_slot: false },
            true,
        )?;
    }
    for i in 1..=profile.group_a_members {
        let role = Role::Consumer {
            group: GROUP_A.into(),
        };
        f.add(&format!("consumer-a{i}"), role, true)?;
    }
    let role = Role::Consumer {
        group: GROUP_B.into(),
    };
    f.add("consumer-b1", role, true)?;
    Ok(writers)
}

/// Reaps and respawns children until cancelled.
async fn supervise(fleet: Arc<Mutex<Fleet>>, stop: CancellationToken) -> Result<()> {
    while !stop.is_cancelled() {
        lock(&fleet).reap()?;
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    Ok(())
}

/// Waits until the outbox has no pending row, every group has an effect for every committed
/// event, and every group has quarantined every malformed record. `false` on timeout. Nothing
/// is done to help a group along: a group that stands still is a failed run.
async fn wait_drained(
    broker: &mut Cluster,
    pool: &PgPool,
    tables: &TableNames,
    topic: &str,
    groups: &[String],
    timeout: Duration,
) -> Result<bool> {
    let outbox = &tables.outbox;
    let quarantine = &tables.consumer_quarantine;
    let pending_sql = format!(
        "SELECT (SELECT count(*) FROM {outbox} WHERE status = 'pending'), \
                (SELECT count(*) FROM {outbox} WHERE topic NOT LIKE 'dispatch:%' \
                   AND id NOT IN (SELECT event_id FROM chaos_expected_quarantine)), \
                (SELECT count(*) FROM chaos_poison)"
    );
    let effects_sql = format!(
        "SELECT (SELECT count(DISTINCT e.event_id) FROM chaos_effects e JOIN {outbox} o ON o.id = e.event_id \
                 WHERE e.consumer = $1), \
                (SELECT count(*) FROM {quarantine} q JOIN chaos_poison p \
                   ON q.partition = p.partition AND q.\"offset\" = p.kafka_offset \
                 WHERE q.consumer = $1 AND q.topic = $2)"
    );
    let started = Instant::now();
    let mut last_log = started;
    loop {
        broker.check_alive().await?;
        let progress = async {
            let (pending, committed, poison): (i64, i64, i64) =
                sqlx::query_as(AssertSqlSafe(pending_sql.clone()))
                    .fetch_one(pool)
                    .await?;
            let mut behind = Vec::new();
            for group in groups {
                let (effects, quarantined): (i64, i64) =
                    sqlx::query_as(AssertSqlSafe(effects_sql.clone()))
                        .bind(group)
                        .bind(topic)
                        .fetch_one(pool)
                        .await?;
                if effects < committed || quarantined < poison {
                    behind.push(format!(
                        "{group}: {effects}/{committed} effects, {quarantined}/{poison} quarantined"
                    ));
                }
            }
            Ok::<_, sqlx::Error>((pending, behind))
        };
        match progress.await {
            Ok((0, behind)) if behind.is_empty() => {
                tracing::info!(elapsed = ?started.elapsed(), "drained");
                return Ok(true);
            }
            Ok((pending, behind)) => {
                if last_log.elapsed() >= Duration::from_secs(5) {
                    tracing::info!(pending, ?behind, "draining");
                    last_log = Instant::now();
                }
            }
            Err(error) => tracing::warn!(%error, "drain check failed; retrying"),
        }
        if started.elapsed() >= timeout {
            tracing::error!(?timeout, "did not drain in time");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Drops the database and the run directory after a passing run; keeps both otherwise. The
/// run's own Postgres server, if any, is stopped either way (a kept one holds the database in
/// `dir/pg/data`: `pg_ctl -D dir/pg/data start` as `postgres` brings it back).
async fn finish(clean: bool, db: ChaosDb, own_pg: Option<&mut LocalPg>, dir: &Path) -> Result<()> {
    if clean {
        db.drop_database().await?;
    } else {
        tracing::warn!(database = %db.name, dir = %dir.display(), "kept for inspection (child logs in dir/logs, the broker's in dir/kafka/broker.log, the run's own Postgres in dir/pg)");
        db.pool.close().await;
    }
    if let Some(pg) = own_pg {
        pg.stop(StopMode::Fast).await?;
    }
    if clean {
        std::fs::remove_dir_all(dir)?;
    }
    Ok(())
}

/// Terminates the dispatchers' connections every 500 ms until `stop`; returns the rounds that
/// found any.
async fn terminate_dispatchers(admin: PgPool, database: String, stop: CancellationToken) -> u64 {
    let mut rounds = 0;
    loop {
        tokio::select! {
            () = stop.cancelled() => return rounds,
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        match crate::db::terminate_dispatchers(&admin, &database).await {
            Ok(0) => {}
            Ok(n) => {
                rounds += 1;
                tracing::debug!(
                    terminated = n,
                    "fault: the dispatchers' connections terminated"
                );
            }
            Err(error) => tracing::warn!(%error, "cannot terminate the dispatchers' connections"),
        }
    }
}
