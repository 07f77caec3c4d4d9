//! `outbox quarantine ...`: look at, requeue or discard what either side quarantined, and
//! read the record of those actions. Requeue and discard act only on a table the migrations
//! registered as that side's quarantine, record themselves in `outbox_quarantine_audit` in the
//! statement that acts, and ask before acting on more than one row.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use clap::{Subcommand, ValueEnum};
use outbox_core::{ActionNote, TableNames, escape, wire};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgConnection;

use crate::confirm::confirm;
use crate::kafka_config::{KafkaArgs, bootstrap_servers};
use crate::print;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Side {
    /// Outbox rows the relay could not publish (ids are `seq`).
    Relay,
    /// Messages a consumer could not handle (ids are quarantine row ids).
    Consumer,
}

/// What every requeue and discard takes besides its rows.
#[derive(Debug, clap::Args)]
pub(crate) struct Confirmation {
    /// Why, recorded with the action in `outbox_quarantine_audit`.
    #[arg(long)]
    reason: Option<String>,
    /// Act on more than one row without asking (required when stdin is not a terminal).
    #[arg(long)]
    yes: bool,
}

impl Confirmation {
    fn note(&self) -> ActionNote {
        self.reason
            .as_ref()
            .map_or_else(ActionNote::new, |r| ActionNote::new().reason(r))
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum Action {
    /// List the oldest quarantined entries of one side.
    List {
        side: Side,
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show entries in full (consumer payloads as text), as JSON.
    Show { side: Side, ids: Vec<i64> },
    /// Relay: make the rows pending again. Consumer: publish the messages again, as received,
    /// to their topic and partition (they land after what came since), for the consumer that
    /// quarantined them alone (header `outbox-requeue-for`: other dedup consumers that handled
    /// the event skip them, the others quarantine them as `requeue_unseen`; clients that are not
    /// dedup consumers see them as redeliveries), then delete them here.
    ///
    /// Consumer requeues take Kafka settings as `outbox relay` does: --kafka-config,
    /// `OUTBOX_KAFKA_<KEY>` variables, --brokers, -X, in that order.
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
        #[command(flatten)]
        confirmation: Confirmation,
    },
    /// Delete entries for good.
    Discard {
        side: Side,
        #[arg(required = true)]
        ids: Vec<i64>,
        #[command(flatten)]
        confirmation: Confirmation,
    },
    /// The newest requeues, discards and prunes: what, when, by which database role, why.
    Audit {
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
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
            let rows =
                outbox_producer::quarantine::list_quarantined(conn, tables, i64::from(limit))
                    .await?;
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
            let rows =
                outbox_consumer::quarantine::list_quarantined(conn, tables, i64::from(limit))
                    .await?;
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
            confirmation,
            ..
        } => {
            let table = shown(&outbox_producer::quarantine::verify(conn, tables).await?);
            if ids.len() > 1 {
                let what = format!("requeue {} rows of {table} (relay side)", ids.len());
                confirm(&what, confirmation.yes)?;
            }
            let note = confirmation.note();
            let n = outbox_producer::quarantine::requeue(conn, tables, &ids, &note).await?;
            println!("requeued {n} rows");
        }
        Action::Requeue {
            side: Side::Consumer,
            ids,
            kafka,
            to_consumer,
            confirmation,
        } => {
            let kafka = kafka.client_config(outbox_producer::producer_config(""))?;
            bootstrap_servers(&kafka).context("consumer requeue publishes to Kafka")?;
            ensure!(
                to_consumer.as_deref() != Some(""),
                "--to-consumer takes a consumer name"
            );
            // Checked before anything is published: copies of a user table's rows must not
            // reach a topic either, nor copies of rows this role cannot remove and audit.
            let table = shown(&outbox_consumer::quarantine::verify(conn, tables).await?);
            outbox_consumer::quarantine::check_requeue(conn, tables).await?;
            // A refused Kafka setting is told before any row is looked up.
            let producer: FutureProducer = outbox_core::kafka_secrets::create(&kafka)?;
            let rows = outbox_consumer::quarantine::get_quarantined(conn, tables, &ids).await?;
            ensure!(
                rows.len() == ids.len(),
                "found {} of the {} ids",
                rows.len(),
                ids.len()
            );
            if rows.len() > 1 {
                let to = to_consumer
                    .as_deref()
                    .map(|c| format!(", to consumer {}", shown(c)))
                    .unwrap_or_default();
                let what = format!("requeue {}{to}", consumer_rows(&rows, &table));
                confirm(&what, confirmation.yes)?;
            }
            let (mut requeued, mut gone) = (Vec::new(), Vec::new());
            for id in rows.iter().map(|r| r.id) {
                let copied = requeue_one(
                    conn,
                    tables,
                    &producer,
                    id,
                    to_consumer.as_deref(),
                    &confirmation,
                )
                .await
                .with_context(|| {
                    format!(
                        "requeueing message {id} (requeued before it: {requeued:?}; already gone: {gone:?})"
                    )
                })?;
                if copied { &mut requeued } else { &mut gone }.push(id);
            }
            println!("requeued {} messages", requeued.len());
            if !gone.is_empty() {
                let gone: Vec<String> = gone.iter().map(i64::to_string).collect();
                println!(
                    "already gone: {} (discarded or requeued by another action since they were read); nothing published for them",
                    gone.join(", ")
                );
            }
        }
        Action::Discard {
            side: Side::Relay,
            ids,
            confirmation,
        } => {
            let table = shown(&outbox_producer::quarantine::verify(conn, tables).await?);
            if ids.len() > 1 {
                let what = format!("discard {} rows of {table} (relay side)", ids.len());
                confirm(&what, confirmation.yes)?;
            }
            let note = confirmation.note();
            let n = outbox_producer::quarantine::discard(conn, tables, &ids, &note).await?;
            println!("discarded {n} rows");
        }
        Action::Discard {
            side: Side::Consumer,
            ids,
            confirmation,
        } => {
            let table = shown(&outbox_consumer::quarantine::verify(conn, tables).await?);
            // Read only to ask (they hold whole payloads): not with --yes.
            if ids.len() > 1 && !confirmation.yes {
                let rows = outbox_consumer::quarantine::get_quarantined(conn, tables, &ids).await?;
                let what = format!("discard {}", consumer_rows(&rows, &table));
                confirm(&what, confirmation.yes)?;
            }
            let note = confirmation.note();
            let n = outbox_consumer::quarantine::discard(conn, tables, &ids, &note).await?;
            println!("discarded {n} messages");
        }
        Action::Audit { limit, json } => {
            let entries = outbox_core::quarantine_audit(conn, i64::from(limit)).await?;
            if json {
                println!("{}", print::json(&entries, false)?);
            }
            for e in entries.iter().filter(|_| !json) {
                let rows = e.row_ids.iter().map(i64::to_string).collect::<Vec<_>>();
                println!(
                    "{}\t{}\t{} {}\t{}\trows={}\tconsumers={}\tby={}/{}\t{}\t{}",
                    e.id,
                    e.at.to_rfc3339(),
                    e.action,
                    e.side,
                    shown(&e.table_name),
                    rows.join(","),
                    shown(&e.consumers.join(",")),
                    shown(&e.db_user),
                    shown(&e.db_session_user),
                    shown(e.reason.as_deref().unwrap_or("")),
                    serde_json::Value::Object(e.detail.0.clone()),
                );
            }
        }
    }
    Ok(())
}

/// Publishes a copy of quarantined message `id` and deletes it, audited, in one transaction
/// that holds the row from before it is read until after it is deleted: a concurrent requeue
/// or discard of it either waits and finds it gone, or is refused at once. `false`: it was
/// gone already, nothing published. A commit that fails after the broker took the copy leaves
/// the message listed: a second requeue publishes it again (the consumer's dedup absorbs a
/// copy whose event id it has handled).
async fn requeue_one(
    conn: &mut PgConnection,
    tables: &TableNames,
    producer: &FutureProducer,
    id: i64,
    to_consumer: Option<&str>,
    confirmation: &Confirmation,
) -> Result<bool> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let Some(r) = outbox_consumer::quarantine::claim(&mut tx, tables, id).await? else {
        return Ok(false);
    };
    // For its consumer alone: every group reads the topic, and the others handled the
    // original (their dedup rows for it are pruned in time).
    let target = to_consumer.unwrap_or(&r.consumer);
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
    // The copy keeps the original's time: handlers that read it (`Event::timestamp`) see when
    // the event happened, not when it was requeued.
    if let Some(at) = r.record_timestamp {
        record = record.timestamp(at.timestamp_millis());
    }
    let copy = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)?;
    // Deleted only after the broker acknowledged the copy: at worst it is both republished
    // and still listed, never lost.
    let note = confirmation.note().detail("to_consumer", target).detail(
        "copy",
        serde_json::json!({ "topic": r.topic, "partition": copy.partition, "offset": copy.offset }),
    );
    let deleted = outbox_consumer::quarantine::requeued(&mut tx, tables, &[id], &note).await?;
    // The row is locked: nothing else can have removed it.
    ensure!(
        deleted == 1,
        "deleted {deleted} rows for message {id}, expected 1; not committed"
    );
    tx.commit().await?;
    Ok(true)
}

/// "3 rows of `<table>` for consumer billing": what a consumer-side action is about to touch.
fn consumer_rows(rows: &[outbox_consumer::quarantine::QuarantinedMessage], table: &str) -> String {
    let mut consumers: Vec<&str> = rows.iter().map(|r| r.consumer.as_str()).collect();
    consumers.sort_unstable();
    consumers.dedup();
    let whose = match consumers.len() {
        0 => String::new(),
        1 => format!(" for consumer {}", shown(consumers[0])),
        _ => format!(" for consumers {}", shown(&consumers.join(", "))),
    };
    format!("{} rows of {table}{whose}", rows.len())
}

/// Text from the database as it may reach a terminal: control, invisible and
/// direction-changing characters escaped, as in logs.
pub(crate) fn shown(text: &str) -> String {
    escape(text).to_string()
}
