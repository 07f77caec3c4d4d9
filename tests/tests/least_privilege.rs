//! Each part of the framework as the least-privileged role the guide's "Roles" section
//! documents (`outbox_core::ROLES_SQL`, run by the tables' owner, not a superuser), against the
//! real Postgres and broker: the writer enqueues, the relay publishes, the consumer handles each
//! event once (also of a day whose dedup slice was not made ahead and that it may not make),
//! the owner prunes and makes slices ahead. Each role lacks what it was not granted.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, Outcome, consumer_config, dedup_slice, stream_consumer,
};
use outbox_core::{EventId, TableNames};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{Roles, event_message, eventually, kafka_bootstrap, random_topic, unique};
use rdkafka::consumer::Consumer;
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const DAY: u64 = 24 * 3600;
const WEEK: Duration = Duration::from_secs(7 * DAY);

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

async fn record(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id, n) VALUES ($1, $2)")
        .bind(event.id)
        .bind(event.payload.n)
        .execute(conn)
        .await?;
    Ok(())
}

/// The consumer's own table (no unique constraint: a second effect shows as a second row),
/// made by the owner and granted to the consumer as an application would.
async fn effects_table(roles: &Roles, owner: &PgPool) -> Result<()> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE effects (event_id UUID, n BIGINT); GRANT INSERT ON effects TO {}",
        roles.consumer.name
    )))
    .execute(owner)
    .await?;
    Ok(())
}

/// (effects, distinct event ids with an effect).
async fn effects(pool: &PgPool) -> Result<(i64, i64)> {
    Ok(
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
            .fetch_one(pool)
            .await?,
    )
}

/// A UUIDv7 event id decided `days` days from now (negative: ago).
fn decided(days: i64) -> EventId {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs();
    let secs = now.saturating_add_signed(days * DAY as i64);
    EventId::from_uuid(Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        secs,
        0,
    )))
}

/// The dedup row of `id`: (its table, its slice value).
async fn dedup_row(pool: &PgPool, id: EventId) -> Result<(String, i32)> {
    Ok(sqlx::query_as(
        "SELECT tableoid::regclass::text, slice FROM outbox_consumer_dedup WHERE event_id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await?)
}

async fn slice_exists(pool: &PgPool, day: i32) -> Result<bool> {
    Ok(sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(format!("outbox_consumer_dedup_d{day}"))
        .fetch_one(pool)
        .await?)
}

fn insufficient_privilege(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("42501"))
}

async fn consume_until(
    consumer: &DedupConsumer<Step, impl outbox_consumer::Handler<Step>>,
    topic: &str,
    done: impl Fn() -> bool,
    what: &str,
) -> Result<()> {
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), &unique("g")))?;
    stream.subscribe(&[topic])?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(stream, shutdown).await }
    });
    let waited = eventually(what, Duration::from_secs(60), || async { Ok(done()) }).await;
    shutdown.cancel();
    running.await??;
    waited
}

