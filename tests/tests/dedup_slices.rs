//! The dedup table in day slices: every kind of id deduplicated in its own slice, slices made
//! by the consumer when missing, pruning that drops whole slices beside running consumers, and
//! the migration from the unsliced table. Real Postgres; the running-consumer test also the
//! real broker.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, Outcome, TIMELESS, consumer_config, dedup_consume,
    dedup_slice,
};
use outbox_core::{EventId, TableNames};
use outbox_tests::{
    TestDb, event_message, eventually, index_blocks_read_by, kafka_bootstrap, produce_raw,
    random_topic, unique,
};
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const DAY: u64 = 24 * 3600;
const WEEK: Duration = Duration::from_secs(7 * DAY);
/// The TTL of a consumer whose slices a week's prune drops under it: its window reaches days
/// that the pruner's has left (what a consumer meets when its day's slice expires while it
/// runs, or when members' clocks disagree about the day).
const MONTH: Duration = Duration::from_secs(30 * DAY);

/// A consumer whose window holds the days a week's prune drops.
fn month_long(name: &str) -> ConsumerConfig {
    ConsumerConfig::new(name).dedup_ttl(MONTH)
}

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect must show as a second row.
    sqlx::query("CREATE TABLE effects (event_id UUID, n BIGINT)")
        .execute(pool)
        .await?;
    Ok(())
}

async fn record(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id, n) VALUES ($1, $2)")
        .bind(event.id)
        .bind(event.payload.n)
        .execute(conn)
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

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs()
}

/// A UUIDv7 event id decided `days` days from now (negative: ago).
fn decided(days: i64) -> EventId {
    let secs = now_secs().saturating_add_signed(days * DAY as i64);
    EventId::from_uuid(Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        secs,
        0,
    )))
}

fn timeless() -> EventId {
    EventId::from_uuid(Uuid::new_v4())
}

/// The table each id's dedup row is in.
async fn slice_tables(pool: &PgPool, ids: &[EventId]) -> Result<Vec<String>> {
    let mut tables = Vec::new();
    for id in ids {
        tables.push(
            sqlx::query_scalar(
                "SELECT tableoid::regclass::text FROM outbox_consumer_dedup WHERE event_id = $1",
            )
            .bind(id)
            .fetch_one(pool)
            .await?,
        );
    }
    Ok(tables)
}

#[tokio::test]
async fn the_slice_function_in_sql_and_in_rust_agree() -> Result<()> {
    let db = TestDb::new().await?;
    let mut ids: Vec<Uuid> = vec![Uuid::nil(), Uuid::max(), Uuid::new_v4(), Uuid::now_v7()];
    ids.extend((-400..400).step_by(37).map(|d| *decided(d).as_uuid()));
    ids.push(Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        0,
        0,
    )));
    ids.push(Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        (1 << 47) / 1000,
        0,
    )));
    for id in ids {
        let sql: i32 = sqlx::query_scalar("SELECT outbox_consumer_dedup_slice($1)")
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
        assert_eq!(sql, dedup_slice(&id), "{id}");
    }
    Ok(())
}

/// Every kind of id deduplicates, in its own slice; a day with no slice yet (an event from a
/// producer whose clock runs a day ahead) gets one from the consumer, which never fails for
/// it; an id dated before the consumer's window (an old event replayed) goes to the slice of
/// the day it is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_id_is_deduplicated_in_its_own_slice() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let ids = [decided(0), decided(1), decided(-30), timeless()];
    let none = CancellationToken::new();
    for round in 0..2 {
        // A new consumer each round: no cache, so the second round meets the dedup rows.
        let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
        for (offset, id) in ids.iter().enumerate() {
            let message = event_message("t", offset as i64, *id, r#"{"n":1}"#);
            let expected = if round == 0 {
                Outcome::Processed
            } else {
                Outcome::DuplicateStored
            };
            assert_eq!(c.process(&message, &none).await?, expected, "{id}");
        }
    }
    assert_eq!(effects(&db.pool).await?, (4, 4), "once per event");
    let expected: Vec<String> = ids
        .iter()
        .map(|id| match dedup_slice(id.as_uuid()) {
            TIMELESS => "outbox_consumer_dedup_timeless".to_owned(),
            // Before the window of the default TTL, a week: today - 6 on.
            day if day < outbox_consumer::today() - 6 => {
                format!("outbox_consumer_dedup_d{}", outbox_consumer::today())
            }
            day => format!("outbox_consumer_dedup_d{day}"),
        })
        .collect();
    assert_eq!(slice_tables(&db.pool, &ids).await?, expected);
    Ok(())
}

