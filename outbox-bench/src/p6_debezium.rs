//! P6: the relay against Debezium's Outbox Event Router, side by side on the same outbox
//! table, broker and machine.
//!
//! Throughput: a backlog of committed rows, timed from the start of `Relay::run` (or from the
//! paused connector's resume request) until the topic's high watermarks add up to the backlog,
//! i.e. until the broker has acknowledged every record (`acks=all` for both producers).
//! Latency: a writer commits 10 rows every 10 ms (1,000 events/s) and a plain rdkafka consumer
//! (assigned to every partition, no group) records when each id arrives; latency is arrival
//! minus the instant the commit returned, both on this process's monotonic clock.
//!
//! Debezium runs with `outbox_tests::outbox_connector_config` in `PayloadMode::Text` (the
//! value is the payload column's text, byte for byte what the relay sends) and Debezium's and
//! Kafka Connect's defaults otherwise (`poll.interval.ms` 500, `max.batch.size` 2048,
//! `max.queue.size` 8192; the worker's producer as Kafka Connect configures it). The latency
//! part also runs Debezium with `poll.interval.ms=10` ([`FAST_POLL_MS`]): at the default,
//! Debezium waits up to 500 ms twice (no message pending; batch not full), a latency the
//! relay's NOTIFY wake-up does not have, so the default alone would compare a setting.
//!
//! While paused for the backlog, Debezium keeps reading the slot into its queue (up to
//! `max.queue.size` records), so up to 8192 of the backlog's change events are decoded before
//! its clock starts; the relay's clock starts with nothing read.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use outbox_producer::NewEvent;
use outbox_tests::{OutboxConnector, PayloadMode, TestDb, kafka_bootstrap, random_topic, unique};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::p2_relay::{fill, payload, relay};
use crate::sample::{Figure, Sample, percentile};

const PARTITIONS: i32 = 4;
const KEYS: usize = 1_000;
/// The writer's pace: `PER_TICK` rows in one transaction every `TICK` (1,000 events/s).
const TICK: Duration = Duration::from_millis(10);
const PER_TICK: usize = 10;
/// Bound on a drain or on the last events' arrival.
const TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Publisher {
    /// `Relay::run` as deployed: default producer config, LISTEN/NOTIFY wake-up.
    Relay,
    /// A Debezium Postgres connector with the Outbox Event Router, its own slot.
    Debezium,
    /// The same with `poll.interval.ms` = [`FAST_POLL_MS`] (latency only).
    DebeziumFastPoll,
}

/// Debezium's `poll.interval.ms` in the fast-poll variant. The default (500 ms) is both how
/// long the streaming loop sleeps when the slot has nothing pending and how long the task's
/// poll waits for a full batch (`max.batch.size`), which 1,000 events/s never fills.
const FAST_POLL_MS: &str = "10";

/// Creates and starts the connector `publisher` names on `db`'s outbox.
async fn start_connector(db: &TestDb, publisher: Publisher) -> Result<OutboxConnector> {
    let mut connector = OutboxConnector::new(db, PayloadMode::Text);
    if publisher == Publisher::DebeziumFastPoll {
        connector
            .config
            .push(("poll.interval.ms".into(), FAST_POLL_MS.into()));
    }
    // On failure, dropping `connector` removes whatever was created.
    connector.launch().await?;
    Ok(connector)
}

fn client(group: &str) -> Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("group.id", unique(group))
        .set("enable.auto.commit", "false")
        .create()?)
}

/// Waits (probing every 10 ms) until `topic`'s high watermarks add up to `n` records;
/// returns the instant it saw them.
async fn records_in_topic(topic: &str, n: usize) -> Result<Instant> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let client = client("p6-watermarks")?;
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let mut total = 0;
            for p in 0..PARTITIONS {
                let (low, high) = client.fetch_watermarks(&topic, p, Duration::from_secs(10))?;
                total += high - low;
            }
            if total >= n as i64 {
                ensure!(
                    total == n as i64,
                    "{total} records in {topic}, expected {n}"
                );
                return Ok(Instant::now());
            }
            if Instant::now() >= deadline {
                bail!("{total} of {n} records in {topic} after {TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await?
}

/// Deletes `topics` (best effort: a leftover topic costs nothing but disk).
async fn drop_topics(topics: &[&str]) {
    let deleted = async {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", kafka_bootstrap())
            .create()?;
        admin
            .delete_topics(
                topics,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        anyhow::Ok(())
    };
    if let Err(error) = deleted.await {
        eprintln!("P6: deleting topics {topics:?}: {error:#}");
    }
}

/// Closes the round's pool and drops its schema.
async fn drop_db(db: TestDb) -> Result<()> {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {} CASCADE",
        db.schema
    )))
    .execute(&db.pool)
    .await?;
    db.pool.close().await;
    Ok(())
}

