//! What the relay's and the consumer's quarantines share: operators name entries by an integer
//! key, list the oldest, look some up, and delete them. The two differ in their tables and
//! columns, and in which rows are quarantined (the outbox keeps every row with a status; the
//! consumer's table holds quarantined messages only).

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, FromRow, PgConnection};

use crate::Ident;

/// One side's quarantine, for the operator's actions on it.
#[derive(Debug, Clone, Copy)]
pub struct QuarantineTable<'a> {
    table: &'a Ident,
    columns: &'static str,
    key: &'static str,
    held: &'static str,
}

impl<'a> QuarantineTable<'a> {
    /// `columns` are selected, `key` names an entry (an integer column), and `held` is the
    /// SQL condition of a quarantined row (`TRUE` when every row is).
    #[must_use]
    pub const fn new(
        table: &'a Ident,
        columns: &'static str,
        key: &'static str,
        held: &'static str,
    ) -> Self {
        Self {
            table,
            columns,
            key,
            held,
        }
    }

    /// The oldest `limit` entries, oldest first.
    pub async fn list<T>(&self, conn: &mut PgConnection, limit: i64) -> Result<Vec<T>, sqlx::Error>
    where
        T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
    {
        let Self {
            table,
            columns,
            key,
            held,
        } = self;
        let query = format!("SELECT {columns} FROM {table} WHERE {held} ORDER BY {key} LIMIT $1");
        sqlx::query_as(AssertSqlSafe(query))
            .bind(limit)
            .fetch_all(conn)
            .await
    }

    /// The entries with the given keys that are quarantined, in key order.
    pub async fn get<T>(&self, conn: &mut PgConnection, keys: &[i64]) -> Result<Vec<T>, sqlx::Error>
    where
        T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
    {
        let Self {
            table,
            columns,
            key,
            held,
        } = self;
        let query = format!(
            "SELECT {columns} FROM {table} WHERE {held} AND {key} = ANY($1) ORDER BY {key}"
        );
        sqlx::query_as(AssertSqlSafe(query))
            .bind(keys)
            .fetch_all(conn)
            .await
    }

    /// Deletes the quarantined entries with the given keys; returns how many there were.
    pub async fn discard(&self, conn: &mut PgConnection, keys: &[i64]) -> Result<u64, sqlx::Error> {
        let Self {
            table, key, held, ..
        } = self;
        let query = format!("DELETE FROM {table} WHERE {held} AND {key} = ANY($1)");
        Ok(sqlx::query(AssertSqlSafe(query))
            .bind(keys)
            .execute(conn)
            .await?
            .rows_affected())
    }
}