/// An id dated more than a day ahead is quarantined (`id_ahead`), with its id, and makes no
/// slice: each such day would make a table that stays until the day is past the TTL, as many
/// as a broken clock or crafted ids name. Its partition goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_dated_days_ahead_is_quarantined_and_makes_no_slice() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let none = CancellationToken::new();
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (ahead, next) = (decided(3), decided(0));
    let message = |offset, id| event_message("t", offset, id, r#"{"n":1}"#);
    assert_eq!(
        c.process(&message(0, ahead), &none).await?,
        Outcome::Quarantined("id_ahead")
    );
    assert_eq!(
        c.process(&message(1, next), &none).await?,
        Outcome::Processed
    );
    assert_eq!(effects(&db.pool).await?, (1, 1));
    let (event_id, reason): (Option<Uuid>, String) = sqlx::query_as(
        "SELECT event_id, reason FROM outbox_consumer_quarantine WHERE consumer = 'c1'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(
        (event_id, reason.as_str()),
        (Some(*ahead.as_uuid()), "id_ahead")
    );
    let slice: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!(
            "outbox_consumer_dedup_d{}",
            dedup_slice(ahead.as_uuid())
        ))
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(slice, None, "no slice for the day ahead");
    Ok(())
}

/// A consumer that has seen a day's slice finds it dropped by a prune: the insert finds no
/// slice, and the consumer makes it again at once instead of failing or waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slice_dropped_under_a_consumer_that_had_seen_it_is_made_again() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let none = CancellationToken::new();
    let c = DedupConsumer::new(db.pool.clone(), month_long("c1"), record)?;
    let (first, second) = (decided(-20), decided(-20));
    let message = |offset, id| event_message("t", offset, id, r#"{"n":1}"#);
    assert_eq!(
        c.process(&message(0, first), &none).await?,
        Outcome::Processed
    );
    let mut conn = db.pool.acquire().await?;
    let pruned = outbox_consumer::prune(&mut conn, &TableNames::default(), WEEK, 100).await?;
    assert_eq!(pruned.slices_dropped, 1);
    assert_eq!(
        c.process(&message(1, second), &none).await?,
        Outcome::Processed
    );
    assert_eq!(c.stats().handler_errors, 0, "no failed attempt");
    assert_eq!(effects(&db.pool).await?, (2, 2));
    Ok(())
}

/// Pruning beside running consumers, again and again, while they handle events of days being
/// dropped: no error, no quarantine, every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_beside_running_consumers_costs_them_nothing() -> Result<()> {
    const EVENTS: i64 = 400;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(2).await?;
    // Decided over the last 20 days: about two thirds fall in days past the week kept.
    for n in 0..EVENTS {
        let id = decided(-(n % 20)).to_string();
        let payload = format!(r#"{{"n":{n}}}"#);
        produce_raw(
            &topic,
            Some((n % 2) as i32),
            Some("k"),
            Some(payload.as_bytes()),
            &[("id", id.as_bytes())],
        )
        .await?;
    }
    let config = month_long("c1").max_batch_size(8);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(
        dedup_consume(
            &consumer_config(&kafka_bootstrap(), &unique("g")),
            db.pool.clone(),
            record,
        )
        .topics([topic.clone()])
        .config(config)
        .run(shutdown.clone()),
    );
    let dropped = std::sync::atomic::AtomicU64::new(0);
    eventually(
        "every event has its effect",
        Duration::from_secs(60),
        || async {
            let mut conn = db.pool.acquire().await?;
            let pruned =
                outbox_consumer::prune(&mut conn, &TableNames::default(), WEEK, 50).await?;
            dropped.fetch_add(pruned.slices_dropped, std::sync::atomic::Ordering::SeqCst);
            Ok(effects(&db.pool).await?.1 >= EVENTS)
        },
    )
    .await?;
    shutdown.cancel();
    running.await??;
    assert_eq!(effects(&db.pool).await?, (EVENTS, EVENTS), "once per event");
    assert!(
        dropped.into_inner() > 0,
        "prune dropped slices while consumers ran"
    );
    let quarantined: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(quarantined, 0);
    Ok(())
}

