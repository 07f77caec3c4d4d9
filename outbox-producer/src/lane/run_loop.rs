//! [`Lane::run`]: batches until shutdown, waiting out a destination that does not answer.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::grace::Grace;
use super::{Destination, Lane};
use crate::ProducerError;
use crate::relay::BatchReport;

/// After shutdown's grace period, how long a batch (or a dispatcher's claim or record) may
/// still take to record what the destination acknowledged before the loop returns without it.
pub(crate) const SHUTDOWN_DB_MARGIN: Duration = Duration::from_millis(500);

/// Runs `work` (a batch, a claim, a record) on a task of its own. Until shutdown it runs to
/// the end; after the signal, it has until the grace period's end (`expired`) and
/// [`SHUTDOWN_DB_MARGIN`]. Work still waiting on the database then is left to its task,
/// never cancelled mid-statement (a future dropped inside `begin()` or a query can put a
/// connection back in the pool with its transaction open): it commits or rolls back when the
/// database answers, or its connection dies with the process. `None` if it was left.
pub(crate) async fn bounded<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
    expired: &CancellationToken,
) -> Option<T> {
    let mut task = tokio::spawn(work.in_current_span());
    let deadline = async {
        expired.cancelled().await;
        tokio::time::sleep(SHUTDOWN_DB_MARGIN).await;
    };
    tokio::select! {
        joined = &mut task => match joined {
            Ok(result) => Some(result),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Never aborted: only a runtime shutting down cancels it.
            Err(_) => None,
        },
        () = deadline => None,
    }
}

/// Longest pause after a failed batch (database unreachable).
const RETRY_MAX: Duration = Duration::from_secs(30);

impl<D: Destination> Lane<D> {
    /// Runs batches until `shutdown` is cancelled, `workers` side by side: immediately while
    /// batches come back full, otherwise on a `NOTIFY` from a committing writer or every
    /// `poll_interval`. When the destination does not answer, a worker stops claiming until
    /// [`Destination::wait_until_answers`] returns; the rows keep their attempt counts.
    ///
    /// Shutdown takes at most `shutdown_timeout` from the signal: a batch in flight is
    /// recorded with what was acknowledged by then (the rest stays pending), then the
    /// destination finishes with what time is left. A batch the database does not answer for
    /// is left to finish or roll back on its own (half a second past `shutdown_timeout`).
    /// A fatal error of one worker stops them all and is returned.
    pub(crate) async fn run(
        self: &Arc<Self>,
        shutdown: CancellationToken,
    ) -> Result<(), ProducerError> {
        let grace = Grace::start(shutdown.clone(), self.config.shutdown_timeout);
        // A fatal error of one worker stops the others.
        let stop = shutdown.child_token();
        let stats = tokio::spawn(Arc::clone(self).export_stats_until(stop.clone()));
        let Some(wake_ups) = self.wake_ups(&shutdown, &stop).await else {
            return Ok(());
        };
        let results = join_all((0..self.workers).map(|_| {
            let (lane, stop, expired, woken) = (
                Arc::clone(self),
                stop.clone(),
                grace.expired.clone(),
                wake_ups.woken.clone(),
            );
            async move {
                let result = lane.work(&stop, &expired, woken).await;
                if result.is_err() {
                    stop.cancel();
                }
                result
            }
        }))
        .await;
        stats.abort();
        drop(wake_ups);
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        self.destination
            .finish(grace.remaining(self.config.shutdown_timeout))
            .await
    }

