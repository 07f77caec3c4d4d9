//! The dispatcher against what real APIs and real deployments do: an outage of the whole
//! API, rows another writer stored that serde_json cannot read, numbers past `f64`, and a
//! schema or role that cannot record what the dispatcher would call.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_producer::dispatch::{Action, Dispatcher, Outcome};
use outbox_producer::{ProducerError, Relay, RelayConfig, producer_config};
use outbox_tests::dispatch::{Ledger, Running, action, config, dispatched, enqueue};
use outbox_tests::{TestDb, count_status, eventually, kafka_bootstrap};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// A load balancer answering 503 to every call for a while, with `max_attempts(3)`: every
/// due action was charged an attempt per batch and quarantined (`GaveUp`) within seconds.
/// The destination is down instead: nothing charged, probed until it answers, then all done.
#[tokio::test]
async fn a_whole_api_outage_quarantines_nothing_and_everything_is_done_after() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..40)
        .map(|k| action(&format!("k{k}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    let up = Arc::new(AtomicBool::new(false));
    // Refusals per action.
    let refused = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let ledger = Arc::new(Ledger::default());
    let executor = {
        let (up, refused, ledger) = (up.clone(), refused.clone(), ledger.clone());
        move |action: Action| {
            let (up, refused, ledger) = (up.clone(), refused.clone(), ledger.clone());
            async move {
                if up.load(Ordering::SeqCst) {
                    Outcome::done(ledger.apply(&action))
                } else {
                    *refused
                        .lock()
                        .expect("lock")
                        .entry(action.idempotency_key())
                        .or_default() += 1;
                    Outcome::retry("HTTP 503 Service Unavailable: upstream connect error")
                }
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .max_attempts(3)
            .backoff(Duration::from_millis(10), Duration::from_millis(50)),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    // Down, and probed again and again: an action refused more times than max_attempts.
    eventually("the destination down and probed", WAIT, || async {
        let most = refused.lock().expect("lock").values().max().copied();
        Ok(!dispatcher.destination_up() && most.unwrap_or(0) > 3)
    })
    .await?;
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);
    assert!(
        dispatcher
            .last_error()
            .is_some_and(|e| e.contains("HTTP 503"))
    );
    up.store(true, Ordering::SeqCst);
    eventually("every action done after the outage", WAIT, || async {
        Ok(dispatched(&db).await? == 40)
    })
    .await?;
    assert!(dispatcher.destination_up());
    run.stop().await?;
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);
    assert_eq!(ledger.charges(), 40);
    Ok(())
}

/// Another writer's row whose `headers` JSONB serde_json refuses (`1e400`, nesting past 127)
/// failed the claim's decoding for every batch: no row of the lane moved, relay included.
/// Read as text and parsed per row, it fails alone.
#[tokio::test]
async fn headers_serde_json_cannot_read_fail_their_own_row_alone() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    for (lane_topic, key) in [("dispatch:billing", "task"), (topic.as_str(), "event")] {
        for (n, headers) in [r#"{"n":1e400}"#, &format!(r#"{{"d":{deep}}}"#), "{}"]
            .iter()
            .enumerate()
        {
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
                 VALUES (gen_random_uuid(), $1, $2, 'T', '{}', $3::jsonb, $4)",
            )
            .bind(key)
            .bind(format!("{key}{n}"))
            .bind(headers)
            .bind(lane_topic)
            .execute(&db.pool)
            .await?;
        }
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let executor = {
        let seen = seen.clone();
        move |action: Action| {
            seen.lock()
                .expect("lock")
                .push(action.headers.get().to_owned());
            async { Outcome::done(json!({})) }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let report = dispatcher.run_once().await?;
    // The executor gets the headers as stored (JSONB writes 1e400 out in full), whatever
    // serde_json makes of them.
    assert_eq!(report.published, 3, "{report:?}");
    assert!(
        seen.lock()
            .expect("lock")
            .iter()
            .any(|h| h.contains(&format!("1{}", "0".repeat(400)))),
        "{seen:?}"
    );
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default(),
    )?;
    let report = relay.run_once().await?;
    assert_eq!((report.published, report.quarantined), (1, 2), "{report:?}");
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM outbox_events WHERE status = 'quarantined' ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await?;
    assert!(
        reasons.iter().all(|r| r.contains("headers cannot be read")),
        "{reasons:?}"
    );
    Ok(())
}

/// A payload's numbers reached the API re-serialised through `serde_json::Value`:
/// `100000000000000000001` as `1e20`.
#[tokio::test]
async fn a_payload_reaches_the_executor_as_stored_digit_for_digit() -> Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic) \
         VALUES (gen_random_uuid(), 'task', 'k', 'Charge', \
                 '{\"cents\": 100000000000000000001, \"rate\": 0.1000000000000000000001}', \
                 'dispatch:billing')",
    )
    .execute(&db.pool)
    .await?;
    let seen = Arc::new(std::sync::Mutex::new(String::new()));
    let executor = {
        let seen = seen.clone();
        move |action: Action| {
            *seen.lock().expect("lock") = action.payload.get().to_owned();
            async { Outcome::done(json!({})) }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    assert_eq!(dispatcher.run_once().await?.published, 1);
    let payload = seen.lock().expect("lock").clone();
    assert!(payload.contains("100000000000000000001"), "{payload}");
    assert!(payload.contains("0.1000000000000000000001"), "{payload}");
    Ok(())
}

/// A dispatcher on a schema without the lease columns (migration 0014 not run) called every
/// action and failed to record it, forever: it refuses to start instead, naming what is
/// missing, before any call.
#[tokio::test]
async fn a_dispatcher_that_cannot_record_refuses_to_start_before_any_call() -> Result<()> {
    let db = TestDb::new().await?;
    enqueue(&db, &[action("k", 0)?]).await?;
    sqlx::query("ALTER TABLE outbox_events DROP COLUMN calls, DROP COLUMN outcome")
        .execute(&db.pool)
        .await?;
    let calls = Arc::new(AtomicUsize::new(0));
    let executor = {
        let calls = calls.clone();
        move |_: Action| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Outcome::done(json!({})) }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let refused = dispatcher.run(CancellationToken::new()).await;
    let Err(ProducerError::Config(message)) = refused else {
        panic!("started: {refused:?}");
    };
    assert!(
        message.contains("calls") && message.contains("outcome") && message.contains("migrat"),
        "{message}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    Ok(())
}

/// The same for a role whose grants omit a column the dispatcher writes.
#[tokio::test]
async fn a_dispatcher_whose_role_cannot_write_its_columns_refuses_to_start() -> Result<()> {
    let roles = outbox_tests::Roles::new().await?;
    let (name, table) = (&roles.relay.name, format!("{}.outbox_events", roles.schema));
    roles
        .as_admin(&format!(
            "REVOKE UPDATE ON {table} FROM {name}; \
             GRANT UPDATE (status, published_at, attempts, next_attempt_at, last_error, lease, \
                           calls) ON {table} TO {name}"
        ))
        .await?;
    let pool = roles.pool(&roles.relay).await?;
    let dispatcher = Dispatcher::new(pool.clone(), config(), |_: Action| async {
        Outcome::done(json!({}))
    })?;
    let checked = dispatcher.check().await;
    let Err(ProducerError::Config(message)) = checked else {
        panic!("passed: {checked:?}");
    };
    assert!(
        message.contains("UPDATE (outcome)") && message.contains("grant"),
        "{message}"
    );
    drop(dispatcher);
    pool.close().await;
    roles.drop_all().await?;
    Ok(())
}

/// Under a rate limit the calls of a claim queue for their turn: a lease ran out while its
/// call still waited, so another claim took the action and it was called twice (and its
/// record fenced out, every lease, until `max_age`). A claim now takes no more than the rate
/// lets start well within a lease, and a call whose lease would end first is not made.
#[tokio::test]
async fn a_rate_limit_never_outlasts_a_lease_each_action_is_called_once() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..16)
        .map(|k| action(&format!("k{k}"), 0))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    let ledger = Arc::new(Ledger::default());
    let executor = {
        let ledger = ledger.clone();
        move |action: Action| {
            let ledger = ledger.clone();
            async move { Outcome::done(ledger.apply(&action)) }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config()
            .max_rate(1.0)
            .call_timeout(Duration::from_millis(500)),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    eventually("every action done", WAIT, || async {
        Ok(dispatched(&db).await? == 16)
    })
    .await?;
    run.stop().await?;
    assert_eq!(ledger.charges(), 16);
    assert_eq!(
        ledger.calls.load(Ordering::SeqCst),
        16,
        "no action called twice"
    );
    Ok(())
}

/// `Retry-After: 99999999999999999999` (more seconds than a u64 holds) overflowed the
/// deadline it was added to, panicking the key's task: the wait is cut to `max_age`.
#[tokio::test]
async fn an_absurd_retry_after_is_cut_to_max_age_and_panics_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let executor =
        |_: Action| async { Outcome::rate_limited("429", Some(Duration::from_secs(u64::MAX))) };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().max_age(Duration::from_secs(3600)),
        executor,
    )?;
    assert_eq!(dispatcher.run_once().await?.waiting, 1);
    let wait: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM next_attempt_at - now())::float8 FROM outbox_events",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(
        (3500.0..=3700.0).contains(&wait),
        "next attempt in {wait} s"
    );
    assert!(matches!(
        outbox_tests::dispatch::state(&db, ids[0]).await?,
        Some(outbox_producer::dispatch::ActionState::Pending { attempts: 0, .. })
    ));
    Ok(())
}

