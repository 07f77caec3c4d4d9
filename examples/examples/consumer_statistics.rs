//! Your own `ConsumerContext` (here: librdkafka's statistics) under the dedup consumer: the
//! consumer wraps it in its `DedupContext`, which still sees rebalances and client errors.
//! Run: `cargo run -p outbox-examples --example consumer_statistics` (needs `DATABASE_URL` and
//! a broker at `KAFKA_BROKERS`).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

use anyhow::Result;
use outbox_consumer::{Event, consumer_config, dedup_consume};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use rdkafka::ClientContext;
use rdkafka::statistics::Statistics;
use serde_json::json;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

/// Keeps what the statistics callback reports: how many reports, and messages received.
#[derive(Clone, Default)]
struct Stats {
    reports: Arc<AtomicUsize>,
    received: Arc<AtomicI64>,
}

impl ClientContext for Stats {
    fn stats(&self, statistics: Statistics) {
        self.reports.fetch_add(1, Ordering::SeqCst);
        self.received.store(statistics.rxmsgs, Ordering::SeqCst);
    }
}

async fn record(
    event: &Event<serde_json::Value>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO seen (event_id) VALUES ($1)")
        .bind(event.id)
        .execute(conn)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_stats").await?;
    let topic = outbox_examples::setup::topic("ex.invoices", 1).await?;
    let brokers = outbox_examples::setup::brokers();
    sqlx::query("CREATE TABLE seen (event_id UUID PRIMARY KEY)")
        .execute(&pool)
        .await?;
    let mut tx = pool.begin().await?;
    let event =
        NewEvent::new("invoice", "inv-1", "InvoiceDecided", &json!({}))?.with_topic(&topic)?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    Relay::new(
        pool.clone(),
        &producer_config(&brokers),
        RelayConfig::default(),
    )?
    .run_once()
    .await?;

    let stats = Stats::default();
    let mut kafka = consumer_config(
        &brokers,
        &format!("ex-stats-{}", uuid::Uuid::new_v4().simple()),
    );
    kafka.set("statistics.interval.ms", "200");
    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let (pool, shutdown, topic, stats) =
            (pool.clone(), shutdown.clone(), topic.clone(), stats.clone());
        async move {
            dedup_consume(&kafka, pool, record)
                .topics([topic])
                .context(stats)
                .run(shutdown)
                .await
        }
    });
    outbox_examples::setup::wait_for_count(&pool, "SELECT count(*) FROM seen", 1).await?;
    while stats.reports.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    consuming.await??;
    println!(
        "handled 1 event; {} statistics reports, the last counting {} messages received",
        stats.reports.load(Ordering::SeqCst),
        stats.received.load(Ordering::SeqCst)
    );
    Ok(())
}
