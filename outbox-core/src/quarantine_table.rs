//! What the relay's and the consumer's quarantines share: operators name entries by an integer
//! key, list the oldest, look some up, and requeue, discard or prune them. The two differ in
//! their tables and columns, and in which rows are quarantined (the outbox keeps every row with
//! a status; the consumer's table holds quarantined messages only).
//!
//! An action changes a table only when migration 0010's registry, `outbox_quarantine_tables`,
//! lists it (by oid) as that side's quarantine: a table name is operator input, and a mistyped
//! one must not delete a user's rows. The database audits every change of quarantined rows
//! (migration 0017's triggers write `outbox_quarantine_audit`, whoever changes them); an
//! action tells its triggers its name, the operator's reason and its detail, in the statement
//! that acts.

use sqlx::postgres::PgRow;
use sqlx::postgres::types::Oid;
use sqlx::types::Json;
use sqlx::{AssertSqlSafe, FromRow, PgConnection};

use crate::{CoreError, Ident};

/// Which side's quarantine a table is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum QuarantineSide {
    /// The outbox: rows the relay could not publish.
    Relay,
    /// A consumer quarantine table: messages a consumer could not handle.
    Consumer,
}

impl QuarantineSide {
    /// The side's name in the registry and the audit.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Relay => "relay",
            Self::Consumer => "consumer",
        }
    }
}

impl std::fmt::Display for QuarantineSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an operator did to quarantined rows, as the audit records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QuarantineAction {
    /// Made pending again (relay) or published again and removed (consumer).
    Requeue,
    /// Deleted for good.
    Discard,
    /// Deleted for its age.
    Prune,
}

impl QuarantineAction {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Requeue => "requeue",
            Self::Discard => "discard",
            Self::Prune => "prune",
        }
    }
}

/// Why an action was taken, and what else it took, for its audit row.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct ActionNote {
    /// The operator's reason, free text.
    pub reason: Option<String>,
    /// Parameters of the action (a requeue's target consumer, where its copy went).
    pub detail: serde_json::Map<String, serde_json::Value>,
}

impl ActionNote {
    /// A note with no reason and no detail.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// With the operator's reason.
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// With one more detail.
    #[must_use]
    pub fn detail(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.detail.insert(key.to_owned(), value.into());
        self
    }
}

/// The columns of one side's quarantine, as SQL.
#[derive(Debug, Clone, Copy)]
pub struct QuarantineColumns {
    /// Selected by `list` and `get`.
    pub all: &'static str,
    /// Names an entry (an integer column).
    pub key: &'static str,
    /// The condition of a quarantined row (`TRUE` when every row is).
    pub held: &'static str,
    /// The event id (a UUID column, may be NULL).
    pub event_id: &'static str,
    /// The consumer whose entry it is (`NULL::text` where there is none).
    pub consumer: &'static str,
    /// What a requeue sets on a row (an `UPDATE`'s `SET` list); `None` where a requeue
    /// publishes a copy elsewhere and deletes the row.
    pub requeue: Option<&'static str>,
}

/// A table [`QuarantineTable::verify`] found registered.
#[derive(Debug)]
struct Verified {
    /// The table, schema-qualified and quoted.
    name: String,
}

/// One side's quarantine, for the operator's actions on it.
#[derive(Debug, Clone, Copy)]
pub struct QuarantineTable<'a> {
    side: QuarantineSide,
    table: &'a Ident,
    columns: &'static QuarantineColumns,
}

impl<'a> QuarantineTable<'a> {
    /// `table`, said to be `side`'s quarantine (checked before any change).
    #[must_use]
    pub const fn new(
        side: QuarantineSide,
        table: &'a Ident,
        columns: &'static QuarantineColumns,
    ) -> Self {
        Self {
            side,
            table,
            columns,
        }
    }

    /// The oldest `limit` entries, oldest first.
    pub async fn list<T>(&self, conn: &mut PgConnection, limit: i64) -> Result<Vec<T>, sqlx::Error>
    where
        T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
    {
        let table = self.table;
        let QuarantineColumns { all, key, held, .. } = self.columns;
        let query = format!("SELECT {all} FROM {table} WHERE {held} ORDER BY {key} LIMIT $1");
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
        let table = self.table;
        let QuarantineColumns { all, key, held, .. } = self.columns;
        let query =
            format!("SELECT {all} FROM {table} WHERE {held} AND {key} = ANY($1) ORDER BY {key}");
        sqlx::query_as(AssertSqlSafe(query))
            .bind(keys)
            .fetch_all(conn)
            .await
    }