/// Writer, relay, consumer and pruner each as their documented role, end to end through the
/// broker. The consumer meets a day whose slice the owner did not make ahead (yesterday's) and
/// that it may not make: it records the day's ids in the timeless slice, without waiting, and
/// a redelivery to a consumer with no cache is a duplicate. The owner's prune then makes the
/// next days' slices, but not yesterday's, whose ids are in the timeless slice. Each role
/// lacks what it was not granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_part_runs_as_its_documented_role() -> Result<()> {
    let roles = Roles::new().await?;
    let owner = roles.pool(&roles.owner).await?;
    effects_table(&roles, &owner).await?;
    let today = outbox_consumer::today();
    // Only today's slice is made ahead, after the grants: reached through the dedup table.
    let mut conn = owner.acquire().await?;
    outbox_consumer::ensure_dedup_slices(&mut conn, &TableNames::default(), [today]).await?;

    // The writer.
    let topic = random_topic(1).await?;
    let ids = [decided(0), decided(-1), EventId::from_uuid(Uuid::new_v4())];
    let writer = roles.pool(&roles.writer).await?;
    let mut tx = writer.begin().await?;
    for id in ids {
        let event = NewEvent::new("agent", "a1", "Step", &serde_json::json!({ "n": 1 }))?
            .with_id(id)
            .with_topic(&topic)?;
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;
    let read = sqlx::query("SELECT payload FROM outbox_events")
        .execute(&writer)
        .await;
    assert!(
        read.as_ref().is_err_and(insufficient_privilege),
        "the writer reads no payload: {read:?}"
    );
    // It reads what became of its actions (`dispatch::outcome`'s columns).
    let unknown = outbox_producer::dispatch::outcome(
        &mut *writer.acquire().await?,
        &TableNames::default(),
        EventId::new(),
    )
    .await?;
    assert!(unknown.is_none(), "{unknown:?}");

    // The relay.
    let relay_pool = roles.pool(&roles.relay).await?;
    let relay = Relay::new(
        relay_pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default(),
    )?;
    while relay.run_once().await?.claimed > 0 {}
    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE status = 'published'")
            .fetch_one(&owner)
            .await?;
    assert_eq!(published, 3);
    let deleted = sqlx::query("DELETE FROM outbox_events")
        .execute(&relay_pool)
        .await;
    assert!(
        deleted.as_ref().is_err_and(insufficient_privilege),
        "the relay deletes nothing without AfterPublish::Delete's grant: {deleted:?}"
    );
    // Nor does it rewrite what a row says: only what became of it.
    for column in [
        "payload = '{}'",
        "topic = 'dispatch:billing'",
        "aggregateid = 'x'",
    ] {
        let rewritten = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE outbox_events SET {column}"
        )))
        .execute(&relay_pool)
        .await;
        assert!(
            rewritten.as_ref().is_err_and(insufficient_privilege),
            "the relay set {column}: {rewritten:?}"
        );
    }

    // The consumer, twice: the second, with no cache, meets every dedup row.
    let consumer_pool = roles.pool(&roles.consumer).await?;
    let config = || ConsumerConfig::new("billing").dedup_ttl(WEEK);
    let first = DedupConsumer::new(consumer_pool.clone(), config(), record)?;
    consume_until(
        &first,
        &topic,
        || first.stats().processed == 3,
        "the consumer handles every event",
    )
    .await?;
    let second = DedupConsumer::new(consumer_pool.clone(), config(), record)?;
    consume_until(
        &second,
        &topic,
        || second.stats().duplicates_stored == 3,
        "a redelivery finds every event recorded",
    )
    .await?;
    assert_eq!(effects(&owner).await?, (3, 3), "once per event");
    assert_eq!(
        first.stats().handler_errors + second.stats().handler_errors,
        0
    );
    let yesterday = dedup_slice(ids[1].as_uuid());
    assert_eq!(
        dedup_row(&owner, ids[0]).await?,
        (format!("outbox_consumer_dedup_d{today}"), today)
    );
    assert_eq!(
        dedup_row(&owner, ids[1]).await?,
        ("outbox_consumer_dedup_timeless".to_owned(), -yesterday),
        "yesterday had no slice: its id is in the timeless slice, under -day"
    );
    assert!(!slice_exists(&owner, yesterday).await?);
    // It reached today's slice, made after the grants, through the dedup table only.
    let direct = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM outbox_consumer_dedup_d{today}"
    )))
    .execute(&consumer_pool)
    .await;
    assert!(
        direct.as_ref().is_err_and(insufficient_privilege),
        "no grant on the slice itself: {direct:?}"
    );
    let detach = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE outbox_consumer_dedup DETACH PARTITION outbox_consumer_dedup_d{today}"
    )))
    .execute(&consumer_pool)
    .await;
    assert!(
        detach.as_ref().is_err_and(insufficient_privilege),
        "the consumer cannot detach a slice: {detach:?}"
    );
    let pruned = outbox_consumer::prune(
        &mut *consumer_pool.acquire().await?,
        &TableNames::default(),
        WEEK,
        100,
    )
    .await;
    assert!(
        matches!(&pruned, Err(outbox_consumer::ConsumerError::Database(e)) if insufficient_privilege(e)),
        "the consumer cannot prune: {pruned:?}"
    );

    // The pruner: the owner.
    let pruned = outbox_consumer::prune(&mut conn, &TableNames::default(), WEEK, 100).await?;
    assert_eq!(
        pruned.slices_made,
        outbox_consumer::SLICES_AHEAD as u64,
        "tomorrow to a week ahead; none for yesterday, whose ids are in the timeless slice"
    );
    assert!(!slice_exists(&owner, yesterday).await?);
    assert!(slice_exists(&owner, today + outbox_consumer::SLICES_AHEAD).await?);
    // A consumer that may make slices (the owner's) meets yesterday again: it makes no slice,
    // and finds the id where the first one put it.
    let as_owner = DedupConsumer::new(owner.clone(), config(), record)?;
    let again = event_message(&topic, 10, ids[1], r#"{"n":1}"#);
    assert_eq!(
        as_owner.process(&again, &CancellationToken::new()).await?,
        Outcome::DuplicateStored
    );
    assert!(!slice_exists(&owner, yesterday).await?);
    assert_eq!(effects(&owner).await?, (3, 3));

    // Poison goes to the quarantine (INSERT only, with its ON CONFLICT .. DO NOTHING).
    let poison = event_message(&topic, 11, decided(0), "not json");
    let quarantined = second.process(&poison, &CancellationToken::new()).await?;
    assert!(
        matches!(quarantined, Outcome::Quarantined(_)),
        "{quarantined:?}"
    );
    assert_eq!(
        second.process(&poison, &CancellationToken::new()).await?,
        quarantined
    );

    // The quarantine operator discards it, audited under its own name; the consumer may not.
    let tables = TableNames::default();
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine")
        .fetch_one(&owner)
        .await?;
    let note = outbox_core::ActionNote::new().reason("poison");
    let refused = outbox_consumer::quarantine::discard(
        &mut *consumer_pool.acquire().await?,
        &tables,
        &[id],
        &note,
    )
    .await;
    assert!(refused.is_err(), "the consumer discarded: {refused:?}");
    let operator = roles.pool(&roles.operator).await?;
    let discarded = outbox_consumer::quarantine::discard(
        &mut *operator.acquire().await?,
        &tables,
        &[id],
        &note,
    )
    .await?;
    assert_eq!(discarded, 1);
    let by: String = sqlx::query_scalar(
        "SELECT db_user FROM outbox_quarantine_audit WHERE action = 'discard' AND reason = 'poison'",
    )
    .fetch_one(&owner)
    .await?;
    assert_eq!(by, roles.operator.name);
    operator.close().await;

    // The documented grants less one essential privilege fail: the test is not vacuous.
    let (writer_name, relay_name) = (&roles.writer.name, &roles.relay.name);
    roles
        .as_admin(&format!(
            "REVOKE INSERT ON {0}.outbox_events FROM {writer_name}; \
             REVOKE UPDATE (status, attempts, next_attempt_at, last_error, published_at, \
                 outcome, lease, calls) ON {0}.outbox_events FROM {relay_name}",
            roles.schema
        ))
        .await?;
    let event =
        NewEvent::new("agent", "a1", "Step", &serde_json::json!({ "n": 2 }))?.with_topic(&topic)?;
    let enqueued = outbox_producer::enqueue(&mut *writer.acquire().await?, &event).await;
    assert!(
        enqueued
            .as_ref()
            .is_err_and(|e| e.to_string().contains("permission denied")),
        "the writer enqueued without INSERT: {enqueued:?}"
    );
    let claimed = relay.run_once().await;
    assert!(
        claimed
            .as_ref()
            .is_err_and(|e| e.to_string().contains("permission denied")),
        "the relay claimed without UPDATE: {claimed:?}"
    );

    drop(conn);
    for pool in [owner, writer, relay_pool, consumer_pool] {
        pool.close().await;
    }
    roles.drop_all().await
}

