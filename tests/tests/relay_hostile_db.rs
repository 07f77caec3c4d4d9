//! The relay against a database set up the way managed Postgres often is: a low
//! `idle_in_transaction_session_timeout` (the relay's transaction waits for Kafka between its
//! claim and its mark) and a low `statement_timeout`. Each setting is given to the relay's own
//! connections only, as a role's or the server's setting would reach them. Real Postgres and
//! Apache Kafka.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{
    TestDb, count_status, eventually, kafka_bootstrap, random_topic, read_all, unique,
};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const ROWS: usize = 5;

/// A pool on the test's schema whose sessions start with `settings`, named so the test can
/// find its backends.
async fn pool_with(db: &TestDb, name: &str, settings: &[(&str, &str)]) -> Result<PgPool> {
    let options = (*db.pool.connect_options())
        .clone()
        .application_name(name)
        .options(settings.iter().copied());
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await?)
}

/// `ROWS` rows for `topic`, committed; their ids.
async fn enqueue(db: &TestDb, topic: &str) -> Result<Vec<String>> {
    let mut events = Vec::new();
    for n in 0..ROWS {
        events.push(
            NewEvent::new("order", format!("k{}", n % 2), "Step", &json!({ "n": n }))?
                .with_topic(topic)?,
        );
    }
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;
    Ok(events.iter().map(|e| e.id().to_string()).collect())
}

/// Every row is marked published and was written to `topic` exactly once.
async fn published_once(db: &TestDb, topic: &str, mut ids: Vec<String>) -> Result<()> {
    assert_eq!(count_status(&db.pool, "published").await?, ROWS as i64);
    let mut on_topic: Vec<String> = read_all(topic, 1, Duration::from_secs(30))
        .await?
        .iter()
        .map(|r| r.id().to_owned())
        .collect();
    on_topic.sort();
    ids.sort();
    assert_eq!(on_topic, ids, "each row once on the topic");
    Ok(())
}

/// The server ends a transaction idle for 200 ms; the relay's producer holds its records for
/// a second before sending (`linger.ms`), so its transaction waits longer than that for the
/// acknowledgements. The rows are still marked, once: the relay's transaction sets its own
/// idle bound. Before, the server ended the transaction after Kafka had acknowledged the
/// rows, the mark failed, and every later batch published them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_marked_when_the_server_ends_idle_transactions_before_kafka_acks() -> Result<()> {
    let db = TestDb::new().await?;
    marked_once_waiting_for_acks_beyond(&db, "idle_in_transaction_session_timeout").await
}

/// Enqueues `ROWS` rows, and publishes them with a relay whose role's `setting` is 200 ms
/// while its producer holds records for a second before sending: each row is marked, and
/// written to its topic once.
async fn marked_once_waiting_for_acks_beyond(db: &TestDb, setting: &str) -> Result<()> {
    let topic = random_topic(1).await?;
    let ids = enqueue(db, &topic).await?;
    let pool = pool_with(db, &unique("relay"), &[(setting, "200ms")]).await?;
    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("linger.ms", "1000");
    let relay = Relay::new(pool, &kafka, RelayConfig::default().listen(false))?;
    let report = relay.run_once().await?;
    assert_eq!(report.published, ROWS, "{report:?}");
    assert_eq!(
        relay.run_once().await?.claimed,
        0,
        "nothing left to publish"
    );
    published_once(db, &topic, ids).await
}

/// PostgreSQL 17 ends any transaction older than `transaction_timeout`, which a managed
/// service may set for a role: set to 200 ms, below the relay's wait for Kafka's
/// acknowledgements, the rows are still marked, once (the relay's transaction sets its own
/// bound). Before, the server ended the batch after Kafka had acknowledged its rows and every
/// later batch published them again. Older servers have no such setting (checked: the
/// relay's statement leaves it unset there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_marked_when_the_server_bounds_transactions_below_kafka_acks() -> Result<()> {
    let db = TestDb::new().await?;
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&db.pool)
        .await?;
    if version < 170_000 {
        let known: Option<String> =
            sqlx::query_scalar("SELECT current_setting('transaction_timeout', true)")
                .fetch_one(&db.pool)
                .await?;
        assert_eq!(
            known, None,
            "PostgreSQL {version} has no transaction_timeout"
        );
        return Ok(());
    }
    marked_once_waiting_for_acks_beyond(&db, "transaction_timeout").await
}

/// The server cancels a statement after 100 ms; the relay's claim waits longer than that for
/// a table lock another session holds (a migration, a `VACUUM FULL`). The claim waits it out
/// and the batch is published: the relay's transaction sets its own statement bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_outlasts_a_server_statement_timeout() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let ids = enqueue(&db, &topic).await?;
    let name = unique("relay");
    let pool = pool_with(&db, &name, &[("statement_timeout", "100ms")]).await?;
    let relay = Relay::new(
        pool,
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().listen(false),
    )?;
    let mut locker = db.pool.begin().await?;
    sqlx::query("LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await?;
    let batch = tokio::spawn(async move { relay.run_once().await });
    let ended = AtomicBool::new(false);
    eventually(
        "the relay's claim waits for the lock three times the server's statement timeout",
        Duration::from_secs(10),
        || async {
            if batch.is_finished() {
                ended.store(true, Ordering::SeqCst);
                return Ok(true);
            }
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND wait_event_type = 'Lock' \
                 AND clock_timestamp() - query_start > interval '300 ms'",
            )
            .bind(&name)
            .fetch_one(&db.pool)
            .await?;
            Ok(waiting > 0)
        },
    )
    .await?;
    ensure!(
        !ended.load(Ordering::SeqCst),
        "the relay's batch ended while the table was locked: {:?}",
        batch.await?
    );
    locker.commit().await?;
    let report = batch.await??;
    assert_eq!(report.published, ROWS, "{report:?}");
    published_once(&db, &topic, ids).await
}

/// A Kafka wait of any length (a slow broker, a producer with a long `message.timeout.ms`)
/// never leaves the batch's transaction idle for long: while it waits, the relay runs a
/// statement in it every few seconds, so even the relay's own idle bound cannot end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_waiting_for_kafka_keeps_its_transaction_active() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let ids = enqueue(&db, &topic).await?;
    let name = unique("relay");
    let pool = pool_with(&db, &name, &[]).await?;
    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("linger.ms", "4000");
    let relay = Relay::new(pool, &kafka, RelayConfig::default().listen(false))?;
    let batch = tokio::spawn(async move { relay.run_once().await });
    let ended = AtomicBool::new(false);
    eventually(
        "a statement runs in the relay's transaction while it waits for Kafka",
        Duration::from_secs(10),
        || async {
            if batch.is_finished() {
                ended.store(true, Ordering::SeqCst);
                return Ok(true);
            }
            let kept: i64 = sqlx::query_scalar(
                // The claim runs as the transaction begins and the mark once Kafka acked,
                // 4 s later at the earliest (`linger.ms`): a statement begun in between was
                // run during the wait.
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND query_start - xact_start BETWEEN interval '1 s' AND interval '3.5 s'",
            )
            .bind(&name)
            .fetch_one(&db.pool)
            .await?;
            Ok(kept > 0)
        },
    )
    .await?;
    ensure!(
        !ended.load(Ordering::SeqCst),
        "the batch ended before a statement ran during its Kafka wait: {:?}",
        batch.await?
    );
    let report = batch.await??;
    assert_eq!(report.published, ROWS, "{report:?}");
    published_once(&db, &topic, ids).await
}
