//! Recording a batch's verdicts on the claim's transaction: done rows are marked published
//! (or deleted) with the destination's answer, the rows' own failures are charged an attempt
//! or quarantined, rows caught in an outage wait with no attempt charged, and rows the
//! destination did not answer for are left exactly as they were.

use std::time::Duration;

use sqlx::PgConnection;

use super::answer::storable;
use super::{Destination, Failure, Lane, OutboxRow, Verdict};
use crate::ProducerError;
use crate::relay::{AfterPublish, BatchReport, RelayConfig};

/// Longest pause before a row caught in an outage is tried again. Each try can cost a batch
/// a long wait (a Kafka `message.timeout.ms`, a call's timeout), so this also bounds how much
/// of a lane's time one outage takes from the other keys.
const OUTAGE_WAIT_MAX: Duration = Duration::from_secs(30);

/// Delay before a row caught in an outage is tried again: `backoff_max`, at most
/// [`OUTAGE_WAIT_MAX`], with jitter. It does not grow with the outage: the destination may
/// come back at any time, and the row must follow soon after.
pub(crate) fn outage_wait(config: &RelayConfig) -> Duration {
    let wait = config.backoff_max.min(OUTAGE_WAIT_MAX);
    outbox_core::backoff(wait, wait, 0)
}

/// Delay before retry number `attempts + 1` (see [`outbox_core::backoff`]), at least
/// `asked` (capped at `backoff_max`) when the destination asked for a wait.
pub(crate) fn retry_delay(
    config: &RelayConfig,
    attempts: u32,
    asked: Option<Duration>,
) -> Duration {
    let backoff = outbox_core::backoff(config.backoff_base, config.backoff_max, attempts);
    asked.map_or(backoff, |asked| backoff.max(asked.min(config.backoff_max)))
}

/// Error texts are stored as TEXT, which refuses NUL bytes (22021).
fn storable_text(text: String) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{fffd}")
    } else {
        text
    }
}