/// Lets the test hold a handler's transaction open: it says when it is inside, and waits.
struct Gate {
    inside: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

fn gate() -> &'static Gate {
    static GATE: std::sync::OnceLock<Gate> = std::sync::OnceLock::new();
    GATE.get_or_init(|| Gate {
        inside: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    })
}

async fn record_when_released(
    event: &Event<Step>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    record(event, conn).await?;
    gate().inside.notify_one();
    gate().release.notified().await;
    Ok(())
}

/// A day's ids are never split between its slice and its fallback: while a consumer that may
/// not make slices records an id of a day without one in the timeless slice, the owner's job
/// making that day's slice waits for it (the fallback lock), then sees the fallback row and
/// makes no slice. A redelivery, alone and in a batch, is a duplicate; a later id of that day
/// goes to the fallback too, and its redelivery is found there. Without the lock, the slice
/// would be made under the open transaction and a redelivery would go to it: a second effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_makes_no_slice_for_a_day_a_consumer_fell_back_on() -> Result<()> {
    let roles = Roles::new().await?;
    let owner = roles.pool(&roles.owner).await?;
    effects_table(&roles, &owner).await?;
    let consumer_pool = roles.pool(&roles.consumer).await?;
    let config = || ConsumerConfig::new("billing").dedup_ttl(WEEK);
    let held = DedupConsumer::new(consumer_pool.clone(), config(), record_when_released)?;
    let (id, later) = (decided(-2), decided(-2));
    let day = dedup_slice(id.as_uuid());
    let message = |offset, id| event_message("t", offset, id, r#"{"n":1}"#);
    let handling = tokio::spawn({
        let message = message(0, id);
        async move { held.process(&message, &CancellationToken::new()).await }
    });
    tokio::time::timeout(Duration::from_secs(60), gate().inside.notified())
        .await
        .map_err(|_| anyhow::anyhow!("the handler never ran"))?;
    let making = tokio::spawn({
        let owner = owner.clone();
        async move {
            let mut conn = owner.acquire().await?;
            outbox_consumer::ensure_dedup_slices(&mut conn, &TableNames::default(), [day]).await
        }
    });
    eventually(
        "the owner's job waits for the fallback lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.usename = $1",
            )
            .bind(&roles.owner.name)
            .fetch_one(&owner)
            .await?;
            Ok(waiting == 1)
        },
    )
    .await?;
    gate().release.notify_one();
    assert_eq!(handling.await??, Outcome::Processed);
    assert_eq!(
        making.await??,
        0,
        "no slice made for a day with fallback rows"
    );
    assert!(!slice_exists(&owner, day).await?);

    let c = DedupConsumer::new(consumer_pool.clone(), config(), record)?;
    let none = CancellationToken::new();
    assert_eq!(
        c.process(&message(1, later), &none).await?,
        Outcome::Processed
    );
    let fresh = DedupConsumer::new(consumer_pool.clone(), config(), record)?;
    assert_eq!(
        fresh.process(&message(2, id), &none).await?,
        Outcome::DuplicateStored
    );
    let fresh = DedupConsumer::new(consumer_pool.clone(), config(), record)?;
    let batch = fresh
        .process_batch(&[message(3, id), message(4, later)], &none)
        .await?;
    assert_eq!(batch, vec![Outcome::DuplicateStored; 2]);
    assert_eq!(effects(&owner).await?, (2, 2), "once per event");
    for event in [id, later] {
        assert_eq!(
            dedup_row(&owner, event).await?,
            ("outbox_consumer_dedup_timeless".to_owned(), -day)
        );
    }
    for pool in [owner, consumer_pool] {
        pool.close().await;
    }
    roles.drop_all().await
}

