//! The README's demo: an agent decides to send invoices, and its process is killed at each
//! step between the decision and the charge. After every restart, each decision was made once
//! and each invoice charged once.
//!
//! Needs PostgreSQL and Apache Kafka (`scripts/demo` starts both and runs this).

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use outbox_examples::agent::dispatch::{
    self, DispatchCrash, DispatchScenario, print_dispatch_report,
};
use outbox_examples::agent::scenario::{Scenario, charged_topic, print_report};
use outbox_examples::agent::worker::{self, WorkerConfig};
use outbox_examples::agent::{CrashPoint, schema};

#[derive(Debug, Parser)]
#[command(about = "Crash an invoicing agent at every step; show each invoice is charged once")]
struct Args {
    /// Where to crash: one point, or every point in turn.
    #[arg(long, value_enum, default_value = "all")]
    crash_at: Target,
    #[command(flatten)]
    services: Services,
    /// The schema the demo recreates for each scenario.
    #[arg(long, default_value = "outbox_agent_demo", global = true)]
    schema: String,
    /// Without Kafka: a dispatcher calls a local HTTP billing service (crash points
    /// before-commit, after-commit, during-call, after-call, lost-response).
    #[arg(long)]
    dispatch: bool,
    #[command(subcommand)]
    role: Option<Role>,
}

#[derive(Debug, clap::Args)]
struct Services {
    /// The PostgreSQL database (scripts/demo sets `DATABASE_URL` to its own cluster's; a URL
    /// with a password belongs in the environment, not in the process list).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Kafka bootstrap servers.
    #[arg(
        long,
        env = "KAFKA_BROKERS",
        default_value = "127.0.0.1:9092",
        global = true
    )]
    brokers: String,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Target {
    /// Every crash point, one scenario each.
    All,
    /// No crash: one clean run.
    None,
    BeforeCommit,
    AfterCommit,
    AfterPublish,
    InHandler,
    AfterHandlerCommit,
    /// `--dispatch` only.
    DuringCall,
    /// `--dispatch` only.
    AfterCall,
    /// `--dispatch` only.
    LostResponse,
}

impl Target {
    fn points(self) -> Result<Vec<Option<CrashPoint>>> {
        Ok(match self {
            Target::All => CrashPoint::ALL.into_iter().map(Some).collect(),
            Target::None => vec![None],
            Target::BeforeCommit => vec![Some(CrashPoint::BeforeCommit)],
            Target::AfterCommit => vec![Some(CrashPoint::AfterCommit)],
            Target::AfterPublish => vec![Some(CrashPoint::AfterPublish)],
            Target::InHandler => vec![Some(CrashPoint::InHandler)],
            Target::AfterHandlerCommit => vec![Some(CrashPoint::AfterHandlerCommit)],
            Target::DuringCall | Target::AfterCall | Target::LostResponse => {
                anyhow::bail!("this crash point needs --dispatch")
            }
        })
    }
}

#[derive(Debug, Subcommand)]
enum Role {
    /// One agent process (started by the demo itself).
    #[command(hide = true)]
    Worker {
        #[arg(long)]
        topic: String,
        #[arg(long)]
        group: String,
        #[arg(long = "crash-at", value_enum)]
        crash: Option<CrashPoint>,
    },
    /// One agent process of the dispatch mode (started by the demo itself).
    #[command(hide = true)]
    DispatchWorker {
        #[arg(long)]
        billing_url: String,
        #[arg(long = "crash-at", value_enum)]
        crash: Option<DispatchCrash>,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    // The demo tells its story on stdout; the framework's own warnings (a retried call, a
    // broker connection the crashed worker left behind) would interleave with its tables.
    // `RUST_LOG=warn scripts/demo` shows them.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let database_url =
        args.services.database_url.clone().context(
            "no database: pass --database-url or set DATABASE_URL (scripts/demo sets it)",
        )?;
    if let Some(Role::DispatchWorker { billing_url, crash }) = args.role {
        let pool = schema::connect(&database_url, &args.schema, 8).await?;
        return dispatch::worker(pool, &billing_url, crash).await;
    }
    if args.dispatch {
        return run_dispatch_demo(database_url, args.schema, args.crash_at).await;
    }
    if let Some(Role::Worker {
        topic,
        group,
        crash,
    }) = args.role
    {
        let pool = schema::connect(&database_url, &args.schema, 8).await?;
        let config = WorkerConfig {
            brokers: args.services.brokers,
            charged_topic: charged_topic(&topic),
            topic,
            group,
            deadline: Duration::from_secs(120),
        };
        return worker::run(pool, &config, crash).await;
    }

    let scenario = Scenario {
        database_url,
        schema: args.schema,
        brokers: args.services.brokers,
        worker_exe: std::env::current_exe()?,
    };
    println!("An agent invoices 3 customers. Each decision commits with its outbox event in one");
    println!(
        "transaction; a relay publishes it; a billing consumer charges it, using the event id"
    );
    println!(
        "as the payment API's idempotency key. Each scenario kills the process once, restarts it."
    );
    let points = args.crash_at.points()?;
    for &point in &points {
        match point {
            Some(point) => println!("\ncrash at {}: {}", point.name(), point.describe()),
            None => println!("\nno crash"),
        }
        let report = scenario.run(point).await?;
        print_report(&report);
        println!("   OK: every decision made once, every invoice charged once, state consistent");
    }
    println!(
        "\nOK: {} scenario(s) recovered: one model call per committed decision, one charge per \
         invoice, state consistent",
        points.len()
    );
    Ok(())
}

/// `--dispatch`: the agent without Kafka, each dispatch crash point in turn.
async fn run_dispatch_demo(database_url: String, schema: String, target: Target) -> Result<()> {
    let points: Vec<Option<DispatchCrash>> = match target {
        Target::None => vec![None],
        Target::BeforeCommit => vec![Some(DispatchCrash::BeforeCommit)],
        Target::AfterCommit => vec![Some(DispatchCrash::AfterCommit)],
        Target::DuringCall => vec![Some(DispatchCrash::DuringCall)],
        Target::AfterCall => vec![Some(DispatchCrash::AfterCall)],
        Target::LostResponse => vec![Some(DispatchCrash::LostResponse)],
        Target::All => DispatchCrash::ALL.into_iter().map(Some).collect(),
        Target::AfterPublish | Target::InHandler | Target::AfterHandlerCommit => {
            anyhow::bail!("this crash point needs Kafka: run without --dispatch")
        }
    };
    let scenario = DispatchScenario {
        database_url,
        schema,
        worker_exe: std::env::current_exe()?,
    };
    println!(
        "An agent invoices 3 customers with no Kafka: each decision commits with its action in"
    );
    println!("one transaction; a dispatcher calls a local HTTP billing API with the event id as");
    println!("Idempotency-Key and stores the answer; the agent reads the charge id from it.");
    for &point in &points {
        match point {
            Some(point) => println!("\ncrash at {}: {}", point.name(), point.describe()),
            None => println!("\nno crash"),
        }
        let report = scenario.run(point).await?;
        print_dispatch_report(&report);
        println!(
            "   OK: every decision made once, every invoice charged once, charge id from the stored outcome"
        );
    }
    println!(
        "\nOK: {} scenario(s) recovered: one model call per committed decision, one charge per \
         invoice, the task holding the invoice's charge id",
        points.len()
    );
    Ok(())
}