    /// One worker: batches until `stop`.
    async fn work(
        self: &Arc<Self>,
        stop: &CancellationToken,
        expired: &CancellationToken,
        mut woken: watch::Receiver<u64>,
    ) -> Result<(), ProducerError> {
        let mut failures = 0_u32;
        loop {
            if stop.is_cancelled() {
                return Ok(());
            }
            let Some(batch) = self.bounded_batch(expired).await else {
                tracing::warn!(
                    "shutdown: the database did not answer within shutdown_timeout; the batch \
                     finishes or rolls back on its own, its rows stay pending until then"
                );
                return Ok(());
            };
            match batch {
                Ok(report) if report.broker_unreachable => {
                    failures = 0;
                    tracing::warn!(
                        left_pending = report.unconfirmed,
                        cause = self.destination.last_error(),
                        "the destination does not answer; waiting for it without charging rows"
                    );
                    self.destination.wait_until_answers(stop).await;
                    continue;
                }
                Ok(BatchReport {
                    claimed, deferred, ..
                }) => {
                    failures = 0;
                    // A full batch, or rows left for the next one (a key's later rows a
                    // dispatcher did not wait for): claim again at once.
                    if claimed >= self.config.batch_size as usize || deferred > 0 {
                        continue;
                    }
                }
                Err(error @ ProducerError::FatalProducer { .. }) => {
                    tracing::error!(%error, "outbox lane stops: its destination is unusable");
                    return Err(error);
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    // The database is down: retry soon enough to notice it is back.
                    let delay =
                        outbox_core::backoff(self.config.backoff_base, RETRY_MAX, failures - 1);
                    tracing::warn!(%error, retry_in = ?delay, "outbox batch failed");
                    tokio::select! {
                        () = stop.cancelled() => return Ok(()),
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(self.config.poll_interval) => {}
                // A commit notified since this worker last looked (also during its batch).
                _ = woken.changed() => {}
            }
        }
    }

    /// One batch, [`bounded`] by shutdown's grace period.
    async fn bounded_batch(
        self: &Arc<Self>,
        expired: &CancellationToken,
    ) -> Option<Result<BatchReport, ProducerError>> {
        let (lane, until) = (Arc::clone(self), expired.clone());
        bounded(async move { lane.run_batch(true, &until).await }, expired).await
    }
}

/// A lane's wake-ups: a `NOTIFY` from a committing writer (or a reconnected listener).
pub(crate) struct WakeUps {
    pub(crate) woken: watch::Receiver<u64>,
    /// Held as long as the receivers wait, so that `changed()` never fails.
    _wake: Arc<watch::Sender<u64>>,
    listener: Option<JoinHandle<()>>,
}

impl Drop for WakeUps {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

impl<D: Send + Sync + 'static> Lane<D> {
    /// Starts listening (when `listen` is on) before the first batch: a commit between that
    /// batch's claim and a later LISTEN would wake nobody until `poll_interval`. `None` if
    /// `shutdown` came first.
    pub(crate) async fn wake_ups(
        self: &Arc<Self>,
        shutdown: &CancellationToken,
        stop: &CancellationToken,
    ) -> Option<WakeUps> {
        let (wake, woken) = watch::channel(0_u64);
        let wake = Arc::new(wake);
        let listener = if self.config.listen {
            let first = tokio::select! {
                () = shutdown.cancelled() => return None,
                listener = self.listen() => listener,
            };
            Some(tokio::spawn(Arc::clone(self).listen_until(
                first,
                Arc::clone(&wake),
                stop.clone(),
            )))
        } else {
            None
        };
        Some(WakeUps {
            woken,
            _wake: wake,
            listener,
        })
    }

    /// Listens for the table's commit notifications and wakes the workers, reconnecting
    /// after a failure (the workers poll meanwhile).
    async fn listen_until(
        self: Arc<Self>,
        mut listener: Option<PgListener>,
        wake: Arc<watch::Sender<u64>>,
        stop: CancellationToken,
    ) {
        loop {
            if let Some(mut listener) = listener.take() {
                loop {
                    let notified = tokio::select! {
                        () = stop.cancelled() => return,
                        notified = listener.recv() => notified,
                    };
                    if let Err(error) = notified {
                        tracing::warn!(%error, "outbox listener failed; polling until it reconnects");
                        break;
                    }
                    while listener.next_buffered().is_some() {}
                    wake.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
            // Connecting holds no transaction: safe to drop on shutdown.
            listener = tokio::select! {
                () = stop.cancelled() => return,
                listener = self.listen() => listener,
            };
            // Commits while no one listened notified no one.
            wake.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    async fn listen(&self) -> Option<PgListener> {
        let listen = async {
            let channel: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT {}",
                crate::sql::channel_sql(&self.config.tables.outbox)
            )))
            .fetch_one(&self.pool)
            .await?;
            let mut listener = PgListener::connect_with(&self.pool).await?;
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
}
