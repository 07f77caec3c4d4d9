//! The dispatcher against the real PostgreSQL: per-key order across dispatchers, a slow key
//! beside fast ones, a destination that does not answer, rejections, timeouts, panics, a
//! crash between the call and the record, and a relay serving the same table. The executors
//! here are plain async functions over an in-memory ledger with the idempotency semantics of
//! a payment API; `examples/tests` drives the HTTP executor against a real HTTP server.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use outbox_producer::dispatch::{Action, ActionState, Dispatcher, DispatcherConfig, Outcome};
use outbox_producer::{EventId, NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::dispatch::{Ledger, Running, action, config, dispatched, enqueue, state};
use outbox_tests::{TestDb, count_status, eventually, kafka_bootstrap};
use rand::Rng;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn several_dispatchers_perform_every_action_once_in_key_order() -> Result<()> {
    let db = TestDb::with_pool_size(24).await?;
    let (keys, per_key) = (150, 4);
    let mut events = Vec::new();
    for n in 0..per_key {
        for k in 0..keys {
            events.push(action(&format!("k{k}"), n)?);
        }
    }
    let ids = enqueue(&db, &events).await?;
    let ledger = Arc::new(Ledger::default());
    let executor = {
        let ledger = ledger.clone();
        move |action: Action| {
            let ledger = ledger.clone();
            async move {
                let ms = rand::rng().random_range(0..4);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Outcome::done(ledger.apply(&action))
            }
        }
    };
    let shutdown = CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let dispatcher = Dispatcher::new(
            db.pool.clone(),
            config().max_in_flight(16).batch_size(8),
            executor.clone(),
        )?;
        let shutdown = shutdown.clone();
        runs.push(tokio::spawn(async move { dispatcher.run(shutdown).await }));
    }
    let total = i64::try_from(events.len())?;
    eventually("every action done", WAIT, || async {
        Ok(dispatched(&db).await? == total)
    })
    .await?;
    shutdown.cancel();
    for run in runs {
        run.await??;
    }
    assert_eq!(ledger.charges(), events.len());
    assert_eq!(
        ledger.calls.load(Ordering::SeqCst),
        events.len(),
        "no call repeated"
    );
    for (key, order) in ledger.order.lock().expect("ledger").iter() {
        assert_eq!(*order, (0..per_key).collect::<Vec<_>>(), "order of {key}");
    }
    // The answer is stored with the row and read back by id.
    let Some(ActionState::Done(answer)) = state(&db, ids[7]).await? else {
        panic!("not done");
    };
    assert_eq!(
        answer,
        ledger.applied.lock().expect("ledger")[&ids[7].to_string()]
    );
    Ok(())
}

#[tokio::test]
async fn a_slow_call_holds_back_neither_other_keys_nor_other_batches() -> Result<()> {
    let db = TestDb::new().await?;
    let mut events = vec![action("slow", 0)?];
    for k in 0..60 {
        events.push(action(&format!("fast{k}"), 0)?);
    }
    let ids = enqueue(&db, &events).await?;
    let release = Arc::new(tokio::sync::Notify::new());
    let executor = {
        let release = release.clone();
        move |action: Action| {
            let release = release.clone();
            async move {
                if action.key == "slow" {
                    release.notified().await;
                }
                Outcome::done(json!({ "ok": action.key }))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .max_in_flight(8)
            .batch_size(2)
            .call_timeout(Duration::from_secs(120)),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    // Every other key is done while the slow call is still in flight: it holds its own key
    // and call slot, nothing else (batches joined their calls, and one other row waited).
    eventually("fast keys done beside the slow call", WAIT, || async {
        Ok(dispatched(&db).await? == 60)
    })
    .await?;
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { .. })
    ));
    release.notify_one();
    eventually("the slow call done", WAIT, || async {
        Ok(dispatched(&db).await? == 61)
    })
    .await?;
    run.stop().await?;
    Ok(())
}

