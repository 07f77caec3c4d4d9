//! A handler with state: a type implementing `Handler` (here a tax rate and a client of an
//! outside service), instead of a plain function. Run: `cargo run -p outbox-examples
//! --example stateful_handler` (needs `DATABASE_URL` and a broker at `KAFKA_BROKERS`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, Event, Handler, HandlerError, consumer_config, dedup_consume,
};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use serde::Deserialize;
use serde_json::json;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Deserialize)]
struct InvoiceDecided {
    cents: i64,
}

/// The handler's state: configuration, and what stands for a client of an outside service.
struct Invoicing {
    tax_percent: i64,
    outside_calls: Arc<AtomicUsize>,
}

impl Handler<InvoiceDecided> for Invoicing {
    async fn handle(
        &self,
        event: &Event<InvoiceDecided>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if event.payload.cents < 0 {
            // Retrying cannot fix it: quarantined at once, the partition moves on.
            return Err(HandlerError::quarantine("negative amount"));
        }
        // An outside call cannot join the transaction: it gets the event id as its key.
        let _key = event.idempotency_key();
        self.outside_calls.fetch_add(1, Ordering::SeqCst);
        let total = event.payload.cents * (100 + self.tax_percent) / 100;
        sqlx::query("INSERT INTO totals (invoice, cents) VALUES ($1, $2)")
            .bind(&event.key)
            .bind(total)
            .execute(conn)
            .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_stateful").await?;
    let topic = outbox_examples::setup::topic("ex.invoices", 1).await?;
    let brokers = outbox_examples::setup::brokers();
    sqlx::query("CREATE TABLE totals (invoice TEXT PRIMARY KEY, cents BIGINT NOT NULL)")
        .execute(&pool)
        .await?;
    let mut tx = pool.begin().await?;
    for (invoice, cents) in [("inv-1", 1000), ("inv-2", -5), ("inv-3", 2000)] {
        let event = NewEvent::new(
            "invoice",
            invoice,
            "InvoiceDecided",
            &json!({ "cents": cents }),
        )?
        .with_topic(&topic)?;
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;
    Relay::new(
        pool.clone(),
        &producer_config(&brokers),
        RelayConfig::default(),
    )?
    .run_once()
    .await?;

    let handler = Invoicing {
        tax_percent: 20,
        outside_calls: Arc::default(),
    };
    let calls = Arc::clone(&handler.outside_calls);
    let shutdown = CancellationToken::new();
    let name = format!("invoicing-{}", uuid::Uuid::new_v4().simple());
    let consuming = tokio::spawn({
        let (pool, shutdown, topic) = (pool.clone(), shutdown.clone(), topic.clone());
        async move {
            dedup_consume(&consumer_config(&brokers, &name), pool, handler)
                .topics([topic])
                .config(ConsumerConfig::new(name.clone()))
                .run(shutdown)
                .await
        }
    });
    outbox_examples::setup::wait_for_count(&pool, "SELECT count(*) FROM totals", 2).await?;
    outbox_examples::setup::wait_for_count(
        &pool,
        "SELECT count(*) FROM outbox_consumer_quarantine",
        1,
    )
    .await?;
    shutdown.cancel();
    consuming.await??;
    println!(
        "2 totals written, 1 invoice quarantined, {} outside calls",
        calls.load(Ordering::SeqCst)
    );
    Ok(())
}
