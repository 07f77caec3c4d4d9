//! One batch of a lane: claim, hand to the destination, record, commit.

use sqlx::query::QueryAs;
use sqlx::{Database, Postgres, Transaction};
use tokio_util::sync::CancellationToken;

use super::{Destination, Lane, OutboxRow, Verdict, record, transaction};
use crate::ProducerError;
use crate::relay::BatchReport;

impl<D: Destination> Lane<D> {
    /// Claims, delivers and records one batch, in one transaction. `expired` ends the wait
    /// for the destination (shutdown's grace period). Without `deliver`, every claimed row is
    /// recorded as done unsent (the benchmarks' SQL ceiling).
    pub(crate) async fn run_batch(
        &self,
        deliver: bool,
        expired: &CancellationToken,
    ) -> Result<BatchReport, ProducerError> {
        let tx = transaction::begin(&self.pool).await?;
        // A named prepared statement (parsed once per connection), planned with its parameter
        // on every run: the transaction's `plan_cache_mode` keeps Postgres from switching it
        // to a generic plan after five runs, which scanned the backlog (18 s per batch at 10M
        // pending, bench P7).
        let query = sqlx::query_as(self.sql.claim.clone()).bind(i64::from(self.config.batch_size));
        let (mut tx, rows) = claim_rows(tx, query).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(BatchReport::default());
        }
        let verdicts = if deliver {
            // The destination's questions and calls run inside the keep-alive: they can take
            // seconds, and the transaction must not sit idle meanwhile.
            let delivered =
                transaction::keep_alive(&mut tx, self.destination.deliver(&rows, expired)).await?;
            match delivered {
                Ok(verdicts) => verdicts,
                Err(error) => {
                    // Released now, not when the pool next touches the connection: the rows
                    // and their keys' locks must be free for the next claim (another relay's,
                    // or a new one after a fatal error).
                    let _ = tx.rollback().await;
                    return Err(error);
                }
            }
        } else {
            rows.iter().map(|_| Verdict::Done(None)).collect()
        };
        let report = record::record(&mut tx, self, &rows, verdicts).await?;
        tx.commit().await?;
        tracing::debug!(
            claimed = report.claimed,
            done = report.published,
            retried = report.retried,
            quarantined = report.quarantined,
            deferred = report.deferred,
            unconfirmed = report.unconfirmed,
            waiting = report.waiting,
            "outbox batch"
        );
        Ok(report)
    }
}

/// Runs a claim in `tx`; on failure, rolls `tx` back.
pub(super) async fn claim_rows<'q>(
    mut tx: Transaction<'static, Postgres>,
    query: QueryAs<'q, Postgres, OutboxRow, <Postgres as Database>::Arguments>,
) -> Result<(Transaction<'static, Postgres>, Vec<OutboxRow>), ProducerError> {
    match query.fetch_all(&mut *tx).await {
        Ok(rows) => Ok((tx, rows)),
        Err(error) => {
            if is_stale_statement(&error) {
                // A migration changed a column the claim returns: its prepared statement
                // no longer fits the table. Closed, so prepared again on the next batch
                // (closing a statement is allowed in the aborted transaction).
                let _ = sqlx::Connection::clear_cached_statements(&mut *tx).await;
            }
            let _ = tx.rollback().await;
            Err(error.into())
        }
    }
}

/// "cached plan must not change result type" (0A000): a prepared statement whose result
/// columns a migration changed.
fn is_stale_statement(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .is_some_and(|e| e.code().as_deref() == Some("0A000"))
}
