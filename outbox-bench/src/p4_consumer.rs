//! P4: `dedup_consume` against a plain consumer running the same handler, and the two
//! duplicate paths (in-memory cache vs dedup table).

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use futures::future::try_join_all;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, DedupContext, Event, Handler, Outcome, consumer_config,
    stream_consumer,
};
use outbox_core::EventId;
use outbox_producer::producer_config;
use outbox_tests::{TestDb, eventually, kafka_bootstrap, random_topic, unique};
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::sample::{Figure, Sample};

const PARTITIONS: i32 = 4;

/// The handler both variants run: one insert on the given transaction.
pub(crate) async fn effect(
    event: &Event<serde_json::Value>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    insert_effect(conn, &event.key).await
}

async fn insert_effect(conn: &mut PgConnection, key: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(key)
        .execute(conn)
        .await?;
    Ok(())
}

/// The table the handler writes.
pub(crate) async fn create_effects(pool: &PgPool) -> Result<()> {
    sqlx::query(
        "CREATE TABLE effects (key TEXT, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Effects per second between the first and the last effect (excludes the group join).
async fn effect_rate(pool: &PgPool, expected: i64) -> Result<f64> {
    eventually(
        "every message has its effect",
        Duration::from_secs(300),
        || async {
            Ok(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects")
                .fetch_one(pool)
                .await?
                >= expected)
        },
    )
    .await?;
    let seconds: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM max(at) - min(at))::float8 FROM effects")
            .fetch_one(pool)
            .await?;
    Ok((expected - 1) as f64 / seconds.max(1e-6))
}

fn stream(topic: &str) -> Result<StreamConsumer<DedupContext>> {
    let consumer = stream_consumer(&consumer_config(&kafka_bootstrap(), &unique("bench")))?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}

async fn dedup_rate(db: &TestDb, topic: &str, events: i64) -> Result<f64> {
    sqlx::query("TRUNCATE effects").execute(&db.pool).await?;
    let config = ConsumerConfig::new(unique("dedup")).max_concurrent_partitions(1);
    let consumer = DedupConsumer::new(db.pool.clone(), config, effect)?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (consumer, shutdown, stream) = (consumer.clone(), shutdown.clone(), stream(topic)?);
        async move { consumer.run(stream, shutdown).await }
    });
    let rate = effect_rate(&db.pool, events).await?;
    shutdown.cancel();
    running.await??;
    Ok(rate)
}

/// The baseline: receive, run the handler in its own transaction, store the offset.
async fn plain_rate(db: &TestDb, topic: &str, events: i64) -> Result<f64> {
    sqlx::query("TRUNCATE effects").execute(&db.pool).await?;
    let consumer = stream(topic)?;
    for _ in 0..events {
        let message = consumer.recv().await?;
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let mut tx = db.pool.begin().await?;
        insert_effect(&mut tx, &key).await?;
        tx.commit().await?;
        consumer.store_offset_from_message(&message)?;
    }
    effect_rate(&db.pool, events).await
}

fn message(n: i64) -> OwnedMessage {
    let id = EventId::new().to_string();
    let headers = OwnedHeaders::new().insert(Header {
        key: "id",
        value: Some(&id),
    });
    OwnedMessage::new(
        Some(format!(r#"{{"n":{n}}}"#).into_bytes()),
        Some(b"k".to_vec()),
        "t".into(),
        Timestamp::NotAvailable,
        0,
        n,
        Some(headers),
    )
}

/// Duplicates handled per second by `consumer` over `messages` already seen.
async fn duplicate_rate<H: Handler<serde_json::Value>>(
    consumer: &DedupConsumer<serde_json::Value, H>,
    messages: &[OwnedMessage],
    expect: &Outcome,
) -> Result<f64> {
    let none = CancellationToken::new();
    let started = Instant::now();
    for m in messages {
        let outcome = consumer.process(m, &none).await?;
        ensure!(outcome == *expect, "expected {expect:?}, got {outcome:?}");
    }
    Ok(messages.len() as f64 / started.elapsed().as_secs_f64())
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let events = (settings.events / 4) as i64;
    let db = TestDb::new().await?;
    create_effects(&db.pool).await?;
    let topic = random_topic(PARTITIONS).await?;
    let producer: FutureProducer = producer_config(&kafka_bootstrap()).create()?;
    let records: Vec<(String, String, String)> = (0..events)
        .map(|n| {
            (
                format!("k{}", n % 100),
                format!(r#"{{"n":{n}}}"#),
                EventId::new().to_string(),
            )
        })
        .collect();
    try_join_all(records.iter().map(|(key, payload, id)| {
        let headers = OwnedHeaders::new().insert(Header {
            key: "id",
            value: Some(id),
        });
        producer.send(
            FutureRecord::to(&topic)
                .key(key)
                .payload(payload)
                .headers(headers),
            Duration::from_secs(30),
        )
    }))
    .await
    .map_err(|(e, _)| e)?;

    let (mut dedup, mut plain) = (Sample::default(), Sample::default());
    let (mut cached, mut stored) = (Sample::default(), Sample::default());
    let messages: Vec<OwnedMessage> = (0..2_000).map(message).collect();
    for round in 0..settings.rounds {
        dedup.push(dedup_rate(&db, &topic, events).await?);
        plain.push(plain_rate(&db, &topic, events).await?);

        let name = unique("dup");
        let warm = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new(&name), effect)?;
        duplicate_rate(&warm, &messages, &Outcome::Processed).await?;
        cached.push(duplicate_rate(&warm, &messages, &Outcome::DuplicateCached).await?);
        let cold = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new(&name), effect)?;
        stored.push(duplicate_rate(&cold, &messages, &Outcome::DuplicateStored).await?);
        eprintln!(
            "P4 round {round}: dedup {:.0}, plain {:.0} msg/s; duplicates: cache {:.0}, table {:.0} per s",
            dedup.values[round], plain.values[round], cached.values[round], stored.values[round]
        );
    }
    Ok(vec![
        Figure::at_least(
            "P4",
            "dedup_consume, new ids (1 partition at a time)",
            "msg/s",
            dedup,
            "plain consumer, same handler",
            plain,
            Some(0.8),
        ),
        Figure::at_least(
            "P4",
            "duplicate via moka cache",
            "msg/s",
            cached,
            "duplicate via dedup table",
            stored,
            Some(10.0),
        ),
    ])
}
