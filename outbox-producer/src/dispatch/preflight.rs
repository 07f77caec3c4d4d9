//! What a dispatcher checks before its first call: that it can record what it calls. A
//! dispatcher that calls and then cannot record (a schema from before a migration, a role
//! without a grant) would call again on every claim.

use outbox_core::Ident;
use sqlx::PgConnection;

use crate::ProducerError;

/// Columns a dispatcher reads.
const READS: &[&str] = &[
    "seq",
    "id",
    "aggregatetype",
    "aggregateid",
    "type",
    "payload",
    "headers",
    "topic",
    "created_at",
    "status",
    "attempts",
    "next_attempt_at",
    "last_error",
    "lease",
    "calls",
    // Read by the record of a released action, which keeps its outcome.
    "outcome",
];

/// Columns a dispatcher writes.
const WRITES: &[&str] = &[
    "status",
    "published_at",
    "attempts",
    "next_attempt_at",
    "last_error",
    "outcome",
    "lease",
    "calls",
];

/// Fails with [`ProducerError::Config`] naming what is missing: the columns of migrations not
/// run, or the privileges the connection's role lacks.
pub(crate) async fn check(conn: &mut PgConnection, table: &Ident) -> Result<(), ProducerError> {
    outbox_core::check_server_version(&mut *conn).await?;
    let columns: Vec<&str> = READS.iter().chain(WRITES).copied().collect();
    let missing: Vec<String> = sqlx::query_scalar(
        "SELECT c FROM unnest($1::text[]) AS c \
         WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a \
                           WHERE a.attrelid = to_regclass($2) AND a.attname = c \
                             AND a.attnum > 0 AND NOT a.attisdropped)",
    )
    .bind(&columns)
    .bind(table.as_str())
    .fetch_all(&mut *conn)
    .await?;
    if !missing.is_empty() {
        let mut missing = missing;
        missing.sort();
        missing.dedup();
        return Err(ProducerError::Config(format!(
            "the outbox table {table} lacks the column(s) {}: run the migrations first \
             (`outbox migrate`, or outbox_producer::migrate at start-up), as the table's owner",
            missing.join(", ")
        )));
    }
    let denied: Vec<String> = sqlx::query_scalar(
        "SELECT p.privilege || ' (' || string_agg(p.c, ', ' ORDER BY p.c) || ')' \
         FROM (SELECT c, 'SELECT' AS privilege FROM unnest($1::text[]) AS c \
               UNION ALL SELECT c, 'UPDATE' FROM unnest($2::text[]) AS c) AS p \
         WHERE NOT has_column_privilege($3, p.c, p.privilege) \
         GROUP BY p.privilege ORDER BY p.privilege",
    )
    .bind(READS)
    .bind(WRITES)
    .bind(table.as_str())
    .fetch_all(&mut *conn)
    .await?;
    if !denied.is_empty() {
        return Err(ProducerError::Config(format!(
            "the dispatcher's role may not {} on the outbox table {table}: grant them (the \
             relay's grants in outbox-core's sql/roles.sql), or it would call the API and \
             fail to record the answer",
            denied.join(" and ")
        )));
    }
    Ok(())
}
