//! Pruning the dedup store in-process, on a schedule: [`prune`](crate::prune) in a loop, for
//! applications that would rather not run `outbox prune dedup` from cron.

use std::time::Duration;

use outbox_core::TableNames;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::{ConsumerError, DedupPruned, prune};

/// Runs [`prune`](crate::prune) every `interval` until cancelled. Any number of instances may
/// run (one per consumer process, say): one prunes at a time, the others find it pruning and
/// skip that turn. Its pool must connect as the dedup table's owner (dropping and making day
/// slices needs it; the guide, operating, "Roles"), not as a least-privileged consumer's role.
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) {
/// use std::time::Duration;
/// use outbox_consumer::DedupPruner;
/// use tokio_util::sync::CancellationToken;
///
/// let shutdown = CancellationToken::new();
/// let pruner = DedupPruner::new(pool, Duration::from_secs(7 * 24 * 3600));
/// tokio::spawn(pruner.run(shutdown.clone()));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct DedupPruner {
    pool: PgPool,
    tables: TableNames,
    older_than: Duration,
    interval: Duration,
    batch: u32,
}

impl DedupPruner {
    /// Prunes ids older than `older_than` (see [`prune`](crate::prune) for choosing it) every
    /// hour, 1,000 timeless rows per statement, in the default tables.
    pub fn new(pool: PgPool, older_than: Duration) -> Self {
        Self {
            pool,
            tables: TableNames::default(),
            older_than,
            interval: Duration::from_secs(3600),
            batch: 1_000,
        }
    }

    /// Sets the tables.
    pub fn tables(mut self, tables: TableNames) -> Self {
        self.tables = tables;
        self
    }

    /// Sets how often it prunes.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Prunes once.
    pub async fn run_once(&self) -> Result<DedupPruned, ConsumerError> {
        let mut conn = self.pool.acquire().await?;
        prune(&mut conn, &self.tables, self.older_than, self.batch).await
    }

    /// Prunes now and then every `interval` until `shutdown`. A failed turn is logged and the
    /// next one tried (the database may be back by then). A turn in progress finishes before
    /// it looks at `shutdown`: its statements are short, and a detach is not left half done.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            match self.run_once().await {
                Ok(pruned) if pruned != DedupPruned::default() => {
                    tracing::info!(
                        slices_dropped = pruned.slices_dropped,
                        timeless_rows = pruned.timeless_rows,
                        slices_made = pruned.slices_made,
                        "pruned the dedup store"
                    );
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "pruning the dedup store failed; trying again next turn")
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
