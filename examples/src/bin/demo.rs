//! End-to-end demo: an agent decides to send invoices; each decision commits with its outbox
//! event; the relay publishes through a crash; a billing consumer charges each invoice once.
//!
//! Needs PostgreSQL and the tansu broker (`scripts/demo` starts both).

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use outbox_consumer::{ConsumerConfig, Event, consumer_config, dedup_consume};
use outbox_producer::{NewEvent, Outbox, Relay, RelayConfig, producer_config};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Serialize, Deserialize)]
struct SendInvoice {
    invoice: String,
    customer: String,
    cents: i64,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();

    let pool = fresh_schema(&database_url, "outbox_demo").await?;
    outbox_producer::migrate(&pool).await?;
    sqlx::query(
        "CREATE TABLE invoices (id TEXT PRIMARY KEY, customer TEXT NOT NULL, state TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    sqlx::query("CREATE TABLE charges (seq BIGSERIAL, idempotency_key TEXT NOT NULL, invoice TEXT NOT NULL, cents BIGINT NOT NULL)")
        .execute(&pool)
        .await?;
    let topic = format!("outbox.event.invoice.{run}");
    create_topic(&brokers, &topic).await?;
    println!("1. agent decides: one transaction per decision = state change + outbox event");

    let outbox = Outbox::default();
    let customers = ["ada", "grace", "edsger", "barbara", "ken"];
    for (i, customer) in customers.iter().enumerate() {
        let invoice = format!("inv-{run}-{i}");
        let decision = SendInvoice {
            invoice: invoice.clone(),
            customer: (*customer).into(),
            cents: 1_000 * (i as i64 + 1),
        };
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO invoices VALUES ($1, $2, 'decided')")
            .bind(&invoice)
            .bind(customer)
            .execute(&mut *tx)
            .await?;
        let event =
            NewEvent::new("invoice", &invoice, "SendInvoice", &decision)?.with_topic(&topic)?;
        outbox.enqueue(&mut tx, &event).await?;
        if *customer == "ken" {
            tx.rollback().await?;
            println!(
                "   {invoice} for {customer}: the agent aborted -> rolled back, state and event both gone"
            );
        } else {
            tx.commit().await?;
            println!("   {invoice} for {customer}: committed");
        }
    }

    println!("2. relay publishes, and crashes after Kafka acknowledged but before marking rows");
    let relay = Relay::new(
        pool.clone(),
        &producer_config(&brokers),
        RelayConfig::default(),
    )?;
    relay.crash_after_next_ack();
    let crashed = relay.run_once().await;
    ensure!(crashed.is_err(), "the injected crash did not happen");
    println!(
        "   crashed: {}",
        crashed.err().map(|e| e.to_string()).unwrap_or_default()
    );
    println!("   restarted relay republishes the same event ids (at-least-once)");

    println!("3. billing consumer charges each invoice, deduplicating on the event id");
    let shutdown = CancellationToken::new();
    let relaying = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let consuming = tokio::spawn({
        let (pool, shutdown) = (pool.clone(), shutdown.clone());
        let kafka = consumer_config(&brokers, &format!("billing-{run}"));
        let topic = topic.clone();
        async move {
            dedup_consume(
                &kafka,
                &[topic.as_str()],
                pool,
                ConsumerConfig::default(),
                charge,
                shutdown,
            )
            .await
        }
    });
    let committed = customers.len() as i64 - 1;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while charges(&pool).await? < committed {
        if tokio::time::Instant::now() > deadline {
            bail!("not every invoice was charged within a minute");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    relaying.await??;
    consuming.await??;

    let per_invoice: Vec<(String, i64)> =
        sqlx::query_as("SELECT invoice, count(*) FROM charges GROUP BY invoice ORDER BY invoice")
            .fetch_all(&pool)
            .await?;
    for (invoice, n) in &per_invoice {
        println!("   {invoice}: charged {n}x");
    }
    let stats = outbox_producer::stats(&mut *pool.acquire().await?, &Default::default()).await?;
    ensure!(
        per_invoice.len() as i64 == committed,
        "expected {committed} charged invoices"
    );
    ensure!(
        per_invoice.iter().all(|(_, n)| *n == 1),
        "an invoice was charged twice"
    );
    ensure!(
        stats.pending == 0 && stats.quarantined == 0,
        "outbox not drained: {stats:?}"
    );
    println!(
        "OK: {committed} decisions committed, 1 rolled back, each invoice charged exactly once, outbox drained"
    );
    Ok(())
}

/// The billing tool call: records the charge under the event id as its idempotency key, in
/// the same transaction as the dedup row.
fn charge<'c>(
    event: &'c Event<SendInvoice>,
    tx: &'c mut sqlx::Transaction<'static, sqlx::Postgres>,
) -> outbox_consumer::HandlerFuture<'c> {
    Box::pin(async move {
        sqlx::query("INSERT INTO charges (idempotency_key, invoice, cents) VALUES ($1, $2, $3)")
            .bind(event.idempotency_key())
            .bind(&event.payload.invoice)
            .bind(event.payload.cents)
            .execute(&mut **tx)
            .await?;
        Ok(())
    })
}

async fn charges(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await?)
}

async fn fresh_schema(url: &str, schema: &str) -> Result<PgPool> {
    let options: PgConnectOptions = url.parse()?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .context("connecting to PostgreSQL")?;
    for statement in [
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
        format!("CREATE SCHEMA {schema}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    Ok(PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.options([("search_path", schema)]))
        .await?)
}

async fn create_topic(brokers: &str, topic: &str) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, 2, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .context("creating the topic (is the broker up? scripts/demo starts it)")?;
    for result in results {
        result.map_err(|(name, code)| anyhow::anyhow!("creating topic {name}: {code}"))?;
    }
    Ok(())
}