    /// Checks that the table is registered as this side's quarantine; returns its
    /// schema-qualified name, or [`CoreError::NotAQuarantineTable`].
    pub async fn verify(&self, conn: &mut PgConnection) -> Result<String, CoreError> {
        Ok(self.verified(conn).await?.name)
    }

    /// [`Self::verify`], with the names the actions use: the table's resolved once here, so
    /// an action changes the very table that was checked, and the registry and audit of its
    /// own schema, whatever else the `search_path` holds.
    async fn verified(&self, conn: &mut PgConnection) -> Result<Verified, CoreError> {
        let refuse = |why| CoreError::NotAQuarantineTable {
            table: self.table.as_str().to_owned(),
            side: self.side,
            why,
        };
        let found: Option<(Oid, String, String, String, String, bool)> = sqlx::query_as(
            "SELECT c.oid, n.nspname::text, c.relname::text, format('%I.%I', n.nspname, c.relname), \
                    quote_ident(n.nspname), \
                    to_regclass(format('%I.outbox_quarantine_tables', n.nspname)) IS NOT NULL \
             FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.oid = to_regclass($1)",
        )
        .bind(self.table.as_str())
        .fetch_optional(&mut *conn)
        .await?;
        let Some((oid, nspname, relname, name, schema, registry)) = found else {
            return Err(refuse("no such table"));
        };
        if !registry {
            return Err(refuse(
                "outbox_quarantine_tables does not exist in its schema: run `outbox migrate`",
            ));
        }
        // Oid and names all three: a registry row can outlive its table, and its oid come
        // back as another table's.
        let listed: bool = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT FROM {schema}.outbox_quarantine_tables \
             WHERE table_oid::oid = $1 AND nspname = $2 AND relname = $3 AND side = $4)"
        )))
        .bind(oid)
        .bind(&nspname)
        .bind(&relname)
        .bind(self.side.as_str())
        .fetch_one(&mut *conn)
        .await?;
        if !listed {
            return Err(refuse(
                "not listed in outbox_quarantine_tables for this side under this oid and name (the migrations list the tables they create)",
            ));
        }
        Ok(Verified { name })
    }

    /// The quarantined entries with the given keys, in key order, locked for the caller's
    /// transaction: another action on them waits for it, and one that finds them gone
    /// changes nothing. A row another transaction holds is not waited for:
    /// [`CoreError::QuarantineRowsBusy`]. Checked as [`Self::verify`].
    pub async fn lock<T>(&self, conn: &mut PgConnection, keys: &[i64]) -> Result<Vec<T>, CoreError>
    where
        T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
    {
        let Verified { name } = self.verified(conn).await?;
        let QuarantineColumns { all, key, held, .. } = self.columns;
        let query = format!(
            "SELECT {all} FROM {name} WHERE {held} AND {key} = ANY($1) ORDER BY {key} \
             FOR UPDATE NOWAIT"
        );
        sqlx::query_as(AssertSqlSafe(query))
            .bind(keys)
            .fetch_all(conn)
            .await
            .map_err(|e| match e {
                sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03") => {
                    CoreError::QuarantineRowsBusy {
                        table: name,
                        keys: keys.to_vec(),
                    }
                }
                e => e.into(),
            })
    }

    /// Checks that the current role may take `action` on the table, without taking it: for an
    /// action with a side effect outside the database (a consumer requeue publishes first), so
    /// that nothing is published that cannot be taken. Checked as [`Self::verify`]; a missing
    /// privilege is [`CoreError::QuarantinePrivilege`]. The audit needs none (the database
    /// writes it).
    pub async fn check_privileges(
        &self,
        conn: &mut PgConnection,
        action: QuarantineAction,
    ) -> Result<(), CoreError> {
        let Verified { name } = self.verified(conn).await?;
        let change = match (action, self.columns.requeue) {
            (QuarantineAction::Requeue, Some(_)) => "UPDATE",
            _ => "DELETE",
        };
        // A requeue's UPDATE may be granted by column (`roles.sql`).
        let (role, on_table): (String, bool) = sqlx::query_as(
            "SELECT current_user::text, CASE WHEN $2 = 'UPDATE' \
                THEN has_any_column_privilege($1, $2) ELSE has_table_privilege($1, $2) END",
        )
        .bind(&name)
        .bind(change)
        .fetch_one(conn)
        .await?;
        if on_table {
            Ok(())
        } else {
            Err(CoreError::QuarantinePrivilege {
                role,
                missing: format!("{change} on {name}"),
            })
        }
    }

    /// Deletes the quarantined entries with the given keys, audited; returns how many there
    /// were.
    pub async fn discard(
        &self,
        conn: &mut PgConnection,
        keys: &[i64],
        note: &ActionNote,
    ) -> Result<u64, CoreError> {
        self.act(conn, QuarantineAction::Discard, keys, note).await
    }

    /// Requeues the quarantined entries with the given keys, audited: sets
    /// [`QuarantineColumns::requeue`] on them, or deletes them where a requeue publishes a
    /// copy first (the consumer's). Returns how many there were.
    pub async fn requeue(
        &self,
        conn: &mut PgConnection,
        keys: &[i64],
        note: &ActionNote,
    ) -> Result<u64, CoreError> {
        self.act(conn, QuarantineAction::Requeue, keys, note).await
    }

    /// Checks the table ([`Self::verify`]) and changes the quarantined rows whose keys are
    /// given, telling the audit's triggers what the change is. Returns how many rows it
    /// changed.
    async fn act(
        &self,
        conn: &mut PgConnection,
        action: QuarantineAction,
        keys: &[i64],
        note: &ActionNote,
    ) -> Result<u64, CoreError> {
        let Verified { name } = self.verified(conn).await?;
        let QuarantineColumns {
            key, held, requeue, ..
        } = self.columns;
        // `noted` runs before the change's rows are read (an InitPlan): the triggers, which
        // run at the statement's end, find the settings made.
        let acted = format!("{held} AND {key} = ANY($1) AND EXISTS (SELECT FROM noted)");
        let change = match (action, requeue) {
            (QuarantineAction::Requeue, Some(set)) => {
                format!("UPDATE {name} SET {set} WHERE {acted} RETURNING 1")
            }
            _ => format!("DELETE FROM {name} WHERE {acted} RETURNING 1"),
        };
        let query = format!(
            "WITH noted AS ({}), acted AS ({change}) SELECT count(*) FROM acted",
            note_settings("$2", "$3", "$4")
        );
        let changed: i64 = sqlx::query_scalar(AssertSqlSafe(query))
            .bind(keys)
            .bind(action.as_str())
            .bind(note.reason.as_deref())
            .bind(Json(&note.detail))
            .fetch_one(&mut *conn)
            .await?;
        // The settings last until the caller's transaction ends: a later statement of its own
        // is not this action.
        sqlx::query(AssertSqlSafe(format!(
            "SELECT FROM ({}) AS cleared",
            note_settings("''", "''", "''")
        )))
        .execute(conn)
        .await?;
        Ok(u64::try_from(changed).unwrap_or(0))
    }

    /// Checks the table ([`Self::verify`]), and returns a statement for
    /// [`crate::delete_in_batches`] that deletes quarantined entries whose `time` column (a
    /// `timestamptz` with an index) is older than `$1` ms, `$2` at a time, from `$3` on, in
    /// `time` order, audited as a `prune` with `reason` (a consumer quarantine's audit row
    /// per batch has how many rows, their least and greatest key and `time`, and their ids
    /// for batches up to a thousand rows: past that, a flood of poison would double in the
    /// audit).
    pub async fn prune_statement(
        &self,
        conn: &mut PgConnection,
        time: &str,
        reason: Option<&str>,
    ) -> Result<String, CoreError> {
        let Verified { name } = self.verified(conn).await?;
        let QuarantineColumns { key, held, .. } = self.columns;
        // The reason stands in a literal: quoted by the server.
        let reason: String = sqlx::query_scalar("SELECT quote_literal(coalesce($1, ''))")
            .bind(reason)
            .fetch_one(conn)
            .await?;
        let noted = note_settings(
            "'prune'",
            &reason,
            "jsonb_build_object('older_than_ms', $1::float8, 'batch', $2::bigint)",
        );
        Ok(format!(
            "WITH noted AS ({noted}), gone AS ( \
                DELETE FROM {name} WHERE {key} IN ( \
                    SELECT {key} FROM {name} WHERE {held} \
                      AND {time} < now() - $1 * interval '1 millisecond' \
                      AND {time} >= coalesce($3, '-infinity'::timestamptz) \
                    ORDER BY {time} LIMIT $2 FOR UPDATE SKIP LOCKED) \
                AND EXISTS (SELECT FROM noted) \
                RETURNING {time} AS at) \
             SELECT count(*), max(at) FROM gone"
        ))
    }
}

/// A `SELECT` that tells the audit's triggers (migration 0017) the action, the reason and the
/// detail (SQL expressions) of the statement it is part of, for the rest of the transaction.
fn note_settings(action: &str, reason: &str, detail: &str) -> String {
    format!(
        "SELECT set_config('outbox.audit_action', {action}, true), \
                set_config('outbox.audit_reason', coalesce({reason}, ''), true), \
                set_config('outbox.audit_detail', ({detail})::text, true)"
    )
}
