//! [`Relay::run`]: batches until shutdown, waiting out outages as a whole.

use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use super::Relay;
use super::grace::Grace;
use super::kafka::broker_answers;
use crate::ProducerError;

/// Longest pause of [`Relay::run`] after a failed batch (database unreachable).
const RELAY_RETRY_MAX: Duration = Duration::from_secs(30);

/// How often an idle relay asks an unreachable cluster whether it is back, and how long it
/// waits for the answer: together, how soon after a broker's return publishing resumes.
const BROKER_PROBE_INTERVAL: Duration = Duration::from_secs(1);
const BROKER_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl Relay {
    /// Runs batches until `shutdown` is cancelled: immediately while batches come back full,
    /// otherwise on a `NOTIFY` from a committing writer or every `poll_interval`.
    ///
    /// When no broker answers, the relay stops claiming and asks the cluster every second
    /// whether it is back; the rows keep their attempt counts, however long the outage.
    ///
    /// Shutdown takes at most `shutdown_timeout` from the signal: a batch in flight is
    /// recorded with what was acknowledged by then (the rest stays pending and is published
    /// again later, same event ids), then the producer is flushed with what time is left.
    ///
    /// Returns [`ProducerError::FatalProducer`] when the producer can no longer be used;
    /// restart the relay with a new producer (its rows are still pending).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProducerError> {
        let config = &self.inner.config;
        let grace = Grace::start(shutdown.clone(), config.shutdown_timeout);
        let stats = tokio::spawn(self.clone().export_stats_until(shutdown.clone()));
        let mut listener = None;
        let mut failures = 0_u32;
        let result = loop {
            if shutdown.is_cancelled() {
                break Ok(());
            }
            if config.listen && listener.is_none() {
                listener = self.listen().await;
            }
            match self.run_batch(true, &grace.expired).await {
                Ok(report) if report.broker_unreachable => {
                    failures = 0;
                    tracing::warn!(
                        left_pending = report.unconfirmed,
                        "no broker answers; waiting for the cluster without charging rows"
                    );
                    self.wait_for_broker(&shutdown).await;
                    continue;
                }
                Ok(report) => {
                    failures = 0;
                    if report.claimed >= config.batch_size as usize {
                        continue;
                    }
                }
                Err(error @ ProducerError::FatalProducer { .. }) => {
                    tracing::error!(%error, "relay stops: its producer is unusable");
                    break Err(error);
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    // The database is down: retry soon enough to notice it is back.
                    let delay =
                        outbox_core::backoff(config.backoff_base, RELAY_RETRY_MAX, failures - 1);
                    tracing::warn!(%error, retry_in = ?delay, "relay batch failed");
                    tokio::select! {
                        () = shutdown.cancelled() => break Ok(()),
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => break Ok(()),
                () = tokio::time::sleep(config.poll_interval) => {}
                notified = recv(&mut listener) => {
                    if let Err(error) = notified {
                        tracing::warn!(%error, "outbox listener failed; polling until it reconnects");
                        listener = None;
                    }
                }
            }
        };
        stats.abort();
        result?;
        self.flush(&grace).await
    }

    /// Returns once a broker answers, or on shutdown.
    async fn wait_for_broker(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(BROKER_PROBE_INTERVAL) => {}
            }
            let probe = broker_answers(&self.inner.producer, None, BROKER_PROBE_TIMEOUT);
            tokio::select! {
                () = shutdown.cancelled() => return,
                answered = probe => if answered {
                    tracing::info!("a broker answers again; relay resumes");
                    return;
                },
            }
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        let listen = async {
            let channel: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT {}",
                crate::sql::channel_sql(&self.inner.config.tables.outbox)
            )))
            .fetch_one(&self.inner.pool)
            .await?;
            let mut listener = PgListener::connect_with(&self.inner.pool).await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        listen
            .await
            .inspect_err(
                |error| tracing::warn!(%error, "cannot LISTEN for outbox commits; polling only"),
            )
            .ok()
    }

    /// Flushes the producer with what is left of the grace period, off the async runtime
    /// (it blocks).
    async fn flush(&self, grace: &Grace) -> Result<(), ProducerError> {
        let producer = self.inner.producer.clone();
        let timeout = grace.remaining(self.inner.config.shutdown_timeout);
        let flushed = tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| ProducerError::Config(format!("flush task failed: {e}")))?;
        match flushed {
            Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) => {
                tracing::warn!(
                    ?timeout,
                    "producer flush timed out; unmarked rows stay pending and will be republished"
                );
                Ok(())
            }
            other => Ok(other?),
        }
    }
}

/// Waits for the next notification, draining any that queued up meanwhile; never resolves
/// when there is no listener.
async fn recv(listener: &mut Option<PgListener>) -> Result<(), sqlx::Error> {
    match listener {
        Some(l) => {
            l.recv().await?;
            while l.next_buffered().is_some() {}
            Ok(())
        }
        None => std::future::pending().await,
    }
}
