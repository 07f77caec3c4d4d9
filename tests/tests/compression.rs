//! Every codec Kafka has (gzip, snappy, lz4, zstd) reaches the consumer: records compressed by
//! Kafka's own Java producer, by the relay with each `compression.type`, and recompressed by a
//! broker whose topic sets `compression.type=zstd`. Each record is handled exactly once and
//! nothing is quarantined. Real Postgres and Apache Kafka.
//!
//! A batch librdkafka cannot decompress never reaches the application (librdkafka reports an
//! error for it instead of records, and the partition's fetch position stays before it), so
//! a codec missing from the build stalls the partition: these tests fail on such a build.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Result, ensure};
use outbox_consumer::{ConsumerConfig, Event, consumer_config, dedup_consume};
use outbox_core::EventId;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{
    JavaRecord, TestDb, count_status, eventually, java_produce, kafka_bootstrap, random_topic,
    unique,
};
use serde::Deserialize;
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// Every compression codec of the Kafka protocol.
const CODECS: [&str; 4] = ["gzip", "snappy", "lz4", "zstd"];
/// Records per codec: several per record batch, on several keys.
const PER_CODEC: usize = 20;
/// How long the consumer gets to handle everything.
const HANDLED_WITHIN: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect must show as a second row.
    sqlx::query("CREATE TABLE effects (event_id UUID, topic TEXT, n BIGINT)")
        .execute(pool)
        .await?;
    Ok(())
}

async fn record(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id, topic, n) VALUES ($1, $2, $3)")
        .bind(event.id)
        .bind(&event.topic)
        .bind(event.payload.n)
        .execute(conn)
        .await?;
    Ok(())
}

/// A topic whose broker (re)compresses every batch with `codec`, whatever the producer sent.
async fn topic_compressed_by_the_broker(codec: &str) -> Result<String> {
    let topic = unique("outbox.test");
    outbox_tests::create_topic_with(&topic, 1, &[("compression.type", codec)]).await?;
    Ok(topic)
}

/// Runs a consumer on `topics` until every event of `expected` (id, what it is) has its
/// effect, then checks that each has exactly one and nothing was quarantined. A failure names
/// the events never handled, by what they are.
async fn consume_all(db: &TestDb, topics: &[String], expected: &[(EventId, String)]) -> Result<()> {
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(
        dedup_consume(
            &consumer_config(&kafka_bootstrap(), &unique("g")),
            db.pool.clone(),
            record,
        )
        .topics(topics.to_vec())
        .config(ConsumerConfig::new("c1"))
        .run(shutdown.clone()),
    );
    let total = expected.len() as i64;
    let waited = eventually("every record has its effect", HANDLED_WITHIN, || async {
        let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT event_id) FROM effects")
            .fetch_one(&db.pool)
            .await?;
        Ok(distinct >= total)
    })
    .await;
    shutdown.cancel();
    running.await??;
    let handled: BTreeSet<uuid::Uuid> = sqlx::query_scalar("SELECT event_id FROM effects")
        .fetch_all(&db.pool)
        .await?
        .into_iter()
        .collect();
    let missing: BTreeSet<&str> = expected
        .iter()
        .filter(|(id, _)| !handled.contains(id.as_uuid()))
        .map(|(_, what)| what.as_str())
        .collect();
    ensure!(missing.is_empty(), "never handled: records of {missing:?}");
    waited?;
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!((effects, distinct), (total, total), "one effect per record");
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(quarantined, 0);
    Ok(())
}

/// Records Kafka's Java producer compressed with each codec (as Java services, Kafka Connect
/// and Debezium send when configured to), one topic per codec so a codec that fails stalls
/// only its own: the consumer handles every one once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_a_java_producer_compressed_with_each_codec_are_handled_once() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let (mut topics, mut records, mut expected) = (Vec::new(), Vec::new(), Vec::new());
    for codec in CODECS {
        let topic = random_topic(1).await?;
        for n in 0..PER_CODEC {
            let id = EventId::new();
            records.push(JavaRecord {
                compression: codec.to_owned(),
                topic: topic.clone(),
                key: format!("k{}", n % 3),
                id: id.to_string(),
                value: json!({ "n": n }).to_string(),
            });
            expected.push((id, format!("java {codec}")));
        }
        topics.push(topic);
    }
    java_produce(&records).await?;
    consume_all(&db, &topics, &expected).await
}

/// The relay publishes with each `compression.type` its producer may be given, both to a
/// plain topic (the batch stays as the relay compressed it) and to a topic whose broker
/// recompresses every batch with zstd: the consumer handles every row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_with_each_codec_and_through_a_zstd_topic_to_the_consumer() -> Result<()>
{
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let zstd_topic = topic_compressed_by_the_broker("zstd").await?;
    let mut topics = vec![zstd_topic.clone()];
    let mut expected = Vec::new();
    for codec in CODECS {
        let topic = random_topic(1).await?;
        let mut events = Vec::new();
        for n in 0..PER_CODEC {
            for (to, what) in [(&topic, "relay"), (&zstd_topic, "zstd topic from relay")] {
                let key = format!("{codec}-{}", n % 3);
                let event = NewEvent::new("order", &key, "Step", &json!({ "n": n }))?
                    .with_topic(to.as_str())?;
                expected.push((event.id(), format!("{what} {codec}")));
                events.push(event);
            }
        }
        let mut tx = db.pool.begin().await?;
        outbox_producer::enqueue_all(&mut tx, &events).await?;
        tx.commit().await?;
        let mut kafka = producer_config(&kafka_bootstrap());
        kafka.set("compression.type", codec);
        let relay = Relay::new(
            db.pool.clone(),
            &kafka,
            RelayConfig::default().listen(false),
        )?;
        let report = relay.run_once().await?;
        assert_eq!(report.published, events.len(), "{codec}: {report:?}");
        topics.push(topic);
    }
    assert_eq!(
        count_status(&db.pool, "published").await?,
        expected.len() as i64
    );
    consume_all(&db, &topics, &expected).await
}
