//! `outbox`: operate the framework's tables from the shell or cron.
//!
//! ```text
//! outbox migrate
//! outbox status [--json]
//! outbox prune dedup --older-than 7d
//! outbox prune published --older-than 3d
//! outbox prune quarantine --older-than 30d --yes
//! outbox quarantine list relay|consumer [--json]
//! outbox quarantine show|requeue|discard relay|consumer ID... [--reason TEXT] [--yes]
//! outbox quarantine audit [--json]
//! outbox parked list [--json] | show KEY | release KEY [--consumer NAME] | skip ID
//! outbox relay --kafka-config kafka.properties [--brokers HOST:PORT] [-X key=value]...
//! ```
//! The database comes from `--database-url-file`, `--database-url` or `DATABASE_URL` (a
//! password from `PGPASSWORD` or `~/.pgpass` when the URL has none); tables resolve through
//! its `search_path`. Kafka's client configuration: see `kafka_config`.

mod confirm;
mod kafka_config;
mod parked;
mod print;
mod quarantine;
mod relay;
mod status;

use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use outbox_core::TableNames;
use sqlx::postgres::PgPoolOptions;
use std::io::IsTerminal;

#[derive(Debug, Parser)]
#[command(
    name = "outbox",
    version,
    about = "Operate the outbox framework's tables"
)]
struct Cli {
    /// Postgres connection URL, like `postgres://relay@db.internal/app?sslmode=verify-full`.
    /// Leave the password out of it: it comes from PGPASSWORD or ~/.pgpass (PGPASSFILE), or
    /// pass the whole URL with --database-url-file; an argument is visible in the process
    /// list.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// Connect even where a password could be read on the network: a database URL without
    /// sslmode=verify-full to another host, or sslmode other than disable and verify-full to
    /// this one; Kafka SASL credentials without verified TLS. Refused otherwise, saying why.
    #[arg(long, env = "OUTBOX_INSECURE_TRANSPORT", global = true)]
    insecure_transport: bool,
    /// A file holding the Postgres connection URL (its first line); used instead of
    /// --database-url and DATABASE_URL.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "FILE")]
    database_url_file: Option<std::path::PathBuf>,
    /// Name of the outbox table.
    #[arg(long, default_value = "outbox_events", global = true)]
    outbox_table: String,
    /// Name of the consumer dedup table.
    #[arg(long, default_value = "outbox_consumer_dedup", global = true)]
    dedup_table: String,
    /// Name of the consumer quarantine table.
    #[arg(long, default_value = "outbox_consumer_quarantine", global = true)]
    quarantine_table: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create or upgrade the framework's tables.
    Migrate,
    /// Outbox depth and relay lag per topic, quarantine counts, dedup table size.
    Status {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Delete old rows in bounded batches; safe to run from cron while relays and consumers run.
    Prune {
        /// Which rows.
        what: PruneTarget,
        /// Age past which rows go, like `7d`, `36h`, `90m`.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Rows deleted per statement.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
        /// `quarantine`: go on without asking (required when stdin is not a terminal, as
        /// from cron).
        #[arg(long)]
        yes: bool,
        /// `quarantine`: why, recorded with each batch in `outbox_quarantine_audit`.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Inspect, requeue or discard quarantined entries.
    Quarantine {
        #[command(subcommand)]
        action: quarantine::Action,
    },
    /// Keys a `ParkKey` consumer parked: list them, show their records, release or skip.
    Parked {
        #[command(subcommand)]
        action: parked::Action,
    },
    /// Run the relay until SIGINT or SIGTERM.
    ///
    /// Kafka settings are librdkafka properties, applied in this order (a later one wins):
    /// the relay's defaults, the --kafka-config file, `OUTBOX_KAFKA_<KEY>` variables
    /// (OUTBOX_KAFKA_SASL_PASSWORD is sasl.password), --brokers, each -X. A value
    /// `file:PATH` is read from PATH. The relay always sets enable.idempotence=true, acks=all
    /// and partitioner=murmur2_random.
    Relay(relay::RelayArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PruneTarget {
    /// Consumer dedup rows (choose the age from the topic's retention; see the guide, operating, "The dedup store and its TTL").
    Dedup,
    /// Outbox rows already published.
    Published,
    /// Messages in the consumer quarantine, whoever looked at them or not (audited per
    /// batch); asks first unless `--yes`.
    Quarantine,
}

/// The database URL, from its file or as given. Errors never show it (it may hold a password).
fn database_url(cli: &Cli) -> Result<String> {
    if let Some(path) = &cli.database_url_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the database URL from {}", path.display()))?;
        return text
            .lines()
            .next()
            .map(|line| line.trim().to_owned())
            .filter(|url| !url.is_empty())
            .with_context(|| format!("{} holds no database URL", path.display()));
    }
    cli.database_url
        .clone()
        .context("no database: pass --database-url or --database-url-file, or set DATABASE_URL")
}

/// `--insecure-transport`, for the Kafka clients the commands build (`kafka_config.rs`).
static INSECURE_TRANSPORT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether `--insecure-transport` was given.
pub(crate) fn insecure_transport() -> bool {
    INSECURE_TRANSPORT.load(std::sync::atomic::Ordering::Relaxed)
}

/// The connection settings of `url`. sqlx warns about any statement over 1 s; a status over
/// hundreds of dedup slices, or a prune batch, takes that long in normal operation, and the
/// warning (with the statement's text) is noise above the command's answer. Only a statement
/// that takes far longer than normal is worth a warning.
fn connect_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions> {
    use sqlx::ConnectOptions;
    let options: sqlx::postgres::PgConnectOptions =
        url.parse().context("the database URL is not valid")?;
    Ok(options.log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(60)))
}

#[tokio::main]
async fn main() -> Result<()> {
    // Logs go to stderr (stdout is the command's answer, often piped into a program), in
    // colour only when stderr is a terminal.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let tables = TableNames::default()
        .with_outbox(&cli.outbox_table)?
        .with_consumer_tables(&cli.dedup_table, &cli.quarantine_table)?;
    let url = database_url(&cli)?;
    let options = connect_options(&url)?;
    INSECURE_TRANSPORT.store(cli.insecure_transport, std::sync::atomic::Ordering::Relaxed);
    if !cli.insecure_transport {
        outbox_core::check_database_tls(&options)
            .context("refusing to connect (--insecure-transport accepts the risk)")?;
    }
    let pool = PgPoolOptions::new()
        .max_connections(if matches!(cli.command, Command::Relay(_)) {
            4
        } else {
            1
        })
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .context("cannot connect to the database")?;
    let mut conn = match cli.command {
        Command::Migrate => {
            outbox_core::migrate_with(&pool, &tables).await?;
            // The dedup slices of the days around today, so consumers find them made
            // (`outbox prune dedup` makes the next ones): a consumer that may not make a slice
            // records a missing day's ids in the timeless slice.
            let today = outbox_consumer::today();
            let mut conn = pool.acquire().await?;
            outbox_consumer::ensure_dedup_slices(
                &mut conn,
                &tables,
                today - 1..=today + outbox_consumer::SLICES_AHEAD,
            )
            .await?;
            println!("migrations applied");
            return Ok(());
        }
        Command::Relay(args) => return relay::run(pool, tables, args).await,
        _ => pool.acquire().await?,
    };
    match cli.command {
        // Migrate and Relay returned above and never reach this match.
        Command::Migrate | Command::Relay(_) => {}
        Command::Quarantine { action } => quarantine::run(&mut conn, &tables, action).await?,
        Command::Parked { action } => parked::run(&mut conn, &tables, action).await?,
        Command::Status { json } => status::run(&mut conn, &tables, json).await?,
        Command::Prune {
            what,
            older_than,
            batch,
            yes,
            reason,
        } => match what {
            PruneTarget::Dedup | PruneTarget::Published if reason.is_some() => {
                anyhow::bail!("--reason is recorded by `prune quarantine` only")
            }
            PruneTarget::Dedup => {
                let pruned = outbox_consumer::prune(&mut conn, &tables, older_than, batch).await?;
                println!(
                    "dropped {} day slices, removed {} timeless rows, made {} day slices ahead",
                    pruned.slices_dropped, pruned.timeless_rows, pruned.slices_made
                );
            }
            PruneTarget::Published => {
                let removed =
                    outbox_producer::prune_published(&mut conn, &tables, older_than, batch).await?;
                println!("removed {removed} rows");
            }
            PruneTarget::Quarantine => {
                let table = quarantine::shown(
                    &outbox_consumer::quarantine::verify(&mut conn, &tables).await?,
                );
                let what = format!(
                    "delete every message of {table} quarantined more than {} ago",
                    humantime::format_duration(older_than)
                );
                confirm::confirm(&what, yes)?;
                let removed = outbox_consumer::prune_quarantine(
                    &mut conn,
                    &tables,
                    older_than,
                    batch,
                    reason.as_deref(),
                )
                .await?;
                println!("removed {removed} quarantined messages");
            }
        },
    }
    Ok(())
}