/// A result the database refuses (here a CHECK the application added) failed the record of
/// every result batched with it, forever, while claims went on: the others are recorded,
/// the refused one alone is left to its lease.
#[tokio::test]
async fn a_result_the_database_refuses_fails_alone() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..5)
        .map(|k| action(&format!("k{k}"), k))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    sqlx::query(
        "ALTER TABLE outbox_events ADD CONSTRAINT no_poison \
         CHECK (outcome IS NULL OR NOT outcome ? 'poison')",
    )
    .execute(&db.pool)
    .await?;
    // Every call answers at once, so that their results reach the recorder together.
    let barrier = Arc::new(tokio::sync::Barrier::new(5));
    let executor = {
        let barrier = barrier.clone();
        move |action: Action| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                if action.key == "k0" {
                    Outcome::done(json!({ "poison": true }))
                } else {
                    Outcome::done(json!({ "ok": true }))
                }
            }
        }
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().call_timeout(Duration::from_secs(30)),
        executor,
    )?;
    let run = Running::start(&dispatcher);
    eventually("the others recorded", WAIT, || async {
        Ok(dispatched(&db).await? == 4)
    })
    .await?;
    run.stop().await?;
    Ok(())
}

/// Behind a quarantined action (`BlockKey`), a key's later actions were never claimed, so
/// never reached `max_age`'s check: they stayed pending for good, to be called after the
/// API forgot their keys if an operator requeued the first. They are given up `NeverSent`.
#[tokio::test]
async fn actions_no_claim_reaches_are_given_up_at_max_age() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?, action("k", 1)?]).await?;
    sqlx::raw_sql(
        "UPDATE outbox_events SET created_at = now() - interval '2 hours'; \
         UPDATE outbox_events SET status = 'quarantined', last_error = 'Permanent: declined' \
         WHERE seq = (SELECT min(seq) FROM outbox_events)",
    )
    .execute(&db.pool)
    .await?;
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().max_age(Duration::from_secs(3600)),
        |_: Action| async { Outcome::done(json!({})) },
    )?;
    let run = Running::start(&dispatcher);
    eventually("the held action given up", WAIT, || async {
        Ok(count_status(&db.pool, "quarantined").await? == 2)
    })
    .await?;
    run.stop().await?;
    let state = outbox_tests::dispatch::state(&db, ids[1]).await?;
    let Some(outbox_producer::dispatch::ActionState::NeverSent { reason }) = state else {
        panic!("not never-sent: {state:?}");
    };
    assert!(reason.contains("max_age"), "{reason}");
    Ok(())
}

