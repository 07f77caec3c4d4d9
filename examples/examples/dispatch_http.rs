//! The dispatcher calling an HTTP API, no Kafka: the agent commits its decision with the
//! action, the dispatcher posts it with `Idempotency-Key: <event id>`, and the agent's next
//! turn reads the API's answer from the stored outcome. The API is a local billing service
//! (`outbox_examples::billing_api`). Run: `cargo run -p outbox-examples --example
//! dispatch_http` (needs `DATABASE_URL` only).

use std::time::Duration;

use anyhow::{Result, bail};
use outbox_examples::billing_api::BillingApi;
use outbox_producer::dispatch::{self, ActionState, Dispatcher, DispatcherConfig, HttpExecutor};
use outbox_producer::{NewEvent, TableNames};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_dispatch").await?;
    let billing = BillingApi::start().await?;

    // The agent's turn: its decision and the action, in one transaction.
    let mut tx = pool.begin().await?;
    let action = NewEvent::new(
        "task",
        "t1",
        "charge",
        &json!({ "invoice": "inv-7", "cents": 500 }),
    )?
    .for_dispatcher("billing")?;
    let id = outbox_producer::enqueue(&mut tx, &action).await?;
    tx.commit().await?;

    let executor =
        HttpExecutor::post_json(reqwest::Client::builder(), billing.charges_url().parse()?)?;
    let config = DispatcherConfig::new("billing").call_timeout(Duration::from_secs(5));
    let dispatcher = Dispatcher::new(pool.clone(), config, executor)?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });

    // The agent's next turn: what the API answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let answer = loop {
        let mut conn = pool.acquire().await?;
        match dispatch::outcome(&mut conn, &TableNames::default(), id).await? {
            Some(ActionState::Done(answer)) => break answer,
            Some(ActionState::Pending { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => bail!("the action ended {other:?}"),
        }
    };
    shutdown.cancel();
    running.await??;
    println!(
        "charged once: {answer}; the billing service holds {} charge(s)",
        billing.charges().len()
    );
    Ok(())
}
