//! A leasing lane (a dispatcher's): the claim leases its rows and commits at once, and the
//! verdicts are recorded later, in transactions of their own, fenced by the lease. No
//! transaction, row lock or advisory lock stays open across a call.

use std::time::Duration;

use super::batch::claim_rows;
use super::{Lane, OutboxRow, Verdict, record, transaction};
use crate::ProducerError;
use crate::relay::BatchReport;

/// What a lease adds to its calls' timeouts: time to record the answer. A dispatcher cut
/// off from the database longer than that may see its action called again by another (with
/// the same key); a dispatcher that died leaves its actions claimable that much sooner.
pub(crate) const LEASE_MARGIN: Duration = Duration::from_secs(10);

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl<D> Lane<D> {
    /// Claims up to `n` due rows and leases them: a key's k-th row of the claim until `k`
    /// times `call_timeout` and [`LEASE_MARGIN`] from now. Committed when it returns.
    pub(crate) async fn claim_leased(
        &self,
        n: u32,
        call_timeout: Duration,
    ) -> Result<Vec<OutboxRow>, ProducerError> {
        let tx = transaction::begin(&self.pool).await?;
        let query = sqlx::query_as(self.sql.claim.clone())
            .bind(i64::from(n))
            .bind(uuid::Uuid::now_v7())
            .bind(millis(call_timeout))
            .bind(millis(LEASE_MARGIN));
        let (tx, rows) = claim_rows(tx, query).await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Gives up the pending rows older than `max_age` that no live lease holds (the ones held
    /// behind a quarantined row of their key, or waiting out a long pause, which no claim
    /// reaches): quarantined without a call. Returns how many.
    pub(crate) async fn give_up_expired(&self, max_age: Duration) -> Result<u64, ProducerError> {
        Ok(sqlx::query(self.sql.give_up_expired.clone())
            .bind(millis(max_age))
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    /// Records the verdicts of leased rows, in a transaction of its own.
    pub(crate) async fn record_leased(
        &self,
        rows: &[OutboxRow],
        verdicts: Vec<Verdict>,
    ) -> Result<BatchReport, ProducerError> {
        let mut tx = transaction::begin(&self.pool).await?;
        let report = record::record(&mut tx, self, rows, verdicts).await?;
        tx.commit().await?;
        Ok(report)
    }
}