/// Events per second from the start of the drain to the last record acknowledged.
async fn backlog_rate(publisher: Publisher, settings: &Settings) -> Result<f64> {
    let events = settings.events;
    let db = TestDb::new().await?;
    let topic = random_topic(PARTITIONS).await?;
    let mut heartbeat = None;
    let outcome = match publisher {
        Publisher::Relay => {
            let relay = relay(&db.pool, settings)?;
            fill(&db.pool, &topic, events).await?;
            let started = Instant::now();
            let shutdown = CancellationToken::new();
            let running = tokio::spawn({
                let (relay, shutdown) = (relay.clone(), shutdown.clone());
                async move { relay.run(shutdown).await }
            });
            let seen = records_in_topic(&topic, events).await;
            shutdown.cancel();
            running.await??;
            seen.map(|done| done - started)
        }
        Publisher::Debezium | Publisher::DebeziumFastPoll => {
            let mut connector = start_connector(&db, publisher).await?;
            heartbeat = Some(format!("__debezium-heartbeat.{}", connector.name));
            let timed = async {
                connector.pause().await?;
                fill(&db.pool, &topic, events).await?;
                let started = Instant::now();
                connector.resume().await?;
                Ok(records_in_topic(&topic, events).await? - started)
            }
            .await;
            let stopped = connector.stop().await;
            timed.and_then(|t| stopped.map(|()| t))
        }
    };
    let mut topics = vec![topic.as_str()];
    topics.extend(heartbeat.as_deref());
    drop_topics(&topics).await;
    drop_db(db).await?;
    Ok(events as f64 / outcome?.as_secs_f64())
}

/// Reads `topic` from the beginning of every partition until `stop`, recording when each id
/// (the `id` header) arrived.
fn spawn_reader(
    topic: &str,
    seen: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Result<HashMap<uuid::Uuid, Instant>>> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer = client("p6-reader")?;
        let mut assignment = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            assignment.add_partition_offset(&topic, p, Offset::Beginning)?;
        }
        consumer.assign(&assignment)?;
        let mut arrivals = HashMap::new();
        while !stop.load(Ordering::Acquire) {
            let Some(message) = consumer.poll(Duration::from_millis(50)) else {
                continue;
            };
            let at = Instant::now();
            let message = message?;
            let id = message
                .headers()
                .and_then(|hs| hs.iter().find(|h| h.key == "id"))
                .and_then(|h| h.value)
                .context("a record without an id header")?;
            let id = std::str::from_utf8(id)?.trim_matches('"').parse()?;
            arrivals.entry(id).or_insert(at);
            seen.store(arrivals.len(), Ordering::Release);
        }
        Ok(arrivals)
    })
}

async fn commit(db: &TestDb, events: &[NewEvent]) -> Result<()> {
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(())
}

async fn await_seen(seen: &AtomicUsize, n: usize, what: &str) -> Result<()> {
    outbox_tests::eventually(what, TIMEOUT, || async {
        Ok(seen.load(Ordering::Acquire) >= n)
    })
    .await
}

