//! Liveness of the relay: a key held back never starves the others, a malformed row fails
//! alone, an outage charges no row, a key's failure in a delivery report holds its later rows,
//! and shutdown is bounded whatever is in flight. Real Postgres and Apache Kafka; librdkafka's
//! mock cluster only where the broker must be taken down at a precise point.

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{
    BatchReport, NewEvent, QuarantinePolicy, Relay, RelayConfig, producer_config,
};
use outbox_tests::{
    TestDb, count_status, eventually, kafka_bootstrap, random_topic, read_all, unique,
};
use rdkafka::mocking::MockCluster;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const READ_TIMEOUT: Duration = Duration::from_secs(30);
const BATCH: u32 = 20;

fn event(topic: &str, key: &str, n: usize) -> Result<NewEvent> {
    Ok(
        NewEvent::new("order", key, "OrderChanged", &json!({ "key": key, "n": n }))?
            .with_topic(topic)?,
    )
}

async fn enqueue(db: &TestDb, events: &[NewEvent]) -> Result<()> {
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(())
}

fn kafka_relay(db: &TestDb, config: RelayConfig) -> Result<Relay> {
    Ok(Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        config,
    )?)
}

async fn keys_on(topic: &str) -> Result<Vec<String>> {
    Ok(read_all(topic, 1, READ_TIMEOUT)
        .await?
        .into_iter()
        .map(|r| r.key)
        .collect())
}