/// Records `verdicts` of `rows`.
pub(crate) async fn record<D: Destination>(
    conn: &mut PgConnection,
    lane: &Lane<D>,
    rows: &[OutboxRow],
    verdicts: Vec<Verdict>,
) -> Result<BatchReport, ProducerError> {
    let config = &lane.config;
    let names = &lane.metrics;
    let mut report = BatchReport {
        claimed: rows.len(),
        ..BatchReport::default()
    };
    let (mut done, mut answers): (Vec<i64>, Vec<Option<String>>) = (Vec::new(), Vec::new());
    // From the decision (created_at) to the destination's acknowledgement.
    let latency = metrics::histogram!(names.latency, &names.labels);
    let now = chrono::Utc::now();
    let mut seqs: Vec<i64> = Vec::new();
    let mut statuses: Vec<&str> = Vec::new();
    let mut delays: Vec<f64> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut charges: Vec<i32> = Vec::new();
    let mut outcomes: Vec<Option<String>> = Vec::new();
    for (row, verdict) in rows.iter().zip(verdicts) {
        let failed = match verdict {
            Verdict::Done(answer) => {
                done.push(row.seq);
                answers.push(answer.map(|a| storable(a, lane.max_answer_bytes)));
                let age = (now - row.created_at).to_std().unwrap_or_default();
                latency.record(age.as_secs_f64());
                continue;
            }
            Verdict::Deferred => {
                report.deferred += 1;
                continue;
            }
            Verdict::Unconfirmed => {
                report.unconfirmed += 1;
                continue;
            }
            Verdict::Unreachable => {
                report.unconfirmed += 1;
                report.broker_unreachable = true;
                continue;
            }
            Verdict::Failed(failed) => failed,
        };
        let error = failed.error;
        let topic = outbox_core::escape(&row.topic);
        if failed.kind == Failure::Outage {
            // Not the row's failure: no attempt charged, however long it lasts. The row waits
            // (and holds its key's later rows) so that the batches in between carry the rows
            // that can go.
            report.waiting += 1;
            report.broker_unreachable |= failed.silent;
            let delay = outage_wait(config);
            if failed.unsent {
                // The outage was logged when it was found.
                tracing::debug!(event_id = %row.id, %topic, retry_in = ?delay, error = %outbox_core::escape(&error), "outage; row waits unsent, not charged");
            } else {
                tracing::warn!(event_id = %row.id, %topic, retry_in = ?delay, error = %outbox_core::escape(&error), "destination cannot take the row now; it waits, not charged");
            }
            seqs.push(row.seq);
            statuses.push("pending");
            delays.push(delay.as_secs_f64() * 1000.0);
            errors.push(storable_text(format!("Outage (not charged): {error}")));
            charges.push(0);
            outcomes.push(None);
            continue;
        }
        let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
        let quarantine = failed.kind == Failure::Permanent || attempts >= config.max_attempts;
        let kind = failed.kind;
        let reason = format!("{kind:?} after attempt {attempts}: {error}");
        if quarantine {
            report.quarantined += 1;
            tracing::error!(event_id = %row.id, %topic, attempts, error = %outbox_core::escape(&error), "quarantined outbox row");
            statuses.push("quarantined");
            delays.push(0.0);
        } else {
            report.retried += 1;
            let delay = retry_delay(config, attempts - 1, failed.retry_after);
            tracing::warn!(event_id = %row.id, %topic, attempts, retry_in = ?delay, error = %outbox_core::escape(&error), "attempt failed; will retry");
            statuses.push("pending");
            delays.push(delay.as_secs_f64() * 1000.0);
        }
        seqs.push(row.seq);
        errors.push(storable_text(reason));
        charges.push(1);
        outcomes.push(failed.answer.map(|a| storable(a, lane.max_answer_bytes)));
    }
    report.published = done.len();
    metrics::counter!(names.done, &names.labels).increment(done.len() as u64);
    metrics::counter!(names.failed, &names.labels).increment((seqs.len() - report.waiting) as u64);
    metrics::counter!(names.quarantined, &names.labels).increment(report.quarantined as u64);
    metrics::counter!(names.unconfirmed, &names.labels).increment(report.unconfirmed as u64);
    metrics::counter!(names.waiting, &names.labels).increment(report.waiting as u64);
    if !done.is_empty() {
        let sql = &lane.sql;
        if answers.iter().any(Option::is_some) {
            sqlx::query(sql.mark_done.clone())
                .bind(&done)
                .bind(&answers)
                .execute(&mut *conn)
                .await?;
        } else {
            let statement = match config.after_publish {
                AfterPublish::Mark => &sql.mark_published,
                AfterPublish::Delete => &sql.delete_published,
            };
            sqlx::query(statement.clone())
                .bind(&done)
                .execute(&mut *conn)
                .await?;
        }
    }
    if !seqs.is_empty() {
        let query = sqlx::query(lane.sql.record_failures.clone())
            .bind(&seqs)
            .bind(&statuses)
            .bind(&delays)
            .bind(&errors)
            .bind(&charges);
        if lane.sql.stores_outcomes {
            query.bind(&outcomes).execute(&mut *conn).await?;
        } else {
            query.execute(&mut *conn).await?;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_never_hold_what_postgres_refuses() {
        assert_eq!(storable_text("e\0".into()), "e\u{fffd}");
    }

    #[test]
    fn a_wait_asked_for_is_honoured_up_to_backoff_max() {
        let config =
            RelayConfig::default().backoff(Duration::from_millis(100), Duration::from_secs(10));
        assert!(retry_delay(&config, 0, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert!(
            retry_delay(&config, 0, Some(Duration::from_secs(3600))) <= Duration::from_secs(10)
        );
        assert!(retry_delay(&config, 0, None) < Duration::from_millis(100));
    }

    #[test]
    fn backoff_grows_jitters_and_caps() {
        let config =
            RelayConfig::default().backoff(Duration::from_millis(100), Duration::from_secs(1));
        for attempts in 0..40 {
            let cap = Duration::from_millis(100 * 2_u64.saturating_pow(attempts))
                .min(Duration::from_secs(1));
            let d = retry_delay(&config, attempts, None);
            assert!(
                d >= cap / 2 && d < cap,
                "attempt {attempts}: {d:?} not in [{:?}, {cap:?})",
                cap / 2
            );
        }
    }
}
