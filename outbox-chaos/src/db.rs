//! The run's own database: created on the shared server, dropped after a passing run.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result};
use outbox_core::TableNames;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

/// `application_name` of the orchestrator's own connections; connection kills spare them.
pub(crate) const ORCHESTRATOR_APP: &str = "chaos-orchestrator";

/// The harness's own tables. `chaos_effects` deliberately has no unique constraint on
/// (consumer, event_id): a double effect must be visible, not prevented.
const SCHEMA: &str = "
CREATE TABLE chaos_attempts (
    event_id     UUID        NOT NULL,
    key          TEXT        NOT NULL,
    attempted_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_state (
    key     TEXT   PRIMARY KEY,
    version BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE chaos_state_log (
    event_id UUID   NOT NULL,
    key      TEXT   NOT NULL,
    version  BIGINT NOT NULL
);
CREATE TABLE chaos_effects (
    effect_order BIGSERIAL PRIMARY KEY,
    consumer     TEXT        NOT NULL,
    member       TEXT        NOT NULL,
    event_id     UUID        NOT NULL,
    key          TEXT        NOT NULL,
    version      BIGINT      NOT NULL,
    partition    INT         NOT NULL,
    kafka_offset BIGINT      NOT NULL,
    at           TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_poison (
    event_id        UUID,
    partition       INT    NOT NULL,
    kafka_offset    BIGINT NOT NULL,
    expected_reason TEXT   NOT NULL,
    -- The topic's incarnation the record went into: deletions of the topic before it.
    epoch           INT    NOT NULL DEFAULT 0
);
-- Outbox rows the harness made fail for good on purpose: each must be quarantined by the
-- relays with a reason containing `reason_contains`, and is missing from the topic and from
-- every group's effects by design.
CREATE TABLE chaos_expected_quarantine (
    event_id        UUID PRIMARY KEY,
    reason_contains TEXT NOT NULL
);
-- Rows of chaos_expected_quarantine that the harness, acting as the operator, discarded
-- (deleted from the outbox) while the relays ran with `BlockKey`: what the row looked like
-- when it went, and when. No later row of its key may have been published before then.
CREATE TABLE chaos_operator_discards (
    event_id     UUID        PRIMARY KEY,
    key          TEXT        NOT NULL,
    seq          BIGINT      NOT NULL,
    last_error   TEXT,
    discarded_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
-- Deletions of the topic (each starts a new epoch of it), and the events the topic held
-- when it was deleted: those were applied by every group before the deletion and are
-- verified by their effects only, since the topic no longer has them.
CREATE TABLE chaos_topic_deletions (
    epoch      INT         PRIMARY KEY,
    deleted_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_deleted_with_topic (
    event_id UUID PRIMARY KEY,
    epoch    INT  NOT NULL
);
-- The dispatcher fleet: the ids of actions the writer tried (before each transaction, in
-- autocommit), and each action key's counter, bumped in the transaction that enqueues the
-- key's next action (whose invoice is `<key>/<counter>`).
CREATE TABLE chaos_action_attempts (
    event_id     UUID        NOT NULL,
    key          TEXT        NOT NULL,
    attempted_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_action_state (
    key     TEXT   PRIMARY KEY,
    counter BIGINT NOT NULL DEFAULT 0
);
";

/// Terminates the dispatchers' connections to `database` (their `application_name` is their
/// label, `dispatcher-...`). Returns how many were terminated.
pub(crate) async fn terminate_dispatchers(admin: &PgPool, database: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = $1 AND application_name LIKE 'dispatcher%'",
    )
    .bind(database)
    .fetch_one(admin)
    .await?)
}

/// A database made for one run.
#[derive(Debug)]
pub(crate) struct ChaosDb {
    /// Its name.
    pub(crate) name: String,
    /// The orchestrator's pool on it.
    pub(crate) pool: PgPool,
    admin: PgPool,
}

impl ChaosDb {
    /// Creates `outbox_chaos_<random>` on the server at `server_url`, migrates the framework's
    /// tables under `tables`, creates the harness's tables, `keys` state rows and
    /// `action_keys` action counters.
    pub(crate) async fn create(
        server_url: &str,
        tables: &TableNames,
        keys: &[String],
        action_keys: &[String],
    ) -> Result<Self> {
        let base = PgConnectOptions::from_str(server_url).context("parsing the database URL")?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(base.clone().application_name(ORCHESTRATOR_APP))
            .await
            .context("connecting to Postgres (is it running? scripts/services.sh starts it)")?;
        let name = format!(
            "outbox_chaos_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await?;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(base.database(&name).application_name(ORCHESTRATOR_APP))
            .await?;
        outbox_core::migrate_with(&pool, tables).await?;
        sqlx::raw_sql(SCHEMA).execute(&pool).await?;
        sqlx::query("INSERT INTO chaos_state (key) SELECT * FROM UNNEST($1::text[])")
            .bind(keys)
            .execute(&pool)
            .await?;
        sqlx::query("INSERT INTO chaos_action_state (key) SELECT * FROM UNNEST($1::text[])")
            .bind(action_keys)
            .execute(&pool)
            .await?;
        Ok(Self { name, pool, admin })
    }

    /// Terminates every connection to the run's database but the orchestrator's own, the way
    /// an operator or a failover would. Returns how many were terminated.
    pub(crate) async fn terminate_connections(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid() AND application_name <> $2",
        )
        .bind(&self.name)
        .bind(ORCHESTRATOR_APP)
        .fetch_one(&self.admin)
        .await?)
    }

    /// What [`terminate_dispatchers`] needs, for a task of its own.
    pub(crate) fn admin(&self) -> (PgPool, String) {
        (self.admin.clone(), self.name.clone())
    }

    /// Drops the database (after a passing run).
    pub(crate) async fn drop_database(self) -> Result<()> {
        self.pool.close().await;
        sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&self.admin)
        .await?;
        self.admin.close().await;
        Ok(())
    }
}