/// On a table of a few dozen rows Postgres answered the claim with a sorted sequential scan,
/// which ran the claim's per-key lock on every due row while it kept 32: one batch held all
/// 50 keys until it committed, and a second batch beside it found nothing to claim.
#[tokio::test]
async fn a_batch_on_a_small_table_holds_only_the_keys_it_claimed() -> Result<()> {
    let db = TestDb::new().await?;
    let events = (0..50)
        .map(|k| action(&format!("k{k}"), 0))
        .collect::<Result<Vec<_>>>()?;
    enqueue(&db, &events).await?;
    // The statistics of a table this small, as autovacuum would leave them.
    sqlx::query("VACUUM ANALYZE outbox_events")
        .execute(&db.pool)
        .await?;
    let started = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let executor = {
        let (started, release) = (started.clone(), release.clone());
        move |_action: Action| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                let _permit = release.acquire().await;
                Outcome::done(json!({ "ok": true }))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .max_in_flight(64)
            .batch_size(32)
            .call_timeout(Duration::from_secs(120)),
        executor,
    )?;
    let first = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.run_once().await }
    });
    eventually("the first batch's 32 calls in flight", WAIT, || async {
        Ok(started.load(Ordering::SeqCst) == 32)
    })
    .await?;
    let second = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.run_once().await }
    });
    eventually(
        "the other 18 keys' calls beside the first batch",
        WAIT,
        || async {
            anyhow::ensure!(
                !second.is_finished(),
                "the second batch ended with {} calls in flight: it found no key to claim",
                started.load(Ordering::SeqCst)
            );
            Ok(started.load(Ordering::SeqCst) == 50)
        },
    )
    .await?;
    release.add_permits(50);
    let (first, second) = (first.await??, second.await??);
    assert_eq!((first.claimed, second.claimed), (32, 18));
    assert_eq!(dispatched(&db).await?, 50);
    Ok(())
}

