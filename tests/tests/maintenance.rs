//! Pruning runs one instance at a time, and the stats stay bounded reads.

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{NewEvent, TableNames};
use outbox_tests::{TestDb, count_status};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pruner_skips_while_one_holds_the_table() -> Result<()> {
    let db = TestDb::new().await?;
    let mut tx = db.pool.begin().await?;
    for n in 0..10 {
        let e = NewEvent::new("order", "k", "OrderChanged", &json!({ "n": n }))?;
        outbox_producer::enqueue(&mut tx, &e).await?;
    }
    tx.commit().await?;
    sqlx::query(
        "UPDATE outbox_events SET status = 'published', published_at = now() - interval '1 day'",
    )
    .execute(&db.pool)
    .await?;
    let tables = TableNames::default();

    // Another instance is pruning this table: it holds the prune lock on its session.
    let mut other = db.pool.acquire().await?;
    let taken: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtext('outbox_prune'), hashtext('outbox_events'::regclass::oid::text))",
    )
    .fetch_one(&mut *other)
    .await?;
    assert!(taken);
    let mut conn = db.pool.acquire().await?;
    let pruned =
        outbox_producer::prune_published(&mut conn, &tables, Duration::from_secs(60), 3).await?;
    assert_eq!(pruned, 0, "one instance prunes at a time");
    assert_eq!(count_status(&db.pool, "published").await?, 10);

    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *other)
        .await?;
    let pruned =
        outbox_producer::prune_published(&mut conn, &tables, Duration::from_secs(60), 3).await?;
    assert_eq!(pruned, 10);
    // The lock is released after a run: the other session can take it again.
    let again: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtext('outbox_prune'), hashtext('outbox_events'::regclass::oid::text))",
    )
    .fetch_one(&mut *other)
    .await?;
    assert!(again, "a prune run releases its lock");
    Ok(())
}

/// Runs `statements` (an operator preparing a migration by hand), then the migrations.
async fn migrate_after(db: &TestDb, statements: &[&'static str]) -> Result<()> {
    for statement in statements {
        sqlx::query(*statement).execute(&db.pool).await?;
    }
    outbox_core::migrate(&db.pool).await?;
    Ok(())
}

/// The README's upgrade path for a large table: the indexes of migration 0003 built
/// beforehand with `CREATE INDEX CONCURRENTLY` (which cannot run inside the migration's
/// transaction) make the migration a no-op instead of a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_0003_accepts_indexes_built_concurrently_beforehand() -> Result<()> {
    let db = TestDb::new().await?;
    migrate_after(
        &db,
        &[
            "DROP INDEX IF EXISTS outbox_events_held_idx",
            "DROP INDEX outbox_events_published_at_idx",
            "DELETE FROM outbox_events_migrations WHERE version = 3",
            "CREATE INDEX CONCURRENTLY outbox_events_held_idx ON outbox_events (aggregateid, seq) \
               WHERE status = 'quarantined' OR (status = 'pending' AND attempts > 0)",
            "CREATE INDEX CONCURRENTLY outbox_events_published_at_idx ON outbox_events (published_at) \
               WHERE status = 'published'",
        ],
    )
    .await?;
    let applied: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM outbox_events_migrations WHERE version = 3 AND success)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(applied);
    Ok(())
}

/// Migration 0005 the same way: its index built concurrently beforehand, the migration only
/// drops the index it replaces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_0005_accepts_its_index_built_concurrently_beforehand() -> Result<()> {
    let db = TestDb::new().await?;
    migrate_after(
        &db,
        &[
            "DROP INDEX outbox_events_holding_idx",
            "DELETE FROM outbox_events_migrations WHERE version = 5",
            "CREATE INDEX CONCURRENTLY outbox_events_held_idx ON outbox_events (aggregateid, seq) \
               WHERE status = 'quarantined' OR (status = 'pending' AND attempts > 0)",
            "CREATE INDEX CONCURRENTLY outbox_events_holding_idx ON outbox_events (aggregateid, seq) \
               WHERE status <> 'published' AND (status = 'quarantined' OR attempts > 0)",
        ],
    )
    .await?;
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = current_schema() \
           AND indexname IN ('outbox_events_held_idx', 'outbox_events_holding_idx')",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(indexes, ["outbox_events_holding_idx"]);
    Ok(())
}

/// The prune lock is the table's, not its name's: an outbox in another schema (the same
/// table name) prunes while this one is being pruned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pruner_of_another_schemas_outbox_is_not_held_back() -> Result<()> {
    let (busy, other) = (TestDb::new().await?, TestDb::new().await?);
    let mut tx = other.pool.begin().await?;
    for n in 0..4 {
        let e = NewEvent::new("order", "k", "OrderChanged", &json!({ "n": n }))?;
        outbox_producer::enqueue(&mut tx, &e).await?;
    }
    tx.commit().await?;
    sqlx::query(
        "UPDATE outbox_events SET status = 'published', published_at = now() - interval '1 day'",
    )
    .execute(&other.pool)
    .await?;
    // The busy schema's pruner holds its lock (under the table's name too: the key this
    // lock had before, which every schema's outbox_events shared).
    let mut holder = busy.pool.acquire().await?;
    let taken: bool = sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtext('outbox_prune'), hashtext('outbox_events'::regclass::oid::text)) \
            AND pg_try_advisory_lock(hashtext('outbox_prune'), hashtext('outbox_events'))",
    )
    .fetch_one(&mut *holder)
    .await?;
    assert!(taken);
    let mut conn = other.pool.acquire().await?;
    let pruned = outbox_producer::prune_published(
        &mut conn,
        &TableNames::default(),
        Duration::from_secs(60),
        3,
    )
    .await?;
    assert_eq!(
        pruned, 4,
        "another schema's pruner holds only its own table"
    );
    Ok(())
}