/// One row of key `k` held back by `hold` (SQL on its row), 3 × BATCH later rows of `k`,
/// then rows of `j`: one batch must publish `j`'s rows.
async fn other_keys_flow_past(policy: QuarantinePolicy, hold: &str) -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let head = event(&topic, "k", 0)?;
    let mut events = vec![head.clone()];
    for n in 1..=3 * BATCH as usize {
        events.push(event(&topic, "k", n)?);
    }
    for n in 0..5 {
        events.push(event(&topic, "j", n)?);
    }
    enqueue(&db, &events).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE outbox_events SET {hold} WHERE id = $1"
    )))
    .bind(head.id())
    .execute(&db.pool)
    .await?;

    let relay = kafka_relay(
        &db,
        RelayConfig::default()
            .batch_size(BATCH)
            .quarantine_policy(policy),
    )?;
    let report = relay.run_once().await?;
    assert_eq!(report.published, 5, "j's rows are published: {report:?}");
    assert_eq!(keys_on(&topic).await?, ["j"; 5]);
    assert_eq!(
        count_status(&db.pool, "pending").await?,
        3 * i64::from(BATCH) + i64::from(policy == QuarantinePolicy::SkipQuarantined),
        "k's rows wait behind their head"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_waiting_for_its_retry_does_not_starve_the_keys_behind_it() -> Result<()> {
    other_keys_flow_past(
        QuarantinePolicy::SkipQuarantined,
        "attempts = 1, next_attempt_at = now() + interval '1 hour', last_error = 'test'",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_blocked_by_quarantine_does_not_starve_the_keys_behind_it() -> Result<()> {
    other_keys_flow_past(
        QuarantinePolicy::BlockKey,
        "status = 'quarantined', attempts = 1, last_error = 'test'",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_topic_is_missing_does_not_starve_other_topics() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let missing = unique("outbox.missing");
    let mut events: Vec<NewEvent> = (0..=3 * BATCH as usize)
        .map(|n| event(&missing, "k", n))
        .collect::<Result<_>>()?;
    for n in 0..5 {
        events.push(event(&topic, "j", n)?);
    }
    enqueue(&db, &events).await?;
    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("message.timeout.ms", "1500");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default()
            .batch_size(BATCH)
            .backoff(Duration::from_secs(3600), Duration::from_secs(3600)),
    )?;
    let mut published = 0;
    for _ in 0..3 {
        published += relay.run_once().await?.published;
    }
    assert_eq!(published, 5, "j's rows are published");
    assert_eq!(keys_on(&topic).await?, ["j"; 5]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_or_ambiguous_row_is_quarantined_alone() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    enqueue(&db, &[event(&topic, "a", 0)?]).await?;
    // Rows as another writer sharing the table could leave them: the schema allows any JSONB.
    let bad = [
        ("b", json!(["not", "an", "object"]), "JSON object"),
        ("c", json!({ "n": 1 }), "JSON string"),
        ("d", json!({ "id": "someone-else" }), "reserved"),
        ("e", json!({ "type": "Other" }), "reserved"),
    ];
    for (key, headers, _) in &bad {
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
             VALUES (gen_random_uuid(), 'order', $1, 'OrderChanged', '{}', $2, $3)",
        )
        .bind(key)
        .bind(headers)
        .bind(&topic)
        .execute(&db.pool)
        .await?;
    }
    enqueue(&db, &[event(&topic, "f", 1)?]).await?;

    let relay = kafka_relay(&db, RelayConfig::default())?;
    let report = relay.run_once().await?;
    assert_eq!((report.published, report.quarantined), (2, 4), "{report:?}");
    for (key, _, reason) in &bad {
        let (status, error): (String, String) =
            sqlx::query_as("SELECT status, last_error FROM outbox_events WHERE aggregateid = $1")
                .bind(key)
                .fetch_one(&db.pool)
                .await?;
        assert_eq!(status, "quarantined", "row {key}");
        assert!(
            error.contains("Permanent") && error.contains(reason),
            "row {key}: {error}"
        );
    }
    let records = read_all(&topic, 1, READ_TIMEOUT).await?;
    let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["a", "f"]);
    Ok(())
}

/// A topic whose broker-side limit rejects records over 1,000 bytes, in the delivery report
/// (the client's own limit is far above it).
async fn small_topic() -> Result<String> {
    let topic = unique("outbox.small");
    outbox_tests::create_topic_with(&topic, 1, &[("max.message.bytes", "1000")]).await?;
    Ok(topic)
}

/// Enqueues a row of key `k` that the broker rejects in its delivery report (over a fresh
/// [`small_topic`]'s limit), then `k`'s and `j`'s next rows on `later` (the small topic when
/// `None`), and runs one batch under `BlockKey`.
async fn rejected_head_then(db: &TestDb, later: Option<&str>) -> Result<(NewEvent, BatchReport)> {
    let small = small_topic().await?;
    let later = later.unwrap_or(&small);
    let big = NewEvent::new("order", "k", "Big", &json!({ "blob": "x".repeat(5_000) }))?
        .with_topic(&small)?;
    enqueue(
        db,
        &[big.clone(), event(later, "k", 1)?, event(later, "j", 2)?],
    )
    .await?;
    let relay = kafka_relay(
        db,
        RelayConfig::default().quarantine_policy(QuarantinePolicy::BlockKey),
    )?;
    Ok((big, relay.run_once().await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_in_a_delivery_report_holds_the_keys_later_rows_under_block_key() -> Result<()>
{
    let db = TestDb::new().await?;
    let other = random_topic(1).await?;
    let (big, report) = rejected_head_then(&db, Some(&other)).await?;
    let (status, error): (String, String) =
        sqlx::query_as("SELECT status, last_error FROM outbox_events WHERE id = $1")
            .bind(big.id())
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(status, "quarantined", "{error}");
    assert_eq!(
        keys_on(&other).await?,
        ["j"],
        "k's later row must not pass its rejected head: {report:?}"
    );
    assert_eq!(count_status(&db.pool, "pending").await?, 1);
    Ok(())
}

/// Attempts charged so far, over all rows.
async fn attempts(db: &TestDb) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(sum(attempts), 0) FROM outbox_events")
            .fetch_one(&db.pool)
            .await?,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_charges_no_row_and_the_relay_resumes_when_it_returns() -> Result<()> {
    const N: usize = 50;
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("outage");
    mock.create_topic(&topic, 1, 1)?;
    let mut kafka = producer_config(&mock.bootstrap_servers());
    kafka.set("message.timeout.ms", "1000");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default()
            .max_attempts(2)
            .poll_interval(Duration::from_millis(100)),
    )?;
    mock.broker_down(1)?;
    let events: Vec<NewEvent> = (0..N)
        .map(|n| event(&topic, &format!("k{}", n % 7), n))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;

    let report = relay.run_once().await?;
    assert!(report.broker_unreachable, "{report:?}");
    // Each key's first row waited for an answer; its later rows were never sent.
    assert_eq!(
        (report.unconfirmed, report.deferred),
        (7, N - 7),
        "{report:?}"
    );

    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    // The outage lasts longer than max_attempts × message.timeout.ms: every row would be
    // quarantined twice over if the relay's failures were charged to them.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        attempts(&db).await?,
        0,
        "an outage is not the rows' failure"
    );
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);

    mock.broker_up(1)?;
    eventually(
        "every row is published once the broker is back",
        Duration::from_secs(20),
        || async { Ok(count_status(&db.pool, "published").await? == N as i64) },
    )
    .await?;
    assert_eq!(
        attempts(&db).await?,
        N as i64,
        "one attempt per row: the successful one"
    );
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await???;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_with_a_batch_in_flight_and_leaves_it_pending() -> Result<()> {
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("stuck");
    mock.create_topic(&topic, 1, 1)?;
    let mut kafka = producer_config(&mock.bootstrap_servers());
    // A batch in flight would wait this long for its delivery reports.
    kafka.set("message.timeout.ms", "300000");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default().shutdown_timeout(Duration::from_secs(1)),
    )?;
    mock.broker_down(1)?;
    enqueue(&db, &[event(&topic, "k", 0)?, event(&topic, "j", 1)?]).await?;

    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    eventually(
        "the relay has claimed the batch",
        Duration::from_secs(20),
        || async {
            // Reads the row locks without taking any: a probe that locked rows itself (FOR
            // UPDATE SKIP LOCKED) could hold one while the relay claims, so the relay would
            // claim the other alone and the probe would wait for a batch that never grows.
            let locked: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_events WHERE xmax IN \
                 (SELECT backend_xid FROM pg_stat_activity WHERE backend_xid IS NOT NULL)",
            )
            .fetch_one(&db.pool)
            .await?;
            Ok(locked == 2)
        },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .map_err(|_| anyhow::anyhow!("run() did not return within shutdown_timeout"))???;
    assert_eq!(count_status(&db.pool, "pending").await?, 2);
    assert_eq!(attempts(&db).await?, 0, "an unconfirmed row is not charged");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_in_a_delivery_report_holds_the_keys_later_rows_on_its_topic_under_block_key()
-> Result<()> {
    let db = TestDb::new().await?;
    let (big, report) = rejected_head_then(&db, None).await?;
    let small = big.topic().to_owned();
    let statuses: Vec<String> = sqlx::query_scalar("SELECT status FROM outbox_events ORDER BY seq")
        .fetch_all(&db.pool)
        .await?;
    // The broker rejected the record batch the three rows shared; only the oversized row is
    // at fault.
    assert_eq!(
        statuses,
        ["quarantined", "pending", "published"],
        "{report:?}"
    );
    assert_eq!(
        keys_on(&small).await?,
        ["j"],
        "k's later row must not pass its rejected head"
    );
    Ok(())
}

/// While one relay publishes a busy aggregate's first rows, another relay's claim must not
/// fill its LIMIT with that aggregate's later rows (each dropped after the LIMIT, behind the
/// rows the first relay holds) and return nothing while other keys' rows wait: it skips
/// the aggregates another relay is publishing. Relay A sends to a mock cluster whose every
/// answer takes seconds, so its batch is in flight while relay B claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_relay_publishes_other_keys_while_the_first_holds_a_busy_aggregate() -> Result<()>
{
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let mock = MockCluster::new(1)?;
    mock.create_topic(&topic, 1, 1)?;
    let busy: Vec<NewEvent> = (0..3 * BATCH as usize)
        .map(|n| event(&topic, "busy", n))
        .collect::<Result<_>>()?;
    enqueue(&db, &busy).await?;
    let others: Vec<NewEvent> = (0..5)
        .map(|n| event(&topic, &format!("other{n}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &others).await?;
    mock.broker_round_trip_time(1, Duration::from_secs(3))?;
    let name = unique("relay_a");
    let relay_a = Relay::new(
        db.pool_named(&name).await?,
        &producer_config(&mock.bootstrap_servers()),
        RelayConfig::default().batch_size(BATCH),
    )?;
    let a = tokio::spawn(async move { relay_a.run_once().await });
    eventually(
        "relay A has claimed its batch and waits for Kafka",
        Duration::from_secs(20),
        || async {
            Ok(sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1 \
                   AND state = 'idle in transaction' AND query LIKE 'WITH claimed%')",
            )
            .bind(&name)
            .fetch_one(&db.pool)
            .await?)
        },
    )
    .await?;

    let relay_b = kafka_relay(&db, RelayConfig::default().batch_size(BATCH))?;
    let report = relay_b.run_once().await?;
    a.abort();
    assert_eq!(
        (report.claimed, report.published),
        (5, 5),
        "the other keys flow past the aggregate relay A holds: {report:?}"
    );
    Ok(())
}