/// The migration from the unsliced table keeps every row, each in its slice: redelivered
/// afterwards, every one of those events is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_moves_every_dedup_row_to_its_slice() -> Result<()> {
    let db = TestDb::before_migration(4).await?;
    let ids: Vec<EventId> = (0..60)
        .map(|n| {
            if n % 4 == 0 {
                timeless()
            } else {
                decided(-(n % 9))
            }
        })
        .collect();
    for id in &ids {
        sqlx::query("INSERT INTO outbox_consumer_dedup (consumer, event_id) VALUES ('c1', $1)")
            .bind(id)
            .execute(&db.pool)
            .await?;
    }
    outbox_core::migrate(&db.pool).await?;
    effects_table(&db.pool).await?;

    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let none = CancellationToken::new();
    for (offset, id) in ids.iter().enumerate() {
        let message = event_message("t", offset as i64, *id, r#"{"n":1}"#);
        assert_eq!(
            c.process(&message, &none).await?,
            Outcome::DuplicateStored,
            "{id}"
        );
    }
    assert_eq!(effects(&db.pool).await?, (0, 0));
    let slices: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT tableoid) FROM outbox_consumer_dedup WHERE slice <> 0",
    )
    .fetch_one(&db.pool)
    .await?;
    assert!(slices >= 9, "one slice per day of the rows: {slices}");
    Ok(())
}

/// One pruner at a time per dedup table: while another session holds the prune lock, `prune`
/// returns at once with nothing removed, and the expired slice is still there for the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pruner_returns_at_once_with_nothing_removed() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), month_long("c1"), record)?;
    let message = event_message("t", 0, decided(-20), r#"{"n":1}"#);
    assert_eq!(
        c.process(&message, &CancellationToken::new()).await?,
        Outcome::Processed
    );
    let (mut first, mut second) = (db.pool.acquire().await?, db.pool.acquire().await?);
    let dedup = TableNames::default().consumer_dedup;
    assert!(outbox_core::try_prune_lock(&mut first, &dedup).await?);
    let pruned = outbox_consumer::prune(&mut second, &TableNames::default(), WEEK, 100).await?;
    assert_eq!(pruned, outbox_consumer::DedupPruned::default());
    outbox_core::prune_unlock(&mut first, &dedup).await?;
    let pruned = outbox_consumer::prune(&mut second, &TableNames::default(), WEEK, 100).await?;
    assert_eq!(pruned.slices_dropped, 1);
    Ok(())
}

/// The timeless slice is pruned in batches, each starting its index scan where the previous
/// one stopped: with autovacuum off, the entries of the rows already deleted stay, and a run
/// whose every batch started from the beginning of the index would walk them all again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prune_run_reads_the_timeless_slices_index_once_through() -> Result<()> {
    const ROWS: i64 = 20_000;
    const BATCH: u32 = 100;
    let db = TestDb::new().await?;
    let mut conn = db.pool.acquire().await?;
    sqlx::query("ALTER TABLE outbox_consumer_dedup_timeless SET (autovacuum_enabled = false)")
        .execute(&mut *conn)
        .await?;
    // UUIDv4 ids (slice 0), processed one a second, over a week before the TTL.
    sqlx::query(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice, processed_at) \
         SELECT 'c1', gen_random_uuid(), 0, now() - interval '14 days' + g * interval '1 second' \
         FROM generate_series(1, $1) AS g",
    )
    .bind(ROWS)
    .execute(&mut *conn)
    .await?;
    let (pruned, read) = index_blocks_read_by(
        &mut conn,
        &db.schema,
        "outbox_consumer_dedup_timeless",
        "outbox_consumer_dedup_timeless_processed_at_idx",
        async |conn| Ok(outbox_consumer::prune(conn, &TableNames::default(), WEEK, BATCH).await?),
    )
    .await?;
    assert_eq!(pruned.timeless_rows, ROWS as u64);
    // A batch descends the tree (two levels here) and reads the leaf or two holding its rows;
    // starting every batch at the beginning reads thousands more over this run.
    let batches = ROWS / i64::from(BATCH) + 1;
    assert!(
        read <= 6 * batches,
        "{read} index blocks for {batches} batches"
    );
    Ok(())
}

