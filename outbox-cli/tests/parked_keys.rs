//! `HandlerFailurePolicy::ParkKey` from outside: a real broker, a running consumer, the
//! `outbox parked` command. A record given up on parks its key; the key's later records are
//! parked in order while the partition's other keys flow; a restart keeps the key parked;
//! `outbox parked release` replays the key's records through the handler in offset order,
//! each once, and `outbox parked skip` drops the head, audited, and replays the rest.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, HandlerError, HandlerFailurePolicy, consumer_config,
    stream_consumer,
};
use outbox_core::EventId;
use outbox_tests::{TestDb, eventually, kafka_bootstrap, random_topic, unique};
use rdkafka::ClientConfig;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Deserialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

/// Runs `outbox` with `args` on the test's schema; its stdout, or an error with its stderr.
fn outbox(db: &TestDb, args: &[&str]) -> Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_BACKTRACE", "0")
        .output()?;
    ensure!(
        out.status.success(),
        "outbox {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// Sends `records` (key, payload) to partition 0 of `topic`, in this order.
async fn send(topic: &str, records: &[(String, String)]) -> Result<()> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;
    let sends = records.iter().map(|(key, payload)| {
        let producer = &producer;
        async move {
            let id = EventId::new().to_string();
            let headers = OwnedHeaders::new().insert(Header {
                key: "id",
                value: Some(id.as_bytes()),
            });
            producer
                .send(
                    FutureRecord::to(topic)
                        .partition(0)
                        .key(key)
                        .payload(payload)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
        }
    });
    futures::future::try_join_all(sends).await?;
    Ok(())
}

fn step(key: &str, n: i64) -> (String, String) {
    (key.to_owned(), format!(r#"{{"n":{n}}}"#))
}

/// A consumer of `topic` under `ParkKey` whose handler records each effect in order (`seq`)
/// and fails every record of key `K` numbered 0 while `poison` is set.
fn start(
    db: &TestDb,
    topic: &str,
    group: &str,
    poison: &Arc<AtomicBool>,
    stop: &CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>> {
    start_with(
        db,
        topic,
        group,
        poison,
        stop,
        HandlerFailurePolicy::ParkKey,
    )
}

fn start_with(
    db: &TestDb,
    topic: &str,
    group: &str,
    poison: &Arc<AtomicBool>,
    stop: &CancellationToken,
    policy: HandlerFailurePolicy,
) -> Result<tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>> {
    let poison = poison.clone();
    let consumer = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("billing")
            .on_handler_failure(policy)
            .max_attempts(2)
            .backoff(Duration::from_millis(1), Duration::from_millis(10)),
        outbox_consumer::boxed(move |event: &Event<Step>, conn| {
            let failing = poison.load(Ordering::SeqCst) && event.key == "K" && event.payload.n == 0;
            Box::pin(async move {
                if failing {
                    return Err(HandlerError::retry("the API rejects K0 for now"));
                }
                sqlx::query("INSERT INTO effects (event_id, key, n) VALUES ($1, $2, $3)")
                    .bind(event.id)
                    .bind(&event.key)
                    .bind(event.payload.n)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }),
    )?;
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), group))?;
    stream.subscribe(&[topic])?;
    let stop = stop.clone();
    Ok(tokio::spawn(
        async move { consumer.run(stream, stop).await },
    ))
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect shows as a second row.
    sqlx::query(
        "CREATE TABLE effects (seq BIGINT GENERATED ALWAYS AS IDENTITY, event_id UUID, \
         key TEXT, n BIGINT)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

async fn count(pool: &PgPool, sql: &'static str) -> Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(pool).await?)
}

/// K's effects, `n` in the order they committed.
async fn effects_of_k(pool: &PgPool) -> Result<Vec<i64>> {
    Ok(
        sqlx::query_scalar("SELECT n FROM effects WHERE key = 'K' ORDER BY seq")
            .fetch_all(pool)
            .await?,
    )
}

const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_given_up_on_is_parked_in_order_and_released_by_the_cli() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let group = unique("parked");
    let poison = Arc::new(AtomicBool::new(true));
    let stop = CancellationToken::new();
    let running = start(&db, &topic, &group, &poison, &stop)?;

    // K0 fails its attempts and parks K; K's 50 later records come among 10,000 of other keys.
    send(&topic, &[step("K", 0)]).await?;
    let mut records = Vec::new();
    for i in 0..10_000 {
        records.push(step(&format!("o{}", i % 100), i));
        if i % 200 == 199 {
            records.push(step("K", i / 200 + 1));
        }
    }
    send(&topic, &records).await?;
    eventually("the other keys' 10,000 records handled", WAIT, || async {
        Ok(count(&db.pool, "SELECT count(*) FROM effects WHERE key <> 'K'").await? == 10_000)
    })
    .await?;
    eventually("K's 51 records parked", WAIT, || async {
        Ok(count(
            &db.pool,
            "SELECT count(*) FROM outbox_consumer_quarantine_parked",
        )
        .await?
            == 51)
    })
    .await?;
    ensure!(effects_of_k(&db.pool).await?.is_empty(), "K waits");
    let quarantined = count(&db.pool, "SELECT count(*) FROM outbox_consumer_quarantine").await?;
    ensure!(quarantined == 0, "nothing quarantined: {quarantined}");
    let listed = outbox(&db, &["parked", "list"])?;
    ensure!(
        listed.contains("key=K\trecords=51") && listed.contains("handler_failed"),
        "{listed}"
    );

    // A restart finds K parked: its next record is parked too, not handled.
    stop.cancel();
    running.await??;
    let stop = CancellationToken::new();
    let running = start(&db, &topic, &group, &poison, &stop)?;
    send(&topic, &[step("K", 51), step("after", 0)]).await?;
    eventually(
        "the restarted consumer handles the other key",
        WAIT,
        || async {
            Ok(count(&db.pool, "SELECT count(*) FROM effects WHERE key = 'after'").await? == 1)
        },
    )
    .await?;
    let parked = count(
        &db.pool,
        "SELECT count(*) FROM outbox_consumer_quarantine_parked",
    )
    .await?;
    ensure!(
        parked == 52,
        "K51 parked behind K0 after the restart: {parked}"
    );
    ensure!(effects_of_k(&db.pool).await?.is_empty(), "K still waits");

    // Fixed: the release replays K's 52 records in offset order, each once; K52, sent as the
    // release is asked for, is parked behind them or handled after them, whichever comes first.
    poison.store(false, Ordering::SeqCst);
    let released = outbox(&db, &["parked", "release", "K"])?;
    ensure!(released.contains("release of key K"), "{released}");
    send(&topic, &[step("K", 52)]).await?;
    eventually("K's 53 records handled", WAIT, || async {
        Ok(effects_of_k(&db.pool).await?.len() >= 53)
    })
    .await?;
    eventually("K unparked", WAIT, || async {
        Ok(count(
            &db.pool,
            "SELECT count(*) FROM outbox_consumer_quarantine_parked_keys",
        )
        .await?
            == 0)
    })
    .await?;
    ensure!(
        effects_of_k(&db.pool).await? == (0..=52).collect::<Vec<_>>(),
        "in offset order, each once"
    );
    let parked = count(
        &db.pool,
        "SELECT count(*) FROM outbox_consumer_quarantine_parked",
    )
    .await?;
    ensure!(parked == 0, "nothing left parked: {parked}");

    // K flows again.
    send(&topic, &[step("K", 53)]).await?;
    eventually("K's next record handled", WAIT, || async {
        Ok(effects_of_k(&db.pool).await?.len() == 54)
    })
    .await?;
    let all = count(
        &db.pool,
        "SELECT count(*) - count(DISTINCT event_id) FROM effects",
    )
    .await?;
    ensure!(all == 0, "no effect twice: {all}");
    stop.cancel();
    running.await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_drops_a_poison_head_audited_and_replays_the_rest() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let poison = Arc::new(AtomicBool::new(false));
    let stop = CancellationToken::new();
    let running = start(&db, &topic, &unique("parked"), &poison, &stop)?;
    // A record that breaks the contract parks its key at once, in the batch that reads it.
    let records = [
        ("K".to_owned(), "not json".to_owned()),
        step("K", 1),
        step("other", 0),
        step("K", 2),
    ];
    send(&topic, &records).await?;
    eventually("K's three records parked", WAIT, || async {
        Ok(count(
            &db.pool,
            "SELECT count(*) FROM outbox_consumer_quarantine_parked",
        )
        .await?
            == 3)
    })
    .await?;
    eventually("the other key handled", WAIT, || async {
        Ok(count(&db.pool, "SELECT count(*) FROM effects WHERE key = 'other'").await? == 1)
    })
    .await?;
    let (head, reason): (i64, String) = sqlx::query_as(
        "SELECT id, reason FROM outbox_consumer_quarantine_parked ORDER BY \"offset\" LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await?;
    ensure!(reason == "invalid_json", "{reason}");
    let skipped = outbox(
        &db,
        &[
            "parked",
            "skip",
            &head.to_string(),
            "--reason",
            "bad producer build",
        ],
    )?;
    ensure!(skipped.contains("dropped parked record"), "{skipped}");
    eventually("K's other records handled", WAIT, || async {
        Ok(effects_of_k(&db.pool).await? == [1, 2])
    })
    .await?;
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_quarantine_audit WHERE action = 'discard' \
         AND $1 = ANY(row_ids) AND reason = 'bad producer build' \
         AND table_name LIKE '%outbox_consumer_quarantine_parked%'",
    )
    .bind(head)
    .fetch_one(&db.pool)
    .await?;
    ensure!(audited == 1, "the skip is audited");
    eventually("K unparked", WAIT, || async {
        Ok(count(
            &db.pool,
            "SELECT count(*) FROM outbox_consumer_quarantine_parked_keys",
        )
        .await?
            == 0)
    })
    .await?;
    stop.cancel();
    running.await??;
    Ok(())
}

/// Keys parked under `ParkKey` stay parked, their records in order, after the consumer is
/// restarted under another policy, and a release still replays them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_parked_stays_parked_after_a_switch_to_another_policy() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let group = unique("parked");
    let poison = Arc::new(AtomicBool::new(true));
    let stop = CancellationToken::new();
    let running = start(&db, &topic, &group, &poison, &stop)?;
    send(&topic, &[step("K", 0), step("K", 1)]).await?;
    eventually("K's two records parked", WAIT, || async {
        Ok(count(
            &db.pool,
            "SELECT count(*) FROM outbox_consumer_quarantine_parked",
        )
        .await?
            == 2)
    })
    .await?;
    stop.cancel();
    running.await??;

    poison.store(false, Ordering::SeqCst);
    let stop = CancellationToken::new();
    let running = start_with(
        &db,
        &topic,
        &group,
        &poison,
        &stop,
        HandlerFailurePolicy::Quarantine,
    )?;
    send(&topic, &[step("K", 2), step("after", 0)]).await?;
    eventually("the other key handled", WAIT, || async {
        Ok(count(&db.pool, "SELECT count(*) FROM effects WHERE key = 'after'").await? == 1)
    })
    .await?;
    ensure!(
        effects_of_k(&db.pool).await?.is_empty(),
        "K2 waits behind K0"
    );
    outbox(&db, &["parked", "release", "K"])?;
    eventually("K's three records handled", WAIT, || async {
        Ok(effects_of_k(&db.pool).await?.len() >= 3)
    })
    .await?;
    ensure!(effects_of_k(&db.pool).await? == [0, 1, 2], "in order");
    stop.cancel();
    running.await??;
    Ok(())
}

/// `outbox parked list` also shows the outbox's keys whose pending rows wait behind a
/// quarantined row (the relay's and the dispatcher's `BlockKey`), with the row that releases
/// them; a key with nothing behind its quarantined row, or nothing quarantined, is not listed.
#[tokio::test]
async fn parked_list_shows_outbox_keys_held_behind_a_quarantined_row() -> Result<()> {
    let db = TestDb::new().await?;
    sqlx::raw_sql(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, \
                                    status, last_error) \
         SELECT gen_random_uuid(), 'agent', k, 'T', '{}', 'dispatch:billing', s, e \
         FROM (VALUES ('a1', 'quarantined', 'rejected: 422'), ('a1', 'pending', NULL), \
                      ('a1', 'pending', NULL), ('a2', 'pending', NULL), \
                      ('a3', 'quarantined', 'rejected: 400')) AS v (k, s, e)",
    )
    .execute(&db.pool)
    .await?;
    let listed = outbox(&db, &["parked", "list"])?;
    ensure!(
        listed.contains("key=a1\tpending behind=2") && listed.contains("rejected: 422"),
        "{listed}"
    );
    ensure!(
        !listed.contains("key=a2") && !listed.contains("key=a3"),
        "{listed}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&outbox(&db, &["parked", "list", "--json"])?)?;
    ensure!(json["outbox"].as_array().map(Vec::len) == Some(1), "{json}");
    ensure!(
        json["consumer"].as_array().map(Vec::len) == Some(0),
        "{json}"
    );
    Ok(())
}
