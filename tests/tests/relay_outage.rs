//! A partition that cannot take writes while the cluster still answers (no leader, fewer
//! in-sync replicas than `min.insync.replicas`) is an outage of that partition: its rows are
//! charged nothing and wait, for any length, while the other partitions flow, and they are
//! published once it can take writes again. Real Postgres; librdkafka's mock cluster to take
//! a partition's leader away, or to answer NOT_ENOUGH_REPLICAS.

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, count_status, eventually, java_partition, unique};
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// A key that the relay's (Java's) partitioner puts on `partition` of 2.
fn key_on(partition: i32) -> String {
    (0..)
        .map(|n| format!("key{n}"))
        .find(|k| java_partition(k.as_bytes(), 2) == partition)
        .unwrap_or_default()
}

fn events(topic: &str, key: &str, n: usize) -> Result<Vec<NewEvent>> {
    (0..n)
        .map(|i| {
            Ok(
                NewEvent::new("order", key, "OrderChanged", &json!({ "n": i }))?
                    .with_topic(topic)?,
            )
        })
        .collect()
}

async fn enqueue(db: &TestDb, events: &[NewEvent]) -> Result<()> {
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(())
}

async fn attempts(db: &TestDb) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(sum(attempts), 0) FROM outbox_events")
            .fetch_one(&db.pool)
            .await?,
    )
}

/// The `last_error` of every row that has one.
async fn errors(db: &TestDb) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT status || ': ' || last_error FROM outbox_events WHERE last_error IS NOT NULL ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await?)
}

/// Published rows of `key`.
async fn published(db: &TestDb, key: &str) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM outbox_events WHERE aggregateid = $1 AND status = 'published'",
    )
    .bind(key)
    .fetch_one(&db.pool)
    .await?)
}

/// A relay that would quarantine a row after two charged failures, each after one second.
fn impatient_relay(db: &TestDb, brokers: &str) -> Result<Relay> {
    let mut kafka = producer_config(brokers);
    kafka.set("message.timeout.ms", "1000");
    Ok(Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default()
            .max_attempts(2)
            .backoff(Duration::from_millis(100), Duration::from_millis(500))
            .poll_interval(Duration::from_millis(100)),
    )?)
}

