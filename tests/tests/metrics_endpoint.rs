//! The opt-in Prometheus endpoint shows what the relay and the consumer did, scraped over
//! HTTP as Prometheus would. Its own test binary: the recorder is process-global.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};
use outbox_consumer::{ConsumerConfig, Event, HandlerError, consumer_config, dedup_consume};
use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Outcome};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, eventually, kafka_bootstrap, produce_raw, random_topic, unique};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_series_are_scraped_over_http() -> Result<()> {
    let addr = free_addr()?;
    outbox_consumer::serve_metrics(addr)?;
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let consumer_name = unique("billing");

    let mut tx = db.pool.begin().await?;
    let mut first = None;
    for key in ["a", "b", "c"] {
        let event =
            NewEvent::new("invoice", key, "InvoiceDecided", &json!({}))?.with_topic(&topic)?;
        first.get_or_insert(event.id());
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    // An action for a dispatcher: pending beside the relay's events, never the relay's lag.
    let action = NewEvent::new("invoice", "a", "Charge", &json!({}))?.for_dispatcher("billing")?;
    outbox_producer::enqueue(&mut tx, &action).await?;
    tx.commit().await?;
    let first = first.context("three events")?.to_string();

    let shutdown = CancellationToken::new();
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default(),
    )?;
    let relaying = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown).await }
    });
    let consuming = tokio::spawn({
        let (pool, shutdown, topic) = (db.pool.clone(), shutdown.clone(), topic.clone());
        let config = ConsumerConfig::new(consumer_name.clone());
        async move {
            async fn nothing(
                _: &Event<serde_json::Value>,
                _: &mut sqlx::PgConnection,
            ) -> Result<(), HandlerError> {
                Ok(())
            }
            dedup_consume(
                &consumer_config(&kafka_bootstrap(), &unique("g")),
                pool,
                nothing,
            )
            .topics([topic])
            .config(config)
            .run(shutdown)
            .await
        }
    });
    let processed = format!("outbox_consumer_processed_total{{consumer=\"{consumer_name}\"}}");
    eventually("three processed", Duration::from_secs(60), || async {
        Ok(scrape(addr)?.get(&processed) == Some(&3.0))
    })
    .await?;
    // A redelivery of the first event, and a record without an id, from an outside client.
    produce_raw(
        &topic,
        None,
        Some("a"),
        Some(b"{}"),
        &[("id", first.as_bytes())],
    )
    .await?;
    produce_raw(&topic, None, Some("x"), Some(b"{}"), &[]).await?;
    let duplicates =
        format!("outbox_consumer_duplicates_total{{consumer=\"{consumer_name}\",via=\"cache\"}}");
    let quarantined = format!(
        "outbox_consumer_quarantined_total{{consumer=\"{consumer_name}\",reason=\"missing_id\"}}"
    );
    eventually(
        "duplicate and quarantine counted",
        Duration::from_secs(60),
        || async {
            let series = scrape(addr)?;
            Ok(series.get(&duplicates) == Some(&1.0) && series.get(&quarantined) == Some(&1.0))
        },
    )
    .await?;
    let table = "table=\"outbox_events\"";
    let relay_pending = format!("outbox_pending{{{table}}}");
    eventually(
        "the relay's gauge counts its own rows only",
        Duration::from_secs(60),
        || async { Ok(scrape(addr)?.get(&relay_pending) == Some(&0.0)) },
    )
    .await?;
    shutdown.cancel();
    relaying.await??;
    consuming.await??;

    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        DispatcherConfig::new("billing").max_in_flight(1),
        |_: Action| async { Outcome::done(json!({ "charge": "ch_1" })) },
    )?;
    assert_eq!(dispatcher.run_once().await?.published, 1);
    let series = scrape(addr)?;
    let dispatched = series
        .iter()
        .find(|(name, _)| {
            name.starts_with("outbox_dispatch_done_total{")
                && name.contains("destination=\"billing\"")
                && name.contains(table)
        })
        .map(|(_, value)| *value);
    assert_eq!(dispatched, Some(1.0), "{series:?}");
    assert!(series[&format!("outbox_relay_published_total{{{table}}}")] >= 3.0);
    assert!(series.contains_key(&format!("outbox_pending{{{table}}}")));
    assert!(series.contains_key(&format!("outbox_oldest_pending_age_seconds{{{table}}}")));
    assert!(series[&format!("outbox_relay_publish_latency_seconds_count{{{table}}}")] >= 3.0);
    let handled = format!("outbox_consumer_message_seconds_count{{consumer=\"{consumer_name}\"}}");
    assert_eq!(series[&handled], 5.0, "every message is timed");
    Ok(())
}

fn free_addr() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// GETs `/metrics` and returns each sample line as `name{labels}` -> value.
fn scrape(addr: SocketAddr) -> Result<BTreeMap<String, f64>> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response")?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "scrape failed: {head}");
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect())
}
