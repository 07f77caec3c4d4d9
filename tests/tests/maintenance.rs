//! Pruning runs one instance at a time, and the stats stay bounded reads.

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{NewEvent, TableNames};
use outbox_tests::{TestDb, count_status, index_blocks_read_by};
use serde_json::json;
use sqlx::Connection;

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

/// The guide's upgrade path for a large table: the indexes of migration 0003 built
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
            "DROP INDEX IF EXISTS outbox_events_holding_idx",
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

/// Migration 0009 the same way: its index (rows holding an aggregate back, keyed by type and
/// id) built concurrently beforehand, the migration only drops 0005's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_0009_accepts_its_index_built_concurrently_beforehand() -> Result<()> {
    let db = TestDb::new().await?;
    migrate_after(
        &db,
        &[
            "DROP INDEX outbox_events_aggregate_holding_idx",
            "DELETE FROM outbox_events_migrations WHERE version = 9",
            "CREATE INDEX CONCURRENTLY outbox_events_holding_idx ON outbox_events (aggregateid, seq) \
               WHERE status <> 'published' AND (status = 'quarantined' OR attempts > 0)",
            "CREATE INDEX CONCURRENTLY outbox_events_aggregate_holding_idx \
               ON outbox_events (aggregateid, aggregatetype, seq) WHERE status <> 'published' \
               AND (status = 'quarantined' OR attempts > 0 OR last_error IS NOT NULL)",
        ],
    )
    .await?;
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE schemaname = current_schema() \
           AND indexname LIKE 'outbox_events_%holding_idx'",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(indexes, ["outbox_events_aggregate_holding_idx"]);
    Ok(())
}

/// Migration 0009 drops an index, which needs the table to itself: behind a relay batch
/// (which can last `message.timeout.ms`), it would wait, and every enqueue would queue behind
/// it. It gives up after its own `lock_timeout` instead, leaves the schema as it was, and
/// succeeds when run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_0009_gives_up_rather_than_queue_writes_behind_a_relay_batch() -> Result<()> {
    let db = TestDb::before_migration(9).await?;
    // A relay batch: rows locked, its transaction open while it waits for Kafka.
    let mut batch = db.pool.begin().await?;
    sqlx::query("SELECT seq FROM outbox_events FOR UPDATE SKIP LOCKED")
        .fetch_all(&mut *batch)
        .await?;
    sqlx::query("LOCK TABLE outbox_events IN ROW EXCLUSIVE MODE")
        .execute(&mut *batch)
        .await?;

    let started = std::time::Instant::now();
    let migrated = tokio::time::timeout(Duration::from_secs(20), outbox_core::migrate(&db.pool))
        .await
        .map_err(|_| anyhow::anyhow!("the migration waited behind the batch"))?;
    let error = migrated.expect_err("the migration cannot have its lock");
    assert!(
        error.to_string().contains("lock timeout"),
        "{error} after {:?}",
        started.elapsed()
    );
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events_migrations WHERE version = 9")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(applied, 0, "rolled back as a whole");

    batch.commit().await?;
    outbox_core::migrate(&db.pool).await?;
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

/// Each batch of a prune run starts its index scan where the previous batch stopped. With
/// autovacuum off, the index entries of the rows already deleted stay, as they do while a long
/// run outpaces autovacuum: a run whose every batch started from the beginning of the index
/// would walk them all again, O(N²) over the run (bench P7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_run_reads_the_published_at_index_once_through() -> Result<()> {
    const ROWS: i64 = 20_000;
    const BATCH: u32 = 100;
    let db = TestDb::new().await?;
    let mut conn = db.pool.acquire().await?;
    sqlx::query("ALTER TABLE outbox_events SET (autovacuum_enabled = false)")
        .execute(&mut *conn)
        .await?;
    // One a second, two days ago: all due, in published_at order.
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, \
                                    status, attempts, published_at) \
         SELECT gen_random_uuid(), 'order', 'k' || (g % 100), 'OrderChanged', '{}', 't', \
                'published', 1, now() - interval '2 days' + g * interval '1 second' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(ROWS)
    .execute(&mut *conn)
    .await?;
    let (pruned, read) = index_blocks_read_by(
        &mut conn,
        &db.schema,
        "outbox_events",
        "outbox_events_published_at_idx",
        async |conn| {
            let hour = Duration::from_secs(3600);
            Ok(outbox_producer::prune_published(conn, &TableNames::default(), hour, BATCH).await?)
        },
    )
    .await?;
    assert_eq!(pruned, ROWS as u64);
    // A batch descends the tree (two levels here) and reads the leaf or two holding its rows;
    // starting every batch at the beginning reads about 5,000 more over this run.
    let batches = ROWS / i64::from(BATCH) + 1;
    assert!(
        read <= 6 * batches,
        "{read} index blocks for {batches} batches"
    );
    Ok(())
}

