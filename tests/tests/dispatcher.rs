//! The dispatcher against the real PostgreSQL: per-key order across dispatchers, a slow key
//! beside fast ones, a destination that does not answer, rejections, timeouts, panics, a
//! crash between the call and the record, and a relay serving the same table. The executors
//! here are plain async functions over an in-memory ledger with the idempotency semantics of
//! a payment API; `examples/tests` drives the HTTP executor against a real HTTP server.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use outbox_producer::dispatch::{
    Action, ActionState, Dispatcher, DispatcherConfig, Outcome, outcome,
};
use outbox_producer::{EventId, NewEvent, Relay, RelayConfig, TableNames, producer_config};
use outbox_tests::{TestDb, count_status, eventually, kafka_bootstrap};
use rand::Rng;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// What the destination applied: each idempotency key once, and each key's payloads `n` in
/// the order they were applied.
#[derive(Debug, Default)]
struct Ledger {
    calls: AtomicUsize,
    applied: Mutex<HashMap<String, serde_json::Value>>,
    order: Mutex<BTreeMap<String, Vec<i64>>>,
}

impl Ledger {
    /// Applies `action` once per idempotency key; a repeat gets the first answer back.
    fn apply(&self, action: &Action) -> serde_json::Value {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut applied = self.applied.lock().expect("ledger");
        if let Some(answer) = applied.get(&action.idempotency_key()) {
            return answer.clone();
        }
        let payload: serde_json::Value = action.payload_as().unwrap_or_default();
        let n = payload["n"].as_i64().unwrap_or(-1);
        self.order
            .lock()
            .expect("ledger")
            .entry(action.key.clone())
            .or_default()
            .push(n);
        let answer = json!({ "charge": format!("ch_{}", applied.len() + 1), "n": n });
        applied.insert(action.idempotency_key(), answer.clone());
        answer
    }

    fn charges(&self) -> usize {
        self.applied.lock().expect("ledger").len()
    }
}

fn action(key: &str, n: i64) -> Result<NewEvent> {
    Ok(
        NewEvent::new("task", key, "Charge", &json!({ "key": key, "n": n }))?
            .for_dispatcher("billing")?,
    )
}

async fn enqueue(db: &TestDb, events: &[NewEvent]) -> Result<Vec<EventId>> {
    let mut tx = db.pool.begin().await?;
    let ids = outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(ids)
}

fn config() -> DispatcherConfig {
    DispatcherConfig::new("billing")
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(50))
        .shutdown_timeout(Duration::from_secs(5))
}

async fn state(db: &TestDb, id: EventId) -> Result<Option<ActionState>> {
    let mut conn = db.pool.acquire().await?;
    Ok(outcome(&mut conn, &TableNames::default(), id).await?)
}

