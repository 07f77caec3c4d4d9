//! One relay process. Normally `Relay::run` until SIGTERM; in crash mode it drives
//! `run_once` itself and arms the library's crash-after-ack fault after a number of batches,
//! exiting the moment it fires (Kafka acknowledged the batch, the rows are still pending).

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{QuarantinePolicy, Relay, RelayConfig, producer_config};

use super::{Common, EXIT_RELAY_AFTER_ACK};

const POLL: Duration = Duration::from_millis(250);

/// The relay's [`QuarantinePolicy`], as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub(crate) enum Policy {
    /// A quarantined row's later rows of its key are published.
    #[default]
    SkipQuarantined,
    /// A quarantined row holds back its key's later rows until an operator acts.
    BlockKey,
}

impl From<Policy> for QuarantinePolicy {
    fn from(policy: Policy) -> Self {
        match policy {
            Policy::SkipQuarantined => Self::SkipQuarantined,
            Policy::BlockKey => Self::BlockKey,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Rows per batch.
    #[arg(long, default_value_t = 50)]
    pub(crate) batch_size: u32,
    /// Crash after Kafka acknowledges the batch that follows this many non-empty batches.
    #[arg(long)]
    pub(crate) crash_after_ack_batches: Option<u32>,
    /// Attempts before a row with transient failures is quarantined. The default is so high
    /// that no row is ever quarantined for a broker fault; the `liveness` profile uses a few,
    /// so that an outage charged to rows would show as quarantined rows.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) max_attempts: u32,
    /// First retry delay of a failed row, in milliseconds (doubled per attempt).
    #[arg(long, default_value_t = 50)]
    pub(crate) backoff_min_ms: u64,
    /// Longest retry delay of a failed row, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub(crate) backoff_max_ms: u64,
    /// librdkafka `message.timeout.ms` (default: the framework's `producer_config`, 30 s).
    #[arg(long)]
    pub(crate) message_timeout_ms: Option<u32>,
    /// What a quarantined row does to its key's later rows.
    #[arg(long, value_enum, default_value_t)]
    pub(crate) quarantine_policy: Policy,
}

pub(crate) async fn run(args: Args) -> Result<()> {
    let pool = args.common.pool(3)?;
    let mut kafka = producer_config(&args.common.brokers);
    kafka.set("client.id", &args.common.label);
    if let Some(ms) = args.message_timeout_ms {
        kafka.set("message.timeout.ms", ms.to_string());
    }
    let config = RelayConfig::default()
        .tables(args.common.tables()?)
        .batch_size(args.batch_size)
        .poll_interval(POLL)
        .max_attempts(args.max_attempts)
        .backoff(
            Duration::from_millis(args.backoff_min_ms),
            Duration::from_millis(args.backoff_max_ms),
        )
        .quarantine_policy(args.quarantine_policy.into())
        .shutdown_timeout(Duration::from_secs(5));
    let relay = Relay::new(pool, &kafka, config)?;
    let shutdown = super::shutdown_token();
    let Some(arm_after) = args.crash_after_ack_batches else {
        relay.run(shutdown).await?;
        return Ok(());
    };
    super::run_armed(
        &shutdown,
        arm_after,
        args.batch_size,
        POLL,
        EXIT_RELAY_AFTER_ACK,
        || relay.crash_after_next_ack(),
        || relay.run_once(),
    )
    .await;
    Ok(())
}
