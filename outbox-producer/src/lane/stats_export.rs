//! The outbox's depth, lag and quarantine gauges, refreshed on their own task so that reading
//! them never delays a batch.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use std::sync::Arc;

use super::{Destination, Lane};

/// How often [`Lane::run`] refreshes the gauges.
const STATS_INTERVAL: Duration = Duration::from_secs(5);

impl<D: Destination> Lane<D> {
    pub(super) async fn export_stats_until(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            self.export_stats().await;
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(STATS_INTERVAL) => {}
            }
        }
    }

    /// Sets the gauges (a failure only skips this export).
    async fn export_stats(&self) {
        let tables = &self.config.tables;
        let stats = async {
            let mut conn = self.pool.acquire().await?;
            crate::stats(&mut conn, tables).await
        };
        match stats.await {
            Ok(s) => {
                let table = tables.outbox.as_str().to_owned();
                metrics::gauge!("outbox_pending", "table" => table.clone()).set(s.pending as f64);
                metrics::gauge!("outbox_quarantined", "table" => table.clone())
                    .set(s.quarantined as f64);
                metrics::gauge!("outbox_oldest_pending_age_seconds", "table" => table)
                    .set(s.oldest_pending_age_ms.unwrap_or(0) as f64 / 1000.0);
            }
            Err(error) => tracing::debug!(%error, "cannot read outbox stats for metrics"),
        }
    }
}
