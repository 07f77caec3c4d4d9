//! The demo's own tables (the agent's state, the model's call log, the billing service's
//! books) next to the framework's, in one schema per run.

use anyhow::{Context, Result};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const TABLES: &[&str] = &[
    "CREATE TABLE agent_tasks (
        id TEXT PRIMARY KEY, customer TEXT NOT NULL, cents BIGINT NOT NULL,
        state TEXT NOT NULL DEFAULT 'new', event_id UUID, charge_id BIGINT)",
    "CREATE TABLE model_calls (seq BIGSERIAL PRIMARY KEY, task TEXT NOT NULL)",
    "CREATE TABLE billing_requests (
        seq BIGSERIAL PRIMARY KEY, idempotency_key TEXT NOT NULL, invoice TEXT NOT NULL)",
    "CREATE TABLE billing_charges (
        charge_id BIGSERIAL PRIMARY KEY, idempotency_key TEXT NOT NULL UNIQUE,
        invoice TEXT NOT NULL, cents BIGINT NOT NULL)",
    // What the receipts consumer did with each InvoiceCharged event. No unique constraint: a
    // second receipt for one invoice would show.
    "CREATE TABLE agent_receipts (
        seq BIGSERIAL PRIMARY KEY, invoice TEXT NOT NULL, charge_id BIGINT NOT NULL)",
];

/// The tasks every run starts with.
pub const TASKS: &[(&str, &str, i64)] = &[
    ("t1", "ada", 1_200),
    ("t2", "grace", 3_400),
    ("t3", "edsger", 5_600),
];

/// A pool whose connections resolve tables in `schema`.
pub async fn connect(database_url: &str, schema: &str, size: u32) -> Result<PgPool> {
    let options: PgConnectOptions = database_url.parse().context("parsing the database URL")?;
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options.options([("search_path", schema)]))
        .await
        .context("connecting to PostgreSQL (is it running? scripts/demo starts it)")
}

/// Drops and recreates `schema` with the framework's and the demo's tables and the tasks.
pub async fn reset(database_url: &str, schema: &str) -> Result<()> {
    outbox_core::Ident::new(schema).context("schema name")?;
    let pool = connect(database_url, "public", 1).await?;
    for statement in [
        format!("DROP SCHEMA IF EXISTS {schema} CASCADE"),
        format!("CREATE SCHEMA {schema}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await?;
    }
    pool.close().await;
    let pool = connect(database_url, schema, 1).await?;
    outbox_producer::migrate(&pool).await?;
    for statement in TABLES {
        sqlx::query(*statement).execute(&pool).await?;
    }
    for (id, customer, cents) in TASKS {
        sqlx::query("INSERT INTO agent_tasks (id, customer, cents) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(customer)
            .bind(cents)
            .execute(&pool)
            .await?;
    }
    pool.close().await;
    Ok(())
}
