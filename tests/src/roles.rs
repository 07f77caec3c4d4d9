//! Least-privileged login roles for one test (the guide, "Roles"): an owner that migrates a
//! schema of its own, and a login per part granted exactly what `outbox_core::ROLES_SQL` says.
//! Roles are cluster-wide, so each test's have random names (and random passwords: the
//! cluster may authenticate with them); [`Roles::drop_all`] removes them and the schema.

use std::str::FromStr;

use anyhow::{Context, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use crate::{database_url, unique};

/// A login role: its name and password.
#[derive(Clone)]
pub struct Login {
    /// The role's name.
    pub name: String,
    password: String,
}

impl std::fmt::Debug for Login {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Login")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Login {
    fn new(part: &str) -> Self {
        Self {
            name: unique(&format!("outbox_t_{part}")),
            password: uuid::Uuid::new_v4().simple().to_string(),
        }
    }
}

/// A schema owned by a non-superuser owner, migrated by it, with the documented grants given
/// to one login per part.
#[derive(Debug)]
pub struct Roles {
    /// The schema, first in every login's `search_path`.
    pub schema: String,
    /// Owns the tables: migrates, makes and drops dedup slices (the pruner).
    pub owner: Login,
    /// The application writer.
    pub writer: Login,
    /// The relay.
    pub relay: Login,
    /// The dispatcher.
    pub dispatcher: Login,
    /// The dedup consumer.
    pub consumer: Login,
    /// `outbox status`.
    pub status: Login,
    /// Debezium's connector (granted, not run here).
    pub debezium: Login,
    /// Quarantine operator.
    pub operator: Login,
    admin: PgPool,
    dropped: bool,
}

impl Roles {
    /// Creates the roles and the schema, migrates it as the owner and runs
    /// `outbox_core::ROLES_SQL` as the owner, for these roles.
    pub async fn new() -> Result<Self> {
        crate::init_tracing();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(PgConnectOptions::from_str(&database_url())?)
            .await
            .context("connecting to the test database (run scripts/test, which starts it)")?;
        let roles = Self {
            schema: unique("t"),
            owner: Login::new("owner"),
            writer: Login::new("writer"),
            relay: Login::new("relay"),
            dispatcher: Login::new("dispatcher"),
            consumer: Login::new("consumer"),
            status: Login::new("status"),
            debezium: Login::new("debezium"),
            operator: Login::new("operator"),
            admin,
            dropped: false,
        };
        for login in roles.logins() {
            let replication = if login.name == roles.debezium.name {
                " REPLICATION"
            } else {
                ""
            };
            // Random hex: nothing to escape.
            sqlx::query(AssertSqlSafe(format!(
                "CREATE ROLE {} LOGIN{replication} PASSWORD '{}'",
                login.name, login.password
            )))
            .execute(&roles.admin)
            .await?;
        }
        let (schema, owner) = (&roles.schema, &roles.owner.name);
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA {schema} AUTHORIZATION {owner}"
        )))
        .execute(&roles.admin)
        .await?;
        let owner = roles.pool(&roles.owner).await?;
        outbox_core::migrate(&owner)
            .await
            .context("migrating as the owner")?;
        sqlx::raw_sql(AssertSqlSafe(roles.grants()))
            .execute(&owner)
            .await
            .context("running the grants as the owner")?;
        owner.close().await;
        Ok(roles)
    }

    fn logins(&self) -> [&Login; 8] {
        [
            &self.owner,
            &self.writer,
            &self.relay,
            &self.dispatcher,
            &self.consumer,
            &self.status,
            &self.debezium,
            &self.operator,
        ]
    }

    /// `outbox_core::ROLES_SQL` for this test's roles.
    pub fn grants(&self) -> String {
        [
            ("outbox_writer", &self.writer),
            ("outbox_relay", &self.relay),
            ("outbox_dispatcher", &self.dispatcher),
            ("outbox_dedup_consumer", &self.consumer),
            ("outbox_status_reader", &self.status),
            ("outbox_debezium", &self.debezium),
            ("outbox_quarantine_operator", &self.operator),
        ]
        .iter()
        .fold(outbox_core::ROLES_SQL.to_owned(), |sql, (from, to)| {
            sql.replace(from, &to.name)
        })
    }

    /// Connection options for `login` on this schema.
    pub fn options(&self, login: &Login) -> Result<PgConnectOptions> {
        Ok(PgConnectOptions::from_str(&database_url())?
            .username(&login.name)
            .password(&login.password)
            .options([("search_path", self.schema.as_str())]))
    }

    /// A pool of `login` on this schema.
    pub async fn pool(&self, login: &Login) -> Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_with(self.options(login)?)
            .await
            .with_context(|| format!("connecting as {}", login.name))
    }

    /// A URL of `login` on this schema, for the CLI (give it through the environment: it
    /// holds the password).
    pub fn url(&self, login: &Login) -> Result<String> {
        let mut url = url::Url::parse(&database_url())?;
        url.set_username(&login.name)
            .map_err(|()| anyhow::anyhow!("cannot set a user name"))?;
        url.set_password(Some(&login.password))
            .map_err(|()| anyhow::anyhow!("cannot set a password"))?;
        url.query_pairs_mut()
            .append_pair("options", &format!("-c search_path={}", self.schema));
        Ok(url.into())
    }

    /// Runs `sql` as a superuser (to revoke a grant for a negative check, say).
    pub async fn as_admin(&self, sql: &str) -> Result<()> {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.admin)
            .await?;
        Ok(())
    }

    /// Drops the schema and the roles. Close the roles' pools first.
    pub async fn drop_all(mut self) -> Result<()> {
        self.dropped = true;
        sqlx::raw_sql(AssertSqlSafe(self.cleanup_sql()))
            .execute(&self.admin)
            .await?;
        Ok(())
    }

    fn cleanup_sql(&self) -> String {
        let mut sql = format!("DROP SCHEMA IF EXISTS {} CASCADE;", self.schema);
        for login in self.logins() {
            // Ends its sessions first: a role with one cannot always be dropped at once.
            sql.push_str(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{0}'; \
                 DROP OWNED BY {0}; DROP ROLE {0};",
                login.name
            ));
        }
        sql
    }
}

impl Drop for Roles {
    /// A test that failed before [`Roles::drop_all`] still removes its roles (they are
    /// cluster-wide), on a thread of its own with a runtime of its own.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let sql = self.cleanup_sql();
        let options = self.admin.connect_options();
        let cleaned = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                let admin = PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with((*options).clone())
                    .await?;
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&admin).await?;
                anyhow::Ok(())
            })
        })
        .join();
        if !matches!(cleaned, Ok(Ok(()))) {
            eprintln!("could not drop the test's roles; drop the roles named outbox_t_* by hand");
        }
    }
}
