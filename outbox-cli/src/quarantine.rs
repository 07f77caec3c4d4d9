//! `outbox quarantine ...`: look at, requeue or discard what either side quarantined.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use clap::{Subcommand, ValueEnum};
use outbox_core::{TableNames, escape, wire};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgConnection;

use crate::kafka_config::{KafkaArgs, bootstrap_servers};
use crate::print;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Side {
    /// Outbox rows the relay could not publish (ids are `seq`).
    Relay,
    /// Messages a consumer could not handle (ids are quarantine row ids).
    Consumer,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Action {
    /// List the oldest quarantined entries of one side.
    List {
        side: Side,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show entries in full (consumer payloads as text), as JSON.
    Show { side: Side, ids: Vec<i64> },
    /// Relay: make the rows pending again. Consumer: publish the messages again, as received,
    /// to their topic and partition (they land after what came since), for the consumer that
    /// quarantined them alone (header `outbox-requeue-for`: other dedup consumers skip them;
    /// clients that are not dedup consumers see them as redeliveries), then delete them here.
    ///
    /// Consumer requeues take Kafka settings as `outbox relay` does: --kafka-config,
    /// OUTBOX_KAFKA_<KEY> variables, --brokers, -X, in that order.
    Requeue {
        side: Side,
        #[arg(required = true)]
        ids: Vec<i64>,
        /// Consumer requeues: how to reach Kafka.
        #[command(flatten)]
        kafka: KafkaArgs,
        /// Consumer requeues: the consumer name to handle the messages, instead of the one
        /// that quarantined them, when it was renamed since (a copy for a name no consumer
        /// has is skipped by all).
        #[arg(long)]
        to_consumer: Option<String>,
    },
    /// Delete entries for good.
    Discard {
        side: Side,
        #[arg(required = true)]
        ids: Vec<i64>,
    },
}

pub(crate) async fn run(
    conn: &mut PgConnection,
    tables: &TableNames,
    action: Action,
) -> Result<()> {
    match action {
        Action::List {
            side: Side::Relay,
            limit,
            json,
        } => {
            let rows = outbox_producer::quarantine::list_quarantined(conn, tables, limit).await?;
            if json {
                println!("{}", print::json(&rows, false)?);
            }
            for r in rows.iter().filter(|_| !json) {
                let error = r.last_error.as_deref().unwrap_or("");
                println!(
                    "{}\t{}\t{}\t{}\tattempts={}\t{}",
                    r.seq,
                    r.id,
                    escape(&r.topic),
                    escape(&r.aggregateid),
                    r.attempts,
                    escape(error)
                );
            }
        }
        Action::List {
            side: Side::Consumer,
            limit,
            json,
        } => {
            let rows = outbox_consumer::quarantine::list_quarantined(conn, tables, limit).await?;
            if json {
                println!("{}", print::json(&rows, false)?);
            }
            // The error quotes the record (its id header, the payload text serde choked on).
            for r in rows.iter().filter(|_| !json) {
                println!(
                    "{}\t{}\t{}[{}]@{}\t{}\t{}",
                    r.id,
                    escape(&r.consumer),
                    escape(&r.topic),
                    r.partition,
                    r.offset,
                    escape(&r.reason),
                    escape(&r.error)
                );
            }
        }
        Action::Show {
            side: Side::Relay,
            ids,
        } => {
            let rows = outbox_producer::quarantine::get_quarantined(conn, tables, &ids).await?;
            println!("{}", print::json(&rows, true)?);
        }
        Action::Show {
            side: Side::Consumer,
            ids,
        } => {
            let rows = outbox_consumer::quarantine::get_quarantined(conn, tables, &ids).await?;
            let shown: Vec<_> = rows
                .iter()
                .map(|r| {
                    let text = |b: &Option<Vec<u8>>| b.as_deref().map(|b| String::from_utf8_lossy(b).into_owned());
                    serde_json::json!({ "entry": r, "key_text": text(&r.message_key), "payload_text": text(&r.payload) })
                })
                .collect();
            println!("{}", print::json(&shown, true)?);
        }
        Action::Requeue {
            side: Side::Relay,
            ids,
            ..
        } => {
            let n = outbox_producer::quarantine::requeue(conn, tables, &ids).await?;
            println!("requeued {n} rows");
        }
        Action::Requeue {
            side: Side::Consumer,
            ids,
            kafka,
            to_consumer,
        } => {
            let kafka = kafka.client_config(outbox_producer::producer_config(""))?;
            bootstrap_servers(&kafka).context("consumer requeue publishes to Kafka")?;
            ensure!(
                to_consumer.as_deref() != Some(""),
                "--to-consumer takes a consumer name"
            );
            let producer: FutureProducer = outbox_core::kafka_secrets::create(&kafka)?;
            let rows = outbox_consumer::quarantine::get_quarantined(conn, tables, &ids).await?;
            ensure!(
                rows.len() == ids.len(),
                "found {} of the {} ids",
                rows.len(),
                ids.len()
            );
            for r in &rows {
                // For its consumer alone: every group reads the topic, and the others handled
                // the original (their dedup rows for it are pruned in time).
                let target = to_consumer.as_deref().unwrap_or(&r.consumer);
                let for_target = OwnedHeaders::new().insert(Header {
                    key: wire::HEADER_REQUEUE_FOR,
                    value: Some(target),
                });
                let headers = r
                    .record_headers()?
                    .iter()
                    .filter(|(key, _)| key != wire::HEADER_REQUEUE_FOR)
                    .fold(for_target, |h, (key, value)| {
                        h.insert(Header {
                            key,
                            value: value.as_deref(),
                        })
                    });
                let mut record = FutureRecord::<[u8], [u8]>::to(&r.topic)
                    .partition(r.partition)
                    .headers(headers);
                if let Some(key) = &r.message_key {
                    record = record.key(key);
                }
                if let Some(payload) = &r.payload {
                    record = record.payload(payload);
                }
                producer
                    .send(record, Duration::from_secs(30))
                    .await
                    .map_err(|(e, _)| e)?;
                // Deleted only after the broker acknowledged the copy: at worst it is both
                // republished and still listed, never lost.
                outbox_consumer::quarantine::discard(conn, tables, &[r.id]).await?;
            }
            println!("requeued {} messages", rows.len());
        }
        Action::Discard {
            side: Side::Relay,
            ids,
        } => {
            let n = outbox_producer::quarantine::discard(conn, tables, &ids).await?;
            println!("discarded {n} rows");
        }
        Action::Discard {
            side: Side::Consumer,
            ids,
        } => {
            let n = outbox_consumer::quarantine::discard(conn, tables, &ids).await?;
            println!("discarded {n} messages");
        }
    }
    Ok(())
}
