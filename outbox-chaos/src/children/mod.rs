//! The processes the orchestrator starts from its own executable. Each stops cleanly on
//! SIGTERM (or when its parent dies), and exits with a distinctive status when an injected
//! crash fires, so the orchestrator can tell a planned crash from a real one.

pub(crate) mod action_writer;
pub(crate) mod consumer;
pub(crate) mod dispatcher;
pub(crate) mod producer;
pub(crate) mod relay;

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result};
use outbox_core::TableNames;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

/// Exit status of a relay whose injected crash after Kafka's ack (before marking) fired.
pub(crate) const EXIT_RELAY_AFTER_ACK: i32 = 17;
/// Exit status of a consumer whose injected crash after commit (before offset store) fired.
pub(crate) const EXIT_CONSUMER_AFTER_COMMIT: i32 = 18;
/// Exit status of a producer that died with its transaction open (before commit).
pub(crate) const EXIT_PRODUCER_BEFORE_COMMIT: i32 = 19;
/// Exit status of a producer that died right after its commit returned.
pub(crate) const EXIT_PRODUCER_AFTER_COMMIT: i32 = 20;
/// Exit status of a dispatcher whose injected crash after the calls (before recording their
/// outcomes) fired.
pub(crate) const EXIT_DISPATCHER_AFTER_CALL: i32 = 21;

/// The event type every good event carries (the consumers accept only this one).
pub(crate) const EVENT_TYPE: &str = "ChaosEvent";
/// The aggregate type of every good event.
pub(crate) const AGGREGATE_TYPE: &str = "chaos";

/// The payload of every good event: the key again and its per-key version (the state row's
/// version after this event, i.e. its position in the key's commit order).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChaosPayload {
    pub(crate) key: String,
    pub(crate) version: i64,
    pub(crate) pad: String,
}

/// What every child needs.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Common {
    /// Postgres server URL (the database name is replaced by `--database`). The orchestrator
    /// passes it in the environment: it may carry a password.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub(crate) database_url: String,
    /// The run's database.
    #[arg(long)]
    pub(crate) database: String,
    /// Broker bootstrap address.
    #[arg(long)]
    pub(crate) brokers: String,
    /// The run's topic.
    #[arg(long)]
    pub(crate) topic: String,
    /// Outbox table name (validated through `TableNames`).
    #[arg(long)]
    pub(crate) outbox_table: String,
    /// This process's name (logs, `application_name`, the effect table's `member`).
    #[arg(long)]
    pub(crate) label: String,
    /// Seed of this process's random choices.
    #[arg(long)]
    pub(crate) seed: u64,
}

impl Common {
    pub(crate) fn tables(&self) -> Result<TableNames> {
        Ok(TableNames::default().with_outbox(&self.outbox_table)?)
    }

    /// A lazily connecting pool, so a child starts even while Postgres refuses it.
    pub(crate) fn pool(&self, size: u32) -> Result<PgPool> {
        let options = PgConnectOptions::from_str(&self.database_url)
            .context("parsing --database-url")?
            .database(&self.database)
            .application_name(&self.label);
        Ok(PgPoolOptions::new()
            .max_connections(size)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options))
    }
}

/// Cancelled on SIGTERM, on Ctrl-C, or when the parent process goes away (so no child
/// outlives an orchestrator that was itself killed).
pub(crate) fn shutdown_token() -> CancellationToken {
    let token = CancellationToken::new();
    let parent = std::os::unix::process::parent_id();
    tokio::spawn({
        let token = token.clone();
        async move {
            let mut terminate =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let orphaned = async {
                loop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if std::os::unix::process::parent_id() != parent {
                        return;
                    }
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                Some(()) = async { terminate.as_mut()?.recv().await } => {}
                () = orphaned => tracing::warn!("parent went away; stopping"),
            }
            token.cancel();
        }
    });
    token
}

/// Leaves the process at once with `code`, as a crash at this point would: no destructor,
/// no flush, no commit; the OS closes the sockets and Postgres rolls back what was open.
pub(crate) fn crash(code: i32, what: &str) -> ! {
    tracing::info!(code, what, "injected crash");
    std::process::exit(code)
}

/// Crash mode of a relay or a dispatcher: runs `run_once` until SIGTERM, arms the library's
/// fault with `arm` once `arm_after` non-empty batches are done, and leaves with `code` the
/// moment it fires. A batch that is not full means nothing more is due: it waits `poll`.
pub(crate) async fn run_armed<F>(
    shutdown: &CancellationToken,
    arm_after: u32,
    batch_size: u32,
    poll: Duration,
    code: i32,
    arm: impl Fn(),
    mut run_once: impl FnMut() -> F,
) where
    F: std::future::Future<
            Output = Result<outbox_producer::BatchReport, outbox_producer::ProducerError>,
        >,
{
    let mut batches = 0_u32;
    while !shutdown.is_cancelled() {
        if batches == arm_after {
            arm();
        }
        let idle = match run_once().await {
            Ok(report) => {
                if report.claimed > 0 {
                    batches += 1;
                }
                report.claimed < batch_size as usize
            }
            Err(outbox_producer::ProducerError::InjectedFault(what)) => crash(code, what),
            Err(error) => {
                tracing::warn!(%error, "batch failed");
                true
            }
        };
        if idle {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = tokio::time::sleep(poll) => {}
            }
        }
    }
}
