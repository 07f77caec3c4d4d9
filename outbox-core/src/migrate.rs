use std::sync::LazyLock;

use sqlx::PgPool;
use sqlx::SqlSafeStr;
use sqlx::migrate::{Migration, Migrator};

use crate::{CoreError, TableNames};

/// The migrations as written, for the default table names.
static EMBEDDED: Migrator = sqlx::migrate!("./migrations");

/// Creates the framework's tables (outbox, consumer dedup, consumer quarantine) under their
/// default names in the first schema of the connection's `search_path`.
///
/// Applied migrations are tracked in `outbox_events_migrations`, not in sqlx's default
/// `_sqlx_migrations`, so they never collide with the application's own sqlx migrations.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| migrator(&TableNames::default()));

/// Applies [`MIGRATOR`], on a server no older than [`crate::MIN_POSTGRES`].
pub async fn migrate(pool: &PgPool) -> Result<(), CoreError> {
    migrate_with(pool, &TableNames::default()).await
}

/// Applies the migrations for custom table names (see [`migrator`]), on a server no older
/// than [`crate::MIN_POSTGRES`].
pub async fn migrate_with(pool: &PgPool, names: &TableNames) -> Result<(), CoreError> {
    // One connection for both: sqlx's migrator takes a session lock, and leaves it taken when a
    // migration fails (a `lock_timeout`), so that connection must not go back to the pool: a
    // later migrate on another connection would wait for the lock forever.
    let mut conn = pool.acquire().await?;
    crate::check_server_version(&mut conn).await?;
    let migrated = migrator(names).run(&mut *conn).await;
    if migrated.is_err() {
        conn.close_on_drop();
    }
    migrated?;
    Ok(())
}

/// A migrator that creates the tables under `names`.
///
/// Every object a migration creates (its indexes) is named after
/// its table, so renaming the table renames them all. Names are validated [`crate::Ident`]s,
/// so the rewritten SQL contains nothing but what the embedded migrations contain.
pub fn migrator(names: &TableNames) -> Migrator {
    let renames = [
        (TableNames::DEFAULT_OUTBOX, names.outbox.as_str()),
        (
            TableNames::DEFAULT_CONSUMER_DEDUP,
            names.consumer_dedup.as_str(),
        ),
        (
            TableNames::DEFAULT_CONSUMER_QUARANTINE,
            names.consumer_quarantine.as_str(),
        ),
    ];
    let migrations = EMBEDDED
        .iter()
        .map(|m| {
            let sql = renames
                .iter()
                .fold(m.sql.as_str().to_owned(), |sql, (from, to)| {
                    sql.replace(from, to)
                });
            Migration::new(
                m.version,
                m.description.clone(),
                m.migration_type,
                sqlx::AssertSqlSafe(sql).into_sql_str(),
                m.no_tx,
            )
        })
        .collect();
    let mut migrator = Migrator::with_migrations(migrations);
    migrator.dangerous_set_table_name(format!("{}_migrations", names.outbox.as_str()));
    migrator
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_keep_the_embedded_sql() {
        for (ours, embedded) in MIGRATOR.iter().zip(EMBEDDED.iter()) {
            assert_eq!(ours.sql.as_str(), embedded.sql.as_str());
        }
        assert_eq!(MIGRATOR.table_name, "outbox_events_migrations");
    }

    #[test]
    fn custom_names_leave_no_default_name_behind() {
        let names = TableNames::default()
            .with_outbox("billing_outbox")
            .and_then(|n| n.with_consumer_tables("billing_dedup", "billing_quarantine"))
            .expect("valid names");
        let m = migrator(&names);
        let all: String = m.iter().map(|m| m.sql.as_str()).collect();
        assert!(!all.contains("outbox_events"));
        assert!(!all.contains("outbox_consumer_dedup"));
        assert!(all.contains("CREATE TABLE billing_outbox ("));
        assert!(all.contains("billing_outbox_pending_idx"));
        assert!(all.contains("CREATE TABLE billing_quarantine ("));
    }
}