/// `ParkKey` as the documented roles: the consumer parks a key and replays it once released;
/// the quarantine operator lists the key, releases it and skips a record, audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_keys_work_as_the_documented_roles() -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let roles = Roles::new().await?;
    let owner = roles.pool(&roles.owner).await?;
    effects_table(&roles, &owner).await?;
    let tables = TableNames::default();
    let failing = Arc::new(AtomicBool::new(true));
    let fails = failing.clone();
    let consumer = DedupConsumer::new(
        roles.pool(&roles.consumer).await?,
        ConsumerConfig::new("billing")
            .dedup_ttl(WEEK)
            .max_attempts(1)
            .on_handler_failure(outbox_consumer::HandlerFailurePolicy::ParkKey),
        outbox_consumer::boxed(move |event: &Event<Step>, conn| {
            let fail = fails.load(Ordering::SeqCst) && event.payload.n == 0;
            Box::pin(async move {
                if fail {
                    return Err(outbox_consumer::HandlerError::retry("not yet"));
                }
                record(event, conn).await?;
                Ok(())
            })
        }),
    )?;
    let message = |offset: i64, key: &str, n: i64| {
        let id = EventId::new().to_string();
        rdkafka::message::OwnedMessage::new(
            Some(format!(r#"{{"n":{n}}}"#).into_bytes()),
            Some(key.as_bytes().to_vec()),
            "t".into(),
            rdkafka::Timestamp::NotAvailable,
            0,
            offset,
            Some(
                rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                    key: "id",
                    value: Some(id.as_bytes()),
                }),
            ),
        )
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let outcomes = consumer
        .process_batch(
            &[message(0, "k", 0), message(1, "k", 1), message(2, "j", 0)],
            &cancel,
        )
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Parked("handler_failed"),
            Outcome::Parked("key_parked"),
            Outcome::Parked("handler_failed"),
        ]
    );

    let operator = roles.pool(&roles.operator).await?;
    let mut conn = operator.acquire().await?;
    let keys = outbox_consumer::parked::list_parked(&mut conn, &tables, 10).await?;
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(
        outbox_consumer::parked::release(&mut conn, &tables, b"k", None).await?,
        1
    );
    // A record whose key is being released is not skipped: its consumer may be running it.
    let k = keys
        .iter()
        .find(|k| k.message_key == b"k")
        .and_then(|k| k.head_id)
        .expect("k's head");
    let skipped =
        outbox_consumer::parked::skip(&mut conn, &tables, k, &outbox_core::ActionNote::new()).await;
    assert!(
        matches!(
            skipped,
            Err(outbox_consumer::ConsumerError::ParkedKeyReleasing { .. })
        ),
        "{skipped:?}"
    );
    let j = keys
        .iter()
        .find(|k| k.message_key == b"j")
        .and_then(|k| k.head_id)
        .expect("j's head");
    let note = outbox_core::ActionNote::new().reason("refunded by hand");
    assert_eq!(
        outbox_consumer::parked::skip(&mut conn, &tables, j, &note).await?,
        1
    );
    failing.store(false, Ordering::SeqCst);
    while consumer.replay_released("t", 0, &cancel).await? {}
    assert_eq!(effects(&owner).await?, (2, 2), "k's two records, once each");
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_consumer_quarantine_parked) \
              + (SELECT count(*) FROM outbox_consumer_quarantine_parked_keys)",
    )
    .fetch_one(&owner)
    .await?;
    assert_eq!(left, 0, "both keys unparked");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_quarantine_audit WHERE action = 'discard' AND $1 = ANY(row_ids)",
    )
    .bind(j)
    .fetch_one(&owner)
    .await?;
    assert_eq!(audited, 1);
    roles.drop_all().await
}

