//! The producer half end to end: real Postgres, real Apache Kafka broker.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use anyhow::Result;
use outbox_producer::{
    AfterPublish, BatchReport, EventId, NewEvent, Outbox, ProducerError, QuarantinePolicy, Relay,
    RelayConfig, TableNames, producer_config,
};
use outbox_tests::{
    TestDb, count_status, eventually, java_partition, kafka_bootstrap, random_topic, read_all,
    unique,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const READ_TIMEOUT: Duration = Duration::from_secs(30);

fn relay(db: &TestDb, config: RelayConfig) -> Result<Relay> {
    Ok(Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        config,
    )?)
}

fn event(topic: &str, key: &str, n: usize) -> Result<NewEvent> {
    Ok(
        NewEvent::new("order", key, "OrderChanged", &json!({ "key": key, "n": n }))?
            .with_topic(topic)?,
    )
}

/// Runs batches until one claims nothing; returns the sum of the reports.
async fn drain(relay: &Relay) -> Result<BatchReport> {
    let mut total = BatchReport::default();
    loop {
        let r = relay.run_once().await?;
        if r.claimed == 0 {
            return Ok(total);
        }
        total.claimed += r.claimed;
        total.published += r.published;
        total.retried += r.retried;
        total.quarantined += r.quarantined;
        total.deferred += r.deferred;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_publishes_and_rollback_publishes_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    sqlx::query("CREATE TABLE invoices (id TEXT PRIMARY KEY, state TEXT NOT NULL)")
        .execute(&db.pool)
        .await?;
    let outbox = Outbox::default();

    let committed = NewEvent::new(
        "invoice",
        "inv-1",
        "InvoiceDecided",
        &json!({ "cents": 1200 }),
    )?
    .with_topic(&topic)?
    .with_header("tenant", "acme")?;
    let mut tx = db.pool.begin().await?;
    sqlx::query("INSERT INTO invoices VALUES ('inv-1', 'decided')")
        .execute(&mut *tx)
        .await?;
    outbox.enqueue(&mut tx, &committed).await?;
    tx.commit().await?;

    let mut tx = db.pool.begin().await?;
    sqlx::query("INSERT INTO invoices VALUES ('inv-2', 'decided')")
        .execute(&mut *tx)
        .await?;
    outbox.enqueue(&mut tx, &event(&topic, "inv-2", 0)?).await?;
    tx.rollback().await?;

    let report = drain(&relay(&db, RelayConfig::default())?).await?;
    assert_eq!((report.claimed, report.published), (1, 1));

    let records = read_all(&topic, 1, READ_TIMEOUT).await?;
    assert_eq!(
        records.len(),
        1,
        "only the committed event is published: {records:?}"
    );
    let r = &records[0];
    assert_eq!(r.key, "inv-1");
    assert_eq!(r.id(), committed.id().to_string());
    assert_eq!(
        r.headers.get("type").map(String::as_str),
        Some("InvoiceDecided")
    );
    assert_eq!(r.headers.get("tenant").map(String::as_str), Some("acme"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&r.payload)?,
        json!({ "cents": 1200 })
    );
    let states: Vec<String> = sqlx::query_scalar("SELECT id FROM invoices")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(
        states,
        ["inv-1"],
        "state and intent commit and roll back together"
    );
    Ok(())
}

/// Debezium and every Java producer put a key on `murmur2(key) % partitions`; the relay must
/// too, or a key's events split across two partitions when a topic has both writers (the
/// switch to CDC and back) and per-key order breaks at the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_partitions_keys_as_java_clients_do() -> Result<()> {
    const PARTITIONS: i32 = 6;
    let db = TestDb::new().await?;
    let topic = random_topic(PARTITIONS).await?;
    let keys: Vec<String> = (0..64).map(|n| format!("order-{n}")).collect();
    let events = keys
        .iter()
        .enumerate()
        .map(|(n, key)| event(&topic, key, n))
        .collect::<Result<Vec<_>>>()?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;
    drain(&relay(&db, RelayConfig::default())?).await?;

    let records = read_all(&topic, PARTITIONS, READ_TIMEOUT).await?;
    assert_eq!(records.len(), keys.len());
    let used: HashSet<i32> = records.iter().map(|r| r.partition).collect();
    assert_eq!(
        used.len(),
        PARTITIONS as usize,
        "64 keys reach every partition"
    );
    for r in &records {
        assert_eq!(
            r.partition,
            java_partition(r.key.as_bytes(), PARTITIONS),
            "key {} is on the partition a Java producer would choose",
            r.key
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_ack_before_mark_republishes_same_ids_and_loses_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(2).await?;
    let events = (0..20)
        .map(|n| event(&topic, &format!("k{}", n % 3), n))
        .collect::<Result<Vec<_>>>()?;
    let mut tx = db.pool.begin().await?;
    let ids = outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;

    let relay = relay(&db, RelayConfig::default())?;
    relay.crash_after_next_ack();
    let crashed = relay.run_once().await;
    assert!(
        matches!(crashed, Err(ProducerError::InjectedFault(_))),
        "{crashed:?}"
    );
    assert_eq!(
        count_status(&db.pool, "pending").await?,
        20,
        "nothing is marked without the commit"
    );
    assert_eq!(
        read_all(&topic, 2, READ_TIMEOUT).await?.len(),
        20,
        "the broker had acknowledged the batch"
    );

    let report = drain(&relay).await?;
    assert_eq!(report.published, 20);
    assert_eq!(count_status(&db.pool, "published").await?, 20);

    let records = read_all(&topic, 2, READ_TIMEOUT).await?;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in &records {
        *seen.entry(r.id()).or_default() += 1;
    }
    let expected: HashSet<String> = ids.iter().map(EventId::to_string).collect();
    let got: HashSet<String> = seen.keys().map(|s| (*s).to_owned()).collect();
    assert_eq!(got, expected, "every event id is on the topic");
    assert!(
        seen.values().all(|&n| n == 2),
        "each id was published twice (once per attempt): {seen:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_key_order_holds_with_three_relays_and_concurrent_writers() -> Result<()> {
    const KEYS: usize = 120;
    const WRITERS: usize = 4;
    const PER_WRITER: usize = 2_600;
    const PARTITIONS: i32 = 4;
    let db = TestDb::with_pool_size(16).await?;
    let topic = random_topic(PARTITIONS).await?;

    let shutdown = CancellationToken::new();
    let config = RelayConfig::default()
        .batch_size(250)
        .poll_interval(Duration::from_millis(100));
    let relays = (0..3)
        .map(|_| {
            let relay = relay(&db, config.clone())?;
            let shutdown = shutdown.clone();
            Ok(tokio::spawn(async move { relay.run(shutdown).await }))
        })
        .collect::<Result<Vec<_>>>()?;

    let writers = (0..WRITERS)
        .map(|w| {
            let pool = db.pool.clone();
            let topic = topic.clone();
            tokio::spawn(async move {
                for chunk in 0..PER_WRITER / 50 {
                    let events = (0..50)
                        .map(|i| {
                            let n = w * PER_WRITER + chunk * 50 + i;
                            event(&topic, &format!("key-{}", (n * 7919) % KEYS), n)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let mut tx = pool.begin().await?;
                    outbox_producer::enqueue_all(&mut tx, &events).await?;
                    tx.commit().await?;
                }
                anyhow::Ok(())
            })
        })
        .collect::<Vec<_>>();
    for w in writers {
        w.await??;
    }
    let total = (WRITERS * PER_WRITER) as i64;
    eventually("the outbox drains", Duration::from_secs(120), || async {
        Ok(count_status(&db.pool, "published").await? == total)
    })
    .await?;
    shutdown.cancel();
    for r in relays {
        r.await??;
    }

    // The outbox order per key (sequence order, which the per-key lock makes commit order)...
    let rows: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, aggregateid FROM outbox_events ORDER BY seq")
            .fetch_all(&db.pool)
            .await?;
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, key) in rows {
        expected.entry(key).or_default().push(id.to_string());
    }
    // ...is the order on the topic, read back by a plain Kafka consumer.
    let records = read_all(&topic, PARTITIONS, Duration::from_secs(60)).await?;
    let mut partition_of: HashMap<&str, i32> = HashMap::new();
    let mut actual: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut seen = HashSet::new();
    for r in &records {
        let p = *partition_of.entry(r.key.as_str()).or_insert(r.partition);
        assert_eq!(p, r.partition, "key {} spans partitions", r.key);
        if seen.insert(r.id().to_owned()) {
            actual
                .entry(r.key.clone())
                .or_default()
                .push(r.id().to_owned());
        }
    }
    assert_eq!(seen.len() as i64, total, "every event was published");
    assert_eq!(expected.len(), KEYS);
    for (key, ids) in &expected {
        assert_eq!(actual.get(key), Some(ids), "order of key {key}");
    }
    Ok(())
}

/// Enqueues b, a (too large for the producer), a, c; drains under `policy`; returns the keys
/// read back and the state of the oversized row.
async fn oversized_row_under(
    policy: QuarantinePolicy,
) -> Result<(Vec<String>, BatchReport, TestDb)> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let big = NewEvent::new("order", "a", "Big", &json!({ "blob": "x".repeat(20_000) }))?
        .with_topic(&topic)?;
    let events = vec![
        event(&topic, "b", 1)?,
        big.clone(),
        event(&topic, "a", 2)?,
        event(&topic, "c", 3)?,
    ];
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;

    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("message.max.bytes", "10000");
    let relay = Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default().quarantine_policy(policy),
    )?;
    let report = drain(&relay).await?;

    let (status, attempts, error): (String, i32, String) =
        sqlx::query_as("SELECT status, attempts, last_error FROM outbox_events WHERE id = $1")
            .bind(big.id())
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(
        (status.as_str(), attempts),
        ("quarantined", 1),
        "permanent errors are not retried"
    );
    assert!(
        error.contains("Permanent") && error.contains("MessageSizeTooLarge"),
        "{error}"
    );
    let keys = read_all(&topic, 1, READ_TIMEOUT)
        .await?
        .into_iter()
        .map(|r| r.key)
        .collect();
    Ok((keys, report, db))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_row_is_quarantined_at_once_and_its_key_moves_on_by_default() -> Result<()> {
    let (keys, report, db) = oversized_row_under(QuarantinePolicy::SkipQuarantined).await?;
    assert_eq!((report.quarantined, report.published), (1, 3), "{report:?}");
    assert_eq!(
        report.deferred, 1,
        "a's later row waits for the batch after its head failed"
    );
    assert_eq!(keys, ["b", "c", "a"]);
    assert_eq!(count_status(&db.pool, "pending").await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_row_holds_its_key_back_under_block_key() -> Result<()> {
    let (keys, report, db) = oversized_row_under(QuarantinePolicy::BlockKey).await?;
    assert_eq!((report.quarantined, report.published), (1, 2), "{report:?}");
    assert_eq!(
        keys,
        ["b", "c"],
        "other keys flow; a's later row waits behind its quarantined head"
    );
    assert_eq!(count_status(&db.pool, "pending").await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failure_retries_with_backoff_then_quarantines_while_others_flow() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    // The test broker does not auto-create topics: publishing here fails until the topic exists.
    let doomed = event(&unique("outbox.missing"), "a", 0)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &doomed).await?;
    outbox_producer::enqueue_all(&mut tx, &[event(&topic, "b", 1)?, event(&topic, "c", 2)?])
        .await?;
    tx.commit().await?;

    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("message.timeout.ms", "1500");
    let config = RelayConfig::default()
        .max_attempts(3)
        .backoff(Duration::from_secs(1), Duration::from_secs(2));
    let relay = Relay::new(db.pool.clone(), &kafka, config)?;

    let first = relay.run_once().await?;
    assert_eq!(
        (first.published, first.retried),
        (2, 1),
        "b and c flow while a fails: {first:?}"
    );
    let state = || async {
        Ok::<_, anyhow::Error>(
            sqlx::query_as::<_, (String, i32, Option<String>, bool)>(
                "SELECT status, attempts, last_error, next_attempt_at > now() FROM outbox_events WHERE id = $1",
            )
            .bind(doomed.id())
            .fetch_one(&db.pool)
            .await?,
        )
    };
    let (status, attempts, error, waiting) = state().await?;
    assert_eq!((status.as_str(), attempts), ("pending", 1));
    assert!(error.unwrap_or_default().contains("Transient"));
    assert!(waiting, "a failed row waits for its backoff");

    eventually(
        "the failing row is quarantined",
        Duration::from_secs(30),
        || async {
            relay.run_once().await?;
            Ok(state().await?.0 == "quarantined")
        },
    )
    .await?;
    assert_eq!(state().await?.1, 3, "quarantined after max_attempts");
    let keys: Vec<String> = read_all(&topic, 1, READ_TIMEOUT)
        .await?
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(keys, ["b", "c"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_batches_and_loses_nothing() -> Result<()> {
    const N: usize = 3_000;
    let db = TestDb::new().await?;
    let topic = random_topic(2).await?;
    let events = (0..N)
        .map(|n| event(&topic, &format!("k{}", n % 50), n))
        .collect::<Result<Vec<_>>>()?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;

    let relay = relay(&db, RelayConfig::default().batch_size(100))?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    eventually(
        "some rows are published",
        Duration::from_secs(30),
        || async { Ok(count_status(&db.pool, "published").await? > 0) },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await???;

    let published: HashSet<String> = sqlx::query_scalar::<_, uuid::Uuid>(
        "SELECT id FROM outbox_events WHERE status = 'published'",
    )
    .fetch_all(&db.pool)
    .await?
    .into_iter()
    .map(|id| id.to_string())
    .collect();
    let pending = count_status(&db.pool, "pending").await?;
    assert_eq!(
        published.len() as i64 + pending,
        N as i64,
        "every row is either published or still pending"
    );
    let on_topic: HashSet<String> = read_all(&topic, 2, READ_TIMEOUT)
        .await?
        .iter()
        .map(|r| r.id().to_owned())
        .collect();
    assert!(
        published.is_subset(&on_topic),
        "every row marked published is on the topic"
    );

    drain(&relay).await?;
    let on_topic: HashSet<String> = read_all(&topic, 2, READ_TIMEOUT)
        .await?
        .iter()
        .map(|r| r.id().to_owned())
        .collect();
    assert_eq!(on_topic.len(), N, "after a restart everything is published");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_an_idle_relay() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    // Polling every hour: only NOTIFY can make the second event go out within the test.
    let relay = relay(
        &db,
        RelayConfig::default().poll_interval(Duration::from_secs(3600)),
    )?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    for n in 1..=2 {
        let mut tx = db.pool.begin().await?;
        outbox_producer::enqueue(&mut tx, &event(&topic, "k", n)?).await?;
        tx.commit().await?;
        eventually(
            "the event is published",
            Duration::from_secs(20),
            || async { Ok(count_status(&db.pool, "published").await? == n as i64) },
        )
        .await?;
    }
    shutdown.cancel();
    running.await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_table_names_work_and_hostile_names_are_refused() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let names = TableNames::default()
        .with_outbox("billing_outbox")?
        .with_consumer_tables("billing_dedup", "billing_quarantine")?;
    outbox_core::migrate_with(&db.pool, &names).await?;
    let outbox = Outbox::new(&names);
    let mut tx = db.pool.begin().await?;
    outbox.enqueue(&mut tx, &event(&topic, "k", 1)?).await?;
    tx.commit().await?;
    let relay = relay(&db, RelayConfig::default().tables(names))?;
    assert_eq!(drain(&relay).await?.published, 1);
    assert_eq!(
        count_status(&db.pool, "published").await?,
        0,
        "the default table was not used"
    );
    assert_eq!(read_all(&topic, 1, READ_TIMEOUT).await?.len(), 1);

    let hostile = TableNames::default().with_outbox("x; DROP TABLE outbox_events; --");
    assert!(matches!(
        hostile,
        Err(outbox_core::CoreError::InvalidIdentifier { .. })
    ));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_show_depth_and_lag_and_prune_removes_only_old_published_rows() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let events = (0..10)
        .map(|n| event(&topic, "k", n))
        .collect::<Result<Vec<_>>>()?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;
    sqlx::query("UPDATE outbox_events SET created_at = now() - interval '1 minute'")
        .execute(&db.pool)
        .await?;

    let mut conn = db.pool.acquire().await?;
    let tables = TableNames::default();
    let before = outbox_producer::stats(&mut conn, &tables).await?;
    assert_eq!(before.pending, 10);
    assert!(
        before.oldest_pending_age_ms.is_some_and(|ms| ms >= 60_000),
        "{before:?}"
    );

    drain(&relay(&db, RelayConfig::default())?).await?;
    let after = outbox_producer::stats(&mut conn, &tables).await?;
    assert_eq!(
        (
            after.pending,
            after.oldest_pending_age_ms,
            after.quarantined
        ),
        (0, None, 0)
    );

    sqlx::query("UPDATE outbox_events SET published_at = now() - interval '10 days' WHERE (payload->>'n')::int < 4")
        .execute(&mut *conn)
        .await?;
    let week = Duration::from_secs(7 * 24 * 3600);
    assert_eq!(
        outbox_producer::prune_published(&mut conn, &tables, week, 3).await?,
        4
    );
    assert_eq!(count_status(&db.pool, "published").await?, 6);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_publish_delete_removes_acknowledged_rows() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let events = (0..5)
        .map(|n| event(&topic, "k", n))
        .collect::<Result<Vec<_>>>()?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;
    let relay = relay(
        &db,
        RelayConfig::default().after_publish(AfterPublish::Delete),
    )?;
    assert_eq!(drain(&relay).await?.published, 5);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 0);
    assert_eq!(read_all(&topic, 1, READ_TIMEOUT).await?.len(), 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_enqueue_option_writes_the_rows_in_order() -> Result<()> {
    let db = TestDb::new().await?;
    let mut expected = Vec::new();
    for lock in [true, false] {
        for notify in [true, false] {
            let outbox = Outbox::default().lock_per_key(lock).notify(notify);
            let label = format!("{lock}-{notify}");
            let batch = (0..3)
                .map(|n| event("t", &label, n))
                .collect::<Result<Vec<_>>>()?;
            let mut tx = db.pool.begin().await?;
            expected.push(outbox.enqueue(&mut tx, &event("t", &label, 9)?).await?);
            expected.extend(outbox.enqueue_all(&mut tx, &batch).await?);
            tx.commit().await?;
        }
    }
    let stored: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events ORDER BY seq")
        .fetch_all(&db.pool)
        .await?;
    let expected: Vec<uuid::Uuid> = expected.iter().map(|id| *id.as_uuid()).collect();
    assert_eq!(stored, expected);
    Ok(())
}

#[tokio::test]
async fn a_relay_refuses_a_pool_too_small_for_its_connections() -> Result<()> {
    // The listener keeps one pooled connection for good: with a pool of one, `run` would
    // wait forever for a connection to claim with.
    let db = TestDb::with_pool_size(1).await?;
    let kafka = producer_config(&kafka_bootstrap());
    let refused = Relay::new(db.pool.clone(), &kafka, RelayConfig::default());
    assert!(
        matches!(&refused, Err(ProducerError::Config(m)) if m.contains("at least 2 connections")),
        "{refused:?}"
    );
    Relay::new(
        db.pool.clone(),
        &kafka,
        RelayConfig::default().listen(false),
    )?;
    Ok(())
}

/// The claim's cost estimate grows with the backlog, and past a few million pending rows
/// Postgres JIT-compiled it: 268 ms of compiling for 4 ms of work per batch (bench P7); and
/// its generic plan (which Postgres may switch a prepared statement to after five runs)
/// scanned the backlog; and on a small table a sorted sequential scan took every due key's
/// lock (`dispatcher::a_batch_on_a_small_table_holds_only_the_keys_it_claimed`). The batch's
/// transaction sets its own JIT, plan cache mode, sorting and timeouts with its `BEGIN`,
/// whatever the session says: here a session that says the opposite of each. A trigger on the rows it marks reads the settings in force in that
/// transaction, and the claim's prepared statement, after a dozen batches on the relay's one
/// connection, was never planned generically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_runs_without_jit_and_on_custom_plans() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    sqlx::raw_sql(
        "CREATE TABLE seen_settings (jit text, plans text, sort text, statement_timeout text, \
           idle text); \
         CREATE FUNCTION record_settings() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO seen_settings VALUES (current_setting('jit'), \
             current_setting('plan_cache_mode'), current_setting('enable_sort'), \
             current_setting('statement_timeout'), \
             current_setting('idle_in_transaction_session_timeout')); \
           RETURN NEW; END $$; \
         CREATE TRIGGER record_settings BEFORE UPDATE ON outbox_events \
           FOR EACH ROW EXECUTE FUNCTION record_settings()",
    )
    .execute(&db.pool)
    .await?;
    let options = (*db.pool.connect_options()).clone().options([
        ("jit", "on"),
        ("plan_cache_mode", "force_generic_plan"),
        ("enable_sort", "on"),
        ("statement_timeout", "0"),
        ("idle_in_transaction_session_timeout", "0"),
    ]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await?;
    let relay = Relay::new(
        pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().listen(false),
    )?;
    for n in 0..12 {
        let mut tx = db.pool.begin().await?;
        outbox_producer::enqueue(&mut tx, &event(&topic, "k", n)?).await?;
        tx.commit().await?;
        assert_eq!(relay.run_once().await?.published, 1);
    }
    let seen: Vec<(String, String, String, String, String)> =
        sqlx::query_as("SELECT DISTINCT * FROM seen_settings")
            .fetch_all(&db.pool)
            .await?;
    let expected = ("off", "force_custom_plan", "off", "5min", "30s");
    assert_eq!(
        seen,
        vec![(
            expected.0.to_owned(),
            expected.1.to_owned(),
            expected.2.to_owned(),
            expected.3.to_owned(),
            expected.4.to_owned()
        )]
    );
    let (generic, custom): (i64, i64) = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
         WHERE statement LIKE '%claimed AS%'",
    )
    .fetch_one(&pool)
    .await?;
    assert_eq!(generic, 0, "{custom} custom plans");
    assert!(custom >= 12, "{custom} custom plans");
    Ok(())
}

/// Every index the plan of `statement` (bound to `limit`) scans for the table alias `alias`.
async fn indexes_scanned_for(
    db: &TestDb,
    statement: &str,
    limit: i64,
    alias: &str,
) -> Result<Vec<String>> {
    fn walk(node: &serde_json::Value, alias: &str, found: &mut Vec<String>) {
        if node["Alias"] == alias
            && let Some(index) = node["Index Name"].as_str()
        {
            found.push(index.to_owned());
        }
        for child in node["Plans"].as_array().into_iter().flatten() {
            walk(child, alias, found);
        }
    }
    let mut tx = db.pool.begin().await?;
    sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (FORMAT JSON) {statement}"
    )))
    .bind(limit)
    .fetch_one(&mut *tx)
    .await?;
    let mut found = Vec::new();
    walk(&plan[0]["Plan"], alias, &mut found);
    Ok(found)
}

/// A quiet outbox (every row published, and analyzed so), then a burst of pending rows: the
/// claim's probe for rows holding a key back must stay on the small index of such rows. With
/// those statistics the planner took the pending index for it when the probe said
/// `status = 'pending'`, and scanned every earlier pending row per claimed row (bench P5:
/// 36 ms vs 7 ms per batch of 500 over 1M retained rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_probe_for_held_keys_stays_on_its_index_after_a_quiet_spell() -> Result<()> {
    use tracing::instrument::WithSubscriber;
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    for (rows, status) in [(50_000, "published"), (2_000, "pending")] {
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, status) \
             SELECT gen_random_uuid(), 'order', 'k' || (i % 1000), 'OrderChanged', '{}', $1, $2 \
             FROM generate_series(1, $3) AS i",
        )
        .bind(&topic)
        .bind(status)
        .bind(rows)
        .execute(&db.pool)
        .await?;
        if status == "published" {
            sqlx::query("ANALYZE outbox_events")
                .execute(&db.pool)
                .await?;
        }
    }
    for policy in [
        QuarantinePolicy::SkipQuarantined,
        QuarantinePolicy::BlockKey,
    ] {
        let relay = relay(&db, RelayConfig::default().quarantine_policy(policy))?;
        let statements = outbox_tests::Statements::default();
        async { relay.run_once().await }
            .with_subscriber(tracing::Dispatch::new(statements.clone()))
            .await?;
        let claim = statements.containing("claimed AS")?;
        let probed = indexes_scanned_for(&db, &claim, 500, "h").await?;
        assert_eq!(
            probed,
            ["outbox_events_aggregate_holding_idx"],
            "{policy:?}"
        );
    }
    Ok(())
}

/// The claim is a prepared statement per connection. A migration that changes the type of a
/// column it returns makes Postgres refuse it ("cached plan must not change result type");
/// the relay closes it, so the next batch prepares it again, and publishing goes on.
#[tokio::test]
async fn a_migration_that_changes_a_claimed_column_costs_one_batch() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*db.pool.connect_options()).clone())
        .await?;
    let relay = Relay::new(
        pool,
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().listen(false),
    )?;
    let enqueue_one = |n| {
        let db = &db;
        let topic = &topic;
        async move {
            let mut tx = db.pool.begin().await?;
            outbox_producer::enqueue(&mut tx, &event(topic, "k", n)?).await?;
            tx.commit().await?;
            anyhow::Ok(())
        }
    };
    enqueue_one(0).await?;
    assert_eq!(relay.run_once().await?.published, 1);
    sqlx::query("ALTER TABLE outbox_events ALTER COLUMN type TYPE varchar(200)")
        .execute(&db.pool)
        .await?;
    enqueue_one(1).await?;
    let refused = relay.run_once().await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("result type")),
        "{refused:?}"
    );
    assert_eq!(relay.run_once().await?.published, 1);
    Ok(())
}
