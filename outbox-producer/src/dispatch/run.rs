//! The dispatcher's loop: claim ahead of the free call slots (leased and committed at once),
//! perform each key's actions on a task of its own once it has a slot, and record verdicts as
//! they arrive, many in one transaction. A slow call holds its own slot and key, nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Executor;
use super::calls::{Calls, Results};
use super::config::MAX_BATCH_ANSWER_BYTES;
use super::health::Admission;
use crate::ProducerError;
use crate::lane::{
    Grace, LEASE_MARGIN, Lane, OutboxRow, SHUTDOWN_DB_MARGIN, Verdict, bounded, chains,
};
use crate::relay::BatchReport;

/// Most verdicts recorded in one transaction.
const RECORD_BATCH: usize = 512;

/// Most verdicts recorded in one statement: [`RECORD_BATCH`], and no more answers of
/// `max_answer_bytes` each than PostgreSQL takes in one message (one statement carries them
/// all; 64 at the default 8 MiB).
fn record_batch(max_answer_bytes: usize) -> usize {
    (MAX_BATCH_ANSWER_BYTES / max_answer_bytes.max(1)).clamp(1, RECORD_BATCH)
}

/// Failed tries of a batch's record before its verdicts are recorded one by one, so that one
/// the database refuses fails alone.
const RECORD_TRIES_TOGETHER: u32 = 3;

/// Longest pause after a claim or a record failed (the database is unreachable).
const RETRY_MAX: Duration = Duration::from_secs(30);

/// How often pending actions past `max_age` that no claim reaches (held behind a quarantined
/// one, or waiting out a long pause) are given up.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

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

/// The rows claimed and not yet performed. The claim loop claims ahead of the free slots,
/// so that the slots freed while a claim runs (4-7 ms) are filled at once, and only while
/// fewer than a claim's worth wait for a slot (rows that wait use up their leases); under a
/// rate limit, only what the rate lets start well within a lease, all of these rows first.
#[derive(Debug, Default)]
struct Claimed {
    /// Rows whose key waits for a call slot.
    waiting: AtomicUsize,
    /// Rows whose key's task has not ended.
    outstanding: AtomicUsize,
    /// A key got its slot (or gave up waiting).
    started: Notify,
}

impl Claimed {
    fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::SeqCst)
    }

    fn add(&self, n: usize) {
        self.waiting.fetch_add(n, Ordering::SeqCst);
        self.outstanding.fetch_add(n, Ordering::SeqCst);
    }

    fn started(&self, n: usize) {
        self.waiting.fetch_sub(n, Ordering::SeqCst);
        self.started.notify_one();
    }
}

/// Counts a key's rows out of [`Claimed::outstanding`] when its task ends, however it ends
/// (a panic included).
struct Ended(Arc<Claimed>, usize);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(self.1, Ordering::SeqCst);
    }
}

/// What the key tasks of a dispatcher share.
struct Keys<'a> {
    tasks: &'a mut JoinSet<()>,
    /// Shutdown: rows still waiting for a slot then are released untried.
    stop: &'a CancellationToken,
    expired: &'a CancellationToken,
    results: &'a Results,
    claimed: &'a Arc<Claimed>,
}