/// In-process pruning: `DedupPruner` drops the expired slice on its first turn, and stops at
/// once when asked while it waits for the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_pruner_prunes_on_its_first_turn_and_stops_when_asked() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), month_long("c1"), record)?;
    let (expired, kept) = (decided(-20), decided(0));
    for (offset, id) in [expired, kept].into_iter().enumerate() {
        let message = event_message("t", offset as i64, id, r#"{"n":1}"#);
        assert_eq!(
            c.process(&message, &CancellationToken::new()).await?,
            Outcome::Processed
        );
    }
    let shutdown = CancellationToken::new();
    let pruner = outbox_consumer::DedupPruner::new(db.pool.clone(), WEEK)
        .interval(Duration::from_secs(3600));
    let running = tokio::spawn(pruner.run(shutdown.clone()));
    eventually(
        "the expired slice is dropped",
        Duration::from_secs(30),
        || async {
            let left: Vec<EventId> =
                sqlx::query_scalar("SELECT event_id FROM outbox_consumer_dedup")
                    .fetch_all(&db.pool)
                    .await?;
            Ok(left == [kept])
        },
    )
    .await?;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), running).await??;
    Ok(())
}

/// An effects table and a parent table for the poison event: a deferred foreign key fails at
/// COMMIT, so the batch holding it is rejected and each of its messages is handled alone,
/// through the one-message transaction.
async fn poison_tables(pool: &PgPool) -> Result<()> {
    effects_table(pool).await?;
    sqlx::raw_sql(
        "CREATE TABLE parents (id INT PRIMARY KEY); \
         CREATE TABLE children (parent INT REFERENCES parents DEFERRABLE INITIALLY DEFERRED)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// `record`, with `n` the advisory locks its transaction holds, except that the event with
/// `n` = -1 makes its transaction's COMMIT fail.
async fn record_or_poison(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    if event.payload.n == -1 {
        sqlx::query("INSERT INTO children (parent) VALUES (42)")
            .execute(conn)
            .await?;
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO effects (event_id, n) SELECT $1, count(*) FROM pg_locks \
         WHERE pid = pg_backend_pid() AND locktype = 'advisory'",
    )
    .bind(event.id)
    .execute(conn)
    .await?;
    Ok(())
}

/// The dedup table's day slices (its partitions but the timeless one).
async fn day_slices(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits \
         WHERE inhparent = 'outbox_consumer_dedup'::regclass \
           AND inhrelid <> 'outbox_consumer_dedup_timeless'::regclass",
    )
    .fetch_one(pool)
    .await?)
}

