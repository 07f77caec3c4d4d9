//! The dispatcher's loop: claim what free call slots can take (leased and committed at once),
//! perform each key's actions on a task of its own, and record verdicts as they arrive, many
//! in one transaction. A slow call holds its own slot and key, nothing else.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::Executor;
use super::calls::{Calls, Results};
use super::health::Admission;
use crate::ProducerError;
use crate::lane::{Grace, Lane, OutboxRow, Verdict, chains};
use crate::relay::BatchReport;

/// Most verdicts recorded in one transaction.
const RECORD_BATCH: usize = 512;

/// Longest pause after a claim or a record failed (the database is unreachable).
const RETRY_MAX: Duration = Duration::from_secs(30);

/// After shutdown's grace period, how long recording what was answered may still take.
const SHUTDOWN_DB_MARGIN: Duration = Duration::from_millis(500);

pub(super) type DispatchLane<E> = Lane<Calls<E>>;

/// A batch's rows as one owned group per key, each in sequence order.
fn by_key(rows: Vec<OutboxRow>) -> Vec<Vec<OutboxRow>> {
    let groups = chains(&rows);
    let mut rows: Vec<Option<OutboxRow>> = rows.into_iter().map(Some).collect();
    groups
        .into_iter()
        .map(|group| group.into_iter().filter_map(|i| rows[i].take()).collect())
        .collect()
}

/// Spawns a task per key of `rows`, each holding a call slot: `first` for the first key,
/// then free ones (a claim never takes more rows than there were free slots).
async fn spawn_keys<E: Executor>(
    lane: &Arc<DispatchLane<E>>,
    rows: Vec<OutboxRow>,
    mut first: Option<OwnedSemaphorePermit>,
    tasks: &mut JoinSet<()>,
    expired: &CancellationToken,
    results: &Results,
    finished: &Arc<Notify>,
) {
    for key in by_key(rows) {
        let permit = match first.take() {
            Some(permit) => permit,
            None => match Arc::clone(&lane.destination.in_flight)
                .acquire_owned()
                .await
            {
                Ok(permit) => permit,
                // The semaphore is never closed.
                Err(_) => return,
            },
        };
        let (lane, expired, results, finished) = (
            Arc::clone(lane),
            expired.clone(),
            results.clone(),
            Arc::clone(finished),
        );
        tasks.spawn(async move {
            lane.destination.run_chain(key, &expired, &results).await;
            drop(permit);
            finished.notify_one();
        });
    }
}