/// A batch's transaction stayed open across its calls, holding its rows' locks and its keys'
/// advisory locks (and vacuum, and any migration's lock) for as long as the slowest call.
/// The claim now leases and commits: a call in flight holds no lock and no transaction.
#[tokio::test]
async fn a_call_in_flight_holds_no_lock_and_no_transaction() -> Result<()> {
    let db = TestDb::new().await?;
    let heads: Vec<NewEvent> = (0..40)
        .map(|k| action(&format!("h{k}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &heads).await?;
    // Each head waits for its retry, an hour away: its key's later row is due but held.
    sqlx::query(
        "UPDATE outbox_events SET attempts = 1, last_error = 'HTTP 503', \
                next_attempt_at = now() + interval '1 hour'",
    )
    .execute(&db.pool)
    .await?;
    let held: Vec<NewEvent> = (0..40)
        .map(|k| action(&format!("h{k}"), 1))
        .collect::<Result<_>>()?;
    enqueue(&db, &held).await?;
    enqueue(&db, &[action("free", 0)?]).await?;
    let started = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let executor = {
        let (started, release) = (started.clone(), release.clone());
        move |_action: Action| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                let _permit = release.acquire().await;
                Outcome::done(json!({ "ok": true }))
            }
        }
    };
    // Its own pool, named, so that the locks counted are its batch's alone.
    let name = format!("claim-locks-{}", EventId::new());
    let options = (*db.pool.connect_options()).clone().application_name(&name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    let dispatcher = Dispatcher::new(pool, config(), executor)?;
    let batch = tokio::spawn({
        let dispatcher = dispatcher.clone();
        async move { dispatcher.run_once().await }
    });
    eventually("the free key's call in flight", WAIT, || async {
        Ok(started.load(Ordering::SeqCst) == 1)
    })
    .await?;
    let (locks, in_transaction): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                 WHERE a.application_name = $1 AND l.locktype IN ('advisory', 'tuple', 'transactionid')), \
                (SELECT count(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND xact_start IS NOT NULL)",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await?;
    release.add_permits(1);
    assert_eq!(batch.await??.claimed, 1);
    assert_eq!(
        (locks, in_transaction),
        (0, 0),
        "locks and open transactions of a dispatcher whose call is in flight"
    );
    Ok(())
}

#[tokio::test]
async fn a_destination_that_does_not_answer_charges_nothing_and_is_resumed() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..20)
        .map(|k| action(&format!("k{k}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    let up = Arc::new(AtomicBool::new(false));
    let ledger = Arc::new(Ledger::default());
    let executor = {
        let (up, ledger) = (up.clone(), ledger.clone());
        move |action: Action| {
            let (up, ledger) = (up.clone(), ledger.clone());
            async move {
                if up.load(Ordering::SeqCst) {
                    Outcome::done(ledger.apply(&action))
                } else {
                    Outcome::unavailable("connection refused")
                }
            }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config().batch_size(50), executor)?;
    let report = dispatcher.run_once().await?;
    assert!(report.broker_unreachable, "{report:?}");
    // Once it is down, the calls not yet made wait for it too (released untried).
    assert_eq!(
        (
            report.waiting + report.deferred,
            report.quarantined,
            report.retried
        ),
        (20, 0, 0),
        "{report:?}"
    );
    assert!(report.waiting >= 3, "{report:?}");
    let charged: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE attempts > 0")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(charged, 0, "no row charged while nothing answers");
    assert_eq!(
        dispatcher.last_error().as_deref(),
        Some("connection refused")
    );
    // Running, it pauses, probes, and resumes once the destination answers.
    let run = Running::start(&dispatcher);
    up.store(true, Ordering::SeqCst);
    eventually("resumed", WAIT, || async {
        Ok(dispatched(&db).await? == 20)
    })
    .await?;
    run.stop().await?;
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);
    assert_eq!(ledger.charges(), 20);
    Ok(())
}

#[tokio::test]
async fn one_unavailable_endpoint_among_answering_ones_waits_uncharged() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(
        &db,
        &[action("down", 0)?, action("down", 1)?, action("up", 0)?],
    )
    .await?;
    let executor = |action: Action| async move {
        if action.key == "down" {
            Outcome::unavailable("that shard refuses connections")
        } else {
            Outcome::done(json!({}))
        }
    };
    // Waiting out an outage takes `backoff_max` (with jitter): long enough to look again.
    let config = config().backoff(Duration::from_millis(10), Duration::from_secs(20));
    let dispatcher = Dispatcher::new(db.pool.clone(), config, executor)?;
    let report = dispatcher.run_once().await?;
    assert_eq!(
        (report.published, report.waiting, report.deferred),
        (1, 1, 1),
        "{report:?}"
    );
    assert!(!report.broker_unreachable);
    let Some(ActionState::Pending {
        attempts,
        last_error,
    }) = state(&db, ids[0]).await?
    else {
        panic!("not pending");
    };
    assert_eq!(attempts, 0);
    assert!(last_error.is_some_and(|e| e.contains("not charged")));
    // It waits: the next batch does not call it again at once.
    assert_eq!(dispatcher.run_once().await?.claimed, 0);
    Ok(())
}

#[tokio::test]
async fn a_rejection_quarantines_that_action_alone_with_the_answer() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("a", 0)?, action("a", 1)?, action("b", 0)?]).await?;
    let bad = ids[0];
    let executor = move |action: Action| async move {
        if action.id == bad {
            Outcome::rejected("402 card declined", json!({ "error": "card_declined" }))
        } else {
            let payload: serde_json::Value = action.payload_as().unwrap_or_default();
            Outcome::done(json!({ "n": payload["n"] }))
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let first = dispatcher.run_once().await?;
    assert_eq!(
        (first.quarantined, first.published, first.deferred),
        (1, 1, 1)
    );
    // A dispatcher's default policy (BlockKey): the key's later action waits for an
    // operator (a declined "charge" must not let its "ship" run).
    assert_eq!(dispatcher.run_once().await?.claimed, 0);
    assert_eq!(dispatched(&db).await?, 1);
    // Under SkipQuarantined it goes on.
    let skipping = Dispatcher::new(
        db.pool.clone(),
        config().quarantine_policy(outbox_producer::QuarantinePolicy::SkipQuarantined),
        executor,
    )?;
    skipping.run_once().await?;
    assert_eq!(dispatched(&db).await?, 2);
    let Some(ActionState::Rejected { answer, reason }) = state(&db, bad).await? else {
        panic!("not rejected");
    };
    assert_eq!(answer, json!({ "error": "card_declined" }));
    assert!(reason.contains("card declined"), "{reason}");
    Ok(())
}

/// A timeout or a panic while the destination answers other calls is the action's own:
/// charged, and given up after `max_attempts` as `Unknown` (its call may have applied).
#[tokio::test]
async fn a_timeout_while_others_answer_and_a_panic_are_charged_then_given_up() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(
        &db,
        &[action("slow", 0)?, action("panics", 0)?, action("ok", 0)?],
    )
    .await?;
    let slow_started = Arc::new(tokio::sync::Notify::new());
    let executor = {
        let slow_started = slow_started.clone();
        move |action: Action| {
            let slow_started = slow_started.clone();
            async move {
                match action.key.as_str() {
                    "panics" => panic!("careless executor"),
                    "slow" => {
                        slow_started.notify_one();
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    // Answers once the slow call is under way: the destination answered
                    // others while it hung.
                    _ => slow_started.notified().await,
                }
                Outcome::done(json!({}))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .call_timeout(Duration::from_millis(300))
            .max_attempts(1),
        executor,
    )?;
    let report = dispatcher.run_once().await?;
    assert_eq!((report.published, report.quarantined), (1, 2), "{report:?}");
    for (id, said) in [(ids[0], "call_timeout"), (ids[1], "careless executor")] {
        let Some(ActionState::Unknown {
            attempts: 1,
            last_error,
        }) = state(&db, id).await?
        else {
            panic!("not given up as unknown");
        };
        assert!(last_error.contains(said), "{last_error}");
    }
    Ok(())
}

/// A call that hangs on every try, with nothing else to call: the destination's failure,
/// never charged; the action ends `Unknown` once `max_age` has passed, and is not called
/// after it.
#[tokio::test]
async fn an_action_that_hangs_forever_ends_unknown_after_max_age() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("hangs", 0)?]).await?;
    let calls = Arc::new(AtomicUsize::new(0));
    let executor = {
        let calls = calls.clone();
        move |_: Action| {
            calls.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Outcome::done(json!({}))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .call_timeout(Duration::from_millis(100))
            .max_attempts(1)
            .max_age(Duration::from_secs(2)),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    eventually("given up", WAIT, || async {
        Ok(count_status(&db.pool, "quarantined").await? == 1)
    })
    .await?;
    let made = calls.load(Ordering::SeqCst);
    run.stop().await?;
    let Some(ActionState::Unknown {
        attempts,
        last_error,
    }) = state(&db, ids[0]).await?
    else {
        panic!("not unknown");
    };
    assert!(
        attempts >= 1 && made >= 1,
        "{attempts} calls recorded, {made} made"
    );
    assert!(last_error.contains("max_age"), "{last_error}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        made,
        "no call after giving up"
    );
    Ok(())
}

/// Refused before any call (by the executor, or too old for its first call): `NeverSent`, so
/// the agent may decide again.
#[tokio::test]
async fn an_action_refused_before_any_call_is_never_sent() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("refused", 0)?, action("stale", 0)?]).await?;
    sqlx::query("UPDATE outbox_events SET created_at = now() - interval '2 days' WHERE id = $1")
        .bind(ids[1])
        .execute(&db.pool)
        .await?;
    let calls = Arc::new(AtomicUsize::new(0));
    let executor = {
        let calls = calls.clone();
        move |_: Action| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Outcome::not_sent("plain http to a remote host") }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let report = dispatcher.run_once().await?;
    assert_eq!(report.quarantined, 2, "{report:?}");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the stale action is not called"
    );
    for (id, said) in [(ids[0], "plain http"), (ids[1], "never sent")] {
        let Some(ActionState::NeverSent { reason }) = state(&db, id).await? else {
            panic!("not never-sent");
        };
        assert!(reason.contains(said), "{reason}");
    }
    Ok(())
}

