//! P9c and P9d: the dispatcher against the billing API (`outbox_examples::billing_api`, in
//! this process) with a slow tail of calls, and against one that limits its rate.
//!
//! - P9c: 64 calls in flight; the API answers 99 % of the calls in 20 ms and 1 % in 2.02 s
//!   (20 ms and a `delay_invoice` of 2 s for the 51st action of every hundred in enqueue
//!   order, chosen at fill time). The dispatcher's actions/s against what 64 call slots
//!   allow at that mean call, 64 / (0.99 × 20 ms + 0.01 × 2.02 s) = 64 / 40 ms = 1,600/s: a
//!   slow call holds its own slot and key, nothing else.
//! - P9d: the dispatcher with its defaults (no `max_rate` of its own) and the HTTP executor
//!   against the API limited to 200 calls/s (`BillingApi::rate_limit`: beyond it, 429 at
//!   once without `Retry-After`, nothing applied), answering at once: actions/s from the
//!   start to the last action done, against 200/s; nothing quarantined; and the 429s it got.
//!
//! Each run checks the ledger: every action charged once, each key's charges in order.
//! Each prints its timeline (actions done, and 429s, per second) on stderr.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use outbox_examples::billing_api::BillingApi;
use outbox_producer::dispatch::{Dispatcher, HttpExecutor};
use outbox_tests::TestDb;
use tokio_util::sync::CancellationToken;

use crate::Settings;
use crate::p2_relay::wait_drained;
use crate::p9_dispatch::{
    LATENCY, MAX_IN_FLIGHT, check_ledger, client_builder, config, enqueue_order, fixture, invoice,
};
use crate::sample::{Figure, Sample};

/// P9c's slow calls: this much more than [`LATENCY`].
const SLOW: Duration = Duration::from_secs(2);
/// One action in this many is slow.
const SLOW_EVERY: usize = 100;
/// P9d's API limit, in calls per second.
const API_LIMIT: f64 = 200.0;
/// P9d's actions per run: 15 s at the API's limit.
const LIMITED_ACTIONS: usize = 3_000;
/// How often a run's progress is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// A run's progress at one moment: seconds since its start, charges applied, 429s answered.
#[derive(Debug, Clone, Copy)]
struct Point {
    at: f64,
    charged: usize,
    rate_limited: u64,
}

/// A dispatcher run to the last action: how long it took and its progress.
#[derive(Debug)]
struct Run {
    elapsed: Duration,
    timeline: Vec<Point>,
    rate_limited: u64,
}

impl Run {
    /// Actions per second from the start to the last action done.
    fn rate(&self, actions: usize) -> f64 {
        actions as f64 / self.elapsed.as_secs_f64()
    }

    /// Actions per second between the moments 10 % and 90 % of them were done: the rate
    /// without the run's start and its last stragglers.
    fn middle_rate(&self, actions: usize) -> f64 {
        let when = |share: f64| {
            self.timeline
                .iter()
                .find(|p| p.charged as f64 >= share * actions as f64)
                .map_or(self.elapsed.as_secs_f64(), |p| p.at)
        };
        0.8 * actions as f64 / (when(0.9) - when(0.1)).max(1e-3)
    }

    /// Actions done and 429s answered in each second of the run.
    fn per_second(&self) -> (Vec<usize>, Vec<u64>) {
        let (mut done, mut limited) = (Vec::new(), Vec::new());
        let mut last = Point {
            at: 0.0,
            charged: 0,
            rate_limited: 0,
        };
        for second in 1.. {
            let Some(point) = self
                .timeline
                .iter()
                .rev()
                .find(|p| p.at <= f64::from(second))
            else {
                break;
            };
            done.push(point.charged - last.charged);
            limited.push(point.rate_limited - last.rate_limited);
            last = *point;
            if point.at >= self.elapsed.as_secs_f64() {
                break;
            }
        }
        (done, limited)
    }

    fn log(&self, what: &str, actions: usize) {
        let (done, limited) = self.per_second();
        let list = |v: &[String]| v.join(" ");
        eprintln!(
            "{what}: {actions} actions in {:.2} s ({:.0}/s; 10-90 %: {:.0}/s), {} answered 429\n  \
             done per second: {}\n  429 per second:  {}",
            self.elapsed.as_secs_f64(),
            self.rate(actions),
            self.middle_rate(actions),
            self.rate_limited,
            list(&done.iter().map(ToString::to_string).collect::<Vec<_>>()),
            list(&limited.iter().map(ToString::to_string).collect::<Vec<_>>()),
        );
    }
}