/// Handles `ids` (from `offset` on) with consumer `c`: through the batch path, or, with
/// `alone`, behind a poison event whose batch the database rejects, so that each id is
/// handled on its own transaction. Returns the ids' outcomes.
async fn deliver<H: outbox_consumer::Handler<Step>>(
    c: &DedupConsumer<Step, H>,
    ids: &[EventId],
    offset: i64,
    alone: bool,
) -> Result<Vec<Outcome>> {
    let mut messages = Vec::with_capacity(ids.len() + 1);
    if alone {
        messages.push(event_message("t", offset, decided(0), r#"{"n":-1}"#));
    }
    for (n, id) in ids.iter().enumerate() {
        let at = offset + 1 + n as i64;
        messages.push(event_message("t", at, *id, r#"{"n":1}"#));
    }
    let mut outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    if alone {
        assert_eq!(outcomes.remove(0), Outcome::Quarantined("commit_failed"));
    }
    Ok(outcomes)
}

/// Ids dated on many past days (a new consumer replaying a topic kept longer than the TTL, a
/// producer's clock far behind, crafted ids) make at most the TTL in days + 2 day slices,
/// however many days they name: each is handled once, on the batch path and on the
/// one-message path, and a redelivery of each is a duplicate. A batch of them holds at most 64
/// advisory locks (Postgres's lock table is sized for 64 a connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_on_hundreds_of_past_days_make_a_bounded_number_of_slices() -> Result<()> {
    const DAYS: i64 = 300;
    let db = TestDb::new().await?;
    poison_tables(&db.pool).await?;
    let ids: Vec<EventId> = (1..=DAYS).map(|d| decided(-d)).collect();
    let (batched, alone) = ids.split_at(ids.len() / 2);
    let config = || ConsumerConfig::new("c1").dedup_ttl(WEEK).max_attempts(1);
    let c = DedupConsumer::new(db.pool.clone(), config(), record_or_poison)?;
    let first: Vec<Outcome> = [
        deliver(&c, batched, 0, false).await?,
        deliver(&c, alone, 1_000, true).await?,
    ]
    .concat();
    assert_eq!(first, vec![Outcome::Processed; ids.len()]);
    assert_eq!(effects(&db.pool).await?, (DAYS, DAYS), "once per event");
    let bound = 7 + 2;
    let made = day_slices(&db.pool).await?;
    assert!(made <= bound, "{made} day slices for {DAYS} days of ids");
    let locks: i64 = sqlx::query_scalar("SELECT max(n) FROM effects")
        .fetch_one(&db.pool)
        .await?;
    assert!(
        (1..=64).contains(&locks),
        "a transaction of {} old ids held {locks} advisory locks",
        batched.len()
    );

    // Redelivered to a consumer that has not cached them.
    let c = DedupConsumer::new(db.pool.clone(), config(), record_or_poison)?;
    let again: Vec<Outcome> = [
        deliver(&c, batched, 2_000, false).await?,
        deliver(&c, alone, 3_000, true).await?,
    ]
    .concat();
    assert_eq!(again, vec![Outcome::DuplicateStored; ids.len()]);
    assert_eq!(effects(&db.pool).await?, (DAYS, DAYS), "no second effect");
    assert!(day_slices(&db.pool).await? <= bound);
    Ok(())
}

/// An id first handled inside the window is recorded in its day's slice; redelivered once its
/// day is past the horizon (simulated by a consumer of the same name with a shorter TTL,
/// whose horizon is where the first one's would be weeks later), it is looked for in every
/// slice and found: a duplicate, on either path, and no slice is made for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_redelivered_after_its_day_passed_the_horizon_is_a_duplicate() -> Result<()> {
    let db = TestDb::new().await?;
    poison_tables(&db.pool).await?;
    let ids: Vec<EventId> = (8..28).map(|d| decided(-d)).collect();
    let (batched, alone) = ids.split_at(ids.len() / 2);
    let month = Duration::from_secs(30 * DAY);
    let c = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").dedup_ttl(month).max_attempts(1),
        record_or_poison,
    )?;
    let first: Vec<Outcome> = [
        deliver(&c, batched, 0, false).await?,
        deliver(&c, alone, 1_000, true).await?,
    ]
    .concat();
    assert_eq!(first, vec![Outcome::Processed; ids.len()]);
    let expected: Vec<String> = ids
        .iter()
        .map(|id| format!("outbox_consumer_dedup_d{}", dedup_slice(id.as_uuid())))
        .collect();
    assert_eq!(
        slice_tables(&db.pool, &ids).await?,
        expected,
        "in their days' slices"
    );
    let made = day_slices(&db.pool).await?;

    let c = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").dedup_ttl(WEEK).max_attempts(1),
        record_or_poison,
    )?;
    let again: Vec<Outcome> = [
        deliver(&c, batched, 2_000, false).await?,
        deliver(&c, alone, 3_000, true).await?,
    ]
    .concat();
    assert_eq!(again, vec![Outcome::DuplicateStored; ids.len()]);
    assert_eq!(effects(&db.pool).await?, (20, 20), "no second effect");
    assert!(day_slices(&db.pool).await? <= made.max(9));
    Ok(())
}

/// Lets the test hold `record_when_released`'s transaction open: it says when it is inside,
/// and waits to be released.
struct Gate {
    inside: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

impl Gate {
    fn new() -> Self {
        Self {
            inside: tokio::sync::Notify::new(),
            release: tokio::sync::Notify::new(),
        }
    }

    /// Says the handler is inside, and waits to be released.
    async fn pass(&self) {
        self.inside.notify_one();
        self.release.notified().await;
    }
}

/// One gate per test that uses one (they run in parallel).
fn gate() -> &'static Gate {
    static GATE: std::sync::OnceLock<Gate> = std::sync::OnceLock::new();
    GATE.get_or_init(Gate::new)
}

async fn record_when_released(
    event: &Event<Step>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    record(event, conn).await?;
    gate().pass().await;
    Ok(())
}

