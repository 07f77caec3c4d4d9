//! Bounding the consumer quarantine: a flood of poison is kept as long as operators need to
//! look at it, not for ever. Rows older than an age are deleted in bounded batches, each its
//! own short transaction with its own audit row, like the dedup table's timeless slice.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, PgConnection};

use crate::ConsumerError;
use crate::quarantine::quarantine;

/// Deletes the messages quarantined more than `older_than` ago, of every consumer, at most
/// `batch` per statement, each batch its own transaction (committed before the next) that also
/// is recorded as one `prune` row in `outbox_quarantine_audit` (how many it deleted, their
/// least and greatest id and `quarantined_at`; their ids for batches up to a thousand rows:
/// past that, a flood would double in the audit).
/// Runs one instance at a time (another finds it running and returns 0 at once), beside
/// running consumers: rows another transaction holds are skipped until the next run. Returns
/// how many rows were deleted. A table that is not a registered consumer quarantine is
/// refused with `CoreError::NotAQuarantineTable`, nothing deleted.
///
/// Run it on a schedule (`outbox prune quarantine --older-than 30d --yes` from cron), with an
/// age long enough for someone to requeue what deserves it.
pub async fn prune_quarantine(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
    reason: Option<&str>,
) -> Result<u64, ConsumerError> {
    let quarantine = quarantine(tables);
    let delete = quarantine
        .prune_statement(conn, "quarantined_at", reason)
        .await?;
    Ok(
        outbox_core::delete_in_batches(
            conn,
            &tables.consumer_quarantine,
            delete,
            older_than,
            batch,
        )
        .await?,
    )
}

/// One batch of [`prune_quarantine`], in the caller's transaction: deletes at most `batch`
/// messages quarantined more than `older_than` ago, the oldest first from `from` on (`None`:
/// from the oldest; pass the previous batch's answer to go on), with its audit row. Returns
/// how many it deleted and the latest `quarantined_at` among them; fewer than `batch` means
/// nothing older is left (but rows other transactions held). Takes no lock: the caller runs
/// one pruner at a time.
pub async fn prune_quarantine_batch(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
    from: Option<DateTime<Utc>>,
    reason: Option<&str>,
) -> Result<(u64, Option<DateTime<Utc>>), ConsumerError> {
    let quarantine = quarantine(tables);
    let delete = quarantine
        .prune_statement(conn, "quarantined_at", reason)
        .await?;
    let (n, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(AssertSqlSafe(delete))
        .bind(older_than.as_secs_f64() * 1000.0)
        .bind(i64::from(batch.max(1)))
        .bind(from)
        .fetch_one(conn)
        .await?;
    Ok((u64::try_from(n).unwrap_or(0), last))
}
