//! `outbox-chaos`: the reliability chaos harness (issue #4).
//!
//! It runs the framework the way production does — separate OS processes against the real
//! Postgres and its own Apache Kafka cluster (KRaft nodes on free ports, started through
//! `scripts/kafka-node`, their data in the run's directory: one node, or three with
//! replication factor 3 and `min.insync.replicas` 2 in the `cluster` profile) — and
//! breaks it on purpose, then proves nothing was lost, doubled, reordered or leaked:
//!
//! * a **producer** process writes a state change and its outbox rows in one transaction
//!   (after recording the ids it is about to try, in autocommit, in a side table);
//! * several **relay** processes publish the outbox to a multi-partition topic;
//! * several **consumer** processes in one group, and one in a second group, record each
//!   event's effect in an effect table that has *no* unique constraint, so a double effect
//!   would be visible.
//! * in the `ci` profile, the **dispatcher fleet** (issue 28) beside them, on the same outbox
//!   table: an action writer committing actions for many keys (each carrying its key's
//!   counter), and dispatcher processes performing them with the HTTP executor against a
//!   billing API the orchestrator serves ([`dispatch`]), which lags, fails with 503, stalls
//!   after applying, and goes away, at random.
//!
//! Faults, in a loop with seeded random timing and bounded in count and time: `kill -9` of
//! relays (mid-batch) and consumers (mid-handler); relays that crash after Kafka acknowledged
//! a batch but before marking it; consumers that crash after their handler committed but
//! before the offset was stored; producers killed before and after their commit; members
//! joining and leaving the group (rebalances); the leader of a random partition (with one
//! node, the broker) shut down cleanly (SIGTERM) or crashed (`kill -9`) and started again on
//! the same storage; every
//! Postgres connection of the run terminated with `pg_terminate_backend`; and malformed
//! records injected straight into the live topic.
//!
//! The dispatchers are killed too (`kill -9`, and a crash after the calls before their record),
//! as is the action writer. Afterwards the [`checker`] verifies, from the database and from the topic read back with
//! a plain consumer: every committed row was published; every event's effect is recorded
//! exactly once per consumer group; per-key effect order is the outbox commit order; the
//! outbox drained; nothing rolled back shows up anywhere; state and outbox rows agree; and
//! every malformed record was quarantined by each group with the expected reason while the
//! partition kept flowing; and [`dispatch::check`] that the API's ledger holds every committed
//! action applied exactly once, under its own idempotency key, in each key's commit order,
//! with that charge's answer stored as its outcome. One summary line is printed; the exit status is non-zero when any
//! invariant fails.
//!
//! ```text
//! outbox-chaos run --profile ci            # ≈2–3 minutes (the test suite runs this)
//! outbox-chaos run --profile cluster       # ≈3 minutes, three brokers (the test suite too)
//! outbox-chaos run --profile long --seed 7 # ≈22 minutes (five runs, long faults in the first)
//! outbox-chaos run --profile liveness      # ≈5 minutes: the long faults (the test suite too)
//! ```
//! The `liveness` profile follows a short fault loop with long faults ([`long_faults`]): the
//! broker down for minutes, the run's own Postgres stopped, a key stuck behind a row the
//! broker rejects for good (under `SkipQuarantined`, and under `BlockKey` until the harness
//! discards the row as an operator would), the topic deleted and re-created, each timed from
//! its end until everything committed by then has flowed, against a bound. The `long`
//! profile's first run ends with the same phase, held longer.
//! The broker's jars come from `scripts/services.sh` (`resolve_jars kafka`), found through
//! `OUTBOX_TEST_KAFKA_CLASSPATH_FILE` (default `.services/kafka.classpath` in the repository).
//! The child roles (`producer`, `relay`, `consumer`, `action-writer`, `dispatcher`) are
//! internal: the orchestrator spawns them from its own executable.

mod broker;
mod checker;
mod children;
mod cluster;
mod db;
mod dispatch;
mod faults;
mod fleet;
mod kafka;
mod long_faults;
mod orchestrator;
mod pg_server;
mod poison;
mod profile;
mod summary;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-chaos",
    about = "Chaos harness for the outbox framework"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the harness: start the broker and the processes, inject faults, check, summarise.
    Run(orchestrator::RunArgs),
    /// Internal: the producer workload.
    #[command(hide = true)]
    Producer(children::producer::Args),
    /// Internal: one relay process.
    #[command(hide = true)]
    Relay(children::relay::Args),
    /// Internal: one consumer process.
    #[command(hide = true)]
    Consumer(children::consumer::Args),
    /// Internal: the dispatcher fleet's writer of actions.
    #[command(hide = true)]
    ActionWriter(children::action_writer::Args),
    /// Internal: one dispatcher process.
    #[command(hide = true)]
    Dispatcher(children::dispatcher::Args),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("cannot start the async runtime: {error}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => orchestrator::run(args).await,
            Command::Producer(args) => children::producer::run(args).await.map(|()| true),
            Command::Relay(args) => children::relay::run(args).await.map(|()| true),
            Command::Consumer(args) => children::consumer::run(args).await.map(|()| true),
            Command::ActionWriter(args) => children::action_writer::run(args).await.map(|()| true),
            Command::Dispatcher(args) => children::dispatcher::run(args).await.map(|()| true),
        }
    });
    // A client still closing on a blocking thread (a consumer whose broker is down) must not
    // hold the process: its work is bounded by the framework's own timeouts, and what it did
    // not finish is redelivered.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("outbox-chaos: {error:#}");
            ExitCode::from(2)
        }
    }
}
