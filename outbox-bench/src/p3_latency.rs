//! P3: commit -> publish latency at a steady rate, woken by NOTIFY vs polling alone.

use std::time::{Duration, Instant};

use anyhow::Result;
use chrono::{DateTime, Utc};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, kafka_bootstrap, random_topic};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::sample::{Figure, Sample, percentile};

const RATE: u64 = 1_000;

/// Latencies in milliseconds from each commit returning to its row being marked published
/// (after Kafka's acknowledgement), over `settings.duration` at `RATE` events per second.
async fn latencies(listen: bool, settings: &Settings) -> Result<Vec<f64>> {
    let db = TestDb::new().await?;
    let topic = random_topic(4).await?;
    let config = RelayConfig::default()
        .listen(listen)
        .poll_interval(Duration::from_millis(100));
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        config,
    )?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    // Warm up: the first publish waits for the producer's id and the topic's metadata.
    let warmup = NewEvent::new("invoice", "warmup", "Decided", &json!({}))?.with_topic(&topic)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &warmup).await?;
    tx.commit().await?;
    drained(&db).await?;
    sqlx::query("DELETE FROM outbox_events")
        .execute(&db.pool)
        .await?;

    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = Instant::now() + settings.duration;
    let mut committed: Vec<(uuid::Uuid, DateTime<Utc>)> = Vec::new();
    let mut n = 0_u64;
    while Instant::now() < deadline {
        ticker.tick().await;
        let event = NewEvent::new(
            "invoice",
            format!("k{}", n % 100),
            "Decided",
            &json!({ "n": n }),
        )?
        .with_topic(&topic)?;
        let mut tx = db.pool.begin().await?;
        outbox_producer::enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        committed.push((*event.id().as_uuid(), Utc::now()));
        n += 1;
    }
    while outbox_producer::stats(&mut *db.pool.acquire().await?, &Default::default())
        .await?
        .pending
        > 0
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await??;
    let published: std::collections::HashMap<uuid::Uuid, DateTime<Utc>> =
        sqlx::query_as("SELECT id, published_at FROM outbox_events")
            .fetch_all(&db.pool)
            .await?
            .into_iter()
            .collect();
    Ok(committed
        .iter()
        .filter_map(|(id, at)| {
            published
                .get(id)
                .map(|p| (*p - *at).num_microseconds().unwrap_or(0) as f64 / 1000.0)
        })
        .map(|ms| ms.max(0.0))
        .collect())
}

async fn drained(db: &TestDb) -> Result<()> {
    outbox_tests::eventually("the outbox drains", Duration::from_secs(60), || async {
        Ok(
            outbox_producer::stats(&mut *db.pool.acquire().await?, &Default::default())
                .await?
                .pending
                == 0,
        )
    })
    .await
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let mut figures = Vec::new();
    let (mut notify_runs, mut poll_runs) = (Vec::new(), Vec::new());
    for round in 0..settings.rounds.min(3) {
        notify_runs.push(latencies(true, settings).await?);
        poll_runs.push(latencies(false, settings).await?);
        eprintln!(
            "P3 round {round}: p50 notify {:.1} ms, polling {:.1} ms",
            percentile(&notify_runs[round], 0.5),
            percentile(&poll_runs[round], 0.5)
        );
    }
    for (q, name, target_ms) in [
        (0.5, "p50", Some(5.0)),
        (0.95, "p95", None),
        (0.99, "p99", Some(25.0)),
    ] {
        let per_round = |runs: &[Vec<f64>]| Sample {
            values: runs.iter().map(|r| percentile(r, q)).collect(),
        };
        figures.push(Figure::at_most(
            "P3",
            format!("commit->published {name}, NOTIFY"),
            "ms",
            per_round(&notify_runs),
            "polling every 100 ms",
            per_round(&poll_runs),
            target_ms,
        ));
    }
    Ok(figures)
}
