//! Recording a batch's outcomes on the claim's transaction: acknowledged rows are marked
//! published (or deleted), the rows' own failures are charged an attempt or quarantined, rows
//! whose partition could not take writes wait with no attempt charged, and rows no broker
//! answered for are left exactly as they were.

use std::collections::HashMap;

use rdkafka::error::KafkaError;
use sqlx::PgConnection;

use super::failure::{FailureKind, backoff, classify, outage_wait};
use super::kafka::TopicAnswer;
use super::publish::Outcome;
use super::row::OutboxRow;
use super::{AfterPublish, BatchReport, RelayConfig};
use crate::ProducerError;
use crate::sql::RelaySql;

/// Records `outcomes` of `rows`. `answers` tells what the cluster said after the batch about
/// each topic with an unanswered record: nothing (the relay's failure, no row is touched),
/// an error for the topic, such as missing or not authorized (the row's failure), or that it
/// knows the topic (an outage of the partition: the row waits, charged nothing). A row not
/// sent because its partition is known to be out waits the same way.
pub(crate) async fn record(
    conn: &mut PgConnection,
    config: &RelayConfig,
    sql: &RelaySql,
    rows: &[OutboxRow],
    outcomes: Vec<Outcome>,
    answers: &HashMap<String, TopicAnswer>,
) -> Result<BatchReport, ProducerError> {
    let mut report = BatchReport {
        claimed: rows.len(),
        ..BatchReport::default()
    };
    let mut published = Vec::new();
    let table = config.tables.outbox.as_str().to_owned();
    // From the decision (created_at) to Kafka's acknowledgement.
    let latency =
        metrics::histogram!("outbox_relay_publish_latency_seconds", "table" => table.clone());
    let now = chrono::Utc::now();
    let (mut seqs, mut statuses, mut delays, mut errors, mut charges): (_, _, _, _, Vec<i32>) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (row, outcome) in rows.iter().zip(outcomes) {
        let unsent = matches!(outcome, Outcome::Waiting(_));
        let (kind, error) = match outcome {
            Outcome::Delivered(_) => {
                published.push(row.seq);
                let age = (now - row.created_at).to_std().unwrap_or_default();
                latency.record(age.as_secs_f64());
                continue;
            }
            Outcome::Deferred => {
                report.deferred += 1;
                continue;
            }
            Outcome::Unconfirmed => {
                report.unconfirmed += 1;
                continue;
            }
            Outcome::Defective(defect) => (FailureKind::Permanent, defect.to_string()),
            Outcome::Waiting(partition) => (
                FailureKind::Outage,
                format!("partition {partition} is out; not sent"),
            ),
            Outcome::Failed(error, _) => match classify(&error) {
                FailureKind::NoAnswer => match answers.get(&row.topic) {
                    Some(TopicAnswer::Refused(code)) => {
                        // Not authorized or invalid for good; missing or other errors may pass.
                        let kind = match classify(&KafkaError::MessageProduction(*code)) {
                            FailureKind::Permanent => FailureKind::Permanent,
                            _ => FailureKind::Transient,
                        };
                        (kind, format!("{error}; the topic's metadata: {code}"))
                    }
                    Some(TopicAnswer::Known(_)) => (FailureKind::Outage, error.to_string()),
                    Some(TopicAnswer::NoAnswer) | None => {
                        report.unconfirmed += 1;
                        report.broker_unreachable = true;
                        continue;
                    }
                },
                kind => (kind, error.to_string()),
            },
        };
        if kind == FailureKind::Outage {
            // Not the row's failure: no attempt charged, however long it lasts. The row waits
            // (and holds its aggregate's later rows) so that the batches in between carry the
            // partitions that can take writes.
            report.waiting += 1;
            let delay = outage_wait(config);
            if unsent {
                // The partition's outage was logged when it was found.
                tracing::debug!(event_id = %row.id, topic = %outbox_core::escape(&row.topic), retry_in = ?delay, %error, "partition out; row waits unsent, not charged");
            } else {
                tracing::warn!(event_id = %row.id, topic = %outbox_core::escape(&row.topic), retry_in = ?delay, %error, "partition cannot take writes; row waits, not charged");
            }
            seqs.push(row.seq);
            statuses.push("pending");
            delays.push(delay.as_secs_f64() * 1000.0);
            errors.push(format!("Outage (not charged): {error}"));
            charges.push(0);
            continue;
        }
        let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
        let quarantine = kind == FailureKind::Permanent || attempts >= config.max_attempts;
        let reason = format!("{kind:?} after attempt {attempts}: {error}");
        if quarantine {
            report.quarantined += 1;
            tracing::error!(event_id = %row.id, topic = %outbox_core::escape(&row.topic), attempts, %error, "quarantined outbox row");
            statuses.push("quarantined");
            delays.push(0.0);
        } else {
            report.retried += 1;
            let delay = backoff(config, attempts - 1);
            tracing::warn!(event_id = %row.id, topic = %outbox_core::escape(&row.topic), attempts, retry_in = ?delay, %error, "publish failed; will retry");
            statuses.push("pending");
            delays.push(delay.as_secs_f64() * 1000.0);
        }
        seqs.push(row.seq);
        errors.push(reason);
        charges.push(1);
    }
    report.published = published.len();
    metrics::counter!("outbox_relay_published_total", "table" => table.clone())
        .increment(published.len() as u64);
    metrics::counter!("outbox_relay_failed_total", "table" => table.clone())
        .increment((seqs.len() - report.waiting) as u64);
    metrics::counter!("outbox_relay_quarantined_total", "table" => table.clone())
        .increment(report.quarantined as u64);
    metrics::counter!("outbox_relay_unconfirmed_total", "table" => table.clone())
        .increment(report.unconfirmed as u64);
    metrics::counter!("outbox_relay_waiting_total", "table" => table)
        .increment(report.waiting as u64);
    if !published.is_empty() {
        let statement = match config.after_publish {
            AfterPublish::Mark => &sql.mark_published,
            AfterPublish::Delete => &sql.delete_published,
        };
        sqlx::query(statement.clone())
            .bind(&published)
            .execute(&mut *conn)
            .await?;
    }
    if !seqs.is_empty() {
        sqlx::query(sql.record_failures.clone())
            .bind(&seqs)
            .bind(&statuses)
            .bind(&delays)
            .bind(&errors)
            .bind(&charges)
            .execute(&mut *conn)
            .await?;
    }
    Ok(report)
}
