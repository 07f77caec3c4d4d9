//! A lane's depth, lag and quarantine gauges, refreshed on their own task so that reading
//! them never delays a batch.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use std::sync::Arc;

use super::Lane;

/// How often [`Lane::run`] refreshes the gauges.
const STATS_INTERVAL: Duration = Duration::from_secs(5);

impl<D: Send + Sync + 'static> Lane<D> {
    pub(crate) async fn export_stats_until(self: Arc<Self>, shutdown: CancellationToken) {
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
            crate::maintenance::stats_where(&mut conn, tables, &self.sql.lane_rows).await
        };
        match stats.await {
            Ok(s) => {
                let names = &self.metrics;
                metrics::gauge!(names.pending, &names.labels).set(s.pending as f64);
                metrics::gauge!(names.quarantined_now, &names.labels).set(s.quarantined as f64);
                metrics::gauge!(names.oldest_pending, &names.labels)
                    .set(s.oldest_pending_age_ms.unwrap_or(0) as f64 / 1000.0);
            }
            Err(error) => tracing::debug!(%error, "cannot read outbox stats for metrics"),
        }
    }
}