/// Records verdicts as they arrive until every sender is gone, many per transaction. A
/// record that fails is tried again until `give_up` (the dispatcher stopped for good): the
/// actions then keep their leases, which run out, and are called again with the same key.
async fn record_until_closed<E: Executor>(
    lane: Arc<DispatchLane<E>>,
    mut results: mpsc::UnboundedReceiver<(OutboxRow, Verdict)>,
    recorded: Arc<Notify>,
    give_up: CancellationToken,
) {
    while let Some(first) = results.recv().await {
        let mut batch = vec![first];
        while batch.len() < RECORD_BATCH {
            match results.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (rows, verdicts): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let mut failures = 0_u32;
        loop {
            match lane.record_leased(&rows, verdicts.clone()).await {
                Ok(_) => break,
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay =
                        outbox_core::backoff(lane.config.backoff_base, RETRY_MAX, failures - 1);
                    tracing::warn!(%error, retry_in = ?delay, actions = rows.len(), "cannot record dispatched actions; trying again");
                    tokio::select! {
                        () = give_up.cancelled() => {
                            tracing::warn!(actions = rows.len(), "shutdown: results not recorded; their actions are called again, same key, once their leases end");
                            break;
                        }
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        recorded.notify_one();
    }
}

/// Claims one batch (ignoring the destination's health), performs it and records it: for
/// tests.
pub(super) async fn run_once<E: Executor>(
    lane: &Arc<DispatchLane<E>>,
) -> Result<BatchReport, ProducerError> {
    let calls = &lane.destination;
    let rows = lane
        .claim_leased(lane.config.batch_size, calls.config.call_timeout)
        .await?;
    let (results, mut received) = mpsc::unbounded_channel();
    let mut tasks = JoinSet::new();
    let expired = CancellationToken::new();
    let finished = Arc::new(Notify::new());
    spawn_keys(lane, rows, None, &mut tasks, &expired, &results, &finished).await;
    drop(results);
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    #[cfg(feature = "fault-injection")]
    if calls
        .crashed
        .swap(false, std::sync::atomic::Ordering::SeqCst)
    {
        // Nothing of the batch recorded, as a process dead after its calls: the actions keep
        // their leases, and are called again with the same keys once those end.
        return Err(ProducerError::InjectedFault(
            "crash after the call, before the record",
        ));
    }
    let mut batch = Vec::new();
    while let Some(result) = received.recv().await {
        batch.push(result);
    }
    let (rows, verdicts): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    if rows.is_empty() {
        return Ok(BatchReport::default());
    }
    let mut report = lane.record_leased(&rows, verdicts).await?;
    report.broker_unreachable = calls.health.reason().is_some();
    Ok(report)
}

/// Runs until `shutdown`: see [`super::Dispatcher::run`].
pub(super) async fn run<E: Executor>(
    lane: &Arc<DispatchLane<E>>,
    shutdown: CancellationToken,
) -> Result<(), ProducerError> {
    let config = &lane.config;
    let calls = &lane.destination;
    let grace = Grace::start(shutdown.clone(), config.shutdown_timeout);
    let stop = shutdown.child_token();
    let stats = tokio::spawn(Arc::clone(lane).export_stats_until(stop.clone()));
    let Some(wake_ups) = lane.wake_ups(&shutdown, &stop).await else {
        return Ok(());
    };
    let mut woken = wake_ups.woken.clone();
    let (results, received) = mpsc::unbounded_channel();
    let recorded = Arc::new(Notify::new());
    let give_up = CancellationToken::new();
    let recorder = tokio::spawn(record_until_closed(
        Arc::clone(lane),
        received,
        Arc::clone(&recorded),
        give_up.clone(),
    ));
    let finished = Arc::new(Notify::new());
    let mut tasks = JoinSet::new();
    let mut failures = 0_u32;
    let max_in_flight = calls.config.max_in_flight;
    loop {
        // Reap the keys that finished (their slots are free already).
        while tasks.try_join_next().is_some() {}
        let limit = match calls.health.admission() {
            Admission::PausedUntil(until) => {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep_until(until) => continue,
                }
            }
            // Down: one action probes it, once no other call is in flight.
            Admission::Probe if calls.in_flight.available_permits() < max_in_flight => {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = finished.notified() => continue,
                }
            }
            Admission::Probe => 1,
            Admission::Open => config.batch_size,
        };
        let first = tokio::select! {
            () = stop.cancelled() => break,
            permit = Arc::clone(&calls.in_flight).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        // The wait for a slot may have outlasted the destination's health (a 429 or an
        // outage answered meanwhile).
        let still = calls.health.admission();
        if !(still == Admission::Open || (still == Admission::Probe && limit == 1)) {
            drop(first);
            continue;
        }
        if still == Admission::Probe {
            calls.health.probing();
        }
        let free = u32::try_from(1 + calls.in_flight.available_permits()).unwrap_or(u32::MAX);
        let n = limit.min(free);
        // A claim holds no transaction past its own statement, and is never dropped midway
        // (see pitfalls: a future cancelled inside `begin()` can pool an open transaction).
        let claimed = lane.claim_leased(n, calls.config.call_timeout).await;
        let rows = match claimed {
            Ok(rows) => {
                failures = 0;
                rows
            }
            Err(error) => {
                drop(first);
                failures = failures.saturating_add(1);
                let delay = outbox_core::backoff(config.backoff_base, RETRY_MAX, failures - 1);
                tracing::warn!(%error, retry_in = ?delay, "dispatcher claim failed");
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(delay) => continue,
                }
            }
        };
        let full = rows.len() >= n as usize;
        if rows.is_empty() {
            drop(first);
        } else {
            spawn_keys(
                lane,
                rows,
                Some(first),
                &mut tasks,
                &grace.expired,
                &results,
                &finished,
            )
            .await;
        }
        if full {
            continue;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(config.poll_interval) => {}
            // A commit notified since the last look (also during the claim).
            _ = woken.changed() => {}
            // Recorded verdicts free a key's later actions, and released ones.
            () = recorded.notified() => {}
        }
    }
    // Shutdown: the keys in flight end by the grace period's end at the latest (a call
    // still running then is dropped, its action released for another call, same key).
    while tasks.join_next().await.is_some() {}
    drop(results);
    stats.abort();
    drop(wake_ups);
    let deadline = async {
        grace.expired.cancelled().await;
        tokio::time::sleep(SHUTDOWN_DB_MARGIN).await;
    };
    let mut recorder = recorder;
    tokio::select! {
        _ = &mut recorder => {}
        () = deadline => {
            give_up.cancel();
            let _ = recorder.await;
        }
    }
    Ok(())
}