/// Runs `relay` batch by batch until its rows have met the outage `times` times (each a try
/// the relay charged before the fix, quarantining a row after `max_attempts`), asserting on
/// the way that none is charged or quarantined for it.
async fn wait_out(relay: &Relay, times: usize) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut met = 0;
    while met < times {
        let report = relay.run_once().await?;
        anyhow::ensure!(
            report.quarantined == 0 && report.retried == 0,
            "the outage was charged to rows: {report:?}"
        );
        met += report.waiting;
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the rows met the outage {met} times in 60 s, not {times}"
        );
        if report.claimed == 0 {
            // Nothing due yet: the waiting rows' pause (`backoff_max`) is not over.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Runs `relay` in the background; returns its handle and its shutdown token.
fn run(
    relay: &Relay,
) -> (
    tokio::task::JoinHandle<Result<(), outbox_producer::ProducerError>>,
    CancellationToken,
) {
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    (running, shutdown)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaderless_partition_is_waited_out_while_the_other_flows() -> Result<()> {
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("leaderless");
    mock.create_topic(&topic, 2, 1)?;
    let (up, down) = (key_on(0), key_on(1));
    let relay = impatient_relay(&db, &mock.bootstrap_servers())?;
    mock.partition_leader(&topic, 1, None)?;
    enqueue(&db, &events(&topic, &down, 3)?).await?;
    enqueue(&db, &events(&topic, &up, 3)?).await?;

    // The stuck rows meet the outage three times max_attempts over; the other partition
    // flows meanwhile.
    wait_out(&relay, 3 * 2).await?;
    assert_eq!(
        published(&db, &up).await?,
        3,
        "the partition with a leader flows"
    );
    assert_eq!(
        count_status(&db.pool, "quarantined").await?,
        0,
        "{:?}",
        errors(&db).await?
    );
    assert_eq!(published(&db, &down).await?, 0);
    assert_eq!(
        attempts(&db).await?,
        3,
        "only the delivered rows' attempts count; a partition's outage is not the rows' failure"
    );

    mock.partition_leader(&topic, 1, Some(1))?;
    let (running, shutdown) = run(&relay);
    eventually(
        "the stuck partition's rows are published once it has a leader",
        Duration::from_secs(30),
        || async { Ok(published(&db, &down).await? == 3) },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await???;
    let order: Vec<i64> = outbox_tests::read_all_from(
        &mock.bootstrap_servers(),
        &topic,
        2,
        Duration::from_secs(30),
    )
    .await?
    .into_iter()
    .filter(|r| r.key == down)
    .map(|r| {
        serde_json::from_str::<serde_json::Value>(&r.payload).map(|v| v["n"].as_i64().unwrap_or(-1))
    })
    .collect::<Result<_, _>>()?;
    assert_eq!(order, [0, 1, 2], "in order, once each");
    Ok(())
}

/// Kafka 4 caps the effective `min.insync.replicas` at the replication factor, so the single
/// test broker cannot be made to answer NOT_ENOUGH_REPLICAS: the mock cluster does, to every
/// produce request, until the fault is cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_enough_replicas_is_waited_out_and_charges_no_row() -> Result<()> {
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("isr");
    mock.create_topic(&topic, 1, 1)?;
    let relay = impatient_relay(&db, &mock.bootstrap_servers())?;
    // Warmed first, so that the fault meets produce requests, not the producer's start.
    enqueue(&db, &events(&topic, "warm", 1)?).await?;
    assert_eq!(relay.run_once().await?.published, 1);
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 100_000],
    );
    enqueue(&db, &events(&topic, "k", 3)?).await?;

    // Three times max_attempts over.
    wait_out(&relay, 3 * 2).await?;
    assert_eq!(
        count_status(&db.pool, "quarantined").await?,
        0,
        "{:?}",
        errors(&db).await?
    );
    assert_eq!(published(&db, "k").await?, 0);
    assert_eq!(attempts(&db).await?, 1, "{:?}", errors(&db).await?);

    mock.clear_request_errors(RDKafkaApiKey::Produce);
    let (running, shutdown) = run(&relay);
    eventually(
        "the rows are published once the partition takes writes",
        Duration::from_secs(30),
        || async { Ok(published(&db, "k").await? == 3) },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await???;
    assert_eq!(
        attempts(&db).await?,
        4,
        "one attempt per row: the successful one"
    );
    Ok(())
}

/// A row waiting out its partition's outage has no attempt charged, yet it must hold its
/// aggregate's later rows back before the claim's LIMIT: otherwise they fill every batch
/// (each dropped after the LIMIT, behind their waiting head) and the other partitions starve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_waiting_out_an_outage_does_not_starve_the_keys_behind_it() -> Result<()> {
    const BATCH: u32 = 20;
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("starve");
    mock.create_topic(&topic, 2, 1)?;
    let (up, down) = (key_on(0), key_on(1));
    let mut kafka = producer_config(&mock.bootstrap_servers());
    kafka.set("message.timeout.ms", "1000");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default()
            .batch_size(BATCH)
            .backoff(Duration::from_millis(100), Duration::from_secs(30)),
    )?;
    mock.partition_leader(&topic, 1, None)?;
    enqueue(&db, &events(&topic, &down, 1 + 3 * BATCH as usize)?).await?;
    enqueue(&db, &events(&topic, &up, 5)?).await?;

    let first = relay.run_once().await?;
    assert_eq!(first.waiting, 1, "{first:?}");
    let second = relay.run_once().await?;
    assert_eq!(
        (second.claimed, second.published),
        (5, 5),
        "the other partition's key flows past the waiting one: {second:?}"
    );
    assert_eq!(attempts(&db).await?, 5);
    Ok(())
}