/// `Retry-After` is honoured in full (it was cut to `backoff_max`): a daily quota's hour
/// is an hour, and charges nothing.
#[tokio::test]
async fn retry_after_is_honoured_in_full_and_charges_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let executor = |_: Action| async {
        Outcome::rate_limited("429 daily quota", Some(Duration::from_secs(3600)))
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().backoff(Duration::from_millis(1), Duration::from_secs(60)),
        executor,
    )?;
    assert_eq!(dispatcher.run_once().await?.waiting, 1);
    let wait: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM outbox_events",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(wait > 3590.0, "next attempt in {wait} s");
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { attempts: 0, .. })
    ));
    Ok(())
}

/// A 429's `Retry-After` holds back every call to the destination, not only its action's.
#[tokio::test]
async fn retry_after_holds_the_whole_destination_back() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..10)
        .map(|k| action(&format!("k{k}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    let asked = Duration::from_secs(10);
    let first_429 = Arc::new(Mutex::new(None::<tokio::time::Instant>));
    let after_429 = Arc::new(Mutex::new(Vec::new()));
    let ledger = Arc::new(Ledger::default());
    let executor = {
        let (first_429, after_429, ledger) = (first_429.clone(), after_429.clone(), ledger.clone());
        move |action: Action| {
            let (first_429, after_429, ledger) =
                (first_429.clone(), after_429.clone(), ledger.clone());
            async move {
                let now = tokio::time::Instant::now();
                let mut first = first_429.lock().expect("lock");
                match *first {
                    None => {
                        *first = Some(now);
                        Outcome::rate_limited("429", Some(asked))
                    }
                    Some(_) => {
                        after_429.lock().expect("lock").push(now);
                        Outcome::done(ledger.apply(&action))
                    }
                }
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().max_in_flight(1).batch_size(1),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    eventually("every action done", WAIT, || async {
        Ok(dispatched(&db).await? == 10)
    })
    .await?;
    run.stop().await?;
    let first = first_429.lock().expect("lock").expect("a 429");
    let earliest = after_429
        .lock()
        .expect("lock")
        .iter()
        .min()
        .copied()
        .expect("calls after");
    assert!(
        earliest.duration_since(first) >= asked,
        "called again {:?} after a 429 asking for {asked:?}",
        earliest.duration_since(first)
    );
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);
    Ok(())
}

#[tokio::test]
async fn a_crash_between_the_call_and_the_record_calls_again_with_the_same_key() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let ledger = Arc::new(Ledger::default());
    let keys = Arc::new(Mutex::new(Vec::new()));
    let executor = {
        let (ledger, keys) = (ledger.clone(), keys.clone());
        move |action: Action| {
            let (ledger, keys) = (ledger.clone(), keys.clone());
            async move {
                keys.lock().expect("keys").push(action.idempotency_key());
                Outcome::done(ledger.apply(&action))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().call_timeout(Duration::from_millis(500)),
        executor,
    )?;
    dispatcher.crash_after_next_call();
    assert!(dispatcher.run_once().await.is_err());
    // Its lease holds it until the call timeout and the margin have passed.
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { .. })
    ));
    assert_eq!(dispatcher.run_once().await?.claimed, 0, "leased");
    eventually("called again once its lease ended", WAIT, || async {
        Ok(dispatcher.run_once().await?.published == 1)
    })
    .await?;
    let keys = keys.lock().expect("keys").clone();
    assert_eq!(
        keys,
        vec![ids[0].to_string(); 2],
        "called twice, with the same key"
    );
    assert_eq!(ledger.charges(), 1);
    let Some(ActionState::Done(answer)) = state(&db, ids[0]).await? else {
        panic!("not done");
    };
    assert_eq!(answer["charge"], "ch_1");
    Ok(())
}

#[tokio::test]
async fn an_answer_postgres_cannot_store_is_stored_scrubbed_not_called_forever() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let executor = |_: Action| async { Outcome::done(json!({ "id\u{0}": "in_\u{0}1" })) };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    assert_eq!(dispatcher.run_once().await?.published, 1);
    let Some(ActionState::Done(answer)) = state(&db, ids[0]).await? else {
        panic!("not done");
    };
    assert_eq!(answer, json!({ "id\u{fffd}": "in_\u{fffd}1" }));
    Ok(())
}

/// An answer over `max_answer_bytes` or nested deeper than a managed PostgreSQL may parse
/// would fail the batch's record (JSONB's 255 MiB limit, `stack depth limit exceeded`), and
/// its calls would be made again on every batch: it is stored as a marker with its size and
/// its start instead, and the action is done, called once. The dispatcher's sessions here
/// have a small `max_stack_depth`, as a managed service may set, which refuses the deep one.
#[tokio::test]
async fn an_answer_too_large_or_too_deep_is_stored_as_a_marker_and_called_once() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("a", 0)?, action("b", 0)?, action("c", 0)?]).await?;
    let (large, deep, small) = (ids[0], ids[1], ids[2]);
    let calls = Arc::new(AtomicUsize::new(0));
    let executor = {
        let calls = calls.clone();
        move |action: Action| {
            calls.fetch_add(1, Ordering::SeqCst);
            let answer = match action.key.as_str() {
                "a" => json!({ "invoice": "in_1", "pdf": "x".repeat(16_384) }),
                "b" => (0..2_000).fold(json!("in_2"), |inner, _| {
                    serde_json::Value::Array(vec![inner])
                }),
                _ => json!({ "invoice": "in_3" }),
            };
            async move { Outcome::done(answer) }
        }
    };
    let options = (*db.pool.connect_options())
        .clone()
        .options([("max_stack_depth", "100kB")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    // The deep answer is 4 KB of text: only its depth makes it a marker.
    let dispatcher = Dispatcher::new(pool, config().max_answer_bytes(8192), executor)?;
    assert_eq!(dispatcher.run_once().await?.published, 3);
    assert_eq!(dispatcher.run_once().await?.claimed, 0);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let Some(ActionState::Done(answer)) = state(&db, large).await? else {
        panic!("not done");
    };
    let marker = &answer["outbox_answer_omitted"];
    assert!(
        marker["bytes"].as_u64().is_some_and(|b| b > 16_384),
        "{marker}"
    );
    let start = marker["start"].as_str().expect("start");
    assert!(
        start.starts_with(r#"{"invoice":"in_1""#) && start.len() <= 1024,
        "{start}"
    );
    let Some(ActionState::Done(answer)) = state(&db, deep).await? else {
        panic!("not done");
    };
    let reason = answer["outbox_answer_omitted"]["reason"]
        .as_str()
        .expect("reason");
    assert!(reason.contains("deeper than"), "{reason}");
    let Some(ActionState::Done(answer)) = state(&db, small).await? else {
        panic!("not done");
    };
    assert_eq!(answer, json!({ "invoice": "in_3" }));
    Ok(())
}

#[tokio::test]
async fn a_relay_and_a_dispatcher_serve_one_table_without_taking_each_others_rows() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let event = NewEvent::new("task", "k", "Decided", &json!({}))?.with_topic(&topic)?;
    // The key's action first: it must not hold back the key's Kafka event, nor the reverse.
    enqueue(&db, &[action("k", 0)?, event, action("k", 1)?]).await?;
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default(),
    )?;
    let report = relay.run_once().await?;
    assert_eq!((report.claimed, report.published), (1, 1), "{report:?}");
    let calls = Arc::new(AtomicUsize::new(0));
    let executor = {
        let calls = calls.clone();
        move |_: Action| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Outcome::done(json!({})) }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    assert_eq!(dispatcher.run_once().await?.published, 2);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(relay.run_once().await?.claimed, 0);
    Ok(())
}