/// Two transactions take the same late id at once and would record it in different slices
/// (one in the day it is handled, the other in the id's own day: the window's oldest for it,
/// as across midnight): the second waits for the first's lock on the id, then finds its row.
/// Once, not twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_transactions_placing_a_late_id_in_different_slices_handle_it_once() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let id = decided(-20);
    let message = event_message("t", 0, id, r#"{"n":1}"#);
    // A week's window records it today; three weeks' records it in its own day, the oldest.
    let first = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").dedup_ttl(WEEK),
        record_when_released,
    )?;
    let second = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").dedup_ttl(Duration::from_secs(21 * DAY)),
        record,
    )?;
    let first = tokio::spawn({
        let message = message.clone();
        async move { first.process(&message, &CancellationToken::new()).await }
    });
    gate().inside.notified().await;
    let second = tokio::spawn({
        let message = message.clone();
        async move { second.process(&message, &CancellationToken::new()).await }
    });
    eventually(
        "the second transaction waits for the id's lock",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks, \
                    hashtextextended('outbox_consumer_dedup/c1/' || (hashtext($1::text) & 63), 0) AS k \
                 WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1 \
                   AND classid::bigint = (k >> 32) & 4294967295 \
                   AND objid::bigint = k & 4294967295",
            )
            .bind(id)
            .fetch_one(&db.pool)
            .await?;
            Ok(waiting == 1)
        },
    )
    .await?;
    gate().release.notify_one();
    assert_eq!(first.await??, Outcome::Processed);
    assert_eq!(second.await??, Outcome::DuplicateStored);
    assert_eq!(effects(&db.pool).await?, (1, 1), "once");
    assert_eq!(
        slice_tables(&db.pool, &[id]).await?,
        [format!(
            "outbox_consumer_dedup_d{}",
            outbox_consumer::today()
        )]
    );
    Ok(())
}

fn held_gate() -> &'static Gate {
    static GATE: std::sync::OnceLock<Gate> = std::sync::OnceLock::new();
    GATE.get_or_init(Gate::new)
}

async fn record_and_hold(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    record(event, conn).await?;
    held_gate().pass().await;
    Ok(())
}

/// A late id's lock held by another batch is contention, not the message's failure: a role's
/// `lock_timeout` (common on managed Postgres) must not cut the wait and charge it an attempt.
/// Fails before the fix: the second consumer's lock statement ended with SQLSTATE 55P03 after
/// 100 ms, charged as `transaction_failed`, and with one attempt the message was quarantined
/// although the first consumer was about to commit it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_ids_lock_wait_outlasts_the_roles_lock_timeout() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let id = decided(-20);
    let message = event_message("t", 0, id, r#"{"n":1}"#);
    let first = DedupConsumer::new(
        db.pool.clone(),
        ConsumerConfig::new("c1").dedup_ttl(WEEK),
        record_and_hold,
    )?;
    let second_pool = {
        use std::str::FromStr;
        let options = sqlx::postgres::PgConnectOptions::from_str(&outbox_tests::database_url())?
            .options([("search_path", db.schema.as_str())])
            .options([("lock_timeout", "100ms"), ("statement_timeout", "100ms")])
            .application_name("impatient");
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?
    };
    let second = DedupConsumer::new(
        second_pool,
        ConsumerConfig::new("c1").dedup_ttl(WEEK).max_attempts(1),
        record,
    )?;
    let first = tokio::spawn({
        let message = message.clone();
        async move { first.process(&message, &CancellationToken::new()).await }
    });
    held_gate().inside.notified().await;
    let second = tokio::spawn({
        let message = message.clone();
        async move { second.process(&message, &CancellationToken::new()).await }
    });
    eventually(
        "the second consumer waits for the id's lock past its lock_timeout",
        Duration::from_secs(30),
        || async {
            anyhow::ensure!(
                !second.is_finished(),
                "the second consumer gave up waiting for the lock"
            );
            let waiting: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid \
                 WHERE a.application_name = 'impatient' AND l.locktype = 'advisory' \
                   AND NOT l.granted AND a.query_start < now() - interval '400 milliseconds')",
            )
            .fetch_one(&db.pool)
            .await?;
            Ok(waiting)
        },
    )
    .await?;
    held_gate().release.notify_one();
    assert_eq!(first.await??, Outcome::Processed);
    assert_eq!(second.await??, Outcome::DuplicateStored);
    assert_eq!(effects(&db.pool).await?, (1, 1), "once");
    Ok(())
}
