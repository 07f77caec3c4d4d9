//! P2: relay throughput against its two ceilings; P5: the same with a million retained rows.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use futures::future::try_join_all;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, kafka_bootstrap, random_topic};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::sample::{Figure, Sample};

const KEYS: usize = 1_000;
const PARTITIONS: i32 = 4;
const RETAINED: i64 = 1_000_000;

pub(crate) fn payload(n: usize) -> serde_json::Value {
    json!({ "n": n, "decision": "send_invoice", "cents": 1200, "note": "x".repeat(100) })
}

pub(crate) async fn fill(pool: &PgPool, topic: &str, events: usize) -> Result<()> {
    for start in (0..events).step_by(1_000) {
        let batch = (start..(start + 1_000).min(events))
            .map(|n| {
                Ok(
                    NewEvent::new("invoice", format!("k{}", n % KEYS), "Decided", &payload(n))?
                        .with_topic(topic)?,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mut tx = pool.begin().await?;
        outbox_producer::enqueue_all(&mut tx, &batch).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// The relay under test, with the producer configuration users get.
/// Waits until a running relay has drained the outbox. The last row drained means (near)
/// all: a primary-key probe, where scanning the pending index would wade through the entries
/// of rows published since the last vacuum; the full check follows. Probing every 2 ms instead
/// of 10 cost the relay ~15% on 2 cores; 10 ms is under 1% of a drain.
pub(crate) async fn wait_drained(pool: &PgPool) -> Result<()> {
    let last: i64 = sqlx::query_scalar("SELECT max(seq) FROM outbox_events")
        .fetch_one(pool)
        .await?;
    for probe in [
        "SELECT status = 'pending' FROM outbox_events WHERE seq = $1",
        "SELECT EXISTS (SELECT 1 FROM outbox_events WHERE status = 'pending' AND seq <= $1)",
    ] {
        while sqlx::query_scalar::<_, bool>(probe)
            .bind(last)
            .fetch_one(pool)
            .await?
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(())
}

pub(crate) fn relay(pool: &PgPool, settings: &Settings) -> Result<Relay> {
    Ok(Relay::new(
        pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default().batch_size(settings.batch_size),
    )?)
}

/// How a relay drains the outbox in a measurement.
#[derive(Debug, Clone, Copy)]
enum Drain {
    /// `Relay::run`, as deployed.
    Run,
    /// `run_once` in a loop: claim, publish, mark, one batch at a time.
    OneBatchAtATime,
    /// `run_once_without_publishing` in a loop: the claim+mark SQL alone.
    SqlOnly,
}

/// Rows per second for `relay` to empty an outbox holding `events` fresh pending rows. Each
/// measurement gets a topic of its own, so none starts on a topic the others have grown.
async fn drained_rate(pool: &PgPool, events: usize, relay: &Relay, how: Drain) -> Result<f64> {
    let topic = random_topic(PARTITIONS).await?;
    fill(pool, &topic, events).await?;
    let started = Instant::now();
    let moved = match how {
        Drain::Run => {
            let shutdown = CancellationToken::new();
            let running = tokio::spawn({
                let (relay, shutdown) = (relay.clone(), shutdown.clone());
                async move { relay.run(shutdown).await }
            });
            wait_drained(pool).await?;
            shutdown.cancel();
            running.await??;
            let unpublished: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_events WHERE status <> 'published'",
            )
            .fetch_one(pool)
            .await?;
            ensure!(unpublished == 0, "{unpublished} rows not published");
            events
        }
        Drain::OneBatchAtATime | Drain::SqlOnly => {
            let mut moved = 0;
            loop {
                let report = if matches!(how, Drain::SqlOnly) {
                    relay.run_once_without_publishing().await?
                } else {
                    relay.run_once().await?
                };
                if report.claimed == 0 {
                    break;
                }
                moved += report.published;
            }
            moved
        }
    };
    let elapsed = started.elapsed();
    ensure!(moved == events, "relay moved {moved} of {events} rows");
    Ok(events as f64 / elapsed.as_secs_f64())
}

/// Messages per second for a bare idempotent producer sending the same records from memory.
async fn raw_produce_rate(events: usize) -> Result<f64> {
    let topic = random_topic(PARTITIONS).await?;
    let producer: FutureProducer = producer_config(&kafka_bootstrap()).create()?;
    let records: Vec<(String, String, String)> = (0..events)
        .map(|n| {
            (
                format!("k{}", n % KEYS),
                payload(n).to_string(),
                uuid::Uuid::now_v7().to_string(),
            )
        })
        .collect();
    // A new producer first fetches its producer id and the topic's metadata, which took up to
    // a second here: not part of the throughput.
    producer
        .send(
            FutureRecord::<str, str>::to(&topic).payload("warm-up"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)?;
    let started = Instant::now();
    let deliveries = records.iter().map(|(key, value, id)| {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "id",
                value: Some(id),
            })
            .insert(Header {
                key: "type",
                value: Some("Decided"),
            });
        producer.send(
            FutureRecord::to(&topic)
                .key(key)
                .payload(value)
                .headers(headers),
            Duration::from_secs(30),
        )
    });
    try_join_all(deliveries).await.map_err(|(e, _)| e)?;
    Ok(events as f64 / started.elapsed().as_secs_f64())
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let events = settings.events;
    let empty = TestDb::new().await?;
    let grown = TestDb::new().await?;
    eprintln!("P5 setup: {RETAINED} published rows of history");
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, status, published_at, attempts) \
         SELECT gen_random_uuid(), 'invoice', 'k' || (g % 1000), 'Decided', '{\"n\": 0}', 'old', 'published', now(), 1 \
         FROM generate_series(1, $1) g",
    )
    .bind(RETAINED)
    .execute(&grown.pool)
    .await?;
    sqlx::query("VACUUM ANALYZE outbox_events")
        .execute(&grown.pool)
        .await?;

    let (relay_empty, relay_grown) = (relay(&empty.pool, settings)?, relay(&grown.pool, settings)?);
    let [
        mut relayed,
        mut produced,
        mut sql_only,
        mut one_at_a_time,
        mut relayed_grown,
    ]: [Sample; 5] = Default::default();
    for round in 0..settings.rounds {
        sqlx::query("TRUNCATE outbox_events")
            .execute(&empty.pool)
            .await?;
        relayed.push(drained_rate(&empty.pool, events, &relay_empty, Drain::Run).await?);
        produced.push(raw_produce_rate(events).await?);
        sqlx::query("TRUNCATE outbox_events")
            .execute(&empty.pool)
            .await?;
        sql_only.push(drained_rate(&empty.pool, events, &relay_empty, Drain::SqlOnly).await?);
        sqlx::query("TRUNCATE outbox_events")
            .execute(&empty.pool)
            .await?;
        one_at_a_time
            .push(drained_rate(&empty.pool, events, &relay_empty, Drain::OneBatchAtATime).await?);
        relayed_grown.push(drained_rate(&grown.pool, events, &relay_grown, Drain::Run).await?);
        eprintln!(
            "P2 round {round}: relay {:.0}, raw produce {:.0}, claim+mark SQL {:.0}, one batch at a time {:.0}, relay over {RETAINED} retained {:.0} events/s",
            relayed.values[round],
            produced.values[round],
            sql_only.values[round],
            one_at_a_time.values[round],
            relayed_grown.values[round]
        );
    }
    let (lower_name, lower) = if produced.median() <= sql_only.median() {
        ("raw rdkafka produce (lower ceiling)", produced.clone())
    } else {
        ("claim+mark SQL only (lower ceiling)", sql_only.clone())
    };
    let mut absolute = Figure::at_least(
        "P2",
        "relay, absolute",
        "ev/s",
        relayed.clone(),
        "20,000 events/s",
        Sample {
            values: vec![20_000.0],
        },
        Some(1.0),
    );
    absolute.target = "ratio >= 1 (20k ev/s)".into();
    Ok(vec![
        Figure::at_least(
            "P2",
            "relay: pending -> acked and marked",
            "ev/s",
            relayed.clone(),
            lower_name,
            lower,
            Some(0.7),
        ),
        Figure::at_least(
            "P2",
            "relay",
            "ev/s",
            relayed.clone(),
            "raw rdkafka produce",
            produced,
            None,
        ),
        Figure::at_least(
            "P2",
            "relay",
            "ev/s",
            relayed.clone(),
            "claim+mark SQL only",
            sql_only,
            None,
        ),
        Figure::at_least(
            "P2",
            "relay (run)",
            "ev/s",
            relayed.clone(),
            "relay, run_once in a loop",
            one_at_a_time,
            None,
        ),
        absolute,
        Figure::at_least(
            "P5",
            "relay over 1M retained published rows",
            "ev/s",
            relayed_grown,
            "relay over an empty table",
            relayed,
            Some(0.9),
        ),
    ])
}