async fn dispatched(db: &TestDb) -> Result<i64> {
    count_status(&db.pool, "published").await
}

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
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    // Everything but the slow call's own batch (one other row at most) is done while the
    // slow call is still in flight.
    eventually("fast keys done beside the slow call", WAIT, || async {
        Ok(dispatched(&db).await? >= 59)
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
    shutdown.cancel();
    run.await??;
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

/// The claim took a key's advisory lock before asking whether an earlier row of the key holds
/// it back, so every held key it walked past stayed locked until its batch committed: one
/// lock per held key, in the server's shared lock table, for a batch that claimed one row.
#[tokio::test]
async fn a_claim_takes_no_lock_for_the_held_keys_it_passes() -> Result<()> {
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
    let locks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND a.application_name = $1",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await?;
    release.add_permits(1);
    assert_eq!(batch.await??.claimed, 1);
    assert_eq!(
        locks, 1,
        "advisory locks held by a batch that claimed one row"
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
    assert_eq!(
        (report.waiting, report.quarantined, report.retried),
        (20, 0, 0)
    );
    let charged: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE attempts > 0")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(charged, 0, "no row charged while nothing answers");
    assert_eq!(
        dispatcher.last_error().as_deref(),
        Some("connection refused")
    );
    // Running, it pauses, probes, and resumes once the destination answers.
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    up.store(true, Ordering::SeqCst);
    eventually("resumed", WAIT, || async {
        Ok(dispatched(&db).await? == 20)
    })
    .await?;
    shutdown.cancel();
    run.await??;
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
    // Under the default policy the key's later action goes on.
    dispatcher.run_once().await?;
    assert_eq!(dispatched(&db).await?, 2);
    let Some(ActionState::Rejected { answer, reason }) = state(&db, bad).await? else {
        panic!("not rejected");
    };
    assert_eq!(answer, json!({ "error": "card_declined" }));
    assert!(reason.contains("card declined"), "{reason}");
    Ok(())
}

#[tokio::test]
async fn timeouts_and_panics_are_retried_then_given_up() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("slow", 0)?, action("panics", 0)?]).await?;
    let executor = |action: Action| async move {
        if action.key == "panics" {
            panic!("careless executor");
        }
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Outcome::done(json!({}))
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .call_timeout(Duration::from_millis(200))
            .max_attempts(2)
            .backoff(Duration::from_millis(1), Duration::from_millis(2)),
        executor,
    )?;
    let report = dispatcher.run_once().await?;
    assert_eq!(report.retried, 2, "{report:?}");
    let Some(ActionState::Pending {
        attempts: 1,
        last_error: Some(e),
    }) = state(&db, ids[0]).await?
    else {
        panic!("not retried");
    };
    assert!(e.contains("call_timeout"), "{e}");
    eventually("both given up", WAIT, || async {
        dispatcher.run_once().await?;
        Ok(count_status(&db.pool, "quarantined").await? == 2)
    })
    .await?;
    let Some(ActionState::Unknown {
        last_error: reason, ..
    }) = state(&db, ids[1]).await?
    else {
        panic!("not given up");
    };
    assert!(reason.contains("careless executor"), "{reason}");
    Ok(())
}

#[tokio::test]
async fn retry_after_is_honoured() -> Result<()> {
    let db = TestDb::new().await?;
    enqueue(&db, &[action("k", 0)?]).await?;
    let executor = |_: Action| async { Outcome::retry_after("429", Duration::from_secs(40)) };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().backoff(Duration::from_millis(1), Duration::from_secs(60)),
        executor,
    )?;
    assert_eq!(dispatcher.run_once().await?.retried, 1);
    let wait: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM outbox_events",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(wait > 35.0, "next attempt in {wait} s");
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
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    dispatcher.crash_after_next_call();
    assert!(dispatcher.run_once().await.is_err());
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { attempts: 0, .. })
    ));
    assert_eq!(dispatcher.run_once().await?.published, 1);
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
    assert!(first.broker_unreachable, "{first:?}");
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
    let ids = enqueue(&db, &[action("a", 0)?, action("b", 0)?]).await?;
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
    assert_eq!((report.waiting, report.quarantined), (2, 0), "{report:?}");
    assert!(matches!(
        state(&db, ids[0]).await?,
        Some(ActionState::Pending { attempts: 0, .. })
    ));
    Ok(())
}

#[tokio::test]
async fn a_slow_keys_run_of_actions_does_not_hold_the_record_of_its_batch() -> Result<()> {
    let db = TestDb::new().await?;
    let mut events: Vec<_> = (0..5).map(|n| action("slow", n)).collect::<Result<_>>()?;
    for k in 0..3 {
        events.push(action(&format!("fast{k}"), 0)?);
    }
    enqueue(&db, &events).await?;
    let executor = |action: Action| async move {
        if action.key == "slow" {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Outcome::done(json!({}))
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().max_in_flight(8).batch_size(8),
        executor,
    )?;
    // The fast keys are recorded after one slow call, not after five.
    let report = dispatcher.run_once().await?;
    assert_eq!((report.published, report.deferred), (4, 4), "{report:?}");
    eventually("the slow key's run done", WAIT, || async {
        dispatcher.run_once().await?;
        Ok(dispatched(&db).await? == 8)
    })
    .await?;
    Ok(())
}