/// The database writes the quarantines' audit, whoever changes a quarantined row: a DELETE or
/// an UPDATE typed by the quarantine operator in psql is recorded under its name, with the
/// rows it touched, and the operator cannot write an entry of its own. Fails before migration
/// 0017: the client wrote the audit row in the statement that acted, so a direct statement
/// left none, and the operator had INSERT on the audit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_writes_the_audit_whoever_changes_a_quarantined_row() -> Result<()> {
    let roles = Roles::new().await?;
    let owner = roles.pool(&roles.owner).await?;
    let operator = roles.pool(&roles.operator).await?;
    let event = EventId::new();
    let quarantined: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_consumer_quarantine \
            (consumer, topic, partition, \"offset\", event_id, message_key, payload, reason, error) \
         VALUES ('billing', 't', 0, 7, $1, 'k', 'x', 'invalid_json', 'bad') RETURNING id",
    )
    .bind(event.as_uuid())
    .fetch_one(&owner)
    .await?;
    let row = NewEvent::new("agent", "a1", "Step", &serde_json::json!({ "n": 1 }))?;
    outbox_producer::enqueue(&mut *owner.acquire().await?, &row).await?;
    let seq: i64 = sqlx::query_scalar(
        "UPDATE outbox_events SET status = 'quarantined', last_error = 'bad' RETURNING seq",
    )
    .fetch_one(&owner)
    .await?;
    let audit = || async {
        let rows: Vec<(String, String, Vec<i64>, String, String)> = sqlx::query_as(
            "SELECT action, side, row_ids, db_user, db_session_user \
             FROM outbox_quarantine_audit ORDER BY at, id",
        )
        .fetch_all(&owner)
        .await?;
        anyhow::Ok(rows)
    };
    assert_eq!(
        audit().await?,
        [],
        "quarantining a row is no operator action"
    );

    let forged = sqlx::query(
        "INSERT INTO outbox_quarantine_audit (action, side, table_name, row_ids, event_ids, consumers) \
         VALUES ('discard', 'consumer', 'x', '{}', '{}', '{}')",
    )
    .execute(&operator)
    .await;
    assert!(
        forged.as_ref().is_err_and(insufficient_privilege),
        "the operator wrote an audit entry: {forged:?}"
    );
    // The operator may set a row's state, nothing else (its payload, its topic).
    for column in ["payload = '{}'", "topic = 'dispatch:billing'"] {
        let rewritten = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE outbox_events SET {column} WHERE seq = $1"
        )))
        .bind(seq)
        .execute(&operator)
        .await;
        assert!(
            rewritten.as_ref().is_err_and(insufficient_privilege),
            "{column}: {rewritten:?}"
        );
    }
    sqlx::query("UPDATE outbox_events SET last_error = 'looked at' WHERE seq = $1")
        .bind(seq)
        .execute(&operator)
        .await?;
    sqlx::query("DELETE FROM outbox_consumer_quarantine WHERE id = $1")
        .bind(quarantined)
        .execute(&operator)
        .await?;
    let name = &roles.operator.name;
    assert_eq!(
        audit().await?,
        [
            (
                "update".into(),
                "relay".into(),
                vec![seq],
                name.clone(),
                name.clone()
            ),
            (
                "delete".into(),
                "consumer".into(),
                vec![quarantined],
                name.clone(),
                name.clone()
            ),
        ]
    );
    // Nor can it take an entry back.
    let erased = sqlx::query("DELETE FROM outbox_quarantine_audit")
        .execute(&operator)
        .await;
    assert!(
        erased.as_ref().is_err_and(insufficient_privilege),
        "{erased:?}"
    );

    // A name claimed for a change that is not that action is not taken: a "requeue" that
    // leaves the row quarantined is an update, the claim kept in its detail.
    let mut tx = operator.begin().await?;
    sqlx::query("SELECT set_config('outbox.audit_action', 'requeue', true)")
        .execute(&mut *tx)
        .await?;
    sqlx::query("UPDATE outbox_events SET last_error = last_error WHERE seq = $1")
        .bind(seq)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    let (action, claimed): (String, Option<String>) = sqlx::query_as(
        "SELECT action, detail->>'claimed_action' FROM outbox_quarantine_audit \
         ORDER BY at DESC, id DESC LIMIT 1",
    )
    .fetch_one(&owner)
    .await?;
    assert_eq!(
        (action.as_str(), claimed.as_deref()),
        ("update", Some("requeue"))
    );

    // Its UPDATE (id) on the consumer quarantine locks rows; it renumbers none.
    let other: i64 = sqlx::query_scalar(
        "INSERT INTO outbox_consumer_quarantine \
            (consumer, topic, partition, \"offset\", message_key, payload, reason, error) \
         VALUES ('billing', 't', 0, 9, 'k', 'x', 'invalid_json', 'bad') RETURNING id",
    )
    .fetch_one(&owner)
    .await?;
    let renumbered =
        sqlx::query("UPDATE outbox_consumer_quarantine SET id = DEFAULT WHERE id = $1")
            .bind(other)
            .execute(&operator)
            .await;
    assert!(
        renumbered.as_ref().is_err_and(insufficient_privilege),
        "{renumbered:?}"
    );

    // The operator's requeue through the library works under the column grants, audited.
    let requeued = outbox_producer::quarantine::requeue(
        &mut *operator.acquire().await?,
        &TableNames::default(),
        &[seq],
        &outbox_core::ActionNote::new().reason("fixed"),
    )
    .await?;
    assert_eq!(requeued, 1);

    // The trigger's function, called from a trigger on a table of one's own, writes nothing.
    let mut conn = operator.acquire().await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TEMP TABLE fake (id BIGINT, event_id UUID, consumer TEXT, quarantined_at TIMESTAMPTZ); \
         CREATE TRIGGER fake_audit AFTER DELETE ON fake REFERENCING OLD TABLE AS changed \
             FOR EACH STATEMENT EXECUTE FUNCTION {}.outbox_quarantine_audit_write(); \
         INSERT INTO fake VALUES (1, NULL, 'billing', now())",
        roles.schema
    )))
    .execute(&mut *conn)
    .await?;
    let faked = sqlx::query("DELETE FROM fake").execute(&mut *conn).await;
    assert!(
        faked.as_ref().is_err_and(insufficient_privilege),
        "{faked:?}"
    );
    drop(conn);
    let entries: Vec<String> =
        sqlx::query_scalar("SELECT action FROM outbox_quarantine_audit ORDER BY at, id")
            .fetch_all(&owner)
            .await?;
    assert_eq!(entries, ["update", "delete", "update", "requeue"]);
    operator.close().await;
    owner.close().await;
    roles.drop_all().await
}