/// A partition that stays out must not slow the others to one batch per `message.timeout.ms`:
/// every batch claims new aggregates' first rows on it, and each would wait out the timeout
/// with the batch. Once the relay knows the partition is out, its rows wait without being
/// sent (one probe row after a pause), so the healthy partitions' rows flow at full speed;
/// and once the partition takes writes again, its rows follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_partition_does_not_slow_the_others_to_one_batch_per_timeout() -> Result<()> {
    const PARTITIONS: i32 = 4;
    const KEYS: usize = 160;
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("deadpart");
    mock.create_topic(&topic, PARTITIONS, 1)?;
    let mut kafka = producer_config(&mock.bootstrap_servers());
    kafka.set("message.timeout.ms", "4000");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default()
            .batch_size(16)
            .backoff(Duration::from_millis(100), Duration::from_secs(10))
            .poll_interval(Duration::from_millis(50)),
    )?;
    // Before the first produce request: the mock cluster crashes answering one for a
    // partition whose leader it took away since.
    mock.partition_leader(&topic, PARTITIONS - 1, None)?;
    let keys: Vec<String> = (0..KEYS).map(|n| format!("agg{n}")).collect();
    let all: Vec<NewEvent> = keys
        .iter()
        .map(|k| events(&topic, k, 1))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    enqueue(&db, &all).await?;
    let dead = keys
        .iter()
        .filter(|k| java_partition(k.as_bytes(), PARTITIONS) == PARTITIONS - 1)
        .count() as i64;
    let healthy = KEYS as i64 - dead;
    let published_rows = || async {
        Ok::<i64, anyhow::Error>(
            sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE status = 'published'")
                .fetch_one(&db.pool)
                .await?,
        )
    };

    let (running, shutdown) = run(&relay);
    // Ten batches, each with rows of the dead partition: one batch per timeout would take
    // 40 s. The first batch meets the timeout once (4 s); the rest need no wait.
    let started = std::time::Instant::now();
    eventually(
        "every healthy partition's row is published",
        Duration::from_secs(16),
        || async { Ok(published_rows().await? == healthy) },
    )
    .await?;
    tracing::info!(elapsed = ?started.elapsed(), healthy, dead, "healthy rows published");
    assert_eq!(attempts(&db).await?, healthy, "{:?}", errors(&db).await?);
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);

    mock.partition_leader(&topic, PARTITIONS - 1, Some(1))?;
    eventually(
        "the dead partition's rows are published once it has a leader",
        Duration::from_secs(40),
        || async { Ok(published_rows().await? == KEYS as i64) },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await???;
    Ok(())
}

/// After the Kafka wait, the relay asks the cluster about the topics whose records went
/// unanswered. With many such topics and a slow cluster, asking one topic after another kept
/// the transaction idle past its own `idle_in_transaction_session_timeout` (30 s): the batch
/// failed after Kafka had answered. One request for all, inside the keep-alive, does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_about_many_unanswered_topics_keeps_the_transaction() -> Result<()> {
    const TOPICS: usize = 64;
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topics: Vec<String> = (0..TOPICS).map(|_| unique("slowmeta")).collect();
    for topic in &topics {
        mock.create_topic(topic, 1, 1)?;
        mock.partition_leader(topic, 0, None)?;
    }
    let all: Vec<NewEvent> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| events(t, &format!("k{i}"), 1))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    enqueue(&db, &all).await?;
    let mut kafka = producer_config(&mock.bootstrap_servers());
    kafka.set("message.timeout.ms", "3000");
    let relay = Relay::new(db.pool.clone(), &kafka, RelayConfig::default())?;
    // Every request to the cluster takes over a second: asked one topic at a time, about a minute.
    mock.broker_round_trip_time(1, Duration::from_millis(600))?;

    let report = relay.run_once().await?;
    assert_eq!(report.waiting, TOPICS, "{report:?}");
    assert_eq!(attempts(&db).await?, 0, "{:?}", errors(&db).await?);
    Ok(())
}
