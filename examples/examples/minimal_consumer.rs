//! A minimal consumer: a plain async function whose writes commit with the event's dedup
//! row, so a redelivered event changes nothing. Run: `cargo run -p outbox-examples --example
//! minimal_consumer` (needs `DATABASE_URL` and a broker at `KAFKA_BROKERS`).

use anyhow::Result;
use outbox_consumer::{Event, consumer_config, dedup_consume};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use serde_json::json;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

/// The handler: its state change, on the connection it is given.
async fn record(
    event: &Event<serde_json::Value>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO seen (event_id, invoice) VALUES ($1, $2)")
        .bind(event.id)
        .bind(&event.key)
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_consumer").await?;
    let topic = outbox_examples::setup::topic("ex.invoices", 2).await?;
    let brokers = outbox_examples::setup::brokers();
    sqlx::query("CREATE TABLE seen (event_id UUID PRIMARY KEY, invoice TEXT NOT NULL)")
        .execute(&pool)
        .await?;

    // Three events, published by a relay.
    let mut tx = pool.begin().await?;
    for invoice in ["inv-1", "inv-2", "inv-3"] {
        let event =
            NewEvent::new("invoice", invoice, "InvoiceDecided", &json!({}))?.with_topic(&topic)?;
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;
    let relay = Relay::new(
        pool.clone(),
        &producer_config(&brokers),
        RelayConfig::default(),
    )?;
    relay.run_once().await?;

    let shutdown = CancellationToken::new();
    let group = format!("ex-consumer-{}", uuid::Uuid::new_v4().simple());
    let consuming = tokio::spawn({
        let (pool, shutdown, topic) = (pool.clone(), shutdown.clone(), topic.clone());
        async move {
            dedup_consume(&consumer_config(&brokers, &group), pool, record)
                .topics([topic])
                .run(shutdown)
                .await
        }
    });
    outbox_examples::setup::wait_for_count(&pool, "SELECT count(*) FROM seen", 3).await?;
    shutdown.cancel();
    consuming.await??;
    println!("3 events handled once each");
    Ok(())
}
