//! The dispatcher fleet's writer: transactions that bump per-key counters and enqueue one
//! action per bump for the `billing` destination, the way an agent commits its decisions.
//!
//! Before each transaction the ids it is about to try are recorded in `chaos_action_attempts`
//! in autocommit, so the checker can prove that the ones that never committed were never
//! charged. Some transactions roll back on purpose; the orchestrator kills the process at
//! random (with a transaction open or not).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use outbox_core::EventId;
use outbox_producer::{NewEvent, Outbox};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::Common;

/// The destination of every action (`NewEvent::for_dispatcher`).
pub(crate) const DESTINATION: &str = "billing";
/// The aggregate type of every action.
pub(crate) const ACTION_AGGREGATE: &str = "chaos-action";
/// The action type.
pub(crate) const ACTION_TYPE: &str = "Charge";

/// An action's payload, sent as the request body by the HTTP executor. The billing API reads
/// `invoice` and `cents` (and keeps the invoice in its ledger); `invoice` names the key and
/// the key's counter, so the ledger alone shows which action each charge applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ActionPayload {
    /// `<key>/<n>`.
    pub(crate) invoice: String,
    pub(crate) cents: i64,
    pub(crate) key: String,
    /// The key's counter after this action: its position in the key's commit order.
    pub(crate) n: i64,
}

/// The invoice of the `n`th action of `key`.
pub(crate) fn invoice(key: &str, n: i64) -> String {
    format!("{key}/{n}")
}

/// `(key, n)` of an invoice written by [`invoice`].
pub(crate) fn parse_invoice(invoice: &str) -> Option<(&str, i64)> {
    let (key, n) = invoice.rsplit_once('/')?;
    Some((key, n.parse().ok()?))
}

/// The name of action key `n`.
pub(crate) fn action_key(n: u32) -> String {
    format!("a{n:03}")
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Number of action keys (`a000`, `a001`, ...).
    #[arg(long)]
    pub(crate) keys: u32,
    /// Concurrent writer tasks.
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: u32,
    /// Pause between a writer's transactions, lower bound (ms).
    #[arg(long, default_value_t = 40)]
    pub(crate) pause_min_ms: u64,
    /// Pause between a writer's transactions, upper bound (ms).
    #[arg(long, default_value_t = 120)]
    pub(crate) pause_max_ms: u64,
    /// Percentage of transactions rolled back on purpose.
    #[arg(long, default_value_t = 5)]
    pub(crate) rollback_percent: u32,
}

pub(crate) async fn run(args: Args) -> Result<()> {
    let pool = args.common.pool(args.workers + 1)?;
    let outbox = Outbox::new(&args.common.tables()?);
    let shutdown = super::shutdown_token();
    let args = Arc::new(args);
    let mut writers = tokio::task::JoinSet::new();
    for w in 0..args.workers {
        writers.spawn(writer(
            Arc::clone(&args),
            pool.clone(),
            outbox.clone(),
            StdRng::seed_from_u64(args.common.seed ^ (u64::from(w) << 32)),
            shutdown.clone(),
        ));
    }
    while writers.join_next().await.is_some() {}
    tracing::info!("action writer stopped");
    Ok(())
}

async fn writer(
    args: Arc<Args>,
    pool: PgPool,
    outbox: Outbox,
    mut rng: StdRng,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        if let Err(error) = transaction(&args, &pool, &outbox, &mut rng).await {
            // Connection terminated and the like: not committed (or committed, if the commit
            // reached the server: the checker asks the table).
            tracing::warn!(%error, "action transaction failed");
        }
        let pause = rng.random_range(args.pause_min_ms..=args.pause_max_ms.max(args.pause_min_ms));
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
        }
    }
}

async fn transaction(args: &Args, pool: &PgPool, outbox: &Outbox, rng: &mut StdRng) -> Result<()> {
    let count = rng.random_range(1..=3_usize);
    let mut keys: Vec<String> = (0..count)
        .map(|_| action_key(rng.random_range(0..args.keys)))
        .collect();
    // One lock order for every writer: no deadlocks between them.
    keys.sort();
    let ids: Vec<Uuid> = keys.iter().map(|_| *EventId::new().as_uuid()).collect();
    sqlx::query(
        "INSERT INTO chaos_action_attempts (event_id, key) \
         SELECT * FROM UNNEST($1::uuid[], $2::text[])",
    )
    .bind(&ids)
    .bind(&keys)
    .execute(pool)
    .await?;
    let mut tx = pool.begin().await?;
    for (id, key) in ids.iter().zip(&keys) {
        let n: i64 = sqlx::query_scalar(
            "UPDATE chaos_action_state SET counter = counter + 1 WHERE key = $1 \
             RETURNING counter",
        )
        .bind(key)
        .fetch_one(&mut *tx)
        .await?;
        let payload = ActionPayload {
            invoice: invoice(key, n),
            cents: 100 + n,
            key: key.clone(),
            n,
        };
        let action = NewEvent::new(ACTION_AGGREGATE, key, ACTION_TYPE, &payload)?
            .with_id(EventId::from_uuid(*id))
            .for_dispatcher(DESTINATION)?;
        outbox.enqueue(&mut tx, &action).await?;
    }
    if rng.random_range(0..100) < args.rollback_percent {
        tx.rollback().await?;
        return Ok(());
    }
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invoice_names_its_key_and_counter() {
        assert_eq!(parse_invoice(&invoice("a017", 42)), Some(("a017", 42)));
        assert_eq!(parse_invoice("a017"), None);
        assert_eq!(parse_invoice("a017/x"), None);
    }
}