#[tokio::test]
async fn configurations_that_cannot_work_are_refused() -> Result<()> {
    let db = TestDb::with_pool_size(2).await?;
    let executor = |_: Action| async { Outcome::done(json!({})) };
    for bad in [
        DispatcherConfig::new("no spaces"),
        DispatcherConfig::new(""),
        config().max_in_flight(0),
        config().call_timeout(Duration::ZERO),
        // 64 / 32 = 2 batches side by side, one more and a listener: more than 2 connections.
        config(),
    ] {
        assert!(
            Dispatcher::new(db.pool.clone(), bad.clone(), executor).is_err(),
            "{bad:?}"
        );
    }
    // Answers over JSONB's limit once stored in binary form; a batch's answers over 1 GiB.
    let fits = config().max_in_flight(1).listen(false);
    Dispatcher::new(db.pool.clone(), fits.clone(), executor)?;
    for (bad, says) in [
        (fits.clone().max_answer_bytes(64 << 20), "max_answer_bytes"),
        (
            fits.clone().batch_size(128),
            "batch_size x max_answer_bytes",
        ),
        // One call in 31,700 years: the time between calls overflowed an instant (a panic).
        (fits.clone().max_rate(1e-12), "max_rate"),
        (fits.clone().max_rate(f64::NAN), "max_rate"),
    ] {
        let refused = Dispatcher::new(db.pool.clone(), bad, executor).map(|_| ());
        assert!(
            matches!(&refused, Err(e) if e.to_string().contains(says)),
            "{refused:?}"
        );
    }
    let mut delete = config().max_in_flight(1);
    delete.lane = delete
        .lane
        .after_publish(outbox_producer::AfterPublish::Delete);
    assert!(Dispatcher::new(db.pool.clone(), delete, executor).is_err());
    Ok(())
}

