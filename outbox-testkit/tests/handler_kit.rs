//! The kit's consumer side against the real PostgreSQL: every delivery function, the
//! restarted consumer, the quarantine, batches and partitions. Each test has its own schema;
//! the handler writes a row per run into `effects`, which has no unique key, so an effect that
//! committed twice shows as two rows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{ConsumerConfig, Event, Handler, HandlerError, Outcome, ReceivedHeader};
use outbox_core::{EventId, NewEvent, java_partition};
use outbox_testkit::{CrashRedelivery, HandlerKit, RawRecord};
use outbox_tests::TestDb;
use sqlx::{PgConnection, PgPool};

const TOPIC: &str = "outbox.event.account";

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    /// Succeeds.
    Ok,
    /// Fails its first run (retryable), then succeeds.
    FailOnce,
    /// Always fails (retryable).
    Fail,
    /// Says retrying cannot help.
    Reject,
}

#[derive(Debug, serde::Deserialize)]
struct Step {
    n: i64,
    mode: Mode,
}

/// Writes its effect first, then fails as its event's mode says: a failed run's effect must
/// be rolled back with it.
#[derive(Debug, Clone, Default)]
struct Ledger {
    /// Runs per event id, rolled back ones included.
    runs: Arc<Mutex<HashMap<EventId, u32>>>,
}

impl Ledger {
    fn runs(&self, id: EventId) -> u32 {
        let runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.get(&id).copied().unwrap_or(0)
    }
}

impl Handler<Step> for Ledger {
    async fn handle(
        &self,
        event: &Event<Step>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let run = {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            let run = runs.entry(event.id).or_default();
            *run += 1;
            *run
        };
        sqlx::query(
            "INSERT INTO effects (event_id, n, key, topic, partition, kafka_offset) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(event.id)
        .bind(event.payload.n)
        .bind(&event.key)
        .bind(&event.topic)
        .bind(event.partition)
        .bind(event.offset)
        .execute(conn)
        .await?;
        match event.payload.mode {
            Mode::FailOnce if run == 1 => Err(HandlerError::retry("the first run fails")),
            Mode::Fail => Err(HandlerError::retry("this one always fails")),
            Mode::Reject => Err(HandlerError::quarantine("this one cannot be done")),
            _ => Ok(()),
        }
    }
}

/// One committed effect: where the handler read its record.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct Effect {
    n: i64,
    key: String,
    topic: String,
    partition: i32,
    kafka_offset: i64,
}

async fn setup() -> Result<TestDb> {
    let db = TestDb::new().await?;
    sqlx::query(
        "CREATE TABLE effects (event_id UUID NOT NULL, n BIGINT NOT NULL, key TEXT NOT NULL, \
         topic TEXT NOT NULL, partition INT NOT NULL, kafka_offset BIGINT NOT NULL)",
    )
    .execute(&db.pool)
    .await?;
    Ok(db)
}

/// The committed effects of `id`.
async fn effects(pool: &PgPool, id: EventId) -> Result<Vec<Effect>> {
    Ok(sqlx::query_as(
        "SELECT n, key, topic, partition, kafka_offset FROM effects WHERE event_id = $1",
    )
    .bind(id)
    .fetch_all(pool)
    .await?)
}

async fn effect_count(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await?)
}

fn step(key: &str, n: i64, mode: Mode) -> Result<NewEvent> {
    let payload = serde_json::json!({ "n": n, "mode": mode });
    Ok(NewEvent::new("account", key, "Stepped", &payload)?)
}

/// Tests retry within milliseconds.
fn config(name: &str) -> ConsumerConfig {
    ConsumerConfig::new(name).backoff(Duration::from_millis(1), Duration::from_millis(5))
}

fn kit(db: &TestDb, name: &str) -> Result<(HandlerKit<Step, Ledger>, Ledger)> {
    let ledger = Ledger::default();
    Ok((
        HandlerKit::new(db.pool.clone(), config(name), ledger.clone())?,
        ledger,
    ))
}

