//! Per-key order when a key's rows travel in several produce requests of one partition. A
//! warmed producer with a small `batch.num.messages` and a linger pipelines them (up to five
//! requests in flight); when one request fails for good (a record over the topic's
//! `max.message.bytes`), librdkafka's idempotent producer bumps its epoch and delivers the
//! later requests anyway. Nothing of a key may reach the wire out of `seq` order, or past a
//! row `BlockKey` holds. Real Postgres and Apache Kafka.

use std::time::Duration;

use anyhow::Result;
use outbox_producer::{
    BatchReport, NewEvent, QuarantinePolicy, Relay, RelayConfig, producer_config,
};
use outbox_tests::{TestDb, count_status, kafka_bootstrap, read_all, unique};
use serde_json::json;

const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A one-partition topic whose broker rejects record batches over 64 KiB.
async fn topic_of_64_kib() -> Result<String> {
    let topic = unique("outbox.order");
    outbox_tests::create_topic_with(&topic, 1, &[("max.message.bytes", "65536")]).await?;
    Ok(topic)
}

fn event(topic: &str, key: &str, n: usize) -> Result<NewEvent> {
    Ok(
        NewEvent::new("order", key, "OrderChanged", &json!({ "key": key, "n": n }))?
            .with_topic(topic)?,
    )
}

fn big(topic: &str, key: &str) -> Result<NewEvent> {
    Ok(
        NewEvent::new("order", key, "Big", &json!({ "blob": "x".repeat(100_000) }))?
            .with_topic(topic)?,
    )
}

async fn enqueue(db: &TestDb, events: &[NewEvent]) -> Result<()> {
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(())
}

/// A relay whose producer splits a batch into requests of `per_request` records, gathered
/// over a linger so that they are pipelined, warmed by one published row (a fresh producer
/// holds everything until it has its producer id, then sends it in one request).
async fn pipelining_relay(
    db: &TestDb,
    topic: &str,
    per_request: usize,
    policy: QuarantinePolicy,
) -> Result<Relay> {
    let mut kafka = producer_config(&kafka_bootstrap());
    kafka
        .set("batch.num.messages", per_request.to_string())
        .set("linger.ms", "50");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default().quarantine_policy(policy),
    )?;
    enqueue(db, &[event(topic, "warm", 0)?]).await?;
    let warmed = relay.run_once().await?;
    assert_eq!(warmed.published, 1, "{warmed:?}");
    Ok(relay)
}

/// Runs batches until one claims nothing.
async fn drain(relay: &Relay) -> Result<Vec<BatchReport>> {
    let mut reports = Vec::new();
    loop {
        let report = relay.run_once().await?;
        if report.claimed == 0 {
            return Ok(reports);
        }
        reports.push(report);
    }
}

/// The payloads' `n` of `key` on `topic`, in offset order, first delivery of each only.
async fn sequence_of(topic: &str, key: &str) -> Result<Vec<u64>> {
    let mut seen = std::collections::HashSet::new();
    let mut ns = Vec::new();
    for record in read_all(topic, 1, READ_TIMEOUT).await? {
        if record.key == key && seen.insert(record.id().to_owned()) {
            let value: serde_json::Value = serde_json::from_str(&record.payload)?;
            ns.push(value["n"].as_u64().unwrap_or(u64::MAX));
        }
    }
    Ok(ns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_key_holds_the_rows_pipelined_behind_a_rejected_head() -> Result<()> {
    for per_request in [1, 2] {
        let db = TestDb::new().await?;
        let topic = topic_of_64_kib().await?;
        let relay = pipelining_relay(&db, &topic, per_request, QuarantinePolicy::BlockKey).await?;
        let head = big(&topic, "k")?;
        let mut events = vec![head.clone()];
        for n in 1..=4 {
            events.push(event(&topic, "k", n)?);
        }
        events.push(event(&topic, "j", 1)?);
        enqueue(&db, &events).await?;
        let reports = drain(&relay).await?;

        let status: String = sqlx::query_scalar("SELECT status FROM outbox_events WHERE id = $1")
            .bind(head.id())
            .fetch_one(&db.pool)
            .await?;
        assert_eq!(status, "quarantined", "{reports:?}");
        assert_eq!(
            sequence_of(&topic, "k").await?,
            Vec::<u64>::new(),
            "batch.num.messages={per_request}: k's rows passed its quarantined head: {reports:?}"
        );
        assert_eq!(count_status(&db.pool, "pending").await?, 4, "{reports:?}");
        assert_eq!(sequence_of(&topic, "j").await?, [1], "other keys flow");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_keys_rows_stay_in_order_when_a_request_they_shared_is_rejected() -> Result<()> {
    for per_request in [2, 3] {
        let db = TestDb::new().await?;
        let topic = topic_of_64_kib().await?;
        let relay =
            pipelining_relay(&db, &topic, per_request, QuarantinePolicy::SkipQuarantined).await?;
        // The oversized row of `j` shares its request with `k`'s first row: the broker rejects
        // both, while `k`'s later rows travel in the next requests.
        let mut events = vec![big(&topic, "j")?];
        for n in 1..=8 {
            events.push(event(&topic, "k", n)?);
        }
        enqueue(&db, &events).await?;
        let reports = drain(&relay).await?;

        assert_eq!(
            sequence_of(&topic, "k").await?,
            [1, 2, 3, 4, 5, 6, 7, 8],
            "batch.num.messages={per_request}: {reports:?}"
        );
        assert_eq!(
            count_status(&db.pool, "quarantined").await?,
            1,
            "{reports:?}"
        );
        let charged: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_events WHERE aggregateid = 'k' AND attempts <> 1",
        )
        .fetch_one(&db.pool)
        .await?;
        assert_eq!(
            charged, 0,
            "k's rows are charged nothing for j's size: {reports:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_row_under_block_key_holds_its_aggregate_not_another_type_with_its_id()
-> Result<()> {
    let db = TestDb::new().await?;
    let invoices = outbox_tests::random_topic(1).await?;
    let customers = outbox_tests::random_topic(1).await?;
    let poison = NewEvent::new("invoice", "42", "InvoiceIssued", &json!({ "n": 0 }))?
        .with_topic(&invoices)?;
    enqueue(
        &db,
        &[
            poison.clone(),
            NewEvent::new("invoice", "42", "InvoicePaid", &json!({ "n": 1 }))?
                .with_topic(&invoices)?,
            NewEvent::new("customer", "42", "CustomerMoved", &json!({ "n": 1 }))?
                .with_topic(&customers)?,
        ],
    )
    .await?;
    // Headers that are not a JSON object: the row's own permanent failure.
    sqlx::query("UPDATE outbox_events SET headers = '[1]' WHERE id = $1")
        .bind(poison.id())
        .execute(&db.pool)
        .await?;
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().quarantine_policy(QuarantinePolicy::BlockKey),
    )?;
    let reports = drain(&relay).await?;
    let statuses: Vec<(String, String)> =
        sqlx::query_as("SELECT aggregatetype, status FROM outbox_events ORDER BY seq")
            .fetch_all(&db.pool)
            .await?;
    let statuses: Vec<(&str, &str)> = statuses
        .iter()
        .map(|(t, s)| (t.as_str(), s.as_str()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("invoice", "quarantined"),
            ("invoice", "pending"),
            ("customer", "published"),
        ],
        "{reports:?}"
    );
    assert_eq!(sequence_of(&customers, "42").await?, [1]);
    Ok(())
}