/// Spawns a task per key of `rows`, each waiting for a call slot (in claim order: the
/// semaphore is fair) and holding it while it performs its key's rows. `probe`: the claim
/// is the destination's probe (or a test's), whose key is called whatever the destination's
/// health; other keys that got their slot after the destination went down are released
/// untried, so that one call probes it, not every key claimed ahead of the slots.
fn spawn_keys<E: Executor>(
    lane: &Arc<DispatchLane<E>>,
    rows: Vec<OutboxRow>,
    claimed_at: Instant,
    probe: bool,
    keys: &mut Keys<'_>,
) {
    for key in by_key(rows) {
        let n = key.len();
        keys.claimed.add(n);
        let (lane, stop, expired, results, claimed) = (
            Arc::clone(lane),
            keys.stop.clone(),
            keys.expired.clone(),
            keys.results.clone(),
            Arc::clone(keys.claimed),
        );
        keys.tasks.spawn(async move {
            let _ended = Ended(Arc::clone(&claimed), n);
            let calls = &lane.destination;
            let permit = tokio::select! {
                biased;
                () = stop.cancelled() => None,
                // The semaphore is never closed.
                permit = Arc::clone(&calls.in_flight).acquire_owned() => permit.ok(),
                // Past it, the lease no longer allows the key's first call: released for a
                // later claim instead of taking a slot only to give it back.
                () = tokio::time::sleep_until(claimed_at + LEASE_MARGIN / 2) => None,
            };
            claimed.started(n);
            match permit {
                Some(permit) if probe || calls.health.is_open() => {
                    calls.run_chain(key, claimed_at, &expired, &results).await;
                    drop(permit);
                }
                _ => {
                    for row in key {
                        let _ = results.send((row, Verdict::Deferred));
                    }
                }
            }
        });
    }
}

