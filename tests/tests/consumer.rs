//! The consumer half end to end: real Postgres, real Apache Kafka broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, ConsumerError, DedupConsumer, DedupContext, Event, Handler, HandlerError,
    HandlerFailurePolicy, Outcome, boxed, consumer_config, stream_consumer,
};
use outbox_core::EventId;
use outbox_tests::{
    TestDb, event_message, eventually, kafka_bootstrap, produce_raw, random_topic, unique,
};
use rdkafka::consumer::{Consumer, StreamConsumer};
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

type Headers = Vec<(&'static str, Vec<u8>)>;

#[derive(Debug, Deserialize)]
struct Order {
    n: i64,
    #[serde(default)]
    fail: bool,
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect must be visible as a second row.
    sqlx::query(
        "CREATE TABLE effects (seq BIGSERIAL, consumer TEXT, event_id UUID, key TEXT, n BIGINT)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Records the effect on the handler's transaction; fails when the payload says so.
async fn record_effect(event: &Event<Order>, conn: &mut PgConnection) -> Result<(), HandlerError> {
    let consumer: String = sqlx::query_scalar("SELECT current_setting('application_name')")
        .fetch_one(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO effects (consumer, event_id, key, n) VALUES ($1, $2, $3, $4)")
        .bind(consumer)
        .bind(event.id)
        .bind(&event.key)
        .bind(event.payload.n)
        .execute(&mut *conn)
        .await?;
    if event.payload.fail {
        return Err(HandlerError::retry("payload asked to fail"));
    }
    Ok(())
}

fn consumer(
    db: &TestDb,
    config: ConsumerConfig,
) -> Result<DedupConsumer<Order, impl Handler<Order> + use<>>> {
    Ok(DedupConsumer::new(db.pool.clone(), config, record_effect)?)
}

fn stream(topic: &str, group: &str) -> Result<StreamConsumer<DedupContext>> {
    let mut config = consumer_config(&kafka_bootstrap(), group);
    config
        .set("session.timeout.ms", "6000")
        .set("auto.commit.interval.ms", "200");
    let consumer = stream_consumer(&config)?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}

async fn effects(pool: &PgPool, id: EventId) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await?,
    )
}

async fn send_event(topic: &str, id: EventId, key: &str, payload: &str) -> Result<()> {
    let id = id.to_string();
    produce_raw(
        topic,
        None,
        Some(key),
        Some(payload.as_bytes()),
        &[("id", id.as_bytes()), ("type", b"OrderPlaced")],
    )
    .await?;
    Ok(())
}

/// Runs `consumer` on `topic` in the background until the returned token is cancelled.
fn spawn_run<H: Handler<Order>>(
    consumer: &DedupConsumer<Order, H>,
    topic: &str,
    group: &str,
) -> Result<(
    CancellationToken,
    tokio::task::JoinHandle<Result<(), ConsumerError>>,
)> {
    let shutdown = CancellationToken::new();
    let stream = stream(topic, group)?;
    let handle = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(stream, shutdown).await }
    });
    Ok((shutdown, handle))
}

fn handled<H: Handler<Order>>(c: &DedupConsumer<Order, H>) -> u64 {
    let s = c.stats();
    s.processed + s.duplicates_cached + s.duplicates_stored + s.quarantined
}