/// The dispatcher as its own role (`outbox_dispatcher`): it claims, leases, calls and records
/// its actions' answers and a rejection, and the writer that enqueued them reads what became
/// of each (`dispatch::outcome`). Neither rewrites what an action says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dispatcher_and_the_writer_do_their_jobs_as_their_roles() -> Result<()> {
    use outbox_producer::dispatch::{Action, ActionState, Dispatcher, Outcome};
    let roles = Roles::new().await?;
    let writer = roles.pool(&roles.writer).await?;
    let mut tx = writer.begin().await?;
    let mut ids = Vec::new();
    for (key, n) in [("a", 0), ("b", 1)] {
        let action = outbox_tests::dispatch::action(key, n)?;
        ids.push(action.id());
        outbox_producer::enqueue(&mut tx, &action).await?;
    }
    tx.commit().await?;
    let declined = ids[1];
    let executor = move |action: Action| async move {
        if action.id == declined {
            Outcome::rejected(
                "402 card declined",
                serde_json::json!({ "error": "declined" }),
            )
        } else {
            Outcome::done(serde_json::json!({ "charged": true }))
        }
    };
    let dispatcher_pool = roles.pool(&roles.dispatcher).await?;
    let dispatcher = Dispatcher::new(
        dispatcher_pool.clone(),
        outbox_tests::dispatch::config(),
        executor,
    )?;
    let report = dispatcher.run_once().await?;
    assert_eq!((report.published, report.quarantined), (1, 1), "{report:?}");
    let tables = TableNames::default();
    let mut conn = writer.acquire().await?;
    let done = outbox_producer::dispatch::outcome(&mut conn, &tables, ids[0]).await?;
    assert_eq!(
        done,
        Some(ActionState::Done(serde_json::json!({ "charged": true })))
    );
    let rejected = outbox_producer::dispatch::outcome(&mut conn, &tables, ids[1]).await?;
    assert!(
        matches!(rejected, Some(ActionState::Rejected { .. })),
        "{rejected:?}"
    );
    drop(conn);
    for pool in [&dispatcher_pool, &writer] {
        let rewritten = sqlx::query("UPDATE outbox_events SET payload = '{}', status = 'pending'")
            .execute(pool)
            .await;
        assert!(
            rewritten.as_ref().is_err_and(insufficient_privilege),
            "{rewritten:?}"
        );
    }
    dispatcher_pool.close().await;
    writer.close().await;
    roles.drop_all().await
}
