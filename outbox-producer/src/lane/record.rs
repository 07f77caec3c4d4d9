//! Recording verdicts: done rows are marked published (or deleted) with the destination's
//! answer, the rows' own failures are charged an attempt or quarantined, rows caught in an
//! outage wait with no attempt charged, and rows the destination did not answer for are left
//! as they were (the relay's, in the claim's transaction) or released uncharged (a
//! dispatcher's leased rows, in a transaction of their own, fenced by the lease).

use std::time::Duration;

use sqlx::PgConnection;

use super::answer::storable;
use super::{Failure, Lane, OutboxRow, Verdict};
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
/// `asked` when the destination asked for a wait, in full: a daily quota's
/// `Retry-After: 3600` is an hour, whatever `backoff_max` says.
pub(crate) fn retry_delay(
    config: &RelayConfig,
    attempts: u32,
    asked: Option<Duration>,
) -> Duration {
    let backoff = outbox_core::backoff(config.backoff_base, config.backoff_max, attempts);
    asked.map_or(backoff, |asked| backoff.max(asked))
}

/// Error texts are stored as TEXT, which refuses NUL bytes (22021).
fn storable_text(text: String) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{fffd}")
    } else {
        text
    }
}

/// The failed and released rows of a batch, as the columns of `record_failures`.
#[derive(Default)]
struct Updates {
    seqs: Vec<i64>,
    statuses: Vec<&'static str>,
    delays: Vec<f64>,
    /// `None` keeps the row's `last_error` (a leased row released untried).
    errors: Vec<Option<String>>,
    charges: Vec<i32>,
    outcomes: Vec<Option<String>>,
    leases: Vec<Option<uuid::Uuid>>,
    calls: Vec<i32>,
}

struct Update {
    status: &'static str,
    delay: Duration,
    error: Option<String>,
    /// Whether the row's own failure is charged an attempt.
    charged: bool,
    outcome: Option<String>,
    /// Whether a call of this claim may have applied it.
    sent: bool,
}

impl Updates {
    /// A leased row's attempt was charged by its claim, and its call counted: what this
    /// record does not charge is taken back. An unleased row (the relay's) is charged here.
    fn push(&mut self, row: &OutboxRow, u: Update) {
        self.seqs.push(row.seq);
        self.statuses.push(u.status);
        self.delays.push(u.delay.as_secs_f64() * 1000.0);
        self.errors.push(u.error.map(storable_text));
        let leased = row.lease.is_some();
        self.charges.push(match (leased, u.charged) {
            (true, true) | (false, false) => 0,
            (true, false) => -1,
            (false, true) => 1,
        });
        self.outcomes.push(u.outcome);
        self.leases.push(row.lease);
        self.calls.push(if leased && !u.sent { -1 } else { 0 });
    }
}