/// A requeued rejection that then fails another way kept the old rejection's answer, so the
/// agent read `Rejected`.
#[tokio::test]
async fn a_requeued_rejection_does_not_keep_its_old_answer() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let rejected = Dispatcher::new(db.pool.clone(), config(), |_: Action| async {
        Outcome::rejected("402", json!({ "error": "card_declined" }))
    })?;
    assert_eq!(rejected.run_once().await?.quarantined, 1);
    let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM outbox_events")
        .fetch_all(&db.pool)
        .await?;
    let mut conn = db.pool.acquire().await?;
    outbox_producer::quarantine::requeue(
        &mut conn,
        &outbox_producer::TableNames::default(),
        &seqs,
        &outbox_core::ActionNote::new().reason("card replaced"),
    )
    .await?;
    drop(conn);
    let refused = Dispatcher::new(db.pool.clone(), config(), |_: Action| async {
        Outcome::not_sent("the card API refuses this account")
    })?;
    assert_eq!(refused.run_once().await?.quarantined, 1);
    let state = outbox_tests::dispatch::state(&db, ids[0]).await?;
    assert!(
        matches!(
            state,
            Some(outbox_producer::dispatch::ActionState::Unknown { .. })
        ),
        "{state:?}"
    );
    Ok(())
}

/// An executor that can ask the API what became of a key: the billing ledger's answer.
struct Verifying {
    ledger: Arc<Ledger>,
    executed: Arc<AtomicUsize>,
}