/// Runs the dispatcher (defaults, HTTP executor) until every action of the fixture is done or
/// given up, sampling the API's progress; then checks that every action is done, none
/// quarantined, and the ledger.
async fn run_sampled(db: &TestDb, api: &BillingApi, actions: usize) -> Result<Run> {
    let executor = HttpExecutor::post_json(client_builder(), api.charges_url().parse()?)?;
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let shutdown = CancellationToken::new();
    let timeline = Mutex::new(Vec::new());
    let started = Instant::now();
    let running = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    let sample = || Point {
        at: started.elapsed().as_secs_f64(),
        charged: api.charges().len(),
        rate_limited: api.requests().rate_limited,
    };
    let sampling = async {
        loop {
            let point = sample();
            timeline
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(point);
            tokio::time::sleep(SAMPLE_EVERY).await;
        }
    };
    tokio::select! {
        drained = wait_drained(&db.pool) => drained?,
        () = sampling => {}
    }
    let elapsed = started.elapsed();
    let last = sample();
    shutdown.cancel();
    running.await??;
    let mut timeline = timeline
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    timeline.push(last);
    let (done, quarantined): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'published'), \
                count(*) FILTER (WHERE status = 'quarantined') FROM outbox_events",
    )
    .fetch_one(&db.pool)
    .await?;
    ensure!(
        quarantined == 0,
        "{quarantined} actions quarantined ({done} of {actions} done)"
    );
    ensure!(done as usize == actions, "{done} of {actions} actions done");
    check_ledger(&api.charges(), actions)?;
    Ok(Run {
        elapsed,
        timeline,
        rate_limited: api.requests().rate_limited,
    })
}

/// P9c: one run with a slow tail.
async fn slow_tail_run(actions: usize) -> Result<Run> {
    let (db, api) = fixture(actions, Some(LATENCY)).await?;
    for (i, &(k, n)) in enqueue_order(actions).iter().enumerate() {
        if i % SLOW_EVERY == SLOW_EVERY / 2 {
            api.delay_invoice(invoice(k, n), SLOW);
        }
    }
    run_sampled(&db, &api, actions).await
}

/// P9d: one run against the rate-limited API.
async fn limited_run(actions: usize) -> Result<Run> {
    let (db, api) = fixture(actions, None).await?;
    api.rate_limit(Some(API_LIMIT));
    run_sampled(&db, &api, actions).await
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    // Twice the others' (16,000 by default: 10 s at the bound), so that the slow calls of
    // the run's end, which end up to 2 s after the rest, are a small part of it.
    let tail_actions = (2 * settings.actions).max(2_000);
    let [
        mut tail,
        mut tail_middle,
        mut limited,
        mut limited_middle,
        mut answered_429,
    ]: [Sample; 5] = Default::default();
    for round in 0..settings.rounds {
        let run = slow_tail_run(tail_actions).await?;
        run.log(&format!("P9c round {round}"), tail_actions);
        tail.push(run.rate(tail_actions));
        tail_middle.push(run.middle_rate(tail_actions));
        let run = limited_run(LIMITED_ACTIONS).await?;
        run.log(&format!("P9d round {round}"), LIMITED_ACTIONS);
        limited.push(run.rate(LIMITED_ACTIONS));
        limited_middle.push(run.middle_rate(LIMITED_ACTIONS));
        answered_429.push(run.rate_limited as f64);
    }
    let slow_share = 1.0 / SLOW_EVERY as f64;
    let mean_call =
        (1.0 - slow_share) * LATENCY.as_secs_f64() + slow_share * (LATENCY + SLOW).as_secs_f64();
    let ideal = Sample {
        values: vec![MAX_IN_FLIGHT as f64 / mean_call],
    };
    let limit = Sample {
        values: vec![API_LIMIT],
    };
    Ok(vec![
        Figure::at_least(
            "P9c",
            "dispatcher, 1 % of calls 2 s, 64 in flight",
            "act/s",
            tail,
            "ideal 64 / 40 ms mean call",
            ideal.clone(),
            Some(0.8),
        ),
        Figure::at_least(
            "P9c",
            "same, between 10 % and 90 % done",
            "act/s",
            tail_middle,
            "ideal 64 / 40 ms mean call",
            ideal,
            None,
        ),
        Figure::at_least(
            "P9d",
            "dispatcher, defaults, API limited to 200/s",
            "act/s",
            limited,
            "the API's limit",
            limit.clone(),
            Some(0.9),
        ),
        Figure::at_least(
            "P9d",
            "same, between 10 % and 90 % done",
            "act/s",
            limited_middle,
            "the API's limit",
            limit,
            None,
        ),
        Figure::cost(
            "P9d",
            "calls answered 429",
            "calls",
            answered_429,
            "actions",
            Sample {
                values: vec![LIMITED_ACTIONS as f64],
            },
            None,
        ),
    ])
}