/// Records verdicts as they arrive until every sender is gone, many per transaction; while a
/// record fails, `failing` is set (and the claim loop claims nothing). A batch that fails
/// [`RECORD_TRIES_TOGETHER`] times is recorded verdict by verdict; a verdict the database
/// refuses alone is dropped (its action keeps its lease, which runs out: it is called again
/// with the same key). Stops trying at `give_up` (the dispatcher stopped for good).
async fn record_until_closed<E: Executor>(
    lane: Arc<DispatchLane<E>>,
    mut results: mpsc::UnboundedReceiver<(OutboxRow, Verdict)>,
    recorded: Arc<Notify>,
    failing: Arc<AtomicBool>,
    give_up: CancellationToken,
) {
    let most = record_batch(lane.max_answer_bytes);
    while let Some(first) = results.recv().await {
        let mut batch = vec![first];
        while batch.len() < most {
            match results.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (rows, verdicts): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let mut failures = 0_u32;
        loop {
            if failures >= RECORD_TRIES_TOGETHER && rows.len() > 1 {
                record_one_by_one(&lane, &rows, verdicts, &give_up).await;
                break;
            }
            match lane.record_leased(&rows, verdicts.clone()).await {
                Ok(_) => break,
                Err(error) => {
                    failing.store(true, Ordering::SeqCst);
                    failures = failures.saturating_add(1);
                    let delay =
                        outbox_core::backoff(lane.config.backoff_base, RETRY_MAX, failures - 1);
                    tracing::warn!(%error, retry_in = ?delay, actions = rows.len(), "cannot record dispatched actions; trying again");
                    tokio::select! {
                        biased;
                        () = give_up.cancelled() => {
                            tracing::warn!(actions = rows.len(), "shutdown: results not recorded; their actions are called again, same key, once their leases end");
                            break;
                        }
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        failing.store(false, Ordering::SeqCst);
        recorded.notify_one();
    }
}

async fn record_one_by_one<E: Executor>(
    lane: &DispatchLane<E>,
    rows: &[OutboxRow],
    verdicts: Vec<Verdict>,
    give_up: &CancellationToken,
) {
    for (row, verdict) in rows.iter().zip(verdicts) {
        if give_up.is_cancelled() {
            return;
        }
        if let Err(error) = lane
            .record_leased(std::slice::from_ref(row), vec![verdict])
            .await
        {
            tracing::error!(%error, event_id = %row.id, "the database refuses this action's result; it is called again, same key, once its lease ends");
        }
    }
}

/// Claims one batch (ignoring the destination's health), performs it and records it: for
/// tests.
pub(super) async fn run_once<E: Executor>(
    lane: &Arc<DispatchLane<E>>,
) -> Result<BatchReport, ProducerError> {
    let calls = &lane.destination;
    let claimed_at = Instant::now();
    let rows = lane
        .claim_leased(lane.config.batch_size, calls.config.call_timeout)
        .await?;
    let (results, mut received) = mpsc::unbounded_channel();
    let mut tasks = JoinSet::new();
    let expired = CancellationToken::new();
    let stop = CancellationToken::new();
    let mut keys = Keys {
        tasks: &mut tasks,
        stop: &stop,
        expired: &expired,
        results: &results,
        claimed: &Arc::new(Claimed::default()),
    };
    spawn_keys(lane, rows, claimed_at, true, &mut keys);
    drop(results);
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
    #[cfg(feature = "fault-injection")]
    if calls.crashed.swap(false, Ordering::SeqCst) {
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

/// Most actions one claim may take: what the destination admits, the call slots
/// (`slots`: all of them, since calls end while the claim runs and its rows wait for the
/// next free slots; one while the destination is probed), and, under a rate limit, what the
/// limit lets start well within a lease, after the calls already booked (`rate`: calls per
/// second, and how far ahead they are booked). 0 when the calls booked already reach that
/// far.
fn claim_size(limit: u32, slots: usize, rate: Option<(f64, Duration)>) -> u32 {
    let free = u32::try_from(slots).unwrap_or(u32::MAX);
    let by_rate = rate.map_or(u32::MAX, |(rate, booked)| {
        let window = (LEASE_MARGIN / 2).saturating_sub(booked);
        // Saturating float-to-int cast.
        (rate * window.as_secs_f64()) as u32
    });
    limit.min(free).min(by_rate)
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
    let failing = Arc::new(AtomicBool::new(false));
    let give_up = CancellationToken::new();
    let mut recorder = tokio::spawn(record_until_closed(
        Arc::clone(lane),
        received,
        Arc::clone(&recorded),
        Arc::clone(&failing),
        give_up.clone(),
    ));
    let claimed = Arc::new(Claimed::default());
    let mut tasks = JoinSet::new();
    let mut failures = 0_u32;
    let max_in_flight = calls.config.max_in_flight;
    let mut last_sweep: Option<Instant> = None;
    loop {
        // Reap the keys that finished (their slots are free already).
        while let Some(joined) = tasks.try_join_next() {
            if let Err(e) = joined
                && e.is_panic()
            {
                tracing::error!(
                    "a dispatcher task panicked; its actions are called again once their leases end"
                );
            }
        }
        if stop.is_cancelled() {
            break;
        }
        if last_sweep.is_none_or(|at| at.elapsed() >= SWEEP_INTERVAL) {
            last_sweep = Some(Instant::now());
            let sweep = {
                let lane = Arc::clone(lane);
                let max_age = calls.config.max_age;
                async move { lane.give_up_expired(max_age).await }
            };
            match bounded(sweep, &grace.expired).await {
                Some(Ok(0)) | None => {}
                Some(Ok(n)) => tracing::warn!(
                    actions = n,
                    "gave up pending actions older than max_age that no claim reached"
                ),
                Some(Err(error)) => tracing::warn!(%error, "cannot give up expired actions"),
            }
        }
        // While results cannot be recorded, a claim would only lease more to call again.
        if failing.load(Ordering::SeqCst) {
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = recorded.notified() => continue,
                () = tokio::time::sleep(RETRY_MAX) => continue,
            }
        }
        let (limit, probe) = match calls.health.admission() {
            Admission::PausedUntil(until) => {
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep_until(until) => continue,
                }
            }
            // Down: one action probes it, once no other key is under way. Awaited on the
            // join set itself: a task's own notice could come before the set counts it done,
            // and the loop then waited for a notice no task was left to give.
            Admission::Probe if !tasks.is_empty() => {
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    _ = tasks.join_next() => continue,
                }
            }
            Admission::Probe => (1, true),
            Admission::Open => (config.batch_size, false),
        };
        // Claimed ahead of the free slots, while fewer than a claim's worth of rows wait for
        // one: a claim taking only the slots free when it began left the ones freed during it
        // idle until the next (at 20 ms per call, 14 of 64 slots per claim, 0.67 of what 64
        // slots allow; bench P9b, 2026-12-07).
        if claimed.waiting() >= (limit as usize).min(max_in_flight) {
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = claimed.started.notified() => continue,
            }
        }
        if probe {
            calls.health.probing();
        }
        let rate = calls.health.rate().map(|(rate, booked)| {
            // Each row claimed and not yet performed needs a turn too (a key books its next
            // row's turn once the one before is done): counted only by the booked turns, the
            // claims outran an API limiting the rate until every call waited past its lease.
            let ahead = Duration::try_from_secs_f64(claimed.outstanding() as f64 / rate)
                .unwrap_or(Duration::MAX);
            (rate, booked.max(ahead))
        });
        let n = claim_size(limit, max_in_flight, rate);
        if n == 0 {
            // The rate limit's turns are booked half a lease ahead: claim once they drain.
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = tokio::time::sleep(Duration::from_millis(100)) => continue,
            }
        }
        let claimed_at = Instant::now();
        let claim = {
            let lane = Arc::clone(lane);
            let call_timeout = calls.config.call_timeout;
            async move { lane.claim_leased(n, call_timeout).await }
        };
        let rows = match bounded(claim, &grace.expired).await {
            None => break,
            Some(Ok(rows)) => {
                failures = 0;
                rows
            }
            Some(Err(error)) => {
                failures = failures.saturating_add(1);
                let delay = outbox_core::backoff(config.backoff_base, RETRY_MAX, failures - 1);
                tracing::warn!(%error, retry_in = ?delay, "dispatcher claim failed");
                tokio::select! {
                    biased;
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(delay) => continue,
                }
            }
        };
        let full = rows.len() >= n as usize;
        if stop.is_cancelled() {
            // Claimed as shutdown came: released untried.
            for row in rows {
                let _ = results.send((row, Verdict::Deferred));
            }
            break;
        }
        let mut keys = Keys {
            tasks: &mut tasks,
            stop: &stop,
            expired: &grace.expired,
            results: &results,
            claimed: &claimed,
        };
        spawn_keys(lane, rows, claimed_at, probe, &mut keys);
        if full {
            continue;
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => break,
            // A commit notified since the last look (also during the claim).
            _ = woken.changed() => {}
            // Recorded verdicts free a key's later actions, and released ones.
            () = recorded.notified() => {}
            () = tokio::time::sleep(config.poll_interval) => {}
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
    tokio::select! {
        _ = &mut recorder => {}
        () = deadline => {
            // Left to finish on its own: what it has not recorded keeps its lease.
            give_up.cancel();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_carries_no_more_answers_than_one_message_takes() {
        // 4 GiB of answers in one statement at 512 verdicts of 8 MiB: refused by PostgreSQL,
        // and every call of the batch made again.
        assert_eq!(record_batch(8 << 20), 64);
        assert!(record_batch(8 << 20) * (8 << 20) <= MAX_BATCH_ANSWER_BYTES);
        assert_eq!(record_batch(32 << 20), 16);
        assert_eq!(record_batch(1024), RECORD_BATCH);
        assert_eq!(record_batch(0), RECORD_BATCH);
        assert_eq!(record_batch(usize::MAX), 1);
    }

    #[test]
    fn a_claim_takes_no_more_than_slots_and_the_rate_allow() {
        assert_eq!(claim_size(32, 64, None), 32);
        assert_eq!(claim_size(32, 5, None), 5);
        assert_eq!(claim_size(32, 0, None), 0);
        assert_eq!(claim_size(1, 64, None), 1);
        // At 1 call/s, no more than start within half the lease's margin, after the calls
        // already booked.
        let now = Duration::ZERO;
        assert_eq!(claim_size(32, 64, Some((1.0, now))), 5);
        assert_eq!(claim_size(32, 64, Some((1.0, Duration::from_secs(3)))), 2);
        assert_eq!(claim_size(32, 64, Some((1.0, Duration::from_secs(9)))), 0);
        assert_eq!(claim_size(32, 64, Some((100.0, now))), 32);
    }
}