/// `stats()` reads without JIT and parallel workers (their start-up outweighs its bounded
/// reads on large tables, bench P7), and leaves the caller's settings and transaction as they
/// were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_read_without_jit_or_workers_and_leave_the_session_as_it_was() -> Result<()> {
    use tracing::instrument::WithSubscriber;
    let db = TestDb::new().await?;
    let tables = TableNames::default();
    let settings = "SELECT current_setting('jit') || ' ' || \
                    current_setting('max_parallel_workers_per_gather')";
    let mut conn = db.pool.acquire().await?;
    let session: String = sqlx::query_scalar(settings).fetch_one(&mut *conn).await?;
    let statements = outbox_tests::Statements::default();
    async { outbox_producer::stats(&mut conn, &tables).await }
        .with_subscriber(tracing::Dispatch::new(statements.clone()))
        .await?;
    let all = statements.all();
    let position = |marker: &str| all.iter().position(|s| s.contains(marker));
    let (off, read) = (
        position("SET LOCAL jit = off; SET LOCAL max_parallel_workers_per_gather = 0"),
        position("oldest_pending_age_ms"),
    );
    assert!(
        matches!((off, read), (Some(o), Some(r)) if o < r),
        "{all:#?}"
    );
    // Outside a transaction block Postgres would warn and ignore SET LOCAL.
    assert_eq!(position("notice:"), None, "{all:#?}");
    let after: String = sqlx::query_scalar(settings).fetch_one(&mut *conn).await?;
    assert_eq!(after, session);

    // Inside the caller's transaction: its writes stay, uncommitted, and so do its settings.
    let mut tx = conn.begin().await?;
    let e = NewEvent::new("order", "k", "OrderChanged", &json!({ "n": 1 }))?;
    outbox_producer::enqueue(&mut tx, &e).await?;
    let stats = outbox_producer::stats(&mut tx, &tables).await?;
    assert_eq!(stats.pending, 1);
    let after: String = sqlx::query_scalar(settings).fetch_one(&mut *tx).await?;
    assert_eq!(after, session);
    tx.commit().await?;
    assert_eq!(count_status(&db.pool, "pending").await?, 1);
    Ok(())
}

/// A prune run plans its statement once, generically, on each batch's own transaction: a
/// plan made for each batch looks up the actual least `seq` for its estimates, walking the
/// primary key from its start through the entries of every row deleted so far (5,471 blocks
/// per batch after 2M rows pruned; a table that small in a test is not planned that way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_prune_batch_runs_a_generic_plan_on_its_own_transaction() -> Result<()> {
    use tracing::instrument::WithSubscriber;
    let db = TestDb::new().await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, \
                                    status, attempts, published_at) \
         SELECT gen_random_uuid(), 'order', 'k', 'OrderChanged', '{}', 't', 'published', 1, \
                now() - interval '3 days' + g * interval '1 second' \
         FROM generate_series(1, 10) AS g",
    )
    .execute(&db.pool)
    .await?;
    let mut conn = db.pool.acquire().await?;
    let statements = outbox_tests::Statements::default();
    let pruned = async {
        outbox_producer::prune_published(
            &mut conn,
            &TableNames::default(),
            Duration::from_secs(3600),
            3,
        )
        .await
    }
    .with_subscriber(tracing::Dispatch::new(statements.clone()))
    .await?;
    assert_eq!(pruned, 10);
    let all = statements.all();
    let deletes: Vec<usize> = (0..all.len())
        .filter(|&i| all[i].starts_with("WITH gone AS"))
        .collect();
    assert_eq!(deletes.len(), 4, "{all:#?}");
    for i in deletes {
        assert!(
            i > 0 && all[i - 1] == "SET LOCAL plan_cache_mode = force_generic_plan",
            "{all:#?}"
        );
    }
    // Outside a transaction block Postgres would warn and ignore SET LOCAL.
    assert!(!all.iter().any(|s| s.starts_with("notice:")), "{all:#?}");
    Ok(())
}