#[tokio::test]
async fn a_key_whose_calls_find_nobody_does_not_starve_the_keys_behind_it() -> Result<()> {
    let db = TestDb::new().await?;
    let mut events: Vec<_> = (0..20).map(|n| action("down", n)).collect::<Result<_>>()?;
    for k in 0..5 {
        events.push(action(&format!("up{k}"), 0)?);
    }
    enqueue(&db, &events).await?;
    let executor = |action: Action| async move {
        if action.key == "down" {
            Outcome::unavailable("connection refused")
        } else {
            Outcome::done(json!({}))
        }
    };
    // One worker, whose first batch holds nothing but the silent key's rows.
    let config = config()
        .max_in_flight(16)
        .batch_size(16)
        .backoff(Duration::from_millis(10), Duration::from_secs(20));
    let dispatcher = Dispatcher::new(db.pool.clone(), config, executor)?;
    let first = dispatcher.run_once().await?;
    assert_eq!((first.waiting, first.deferred), (1, 15), "{first:?}");
    let second = dispatcher.run_once().await?;
    assert_eq!(second.published, 5, "{second:?}");
    let charged: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_events WHERE attempts > 0 AND status <> 'published'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(charged, 0);
    Ok(())
}

#[tokio::test]
async fn calls_that_all_time_out_charge_nobody() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("a", 0)?, action("b", 0)?, action("c", 0)?]).await?;
    let executor = |_: Action| async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Outcome::done(json!({}))
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .call_timeout(Duration::from_millis(100))
            .max_attempts(1),
        executor,
    )?;
    let report = dispatcher.run_once().await?;
    assert!(report.broker_unreachable, "{report:?}");
    assert_eq!((report.waiting, report.quarantined), (3, 0), "{report:?}");
    assert!(!dispatcher.destination_up());
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { attempts: 0, .. })
    ));
    Ok(())
}

/// Verdicts are recorded as they arrive: the keys claimed with a slow key are recorded while
/// its call still runs (a batch's record waited for its slowest call).
#[tokio::test]
async fn a_slow_call_delays_the_record_of_no_other_key() -> Result<()> {
    let db = TestDb::new().await?;
    let mut events: Vec<_> = (0..5).map(|n| action("slow", n)).collect::<Result<_>>()?;
    for k in 0..3 {
        events.push(action(&format!("fast{k}"), 0)?);
    }
    enqueue(&db, &events).await?;
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let executor = {
        let release = release.clone();
        move |action: Action| {
            let release = release.clone();
            async move {
                if action.key == "slow" {
                    let _ = release.acquire().await.map(|p| p.forget());
                }
                Outcome::done(json!({}))
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().max_in_flight(8).batch_size(8),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    eventually(
        "the fast keys recorded beside the slow call",
        WAIT,
        || async { Ok(dispatched(&db).await? == 3) },
    )
    .await?;
    release.add_permits(5);
    eventually("the slow key's run done", WAIT, || async {
        Ok(dispatched(&db).await? == 8)
    })
    .await?;
    run.stop().await?;
    Ok(())
}
