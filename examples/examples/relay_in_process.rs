//! A relay in your process: publishes what your transactions enqueued, then stops cleanly.
//! Run: `cargo run -p outbox-examples --example relay_in_process` (needs `DATABASE_URL` and a
//! broker at `KAFKA_BROKERS`).

use anyhow::Result;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_relay").await?;
    let topic = outbox_examples::setup::topic("ex.invoices", 3).await?;

    let mut tx = pool.begin().await?;
    for n in 0..10 {
        let event = NewEvent::new(
            "invoice",
            format!("inv-{n}"),
            "InvoiceDecided",
            &json!({ "n": n }),
        )?
        .with_topic(&topic)?;
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;

    let relay = Relay::new(
        pool.clone(),
        &producer_config(&outbox_examples::setup::brokers()),
        RelayConfig::default(),
    )?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    outbox_examples::setup::wait_for_count(
        &pool,
        "SELECT count(*) FROM outbox_events WHERE status = 'published'",
        10,
    )
    .await?;
    // Bounded: a batch in flight is recorded, the producer flushed, within shutdown_timeout.
    shutdown.cancel();
    running.await??;
    println!("10 events published to {topic}");
    Ok(())
}
