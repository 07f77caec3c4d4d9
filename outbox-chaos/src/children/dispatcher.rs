//! One dispatcher process: `Dispatcher::run` with the HTTP executor against the billing API
//! the orchestrator serves, until SIGTERM. In crash mode it drives `run_once` itself and arms
//! the library's crash-after-call fault after a number of batches, exiting the moment it
//! fires (the API answered the calls, their outcomes are not recorded: the next dispatcher
//! makes them again with the same keys).

use std::time::Duration;

use anyhow::Result;
use outbox_core::EventId;
use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Executor, HttpExecutor};

use super::action_writer::DESTINATION;
use super::{Common, EXIT_DISPATCHER_AFTER_CALL};

const POLL: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// The billing API's charges endpoint.
    #[arg(long)]
    pub(crate) api_url: String,
    /// Calls in flight at once, across keys.
    #[arg(long, default_value_t = 16)]
    pub(crate) max_in_flight: usize,
    /// Rows per batch.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch_size: u32,
    /// The longest call, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub(crate) call_timeout_ms: u64,
    /// Crash after the calls of the batch that follows this many non-empty batches.
    #[arg(long)]
    pub(crate) crash_after_call_batches: Option<u32>,
}

pub(crate) async fn run(args: Args) -> Result<()> {
    let config = DispatcherConfig::new(DESTINATION)
        .tables(args.common.tables()?)
        .max_in_flight(args.max_in_flight)
        .batch_size(args.batch_size)
        .call_timeout(Duration::from_millis(args.call_timeout_ms))
        // The default `max_attempts` (10): the API's outages, 503s and stalls are the
        // destination's failures, never charged to an action, so every committed action must
        // still end done (the checker counts one quarantined as lost).
        .backoff(Duration::from_millis(50), Duration::from_secs(1))
        .poll_interval(POLL)
        .shutdown_timeout(Duration::from_secs(5));
    // One connection claims, one records, one LISTENs, and one for the gauges' query.
    let pool = args.common.pool(4)?;
    // Connection refused (the API down) must read as an outage, not as a call without an
    // answer: the connect timeout stays below the call timeout.
    let client =
        reqwest::Client::builder().connect_timeout(Duration::from_millis(args.call_timeout_ms / 2));
    let executor = HttpExecutor::post_json(client, args.api_url.parse()?)?;
    // Checking the checker: `CHAOS_SABOTAGE=fresh-key` makes this dispatcher send a new
    // idempotency key on every retry, a bug the run must then report (charges under keys of
    // no committed action, actions without a charge under their own).
    if std::env::var("CHAOS_SABOTAGE").is_ok_and(|v| v == "fresh-key") {
        let sabotaged = move |mut action: Action| {
            let executor = executor.clone();
            async move {
                if action.attempt > 0 {
                    action.id = EventId::new();
                }
                executor.execute(action).await
            }
        };
        return drive(&args, Dispatcher::new(pool, config, sabotaged)?).await;
    }
    drive(&args, Dispatcher::new(pool, config, executor)?).await
}

/// Runs `dispatcher` until SIGTERM, or in crash mode until the injected crash fires.
async fn drive<E: Executor>(args: &Args, dispatcher: Dispatcher<E>) -> Result<()> {
    let shutdown = super::shutdown_token();
    let Some(arm_after) = args.crash_after_call_batches else {
        dispatcher.run(shutdown).await?;
        return Ok(());
    };
    super::run_armed(
        &shutdown,
        arm_after,
        args.batch_size,
        POLL,
        EXIT_DISPATCHER_AFTER_CALL,
        || dispatcher.crash_after_next_call(),
        || dispatcher.run_once(),
    )
    .await;
    Ok(())
}
