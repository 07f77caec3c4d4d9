//! What every runnable example needs and none of them is about: a PostgreSQL schema of its
//! own (with the framework's tables), and a Kafka topic (the brokers these examples run
//! against do not create topics on demand, and most production brokers do not either).
//!
//! `DATABASE_URL` names the database (`scripts/demo` and `scripts/test` export the scripts'
//! own cluster's as `OUTBOX_TEST_DATABASE_URL`, used when `DATABASE_URL` is unset);
//! `KAFKA_BROKERS` the brokers (default `127.0.0.1:9092`).

use anyhow::{Context, Result};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A pool on a fresh schema named `<prefix>_<random>`, migrated.
pub async fn database(prefix: &str) -> Result<PgPool> {
    let url = std::env::var("DATABASE_URL")
        .or_else(|_| std::env::var("OUTBOX_TEST_DATABASE_URL"))
        .context("set DATABASE_URL to a PostgreSQL database the example may create a schema in")?;
    let schema = format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let options: PgConnectOptions = url.parse().context("DATABASE_URL")?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.clone())
        .await
        .context("connecting to PostgreSQL")?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;
    admin.close().await;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    outbox_producer::migrate(&pool).await?;
    Ok(pool)
}

/// The Kafka brokers.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// Creates a topic `<prefix>.<random>` with `partitions` partitions and returns its name.
pub async fn topic(prefix: &str, partitions: i32) -> Result<String> {
    let name = format!("{prefix}.{}", uuid::Uuid::new_v4().simple());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()?;
    for result in admin
        .create_topics(
            &[NewTopic::new(&name, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await?
    {
        result.map_err(|(topic, code)| anyhow::anyhow!("creating {topic}: {code}"))?;
    }
    Ok(name)
}

/// Waits until `query` (a `SELECT count(*)`) returns at least `n`, or fails after 60 s.
pub async fn wait_for_count(pool: &PgPool, query: &'static str, n: i64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let count: i64 = sqlx::query_scalar(query).fetch_one(pool).await?;
        if count >= n {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "waited 60 s for {n} rows: {query}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
