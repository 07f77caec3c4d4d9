//! `outbox relay`: the relay as its own process.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use outbox_core::TableNames;
use outbox_producer::{AfterPublish, QuarantinePolicy, Relay, RelayConfig, producer_config};
use rdkafka::ClientConfig;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::kafka_config::{KafkaArgs, bootstrap_servers};

#[derive(Debug, Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    kafka: KafkaArgs,
    /// Rows per batch.
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Fallback polling interval, like `1s` or `250ms`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "1s")]
    poll_interval: Duration,
    /// Transient failures before a row is quarantined.
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Delete rows once published instead of marking them.
    #[arg(long)]
    delete_published: bool,
    /// Hold an aggregate's later rows behind its quarantined row.
    #[arg(long)]
    block_key_on_quarantine: bool,
    /// How long to wait for the brokers at startup before giving up, like `10s`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    connect_timeout: Duration,
    /// Serve Prometheus metrics on this address (for example `127.0.0.1:9464`).
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

pub(crate) async fn run(pool: PgPool, tables: TableNames, args: RelayArgs) -> Result<()> {
    let config = RelayConfig::default()
        .tables(tables)
        .batch_size(args.batch_size)
        .poll_interval(args.poll_interval)
        .max_attempts(args.max_attempts)
        .after_publish(if args.delete_published {
            AfterPublish::Delete
        } else {
            AfterPublish::Mark
        })
        .quarantine_policy(if args.block_key_on_quarantine {
            QuarantinePolicy::BlockKey
        } else {
            QuarantinePolicy::SkipQuarantined
        })
        .insecure_transport(crate::insecure_transport());
    if let Some(addr) = args.metrics_addr {
        outbox_producer::serve_metrics(addr)?;
        eprintln!("metrics on http://{addr}/metrics");
    }
    // The relay's defaults, then the user's properties; `Relay::new` enforces what its
    // guarantees need on top.
    let kafka = args.kafka.client_config(producer_config(""))?;
    let brokers = bootstrap_servers(&kafka)?;
    check_brokers(&kafka, &brokers, args.connect_timeout).await?;
    let relay = Relay::new(pool, &kafka, config)?;
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            shutdown_signal().await;
            eprintln!("shutting down: finishing the batch in flight");
            shutdown.cancel();
        }
    });
    eprintln!("relaying to {brokers}");
    relay.run(shutdown).await?;
    Ok(())
}

/// Fails fast, naming the address and what failed (no broker answering, a refused password,
/// an untrusted certificate: `check_connection`'s words, with no secret in them): librdkafka
/// would otherwise retry quietly and the relay would only log failed batches.
async fn check_brokers(kafka: &ClientConfig, brokers: &str, timeout: Duration) -> Result<()> {
    let kafka = kafka.clone();
    tokio::task::spawn_blocking(move || outbox_core::check_connection(&kafka, timeout))
        .await?
        .with_context(|| format!("cannot use the Kafka brokers at {brokers}"))?;
    Ok(())
}

async fn shutdown_signal() {
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        Some(()) = async { terminate.as_mut()?.recv().await } => {}
    }
}