impl outbox_producer::dispatch::Executor for Verifying {
    async fn execute(&self, action: Action) -> Outcome {
        self.executed.fetch_add(1, Ordering::SeqCst);
        Outcome::done(self.ledger.apply(&action))
    }

    async fn verify(&self, action: &Action) -> Option<Outcome> {
        let applied = self.ledger.applied.lock().expect("lock");
        applied
            .get(&action.idempotency_key())
            .map(|answer| Outcome::done(answer.clone()))
    }
}

/// A dispatcher that died after its call leaves the action leased; the one that takes it
/// over asks the executor's `verify` first, finds it applied, and records that answer
/// without calling again.
#[tokio::test]
async fn an_action_a_dead_dispatcher_called_is_verified_not_called_again() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = enqueue(&db, &[action("k", 0)?]).await?;
    let (ledger, executed) = (Arc::new(Ledger::default()), Arc::new(AtomicUsize::new(0)));
    let executor = Verifying {
        ledger: ledger.clone(),
        executed: executed.clone(),
    };
    let dispatcher = Dispatcher::new(
        db.pool.clone(),
        config().call_timeout(Duration::from_millis(500)),
        executor,
    )?;
    dispatcher.crash_after_next_call();
    assert!(dispatcher.run_once().await.is_err(), "the injected crash");
    eventually("taken over once its lease ended", WAIT, || async {
        Ok(dispatcher.run_once().await?.published == 1)
    })
    .await?;
    assert_eq!(
        executed.load(Ordering::SeqCst),
        1,
        "called once, verified after"
    );
    let state = outbox_tests::dispatch::state(&db, ids[0]).await?;
    let Some(outbox_producer::dispatch::ActionState::Done(answer)) = state else {
        panic!("not done: {state:?}");
    };
    assert_eq!(answer["charge"], "ch_1");
    Ok(())
}

/// A token bucket of `rate` calls per second (burst 10), as a rate-limited API keeps.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    state: std::sync::Mutex<(f64, std::time::Instant)>,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        Self {
            rate,
            state: std::sync::Mutex::new((10.0, std::time::Instant::now())),
        }
    }

    fn take(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        let (tokens, at) = *state;
        let tokens = (tokens + now.duration_since(at).as_secs_f64() * self.rate).min(10.0);
        let (left, taken) = if tokens >= 1.0 {
            (tokens - 1.0, true)
        } else {
            (tokens, false)
        };
        *state = (left, now);
        taken
    }
}

/// An API taking 200 calls a second, answering 429 (without `Retry-After`) beyond: the
/// dispatcher slows down to it and every action is done, none given up, at no less than a
/// fifth of the limit (the 1,200 actions take 6 s at 200/s; the bound is 30 s). The 64
/// calls of the start, answered 429 one after the other, each decreased the rate (200/s down
/// to 18/s within a millisecond), and claims outran the slower rate until calls waited past
/// their leases and were released unmade: 46.8 s, 26/s (bench P9d stalled outright).
#[tokio::test]
async fn an_api_limiting_the_rate_gets_every_action_at_its_pace() -> Result<()> {
    let db = TestDb::new().await?;
    let events: Vec<_> = (0..1200)
        .map(|i| action(&format!("k{}", i % 300), i))
        .collect::<Result<_>>()?;
    enqueue(&db, &events).await?;
    let ledger = Arc::new(Ledger::default());
    let bucket = Arc::new(Bucket::new(200.0));
    let limited = Arc::new(AtomicUsize::new(0));
    let executor = {
        let (ledger, bucket, limited) = (ledger.clone(), bucket.clone(), limited.clone());
        move |action: Action| {
            let (ledger, bucket, limited) = (ledger.clone(), bucket.clone(), limited.clone());
            async move {
                if bucket.take() {
                    Outcome::done(ledger.apply(&action))
                } else {
                    limited.fetch_add(1, Ordering::SeqCst);
                    Outcome::rate_limited("429 Too Many Requests", None)
                }
            }
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), config(), executor)?;
    let run = Running::start(&dispatcher);
    eventually("every action done", Duration::from_secs(30), || async {
        Ok(dispatched(&db).await? == 1200)
    })
    .await?;
    run.stop().await?;
    assert_eq!(ledger.charges(), 1200);
    assert_eq!(count_status(&db.pool, "quarantined").await?, 0);
    assert!(limited.load(Ordering::SeqCst) > 0, "the limit was reached");
    Ok(())
}
