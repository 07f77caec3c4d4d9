//! [`Relay::run`]: batches until shutdown, waiting out outages as a whole.

use rdkafka::client::ClientContext;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer;
use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::grace::Grace;
use super::kafka::broker_answers;
use super::{BatchReport, Relay};
use crate::ProducerError;

/// After shutdown's grace period, how long a batch may still take to record what Kafka
/// acknowledged before [`Relay::run`] returns without it.
const SHUTDOWN_DB_MARGIN: Duration = Duration::from_millis(500);

/// Longest pause of [`Relay::run`] after a failed batch (database unreachable).
const RELAY_RETRY_MAX: Duration = Duration::from_secs(30);

/// How often an idle relay asks an unreachable cluster whether it is back, and how long it
/// waits for the answer: together, how soon after a broker's return publishing resumes.
const BROKER_PROBE_INTERVAL: Duration = Duration::from_secs(1);
const BROKER_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl<C: ClientContext + 'static> Relay<C> {
    /// Runs batches until `shutdown` is cancelled: immediately while batches come back full,
    /// otherwise on a `NOTIFY` from a committing writer or every `poll_interval`.
    ///
    /// When no broker answers, the relay stops claiming and asks the cluster every second
    /// whether it is back; the rows keep their attempt counts, however long the outage.
    ///
    /// Shutdown takes at most `shutdown_timeout` from the signal: a batch in flight is
    /// recorded with what was acknowledged by then (the rest stays pending and is published
    /// again later, same event ids), then the producer is flushed with what time is left. A
    /// batch the database does not answer for is left to finish or roll back on its own
    /// (half a second past `shutdown_timeout`): its rows stay pending until then.
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
                // Connecting holds no transaction: safe to drop on shutdown.
                listener = tokio::select! {
                    () = shutdown.cancelled() => break Ok(()),
                    listener = self.listen() => listener,
                };
            }
            let Some(batch) = self.bounded_batch(&grace).await else {
                tracing::warn!(
                    "shutdown: the database did not answer within shutdown_timeout; the batch \
                     finishes or rolls back on its own, its rows stay pending until then"
                );
                break Ok(());
            };
            match batch {
                Ok(report) if report.broker_unreachable => {
                    failures = 0;
                    tracing::warn!(
                        left_pending = report.unconfirmed,
                        cause = self.inner.client_error.get(),
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

    /// One batch, on a task of its own. Until shutdown it runs to the end; after the signal,
    /// it has until the grace period's end (plus [`SHUTDOWN_DB_MARGIN`] to record what was
    /// acknowledged by then). A batch still waiting on the database then is left to its task,
    /// never cancelled mid-statement (a future dropped inside `begin()` or a query can put a
    /// connection back in the pool with its transaction open): it commits or rolls back when
    /// the database answers, or its connection dies with the process. `None` if it was left.
    async fn bounded_batch(&self, grace: &Grace) -> Option<Result<BatchReport, ProducerError>> {
        let mut batch = tokio::spawn({
            let (relay, expired) = (self.clone(), grace.expired.clone());
            async move { relay.run_batch(true, &expired).await }.in_current_span()
        });
        let deadline = async {
            grace.expired.cancelled().await;
            tokio::time::sleep(SHUTDOWN_DB_MARGIN).await;
        };
        tokio::select! {
            joined = &mut batch => Some(match joined {
                Ok(result) => result,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => Err(ProducerError::Config(format!("relay batch task failed: {e}"))),
            }),
            () = deadline => None,
        }
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
