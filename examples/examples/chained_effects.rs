//! Chained effects: a handler enqueues its follow-up event on the connection it is given, so
//! consume → decide → enqueue happens once: a redelivery enqueues nothing, a handler that dies
//! before its commit takes its follow-up with it. Run: `cargo run -p outbox-examples --example
//! chained_effects` (needs `DATABASE_URL` and a broker at `KAFKA_BROKERS`).

use anyhow::Result;
use outbox_consumer::{Event, HandlerError, boxed, consumer_config, dedup_consume};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_chain").await?;
    let decided = outbox_examples::setup::topic("ex.decided", 1).await?;
    let charged = outbox_examples::setup::topic("ex.charged", 1).await?;
    let brokers = outbox_examples::setup::brokers();

    let mut tx = pool.begin().await?;
    let event = NewEvent::new(
        "invoice",
        "inv-1",
        "InvoiceDecided",
        &json!({ "cents": 500 }),
    )?
    .with_topic(&decided)?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    let relay = Relay::new(
        pool.clone(),
        &producer_config(&brokers),
        RelayConfig::default(),
    )?;
    relay.run_once().await?;

    // A closure handler (through `boxed`), capturing the follow-up's topic.
    let handler = boxed(move |event: &Event<serde_json::Value>, conn| {
        let charged = charged.clone();
        let key = event.key.clone();
        Box::pin(async move {
            let follow_up = NewEvent::new(
                "invoice",
                key,
                "InvoiceCharged",
                &json!({ "charge": "ch_1" }),
            )
            .and_then(|e| e.with_topic(charged))
            .map_err(HandlerError::quarantine)?;
            // On the handler's connection: it commits with the dedup row, or not at all.
            outbox_producer::enqueue(conn, &follow_up)
                .await
                .map_err(HandlerError::retry)?;
            Ok(())
        })
    });
    let shutdown = CancellationToken::new();
    let group = format!("ex-chain-{}", uuid::Uuid::new_v4().simple());
    let consuming = tokio::spawn({
        let (pool, shutdown) = (pool.clone(), shutdown.clone());
        async move {
            dedup_consume(&consumer_config(&brokers, &group), pool, handler)
                .topics([decided])
                .run(shutdown)
                .await
        }
    });
    outbox_examples::setup::wait_for_count(
        &pool,
        "SELECT count(*) FROM outbox_events WHERE type = 'InvoiceCharged'",
        1,
    )
    .await?;
    shutdown.cancel();
    consuming.await??;
    // The follow-up is an ordinary pending event: the relay publishes it.
    relay.run_once().await?;
    println!("InvoiceDecided handled once; its InvoiceCharged follow-up enqueued and published");
    Ok(())
}