/// Commit -> consumer latencies (ms) over `settings.duration` at 1,000 events/s, after one
/// warm-up event has gone through.
async fn measure_latencies(db: &TestDb, topic: &str, settings: &Settings) -> Result<Vec<f64>> {
    let (seen, stop) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let reader = spawn_reader(topic, seen.clone(), stop.clone());
    let measured = async {
        let warmup =
            NewEvent::new("invoice", "warmup", "Decided", &payload(0))?.with_topic(topic)?;
        commit(db, std::slice::from_ref(&warmup)).await?;
        await_seen(&seen, 1, "the warm-up event arrives").await?;

        let mut committed = Vec::new();
        let mut ticker = tokio::time::interval(TICK);
        // Burst (the default): a late tick is caught up, so the rate stays 1,000/s on average.
        let deadline = Instant::now() + settings.duration;
        let mut n = 0;
        while Instant::now() < deadline {
            ticker.tick().await;
            let batch = (n..n + PER_TICK)
                .map(|i| {
                    Ok(
                        NewEvent::new("invoice", format!("k{}", i % KEYS), "Decided", &payload(i))?
                            .with_topic(topic)?,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            commit(db, &batch).await?;
            let at = Instant::now();
            committed.extend(batch.iter().map(|e| (*e.id().as_uuid(), at)));
            n += PER_TICK;
        }
        await_seen(&seen, committed.len() + 1, "every event arrives").await?;
        anyhow::Ok(committed)
    }
    .await;
    stop.store(true, Ordering::Release);
    let arrivals = reader.await??;
    let committed = measured?;
    committed
        .iter()
        .map(|(id, at)| {
            let arrived = arrivals.get(id).context("an event never arrived")?;
            Ok(arrived.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect()
}

async fn latencies(publisher: Publisher, settings: &Settings) -> Result<Vec<f64>> {
    let db = TestDb::new().await?;
    let topic = random_topic(PARTITIONS).await?;
    let mut heartbeat = None;
    let outcome = match publisher {
        Publisher::Relay => {
            let relay = relay(&db.pool, settings)?;
            let shutdown = CancellationToken::new();
            let running = tokio::spawn({
                let (relay, shutdown) = (relay.clone(), shutdown.clone());
                async move { relay.run(shutdown).await }
            });
            let measured = measure_latencies(&db, &topic, settings).await;
            shutdown.cancel();
            running.await??;
            measured
        }
        Publisher::Debezium | Publisher::DebeziumFastPoll => {
            let mut connector = start_connector(&db, publisher).await?;
            heartbeat = Some(format!("__debezium-heartbeat.{}", connector.name));
            let measured = measure_latencies(&db, &topic, settings).await;
            let stopped = connector.stop().await;
            measured.and_then(|m| stopped.map(|()| m))
        }
    };
    let mut topics = vec![topic.as_str()];
    topics.extend(heartbeat.as_deref());
    drop_topics(&topics).await;
    drop_db(db).await?;
    outcome
}

/// Fails if a replication slot of this database is left (every connector drops its own).
async fn no_slot_left() -> Result<()> {
    let mut conn = PgConnection::connect(&outbox_tests::database_url()).await?;
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT slot_name::text FROM pg_replication_slots WHERE database = current_database()",
    )
    .fetch_all(&mut conn)
    .await?;
    conn.close().await?;
    ensure!(left.is_empty(), "replication slots left behind: {left:?}");
    Ok(())
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let [mut relay_rate, mut debezium_rate]: [Sample; 2] = Default::default();
    for round in 0..settings.rounds {
        relay_rate.push(backlog_rate(Publisher::Relay, settings).await?);
        debezium_rate.push(backlog_rate(Publisher::Debezium, settings).await?);
        eprintln!(
            "P6 round {round}: backlog of {} drained by the relay {:.0}, by Debezium {:.0} events/s",
            settings.events, relay_rate.values[round], debezium_rate.values[round]
        );
    }
    let (mut relay_runs, mut debezium_runs, mut fast_runs) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..settings.rounds {
        relay_runs.push(latencies(Publisher::Relay, settings).await?);
        debezium_runs.push(latencies(Publisher::Debezium, settings).await?);
        fast_runs.push(latencies(Publisher::DebeziumFastPoll, settings).await?);
        let p = |runs: &[Vec<f64>]| {
            format!(
                "{:.1}/{:.1}",
                percentile(&runs[round], 0.5),
                percentile(&runs[round], 0.99)
            )
        };
        eprintln!(
            "P6 round {round}: commit->consumer p50/p99 relay {} ms, Debezium {} ms, Debezium poll.interval.ms={FAST_POLL_MS} {} ms ({} events each)",
            p(&relay_runs),
            p(&debezium_runs),
            p(&fast_runs),
            relay_runs[round].len(),
        );
    }
    no_slot_left().await?;
    let mut figures = vec![Figure::at_least(
        "P6",
        "Debezium outbox router: backlog -> acked",
        "ev/s",
        debezium_rate,
        "relay (Relay::run), same backlog",
        relay_rate,
        None,
    )];
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let per_round = |runs: &[Vec<f64>]| Sample {
            values: runs.iter().map(|r| percentile(r, q)).collect(),
        };
        figures.push(Figure::at_most(
            "P6",
            format!("commit->consumer {name}, Debezium, 1k ev/s"),
            "ms",
            per_round(&debezium_runs),
            "relay, NOTIFY",
            per_round(&relay_runs),
            None,
        ));
    }
    for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
        let per_round = |runs: &[Vec<f64>]| Sample {
            values: runs.iter().map(|r| percentile(r, q)).collect(),
        };
        figures.push(Figure::at_most(
            "P6",
            format!("commit->consumer {name}, Debezium poll {FAST_POLL_MS} ms"),
            "ms",
            per_round(&fast_runs),
            "relay, NOTIFY",
            per_round(&relay_runs),
            None,
        ));
    }
    Ok(figures)
}
