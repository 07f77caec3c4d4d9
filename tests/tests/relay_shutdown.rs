//! Shutdown is bounded when the database does not answer: `Relay::run` returns within
//! `shutdown_timeout` (and a short margin to record what was acknowledged) even while its batch
//! waits on Postgres, and the rows stay pending. Real Postgres and Apache Kafka.

use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, count_status, eventually, kafka_bootstrap, random_topic};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_while_the_database_does_not_answer() -> Result<()> {
    let db = TestDb::with_pool_size(8).await?;
    let topic = random_topic(1).await?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(
        &mut tx,
        &NewEvent::new("order", "k", "OrderChanged", &json!({ "n": 0 }))?.with_topic(&topic)?,
    )
    .await?;
    tx.commit().await?;

    // Another session holds the outbox table: the relay's claim waits on it, as it would on a
    // database that stopped answering.
    let mut blocker = db.pool.begin().await?;
    sqlx::query("LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await?;
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default()
            .shutdown_timeout(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(100)),
    )?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    eventually(
        "the relay's claim waits on the table",
        Duration::from_secs(20),
        || async {
            // The claim itself, not the stats exporter's query, which waits on the table too.
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.relation = 'outbox_events'::regclass AND NOT l.granted \
                   AND a.query LIKE '%claimed AS%'",
            )
            .fetch_one(&db.pool)
            .await?;
            Ok(waiting > 0)
        },
    )
    .await?;

    let started = Instant::now();
    shutdown.cancel();
    let returned = tokio::time::timeout(Duration::from_secs(5), running).await;
    let took = started.elapsed();
    blocker.rollback().await?;
    returned.map_err(|_| {
        anyhow::anyhow!("run() did not return while the database did not answer")
    })???;
    // shutdown_timeout, then half a second to record what was acknowledged.
    assert!(took < Duration::from_secs(3), "run() took {took:?}");
    // The abandoned batch finishes on its own once the table is free; nothing is lost.
    eventually(
        "the row is pending or published, never lost",
        Duration::from_secs(20),
        || async {
            Ok(count_status(&db.pool, "pending").await?
                + count_status(&db.pool, "published").await?
                == 1)
        },
    )
    .await?;
    Ok(())
}