/// The application_name tags each effect row with the consumer that made it.
async fn db_for(name: &str) -> Result<TestDb> {
    let db = TestDb::new().await?;
    Ok(TestDb {
        pool: db.pool_named(name).await?,
        schema: db.schema,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_event_three_times_and_after_restart_has_one_effect() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let group = unique("g");
    let id = EventId::new();
    for _ in 0..3 {
        send_event(&topic, id, "k", r#"{"n":1}"#).await?;
    }
    let c = consumer(&db, ConsumerConfig::new("c1"))?;
    let (shutdown, run) = spawn_run(&c, &topic, &group)?;
    eventually("three deliveries handled", WAIT, || async {
        Ok(handled(&c) == 3)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    let s = c.stats();
    // Copies in one batch meet the dedup row their first copy inserted; copies in later
    // batches meet the cache.
    assert_eq!(
        (s.processed, s.duplicates_cached + s.duplicates_stored),
        (1, 2),
        "{s:?}"
    );

    // A restarted consumer (empty cache) resumes after the committed offsets; the fourth copy
    // is caught by the dedup table.
    send_event(&topic, id, "k", r#"{"n":1}"#).await?;
    let c = consumer(&db, ConsumerConfig::new("c1"))?;
    let (shutdown, run) = spawn_run(&c, &topic, &group)?;
    eventually("the fourth delivery handled", WAIT, || async {
        Ok(handled(&c) >= 1)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(c.stats().duplicates_stored, 1, "{:?}", c.stats());
    assert_eq!(c.stats().processed, 0);
    assert_eq!(effects(&db.pool, id).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_offset_store_is_absorbed() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let group = unique("g");
    let id = EventId::new();
    send_event(&topic, id, "k", r#"{"n":1}"#).await?;

    let c = consumer(&db, ConsumerConfig::new("c1"))?;
    c.crash_after_next_commit();
    let (_shutdown, run) = spawn_run(&c, &topic, &group)?;
    let crashed = tokio::time::timeout(WAIT, run).await??;
    assert!(
        matches!(crashed, Err(ConsumerError::InjectedFault(_))),
        "{crashed:?}"
    );
    assert_eq!(
        effects(&db.pool, id).await?,
        1,
        "the handler's transaction committed"
    );

    let c = consumer(&db, ConsumerConfig::new("c1"))?;
    let (shutdown, run) = spawn_run(&c, &topic, &group)?;
    eventually("the redelivery is handled", WAIT, || async {
        Ok(handled(&c) >= 1)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(
        c.stats().duplicates_stored,
        1,
        "redelivered, recognised as a duplicate: {:?}",
        c.stats()
    );
    assert_eq!(effects(&db.pool, id).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_error_rolls_back_state_and_dedup_row_then_retry_succeeds_once() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let calls = Arc::new(AtomicU32::new(0));
    let c = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").backoff(Duration::from_millis(1), Duration::from_millis(5)),
        {
            let calls = Arc::clone(&calls);
            boxed(move |event: &Event<Order>, conn| {
                let first = calls.fetch_add(1, Ordering::SeqCst) == 0;
                Box::pin(async move {
                    record_effect(event, conn).await?;
                    if first {
                        return Err(HandlerError::retry(
                            "first attempt fails after writing its state",
                        ));
                    }
                    Ok(())
                })
            })
        },
    )?;
    let id = EventId::new();
    let outcome = c
        .process(
            &event_message("t", 0, id, r#"{"n":1}"#),
            &CancellationToken::new(),
        )
        .await?;
    assert_eq!(outcome, Outcome::Processed);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(c.stats().handler_errors, 1);
    assert_eq!(
        effects(&db.pool, id).await?,
        1,
        "the failed attempt's state was rolled back"
    );
    let dedup_rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dedup")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(dedup_rows, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumer_names_each_process_every_event_once() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(3).await?;
    let ids: Vec<EventId> = (0..30).map(|_| EventId::new()).collect();
    for (n, id) in ids.iter().enumerate() {
        send_event(
            &topic,
            *id,
            &format!("k{}", n % 5),
            &format!(r#"{{"n":{n}}}"#),
        )
        .await?;
        send_event(
            &topic,
            *id,
            &format!("k{}", n % 5),
            &format!(r#"{{"n":{n}}}"#),
        )
        .await?;
    }
    let mut runs = Vec::new();
    for name in ["billing", "audit"] {
        let named = db_for(name).await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(
                (*named.pool.connect_options())
                    .clone()
                    .options([("search_path", db.schema.as_str())]),
            )
            .await?;
        let c = DedupConsumer::new(pool, ConsumerConfig::new(name), record_effect)?;
        let (shutdown, run) = spawn_run(&c, &topic, &unique(name))?;
        runs.push((c, shutdown, run));
    }
    for (c, _, _) in &runs {
        eventually("all 60 deliveries handled", WAIT, || async {
            Ok(handled(c) == 60)
        })
        .await?;
    }
    for (_, shutdown, run) in runs {
        shutdown.cancel();
        run.await??;
    }
    let per_consumer: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT consumer, count(*), count(DISTINCT event_id) FROM effects GROUP BY consumer ORDER BY consumer",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(
        per_consumer,
        [("audit".into(), 30, 30), ("billing".into(), 30, 30)]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_quarantined_with_reasons_and_the_partition_flows() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let good = |n: i64| (EventId::new(), format!(r#"{{"n":{n}}}"#));
    let (first, first_payload) = good(1);
    send_event(&topic, first, "k", &first_payload).await?;
    let big = format!(r#"{{"n":2,"pad":"{}"}}"#, "x".repeat(5_000));
    let poison: Vec<(Headers, Option<Vec<u8>>)> = vec![
        (
            vec![("type", b"OrderPlaced".to_vec())],
            Some(br#"{"n":2}"#.to_vec()),
        ),
        (
            vec![("id", b"not-a-uuid".to_vec())],
            Some(br#"{"n":2}"#.to_vec()),
        ),
        (
            vec![("id", EventId::new().to_string().into_bytes())],
            Some(b"{not json".to_vec()),
        ),
        (
            vec![("id", EventId::new().to_string().into_bytes())],
            Some(br#"{"m":"no n"}"#.to_vec()),
        ),
        (
            vec![
                ("id", EventId::new().to_string().into_bytes()),
                ("type", b"Unknown".to_vec()),
            ],
            Some(br#"{"n":2}"#.to_vec()),
        ),
        (
            vec![
                ("id", EventId::new().to_string().into_bytes()),
                ("type", b"OrderPlaced".to_vec()),
            ],
            Some(big.into_bytes()),
        ),
        (
            vec![
                ("id", EventId::new().to_string().into_bytes()),
                ("type", b"OrderPlaced".to_vec()),
            ],
            None,
        ),
        (
            vec![
                ("id", EventId::new().to_string().into_bytes()),
                ("type", b"OrderPlaced".to_vec()),
            ],
            Some(br#"{"n":2,"fail":true}"#.to_vec()),
        ),
    ];
    for (headers, payload) in &poison {
        let headers: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        produce_raw(&topic, Some(0), Some("k"), payload.as_deref(), &headers).await?;
    }
    let (last, last_payload) = good(3);
    send_event(&topic, last, "k", &last_payload).await?;

    let config = ConsumerConfig::new("c1")
        .event_types(["OrderPlaced"])
        .max_payload_bytes(4_096)
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let c = consumer(&db, config)?;
    let (shutdown, run) = spawn_run(&c, &topic, &unique("g"))?;
    eventually("every message handled", WAIT, || async {
        Ok(handled(&c) == 10)
    })
    .await?;
    shutdown.cancel();
    run.await??;

    assert_eq!(effects(&db.pool, first).await?, 1);
    assert_eq!(
        effects(&db.pool, last).await?,
        1,
        "the message after the poison ones was processed"
    );
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM outbox_consumer_quarantine ORDER BY \"offset\"")
            .fetch_all(&db.pool)
            .await?;
    // "missing id" lacks a type header too, but the id is checked first.
    assert_eq!(
        reasons,
        [
            "missing_id",
            "invalid_id",
            "invalid_json",
            "unknown_type",
            "unknown_type",
            "too_large",
            "missing_payload",
            "handler_failed"
        ]
        .map(String::from)
    );
    let kept: (i64, Option<Vec<u8>>) = sqlx::query_as(
        "SELECT count(*), (array_agg(payload) FILTER (WHERE reason = 'invalid_json'))[1] \
         FROM outbox_consumer_quarantine",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(kept, (8, Some(b"{not json".to_vec())), "raw bytes are kept");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_hit_makes_no_database_round_trip() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let c = consumer(&db, ConsumerConfig::new("c1"))?;
    let id = EventId::new();
    let msg = event_message("t", 0, id, r#"{"n":1}"#);
    let none = CancellationToken::new();
    assert_eq!(c.process(&msg, &none).await?, Outcome::Processed);
    let transactions = c.stats().transactions;
    // With the pool closed, any database access would fail.
    db.pool.close().await;
    assert_eq!(c.process(&msg, &none).await?, Outcome::DuplicateCached);
    assert_eq!(c.stats().transactions, transactions);
    Ok(())
}

/// An event id decided `days` days ago (a UUIDv7 id carries its time).
fn decided_days_ago(days: u64) -> EventId {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs();
    let ts = uuid::Timestamp::from_unix(uuid::NoContext, now - days * 24 * 3600, 0);
    EventId::from_uuid(uuid::Uuid::new_v7(ts))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_removes_only_expired_rows_and_a_pruned_event_is_handled_again() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let none = CancellationToken::new();
    // A month's window (as a consumer that met these events weeks ago had): events decided 10,
    // 8 and 1 day(s) ago, each in its day's slice (made by the consumer as it meets them), and
    // ids with no time handled 8 days and 1 day ago.
    let month = || ConsumerConfig::new("c1").dedup_ttl(Duration::from_secs(30 * 24 * 3600));
    let c = consumer(&db, month())?;
    let (old, older, recent) = (
        decided_days_ago(8),
        decided_days_ago(10),
        decided_days_ago(1),
    );
    let timeless: Vec<EventId> = (0..4)
        .map(|_| EventId::from_uuid(uuid::Uuid::new_v4()))
        .collect();
    for (offset, id) in [old, older, recent].iter().chain(&timeless).enumerate() {
        let msg = event_message("t", offset as i64, *id, r#"{"n":1}"#);
        assert_eq!(c.process(&msg, &none).await?, Outcome::Processed);
    }
    sqlx::query(
        "UPDATE outbox_consumer_dedup SET processed_at = now() - interval '8 days' \
         WHERE event_id = ANY($1)",
    )
    .bind([timeless[0], timeless[1]])
    .execute(&db.pool)
    .await?;

    let mut conn = db.pool.acquire().await?;
    let week = Duration::from_secs(7 * 24 * 3600);
    let pruned = outbox_consumer::prune(&mut conn, &Default::default(), week, 1).await?;
    assert_eq!(
        (pruned.slices_dropped, pruned.timeless_rows),
        (2, 2),
        "the days of 10 and 8 days ago; the two timeless rows of 8 days ago, one per batch"
    );
    let left: Vec<EventId> =
        sqlx::query_scalar("SELECT event_id FROM outbox_consumer_dedup ORDER BY event_id")
            .fetch_all(&mut *conn)
            .await?;
    let mut expected = vec![recent, timeless[2], timeless[3]];
    expected.sort_by_key(|id| *id.as_uuid());
    assert_eq!(left, expected);

    // Documented behaviour: once its dedup row is pruned, a redelivered event looks new (a
    // consumer that had seen its slice makes it again).
    let again = consumer(&db, month())?;
    let msg = event_message("t", 9, old, r#"{"n":1}"#);
    assert_eq!(again.process(&msg, &none).await?, Outcome::Processed);
    assert_eq!(c.process(&msg, &none).await?, Outcome::DuplicateCached);
    assert_eq!(effects(&db.pool, old).await?, 2);
    Ok(())
}

#[tokio::test]
async fn cache_may_not_outlive_the_dedup_rows() {
    let config = ConsumerConfig::new("c")
        .dedup_ttl(Duration::from_secs(60))
        .cache(10, Duration::from_secs(61));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .connect_lazy("postgres://unused@127.0.0.1/x")
        .expect("lazy pool");
    let built = DedupConsumer::new(pool, config, record_effect);
    assert!(matches!(built, Err(ConsumerError::Config(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_policy_retries_until_shutdown_and_never_quarantines() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let config = ConsumerConfig::new("c1")
        .max_attempts(1)
        .on_handler_failure(HandlerFailurePolicy::Block)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let c = consumer(&db, config)?;
    let shutdown = CancellationToken::new();
    let id = EventId::new();
    let processing = tokio::spawn({
        let (c, shutdown) = (c.clone(), shutdown.clone());
        let msg = event_message("t", 0, id, r#"{"n":1,"fail":true}"#);
        async move { c.process(&msg, &shutdown).await }
    });
    eventually("the handler is retried past max_attempts", WAIT, || async {
        Ok(c.stats().handler_errors >= 3)
    })
    .await?;
    shutdown.cancel();
    assert_eq!(processing.await??, Outcome::Abandoned);
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(quarantined, 0);
    assert_eq!(
        effects(&db.pool, id).await?,
        0,
        "every failed attempt rolled back"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_mid_stream_causes_no_double_effect() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(4).await?;
    let group = unique("g");
    let send_batch = |from: i64| {
        let topic = topic.clone();
        async move {
            for n in from..from + 100 {
                send_event(
                    &topic,
                    EventId::new(),
                    &format!("k{}", n % 10),
                    &format!(r#"{{"n":{n}}}"#),
                )
                .await?;
            }
            anyhow::Ok(())
        }
    };
    let effect_count = || async {
        Ok::<_, anyhow::Error>(
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT count(*), count(DISTINCT event_id) FROM effects",
            )
            .fetch_one(&db.pool)
            .await?,
        )
    };
    send_batch(0).await?;
    let first = consumer(&db, ConsumerConfig::new("c1"))?;
    let (stop_first, run_first) = spawn_run(&first, &topic, &group)?;
    eventually("the first member is working", WAIT, || async {
        Ok(effect_count().await?.0 > 0)
    })
    .await?;

    // A second member joins while the first has messages in flight: partitions move.
    let second = consumer(&db, ConsumerConfig::new("c1"))?;
    let (stop_second, run_second) = spawn_run(&second, &topic, &group)?;
    send_batch(100).await?;
    eventually(
        "every event has an effect",
        Duration::from_secs(120),
        || async { Ok(effect_count().await?.1 == 200) },
    )
    .await?;
    stop_first.cancel();
    stop_second.cancel();
    run_first.await??;
    run_second.await??;
    assert!(
        handled(&second) > 0,
        "the joining member took over partitions: {:?}",
        second.stats()
    );
    assert_eq!(
        effect_count().await?,
        (200, 200),
        "one effect per event id across the rebalance"
    );
    Ok(())
}

/// Reason, event id and headers of each quarantined message, in offset order.
async fn quarantined_rows(
    pool: &PgPool,
) -> Result<Vec<(String, Option<EventId>, serde_json::Value)>> {
    Ok(sqlx::query_as(
        "SELECT reason, event_id, headers FROM outbox_consumer_quarantine ORDER BY \"offset\"",
    )
    .fetch_all(pool)
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_id_or_type_header_is_quarantined_as_ambiguous_and_the_partition_flows()
-> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let [a, b, c, d, good] = [(); 5].map(|()| EventId::new().to_string());
    let records: [Vec<(&str, &[u8])>; 3] = [
        vec![
            ("id", a.as_bytes()),
            ("type", b"OrderPlaced"),
            ("id", b.as_bytes()),
        ],
        vec![
            ("id", c.as_bytes()),
            ("type", b"OrderPlaced"),
            ("type", b"OrderShipped"),
        ],
        // The same value twice is still two headers: the contract has one.
        vec![("id", d.as_bytes()), ("id", d.as_bytes())],
    ];
    for headers in &records {
        produce_raw(&topic, Some(0), Some("k"), Some(br#"{"n":1}"#), headers).await?;
    }
    send_event(&topic, good.parse()?, "k", r#"{"n":2}"#).await?;

    let c1 = consumer(
        &db,
        ConsumerConfig::new("c1").event_types(["OrderPlaced", "OrderShipped"]),
    )?;
    let (shutdown, run) = spawn_run(&c1, &topic, &unique("g"))?;
    eventually("every message handled", WAIT, || async {
        Ok(handled(&c1) == 4)
    })
    .await?;
    shutdown.cancel();
    run.await??;

    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(total, 1, "only the unambiguous message took effect");
    assert_eq!(effects(&db.pool, good.parse()?).await?, 1);
    let rows = quarantined_rows(&db.pool).await?;
    let reasons: Vec<&str> = rows.iter().map(|(r, _, _)| r.as_str()).collect();
    assert_eq!(reasons, ["ambiguous_id", "ambiguous_type", "ambiguous_id"]);
    assert_eq!(rows[0].1, None, "no id is picked from two");
    assert_eq!(rows[1].1, Some(c.parse()?), "the id itself was unambiguous");
    // Both values are kept, in the order they were received, so a requeue sends them back.
    assert_eq!(
        rows[0].2,
        serde_json::json!({"id": [a, b], "type": "OrderPlaced"})
    );
    assert_eq!(
        rows[1].2,
        serde_json::json!({"id": c, "type": ["OrderPlaced", "OrderShipped"]})
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_header_of_another_producer_is_kept_and_quarantines_nothing() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let [a, b, good] = [(); 3].map(|()| EventId::new().to_string());
    let binary: &[u8] = &[0xff, 0x00, 0xc3];
    type RawRecord<'a> = (Vec<(&'a str, &'a [u8])>, &'a [u8]);
    let records: [RawRecord<'_>; 3] = [
        (
            vec![
                ("id", a.as_bytes()),
                ("type", b"OrderPlaced"),
                ("bin", binary),
            ],
            br#"{"n":1}"#,
        ),
        // Quarantined for its payload; its headers are kept byte for byte.
        (
            vec![("id", b.as_bytes()), ("bin", binary), ("x", b"text")],
            br#"{"m":"no n"}"#,
        ),
        // A contract header must be text.
        (vec![("id", &[0xff, 0xfe])], br#"{"n":3}"#),
    ];
    for (headers, payload) in &records {
        produce_raw(&topic, Some(0), Some("k"), Some(payload), headers).await?;
    }
    send_event(&topic, good.parse()?, "k", r#"{"n":4}"#).await?;

    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let c1 = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), {
        let seen = Arc::clone(&seen);
        boxed(move |event: &Event<Order>, conn| {
            seen.lock().expect("lock").push(event.raw_headers.clone());
            Box::pin(record_effect(event, conn))
        })
    })?;
    let stream = stream(&topic, &unique("g"))?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (c1, shutdown) = (c1.clone(), shutdown.clone());
        async move { c1.run(stream, shutdown).await }
    });
    eventually("every message handled", WAIT, || async {
        let s = c1.stats();
        Ok(s.processed + s.quarantined == 4)
    })
    .await?;
    shutdown.cancel();
    run.await??;

    assert_eq!(
        effects(&db.pool, a.parse()?).await?,
        1,
        "processed despite its binary header"
    );
    assert_eq!(effects(&db.pool, good.parse()?).await?, 1);
    let first = seen.lock().expect("lock")[0].clone();
    assert_eq!(
        first,
        [
            ("id".to_owned(), Some(a.clone().into_bytes())),
            ("type".to_owned(), Some(b"OrderPlaced".to_vec())),
            ("bin".to_owned(), Some(binary.to_vec())),
        ],
        "the handler sees every header as received"
    );
    let rows = quarantined_rows(&db.pool).await?;
    let reasons: Vec<&str> = rows.iter().map(|(r, _, _)| r.as_str()).collect();
    assert_eq!(reasons, ["wrong_shape", "invalid_header"]);
    assert_eq!(
        rows[0].2,
        serde_json::json!({"id": b, "bin": {"hex": "ff00c3"}, "x": "text"})
    );
    assert_eq!(rows[1].2, serde_json::json!({"id": {"hex": "fffe"}}));

    // What `outbox quarantine requeue` sends back: the received headers, bytes intact.
    let mut conn = db.pool.acquire().await?;
    let listed =
        outbox_consumer::quarantine::list_quarantined(&mut conn, &Default::default(), 10).await?;
    let mut headers = listed[0].record_headers()?;
    headers.sort();
    assert_eq!(
        headers,
        [
            ("bin".to_owned(), Some(binary.to_vec())),
            ("id".to_owned(), Some(b.clone().into_bytes())),
            ("x".to_owned(), Some(b"text".to_vec())),
        ]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_database_rejects_is_quarantined_and_the_partition_flows() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    // Checked at COMMIT, not at the INSERT: the handler itself succeeds every time.
    sqlx::query("CREATE TABLE claims (k TEXT UNIQUE DEFERRABLE INITIALLY DEFERRED)")
        .execute(&db.pool)
        .await?;
    sqlx::query("INSERT INTO claims VALUES ('taken')")
        .execute(&db.pool)
        .await?;
    let topic = random_topic(1).await?;
    let (rejected, accepted) = (EventId::new(), EventId::new());
    send_event(&topic, rejected, "taken", r#"{"n":1}"#).await?;
    send_event(&topic, accepted, "free", r#"{"n":2}"#).await?;

    let config = ConsumerConfig::new("c1")
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    async fn claim(event: &Event<Order>, conn: &mut PgConnection) -> Result<(), HandlerError> {
        record_effect(event, conn).await?;
        sqlx::query("INSERT INTO claims VALUES ($1)")
            .bind(&event.key)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
    let c1 = DedupConsumer::new(db.pool.clone(), config, claim)?;
    let stream = stream(&topic, &unique("g"))?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (c1, shutdown) = (c1.clone(), shutdown.clone());
        async move { c1.run(stream, shutdown).await }
    });
    eventually(
        "the rejected message quarantined, the next one processed",
        Duration::from_secs(30),
        || async {
            let s = c1.stats();
            Ok(s.quarantined == 1 && s.processed == 1)
        },
    )
    .await?;
    shutdown.cancel();
    run.await??;

    assert_eq!(
        c1.stats().handler_errors,
        3,
        "each rejected COMMIT is an attempt"
    );
    assert_eq!(effects(&db.pool, rejected).await?, 0, "rolled back");
    assert_eq!(effects(&db.pool, accepted).await?, 1);
    let (reason, event_id, error): (String, Option<EventId>, String) =
        sqlx::query_as("SELECT reason, event_id, error FROM outbox_consumer_quarantine")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(
        (reason.as_str(), event_id),
        ("commit_failed", Some(rejected))
    );
    assert!(
        error.starts_with("after 3 attempts: ") && error.contains("SQLSTATE 23505"),
        "{error}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_backing_off_gives_its_turn_to_the_others() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(2).await?;
    let (failing, fine) = (EventId::new().to_string(), EventId::new());
    let contract = |id: &str| {
        vec![
            ("id", id.as_bytes().to_vec()),
            ("type", b"OrderPlaced".to_vec()),
        ]
    };
    let headers = contract(&failing);
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    produce_raw(
        &topic,
        Some(0),
        Some("a"),
        Some(br#"{"n":1,"fail":true}"#),
        &headers,
    )
    .await?;

    // One turn, and a message that fails for as long as the test runs.
    let config = ConsumerConfig::new("c1")
        .max_concurrent_partitions(1)
        .on_handler_failure(HandlerFailurePolicy::Block)
        .backoff(Duration::from_millis(200), Duration::from_millis(200));
    let c1 = consumer(&db, config)?;
    let (shutdown, run) = spawn_run(&c1, &topic, &unique("g"))?;
    eventually("partition 0 is retrying", WAIT, || async {
        Ok(c1.stats().handler_errors >= 2)
    })
    .await?;

    let headers = contract(&fine.to_string());
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    produce_raw(&topic, Some(1), Some("b"), Some(br#"{"n":2}"#), &headers).await?;
    eventually(
        "partition 1 handled while partition 0 backs off",
        Duration::from_secs(30),
        || async { Ok(c1.stats().processed == 1) },
    )
    .await?;
    let errors = c1.stats().handler_errors;
    eventually("partition 0 still retrying", WAIT, || async {
        Ok(c1.stats().handler_errors > errors)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(effects(&db.pool, fine).await?, 1);
    assert_eq!(c1.stats().quarantined, 0, "Block never quarantines");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_consumer_error_ends_run_with_a_typed_error() -> Result<()> {
    let db = db_for("c1").await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let id = EventId::new();
    send_event(&topic, id, "k", r#"{"n":1}"#).await?;
    let mut kafka = consumer_config(&kafka_bootstrap(), &unique("g"));
    kafka
        .set("group.instance.id", unique("member"))
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500");
    let first = stream_consumer(&kafka)?;
    first.subscribe(&[topic.as_str()])?;
    let c1 = consumer(&db, ConsumerConfig::new("c1"))?;
    let run = tokio::spawn({
        let c1 = c1.clone();
        async move { c1.run(first, CancellationToken::new()).await }
    });
    eventually("the first member is consuming", WAIT, || async {
        Ok(c1.stats().processed == 1)
    })
    .await?;

    // A second member with the same static identity fences the first: librdkafka reports a
    // fatal error to it, after which it fetches nothing.
    let second = Arc::new(stream_consumer(&kafka)?);
    second.subscribe(&[topic.as_str()])?;
    let polling = tokio::spawn({
        let second = Arc::clone(&second);
        async move {
            loop {
                let _ = second.recv().await;
            }
        }
    });
    let ended = tokio::time::timeout(WAIT, run).await;
    polling.abort();
    let _ = polling.await;
    tokio::task::spawn_blocking(move || drop(second)).await?;
    let ended = ended.map_err(|_| anyhow::anyhow!("run went on after a fatal error"))??;
    assert!(
        matches!(ended, Err(ConsumerError::KafkaFatal { .. })),
        "{ended:?}"
    );
    assert_eq!(effects(&db.pool, id).await?, 1);
    Ok(())
}