/// Records `verdicts` of `rows`.
pub(crate) async fn record<D>(
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
    let (mut done, mut answers, mut done_leases) = (Vec::new(), Vec::new(), Vec::new());
    // From the decision (created_at) to the destination's acknowledgement.
    let latency = metrics::histogram!(names.latency, &names.labels);
    let now = chrono::Utc::now();
    let mut updates = Updates::default();
    // A leased row left untried (or without an answer at shutdown) is released at once,
    // uncharged, for the next claim; an unleased one is simply left as it was.
    let release = |updates: &mut Updates, row: &OutboxRow, sent: bool| {
        if row.lease.is_some() {
            updates.push(
                row,
                Update {
                    status: "pending",
                    delay: Duration::ZERO,
                    error: None,
                    charged: false,
                    outcome: None,
                    sent,
                },
            );
        }
    };
    for (row, verdict) in rows.iter().zip(verdicts) {
        let failed = match verdict {
            Verdict::Done(answer) => {
                done.push(row.seq);
                answers.push(answer.map(|a| storable(a, lane.max_answer_bytes)));
                done_leases.push(row.lease);
                let age = (now - row.created_at).to_std().unwrap_or_default();
                latency.record(age.as_secs_f64());
                continue;
            }
            Verdict::Deferred => {
                report.deferred += 1;
                release(&mut updates, row, false);
                continue;
            }
            Verdict::Unconfirmed => {
                report.unconfirmed += 1;
                release(&mut updates, row, true);
                continue;
            }
            Verdict::Unreachable => {
                report.unconfirmed += 1;
                report.broker_unreachable = true;
                release(&mut updates, row, false);
                continue;
            }
            Verdict::Failed(failed) => failed,
        };
        let error = failed.error;
        let topic = outbox_core::escape(&row.topic);
        if failed.kind == Failure::Outage {
            // Not the row's failure: no attempt charged, however long it lasts. The row waits
            // (and holds its key's later rows) so that the batches in between carry the rows
            // that can go; as long as the destination asked (or a 429's turn at the slower
            // rate), otherwise an outage's wait.
            report.waiting += 1;
            report.broker_unreachable |= failed.silent;
            let delay = failed.retry_after.unwrap_or_else(|| outage_wait(config));
            if failed.unsent {
                // The outage was logged when it was found.
                tracing::debug!(event_id = %row.id, %topic, retry_in = ?delay, error = %outbox_core::escape(&error), "outage; row waits unsent, not charged");
            } else {
                tracing::warn!(event_id = %row.id, %topic, retry_in = ?delay, error = %outbox_core::escape(&error), "destination cannot take the row now; it waits, not charged");
            }
            updates.push(
                row,
                Update {
                    status: "pending",
                    delay,
                    error: Some(format!("Outage (not charged): {error}")),
                    charged: false,
                    outcome: None,
                    sent: !failed.unsent,
                },
            );
            continue;
        }
        let attempts = u32::try_from(row.attempts).unwrap_or(0) + 1;
        let quarantine = failed.kind == Failure::Permanent || attempts >= config.max_attempts;
        let kind = failed.kind;
        let reason = format!("{kind:?} after attempt {attempts}: {error}");
        let (status, delay) = if quarantine {
            report.quarantined += 1;
            tracing::error!(event_id = %row.id, %topic, attempts, error = %outbox_core::escape(&error), "quarantined outbox row");
            ("quarantined", Duration::ZERO)
        } else {
            report.retried += 1;
            let delay = retry_delay(config, attempts - 1, failed.retry_after);
            tracing::warn!(event_id = %row.id, %topic, attempts, retry_in = ?delay, error = %outbox_core::escape(&error), "attempt failed; will retry");
            ("pending", delay)
        };
        updates.push(
            row,
            Update {
                status,
                delay,
                error: Some(reason),
                charged: true,
                outcome: failed.answer.map(|a| storable(a, lane.max_answer_bytes)),
                sent: !failed.unsent,
            },
        );
    }
    report.published = done.len();
    let released = report.deferred + report.unconfirmed;
    let failed = updates.seqs.len() - report.waiting - if lane.sql.leased { released } else { 0 };
    metrics::counter!(names.done, &names.labels).increment(done.len() as u64);
    metrics::counter!(names.failed, &names.labels).increment(failed as u64);
    metrics::counter!(names.quarantined, &names.labels).increment(report.quarantined as u64);
    metrics::counter!(names.unconfirmed, &names.labels).increment(report.unconfirmed as u64);
    metrics::counter!(names.waiting, &names.labels).increment(report.waiting as u64);
    let sql = &lane.sql;
    let mut recorded = 0;
    if !done.is_empty() {
        recorded += if sql.leased {
            sqlx::query(sql.mark_done.clone())
                .bind(&done)
                .bind(&answers)
                .bind(&done_leases)
                .execute(&mut *conn)
                .await?
        } else {
            let statement = match config.after_publish {
                AfterPublish::Mark => &sql.mark_published,
                AfterPublish::Delete => &sql.delete_published,
            };
            sqlx::query(statement.clone())
                .bind(&done)
                .execute(&mut *conn)
                .await?
        }
        .rows_affected();
    }
    if !updates.seqs.is_empty() {
        let u = &updates;
        let query = sqlx::query(sql.record_failures.clone())
            .bind(&u.seqs)
            .bind(&u.statuses)
            .bind(&u.delays)
            .bind(&u.errors)
            .bind(&u.charges);
        recorded += if sql.leased {
            query
                .bind(&u.outcomes)
                .bind(&u.leases)
                .bind(&u.calls)
                .execute(&mut *conn)
                .await?
        } else {
            query.execute(&mut *conn).await?
        }
        .rows_affected();
    }
    let expected = done.len() + updates.seqs.len();
    if sql.leased && (recorded as usize) < expected {
        // Another dispatcher took these over after their lease ended (this one was cut off
        // from the database, or stalled, longer than a call timeout and a margin): its record
        // stands, and the call was made again with the same key.
        report.lease_lost = expected - recorded as usize;
        tracing::warn!(
            lost = report.lease_lost,
            "results of actions whose lease had passed to another dispatcher were not recorded"
        );
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
    fn a_wait_asked_for_is_honoured_in_full() {
        let config =
            RelayConfig::default().backoff(Duration::from_millis(100), Duration::from_secs(10));
        assert!(retry_delay(&config, 0, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert!(
            retry_delay(&config, 0, Some(Duration::from_secs(3600))) >= Duration::from_secs(3600)
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