#[tokio::test]
async fn deliver_commits_the_effect_with_its_dedup_row_and_deliver_again_skips_it() -> Result<()> {
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    assert_eq!(kit.name(), "ledger");
    let e = step("acct-1", 7, Mode::Ok)?;
    assert!(!kit.is_recorded(e.id()).await?);

    assert_eq!(kit.deliver(&e).await?, Outcome::Processed);
    assert_eq!(
        effects(&db.pool, e.id()).await?,
        [Effect {
            n: 7,
            key: "acct-1".into(),
            topic: TOPIC.into(),
            partition: 0,
            kafka_offset: 0,
        }]
    );
    assert!(kit.is_recorded(e.id()).await?);

    assert_eq!(kit.deliver_again(&e).await?, Outcome::DuplicateCached);
    assert_eq!(effects(&db.pool, e.id()).await?.len(), 1);
    assert_eq!(
        ledger.runs(e.id()),
        1,
        "a duplicate never reaches the handler"
    );
    let stats = kit.stats();
    assert_eq!(
        (stats.processed, stats.duplicates_cached, stats.transactions),
        (1, 1, 1),
        "{stats:?}"
    );
    // The next event goes to the next offset.
    let f = step("acct-1", 8, Mode::Ok)?;
    assert_eq!(kit.deliver(&f).await?, Outcome::Processed);
    assert_eq!(effects(&db.pool, f.id()).await?[0].kafka_offset, 1);
    assert!(kit.quarantined().await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn after_a_restart_or_on_another_member_the_dedup_table_answers() -> Result<()> {
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    let e = step("acct-1", 1, Mode::Ok)?;
    assert_eq!(kit.deliver(&e).await?, Outcome::Processed);

    // Every offset was stored: a restart redelivers nothing.
    assert_eq!(kit.restart().await?, []);
    assert_eq!(kit.stats().processed, 0, "a new consumer, new counters");
    assert_eq!(kit.deliver_again(&e).await?, Outcome::DuplicateStored);
    // The duplicate's id is cached now.
    assert_eq!(kit.deliver_again(&e).await?, Outcome::DuplicateCached);

    // Another member of the same consumer name shares the dedup rows; another name does not.
    let (mut member, _) = self::kit(&db, "ledger")?;
    assert_eq!(member.deliver(&e).await?, Outcome::DuplicateStored);
    let (mut audit, audit_ledger) = self::kit(&db, "audit")?;
    assert_eq!(audit.deliver(&e).await?, Outcome::Processed);
    assert_eq!(
        effects(&db.pool, e.id()).await?.len(),
        2,
        "once per consumer name"
    );
    assert_eq!((ledger.runs(e.id()), audit_ledger.runs(e.id())), (1, 1));
    Ok(())
}

#[tokio::test]
async fn republish_sends_the_same_id_at_a_later_offset_and_it_is_skipped() -> Result<()> {
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    let e = step("acct-1", 1, Mode::Ok)?;
    assert_eq!(kit.deliver(&e).await?, Outcome::Processed);
    assert_eq!(kit.republish(&e).await?, Outcome::DuplicateCached);
    kit.restart().await?;
    assert_eq!(kit.republish(&e).await?, Outcome::DuplicateStored);
    let f = step("acct-1", 2, Mode::Ok)?;
    assert_eq!(kit.deliver(&f).await?, Outcome::Processed);
    // Offsets 0 (e), 1 and 2 (e again), 3 (f).
    assert_eq!(effects(&db.pool, f.id()).await?[0].kafka_offset, 3);
    assert_eq!(effects(&db.pool, e.id()).await?.len(), 1);
    assert_eq!(ledger.runs(e.id()), 1);
    Ok(())
}

#[tokio::test]
#[should_panic(expected = "was never delivered by this kit")]
async fn deliver_again_refuses_an_event_never_delivered() {
    let db = setup().await.expect("a test database");
    let (mut kit, _) = kit(&db, "ledger").expect("a kit");
    let e = step("acct-1", 1, Mode::Ok).expect("an event");
    let _ = kit.deliver_again(&e).await;
}

#[tokio::test]
async fn a_handler_that_fails_once_is_retried_and_its_effect_committed_once() -> Result<()> {
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    let flaky = step("acct-1", 1, Mode::FailOnce)?;
    assert_eq!(kit.deliver(&flaky).await?, Outcome::Processed);
    assert_eq!(ledger.runs(flaky.id()), 2, "failed, then retried");
    assert_eq!(
        effects(&db.pool, flaky.id()).await?.len(),
        1,
        "the failed run rolled back"
    );
    assert_eq!(kit.stats().handler_errors, 1);

    // In a batch: the batch is rolled back and replayed around it; each effect is once.
    let batch = [
        step("acct-1", 2, Mode::Ok)?,
        step("acct-1", 3, Mode::FailOnce)?,
        step("acct-1", 4, Mode::Ok)?,
    ];
    assert_eq!(
        kit.deliver_batch(&batch).await?,
        vec![Outcome::Processed; 3]
    );
    for e in &batch {
        assert_eq!(effects(&db.pool, e.id()).await?.len(), 1, "{e:?}");
    }
    assert_eq!(ledger.runs(batch[1].id()), 2);
    assert_eq!(effect_count(&db.pool).await?, 4);
    assert!(kit.quarantined().await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn a_batch_with_failing_messages_commits_the_others_once_and_quarantines_those() -> Result<()>
{
    let db = setup().await?;
    let ledger = Ledger::default();
    let mut kit = HandlerKit::new(
        db.pool.clone(),
        config("ledger").max_attempts(2),
        ledger.clone(),
    )?;
    let batch = [
        step("acct-1", 1, Mode::Ok)?,
        step("acct-1", 2, Mode::Reject)?,
        step("acct-1", 3, Mode::Ok)?,
        step("acct-1", 4, Mode::Fail)?,
        step("acct-1", 5, Mode::Ok)?,
    ];
    assert_eq!(
        kit.deliver_batch(&batch).await?,
        [
            Outcome::Processed,
            Outcome::Quarantined("handler_rejected"),
            Outcome::Processed,
            Outcome::Quarantined("handler_failed"),
            Outcome::Processed,
        ]
    );
    for (e, committed) in batch.iter().zip([1, 0, 1, 0, 1]) {
        assert_eq!(effects(&db.pool, e.id()).await?.len(), committed, "{e:?}");
    }
    assert_eq!(ledger.runs(batch[1].id()), 1, "rejected: not retried");
    assert_eq!(ledger.runs(batch[3].id()), 2, "max_attempts");
    let quarantined = kit.quarantined().await?;
    let rows: Vec<_> = quarantined
        .iter()
        .map(|q| (q.event_id, q.reason.as_str(), q.offset))
        .collect();
    assert_eq!(
        rows,
        [
            (Some(*batch[1].id().as_uuid()), "handler_rejected", 1),
            (Some(*batch[3].id().as_uuid()), "handler_failed", 3),
        ]
    );
    assert!(
        quarantined[1].error.contains("this one always fails"),
        "{quarantined:?}"
    );
    // Delivered again, they are quarantined rows already (one per record), and the others
    // duplicates.
    kit.restart().await?;
    for (e, outcome) in batch.iter().zip([
        Outcome::DuplicateStored,
        Outcome::Quarantined("handler_rejected"),
        Outcome::DuplicateStored,
        Outcome::Quarantined("handler_failed"),
        Outcome::DuplicateStored,
    ]) {
        assert_eq!(kit.deliver_again(e).await?, outcome, "{e:?}");
    }
    assert_eq!(kit.quarantined().await?.len(), 2);
    assert_eq!(effect_count(&db.pool).await?, 3);
    Ok(())
}

#[tokio::test]
async fn records_spread_over_partitions_by_key_and_batches_follow_max_batch_size() -> Result<()> {
    let db = setup().await?;
    let ledger = Ledger::default();
    let mut kit =
        HandlerKit::new(db.pool.clone(), config("ledger").max_batch_size(2), ledger)?.partitions(3);
    let keys: Vec<String> = (0..12).map(|i| format!("acct-{i}")).collect();
    let events = keys
        .iter()
        .enumerate()
        .map(|(n, key)| step(key, n as i64, Mode::Ok))
        .collect::<Result<Vec<_>>>()?;
    assert_eq!(
        kit.deliver_batch(&events).await?,
        vec![Outcome::Processed; 12]
    );
    let mut per_partition: HashMap<i32, Vec<i64>> = HashMap::new();
    for e in &events {
        let effect = effects(&db.pool, e.id()).await?;
        assert_eq!(effect.len(), 1);
        let partition = java_partition(e.aggregate_id().as_bytes(), 3);
        assert_eq!(effect[0].partition, partition, "{e:?}");
        per_partition
            .entry(partition)
            .or_default()
            .push(effect[0].kafka_offset);
    }
    // Each partition's offsets start at 0 and follow the order of delivery.
    let mut transactions = 0;
    for offsets in per_partition.values() {
        assert_eq!(*offsets, (0..offsets.len() as i64).collect::<Vec<_>>());
        transactions += offsets.len().div_ceil(2) as u64;
    }
    assert!(
        per_partition.len() > 1,
        "12 keys over 3 partitions: {per_partition:?}"
    );
    assert_eq!(kit.stats().transactions, transactions, "{:?}", kit.stats());
    Ok(())
}

#[tokio::test]
async fn a_poison_record_is_quarantined_whole_with_its_bytes() -> Result<()> {
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    let good = step("acct-1", 1, Mode::Ok)?;
    let bad = step("acct-1", 2, Mode::Ok)?;
    let poison = RawRecord::from(&bad)
        .with_payload(&b"{\"n\": 2, \xff"[..])
        .with_header("binary", vec![0, 0xff, 0xfe]);
    let mut no_id = RawRecord::new(TOPIC).with_key("acct-1").with_payload("{}");
    no_id.headers.push(("empty".into(), None));
    let outcomes = kit
        .deliver_raw_batch([RawRecord::from(&good), poison.clone(), no_id.clone()])
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::Quarantined("invalid_json"),
            Outcome::Quarantined("missing_id"),
        ]
    );
    let quarantined = kit.quarantined().await?;
    assert_eq!(quarantined.len(), 2);
    let (row, record) = (&quarantined[0], &poison);
    assert_eq!(row.event_id, Some(*bad.id().as_uuid()));
    assert_eq!(
        (row.topic.as_str(), row.partition, row.offset),
        (TOPIC, 0, 1)
    );
    assert_eq!(row.message_key, record.key);
    assert_eq!(row.payload, record.payload);
    assert_eq!(row.record_headers()?, record.headers);
    assert_eq!(quarantined[1].event_id, None);
    assert_eq!(quarantined[1].record_headers()?, no_id.headers);
    assert_eq!(quarantined[1].payload.as_deref(), Some(&b"{}"[..]));

    // A header name with a NUL inside is no contract name: quarantined, its name's bytes kept.
    let odd = step("acct-1", 3, Mode::Ok)?;
    let named = RawRecord::from(&odd).with_header("id\0x", "spoof");
    assert_eq!(
        kit.deliver_raw(named).await?,
        Outcome::Quarantined("invalid_header_name")
    );
    let rows = kit.quarantined().await?;
    let headers = rows[2].received_headers()?;
    assert!(
        headers.contains(&ReceivedHeader::Bytes {
            name: b"id\0x".to_vec(),
            value: Some(b"spoof".to_vec()),
        }),
        "{headers:?}"
    );
    assert_eq!(
        effect_count(&db.pool).await?,
        1,
        "only the good record had an effect"
    );
    assert_eq!(ledger.runs(bad.id()), 0);
    Ok(())
}

#[tokio::test]
async fn a_crash_between_commit_and_offset_store_redelivers_and_the_effect_stays_once() -> Result<()>
{
    let db = setup().await?;
    let (mut kit, ledger) = kit(&db, "ledger")?;
    let e = step("acct-1", 1, Mode::Ok)?;
    let crash = kit.crash_after_commit_then_redeliver(&e).await?;
    assert_eq!(crash.before_crash, Outcome::Processed);
    assert_eq!(crash.after_restart, Outcome::DuplicateStored);
    assert_eq!(effects(&db.pool, e.id()).await?.len(), 1);
    assert_eq!(ledger.runs(e.id()), 1);
    let stats = kit.stats();
    assert_eq!(
        (stats.processed, stats.duplicates_stored),
        (0, 1),
        "the restarted consumer's: {stats:?}"
    );
    // The redelivery stored the offset: nothing more comes on the next restart.
    assert_eq!(kit.restart().await?, []);

    // A batch: every message is redelivered; the rejected one is handled again and
    // quarantined again, under its one row.
    let batch = [
        step("acct-1", 2, Mode::Ok)?,
        step("acct-1", 3, Mode::Reject)?,
        step("acct-1", 4, Mode::FailOnce)?,
    ];
    let crashed = kit.crash_after_batch_commit_then_redeliver(&batch).await?;
    let outcomes = |c: &CrashRedelivery| (c.before_crash.clone(), c.after_restart.clone());
    assert_eq!(
        crashed.iter().map(outcomes).collect::<Vec<_>>(),
        [
            (Outcome::Processed, Outcome::DuplicateStored),
            (
                Outcome::Quarantined("handler_rejected"),
                Outcome::Quarantined("handler_rejected")
            ),
            (Outcome::Processed, Outcome::DuplicateStored),
        ]
    );
    for (e, committed) in batch.iter().zip([1, 0, 1]) {
        assert_eq!(effects(&db.pool, e.id()).await?.len(), committed, "{e:?}");
    }
    assert_eq!(
        ledger.runs(batch[1].id()),
        2,
        "handled before and after the crash"
    );
    assert_eq!(kit.quarantined().await?.len(), 1);
    // The partition goes on after the redelivered ones.
    let f = step("acct-1", 5, Mode::Ok)?;
    assert_eq!(kit.deliver(&f).await?, Outcome::Processed);
    assert_eq!(effects(&db.pool, f.id()).await?[0].kafka_offset, 4);
    Ok(())
}
