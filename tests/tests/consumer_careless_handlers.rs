//! Handlers written as a Rust user might write them: one that ignores a failed statement
//! (`let _ = ...`, or a caught unique violation taken for "already done"), one that panics
//! (in its future, or before making it), one that holds the connection past the server's
//! `idle_in_transaction_session_timeout`, one whose statement runs past `statement_timeout`.
//! Each costs its own message only: the other messages of its batch are handled exactly once,
//! nothing is lost, and the careless one is retried and quarantined with its reason.
//! Real Postgres; the run-loop tests also the real broker.

use std::collections::HashMap;
use std::future::Future;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, Handler, HandlerError, Outcome, consumer_config,
    stream_consumer,
};
use outbox_core::EventId;
use outbox_tests::{
    TestDb, event_message, eventually, kafka_bootstrap, produce_raw, random_topic, unique,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::OwnedMessage;
use rdkafka::{Offset, TopicPartitionList};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// Attempts per message: each careless message is tried this often, then quarantined.
const ATTEMPTS: u32 = 2;

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

/// What the handler does with one message, after writing its effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Care {
    /// Nothing more: a careful handler.
    Record,
    /// A best-effort audit insert into a table that does not exist, its error ignored.
    SwallowFailed,
    /// An insert meeting a unique violation, caught and taken to mean "already done".
    CatchUnique,
    /// Panics inside its future.
    PanicInFuture,
    /// Panics while making its future (a `Handler` whose `handle` is a plain `fn`).
    PanicBeforeFuture,
    /// Holds the connection past `idle_in_transaction_session_timeout` (a slow call to
    /// another service), then returns `Ok`.
    HoldThenOk,
    /// Holds it as long, then makes a best-effort audit insert and ignores its error (the
    /// server has ended the session by then).
    HoldThenSwallow,
    /// A statement past `statement_timeout`, its error returned.
    SlowStatement,
    /// The same statement, its error ignored.
    SwallowSlowStatement,
    /// Ends the transaction and begins another (`ROLLBACK; BEGIN`), then writes again.
    RestartTransaction,
    /// Ends the transaction (`ROLLBACK`): what follows runs in autocommit.
    EndTransaction,
    /// Commits the transaction itself (`COMMIT`), its error returned.
    Commit,
    /// Fails (returns an error to retry).
    Fail,
    /// Begins a transaction of its own (a savepoint) and forgets it: sqlx still counts it.
    LeakTransaction,
    /// The same, then fails.
    LeakThenFail,
    /// Sets the session's `search_path` elsewhere (schema-per-tenant code does) and leaves it.
    SetSearchPath,
}

/// A handler doing what `plan` says for each payload `n` (`Record` for the rest).
#[derive(Debug, Clone)]
struct Careless {
    plan: Arc<HashMap<i64, Care>>,
    hold: Duration,
}

impl Careless {
    fn new(plan: &[(i64, Care)]) -> Self {
        Self {
            plan: Arc::new(plan.iter().copied().collect()),
            hold: Duration::ZERO,
        }
    }

    fn holding(mut self, hold: Duration) -> Self {
        self.hold = hold;
        self
    }
}

impl Handler<Step> for Careless {
    fn handle(
        &self,
        event: &Event<Step>,
        conn: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        let care = self
            .plan
            .get(&event.payload.n)
            .copied()
            .unwrap_or(Care::Record);
        assert!(
            care != Care::PanicBeforeFuture,
            "careless handler panicked before its future"
        );
        let (n, hold) = (event.payload.n, self.hold);
        async move {
            sqlx::query("INSERT INTO effects (n) VALUES ($1)")
                .bind(n)
                .execute(&mut *conn)
                .await?;
            let audit = "INSERT INTO no_such_audit_table (n) VALUES (1)";
            match care {
                Care::Record | Care::PanicBeforeFuture => {}
                Care::SwallowFailed => {
                    let _ = sqlx::query(audit).execute(&mut *conn).await;
                }
                Care::CatchUnique => {
                    match sqlx::query("INSERT INTO done (k) VALUES ('same')")
                        .execute(&mut *conn)
                        .await
                    {
                        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {}
                        other => {
                            other?;
                        }
                    }
                }
                Care::PanicInFuture => panic!("careless handler panicked in its future"),
                Care::HoldThenOk => tokio::time::sleep(hold).await,
                Care::HoldThenSwallow => {
                    tokio::time::sleep(hold).await;
                    let _ = sqlx::query(audit).execute(&mut *conn).await;
                }
                Care::SlowStatement => {
                    sqlx::query("SELECT pg_sleep(2)")
                        .execute(&mut *conn)
                        .await?;
                }
                Care::SwallowSlowStatement => {
                    let _ = sqlx::query("SELECT pg_sleep(2)").execute(&mut *conn).await;
                }
                Care::RestartTransaction => {
                    sqlx::raw_sql("ROLLBACK; BEGIN; INSERT INTO effects (n) VALUES (-1)")
                        .execute(&mut *conn)
                        .await?;
                }
                Care::EndTransaction => {
                    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
                }
                Care::Commit => {
                    sqlx::raw_sql("COMMIT").execute(&mut *conn).await?;
                }
                Care::Fail => return Err(HandlerError::retry("careless handler failed")),
                Care::LeakTransaction => {
                    let nested = sqlx::Connection::begin(&mut *conn).await?;
                    std::mem::forget(nested);
                }
                Care::LeakThenFail => {
                    let nested = sqlx::Connection::begin(&mut *conn).await?;
                    std::mem::forget(nested);
                    return Err(HandlerError::retry("careless handler failed"));
                }
                Care::SetSearchPath => {
                    sqlx::query("SET search_path TO public")
                        .execute(&mut *conn)
                        .await?;
                }
            }
            Ok(())
        }
    }
}

async fn tables(pool: &PgPool) -> Result<()> {
    // No unique constraint on effects: a double effect shows as a second row.
    sqlx::query("CREATE TABLE effects (seq BIGSERIAL, n BIGINT)")
        .execute(pool)
        .await?;
    sqlx::query("CREATE TABLE done (k TEXT PRIMARY KEY)")
        .execute(pool)
        .await?;
    sqlx::query("INSERT INTO done (k) VALUES ('same')")
        .execute(pool)
        .await?;
    Ok(())
}

/// The effects, in the order they were written.
async fn effects(pool: &PgPool) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar("SELECT n FROM effects ORDER BY seq")
        .fetch_all(pool)
        .await?)
}

/// (offset, reason, error) of each quarantine row, by offset.
async fn quarantined(pool: &PgPool) -> Result<Vec<(i64, String, String)>> {
    Ok(sqlx::query_as(
        "SELECT \"offset\", reason, error FROM outbox_consumer_quarantine ORDER BY \"offset\"",
    )
    .fetch_all(pool)
    .await?)
}

/// Dedup rows committed for `ids`.
async fn dedup_rows(pool: &PgPool, ids: &[EventId]) -> Result<i64> {
    let ids: Vec<uuid::Uuid> = ids.iter().map(|id| *id.as_uuid()).collect();
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dedup WHERE event_id = ANY($1)")
            .bind(ids)
            .fetch_one(pool)
            .await?,
    )
}

fn batch(n: i64) -> (Vec<EventId>, Vec<OwnedMessage>) {
    let ids: Vec<EventId> = (0..n).map(|_| EventId::new()).collect();
    let messages = ids
        .iter()
        .enumerate()
        .map(|(i, id)| event_message("t", i as i64, *id, &format!(r#"{{"n":{i}}}"#)))
        .collect();
    (ids, messages)
}

fn config() -> ConsumerConfig {
    ConsumerConfig::new("c1")
        .max_attempts(ATTEMPTS)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
}

/// A pool on the test's schema whose sessions carry `settings` (server parameters).
async fn pool_with(db: &TestDb, settings: &[(&str, &str)]) -> Result<PgPool> {
    pool_of(db, settings, 8).await
}

/// The same, of at most `size` connections.
async fn pool_of(db: &TestDb, settings: &[(&str, &str)], size: u32) -> Result<PgPool> {
    let options = PgConnectOptions::from_str(&outbox_tests::database_url())?
        .options([("search_path", db.schema.as_str())])
        .options(settings.iter().copied());
    Ok(PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await?)
}

/// Runs `messages` (payloads `0..n`) as one batch through `handler` and checks what the
/// module promises: the messages `careless` names are quarantined with their reason after
/// `ATTEMPTS` failed attempts each, every other one is processed once and has its effect
/// once, and only processed messages have dedup rows.
async fn run_batch(
    db: &TestDb,
    pool: PgPool,
    n: i64,
    handler: Careless,
    careless: &[(i64, &'static str)],
) -> Result<DedupConsumer<Step, Careless>> {
    let c = DedupConsumer::new(pool, config(), handler)?;
    let (ids, messages) = batch(n);
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    let reason = |i: i64| careless.iter().find(|(n, _)| *n == i).map(|(_, r)| *r);
    let expected: Vec<Outcome> = (0..n)
        .map(|i| reason(i).map_or(Outcome::Processed, Outcome::Quarantined))
        .collect();
    assert_eq!(outcomes, expected);
    let kept: Vec<i64> = (0..n).filter(|i| reason(*i).is_none()).collect();
    assert_eq!(effects(&db.pool).await?, kept, "each other effect once");
    let rows = quarantined(&db.pool).await?;
    assert_eq!(
        rows.iter()
            .map(|(o, r, _)| (*o, r.as_str()))
            .collect::<Vec<_>>(),
        careless.to_vec()
    );
    let stats = c.stats();
    assert_eq!(stats.processed, kept.len() as u64, "{stats:?}");
    assert_eq!(
        stats.handler_errors,
        careless.len() as u64 * u64::from(ATTEMPTS),
        "only the careless messages were blamed: {stats:?}"
    );
    assert_eq!(
        dedup_rows(&db.pool, &ids).await?,
        kept.len() as i64,
        "a dedup row for each processed message, none for the others"
    );
    Ok(c)
}

/// Fails before the fix: the swallowed error left the transaction aborted, the next
/// handler's statement failed with 25P02 and it was blamed, and the replayed batch's COMMIT
/// was a silent ROLLBACK: every outcome `Processed`, effects 0, 1 and 3 lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_ignores_a_failed_statement_fails_alone() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let handler = Careless::new(&[(1, Care::SwallowFailed), (3, Care::CatchUnique)]);
    run_batch(
        &db,
        db.pool.clone(),
        6,
        handler,
        &[
            (1, "handler_aborted_transaction"),
            (3, "handler_aborted_transaction"),
        ],
    )
    .await?;
    let rows = quarantined(&db.pool).await?;
    assert!(
        rows.iter()
            .all(|(_, _, e)| e.contains("returned Ok") && e.contains("25P02")),
        "the quarantine says what the handler did: {rows:?}"
    );
    Ok(())
}

/// Fails before the fix: the panic raised while making the future escaped `catch_unwind`
/// and took the test (a partition's worker, in `run`) down with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_fails_alone() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let handler = Careless::new(&[(1, Care::PanicInFuture), (3, Care::PanicBeforeFuture)]);
    run_batch(
        &db,
        db.pool.clone(),
        5,
        handler,
        &[(1, "handler_failed"), (3, "handler_failed")],
    )
    .await?;
    let rows = quarantined(&db.pool).await?;
    // With the panic's own message (it read "non-string panic": the box was taken for the
    // panic's payload).
    assert!(
        rows.iter()
            .all(|(_, _, e)| e.contains("handler panicked: careless handler panicked")),
        "{rows:?}"
    );
    Ok(())
}

/// The server ends a session idle in its transaction past the timeout (SQLSTATE 25P03 to the
/// next statement, then a closed connection): the handler that held it fails, not the
/// next one, and a closed connection with the database answering is no outage.
/// Fails before the fix: the next handler met the closed connection, taken for an outage,
/// and `process_batch` returned `Err` (`run` retried the batch forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_holding_the_connection_past_the_idle_timeout_fails_alone() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let pool = pool_with(&db, &[("idle_in_transaction_session_timeout", "300ms")]).await?;
    let handler = Careless::new(&[(1, Care::HoldThenSwallow), (3, Care::HoldThenOk)])
        .holding(Duration::from_millis(700));
    run_batch(
        &db,
        pool,
        5,
        handler,
        &[
            (1, "handler_aborted_transaction"),
            (3, "handler_aborted_transaction"),
        ],
    )
    .await?;
    Ok(())
}

/// The same with a pool of one connection: whether the database answers is asked on a
/// connection of its own, not of the pool the dead transaction's connection is still taken
/// from.
/// Fails before the fix: the question waited for the pool's only connection, timed out, and
/// was taken for an outage: `process_batch` returned `Err` (`run` retried the batch forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_connection_pool_tells_a_handler_holding_it_from_an_outage() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let pool = pool_of(&db, &[("idle_in_transaction_session_timeout", "300ms")], 1).await?;
    let handler = Careless::new(&[(1, Care::HoldThenSwallow)]).holding(Duration::from_millis(700));
    run_batch(&db, pool, 3, handler, &[(1, "handler_aborted_transaction")]).await?;
    Ok(())
}

/// A handler that ends the transaction and begins another (`ROLLBACK; BEGIN; ...`) leaves
/// the dedup rows, and the effects before it, rolled back: the transaction that would commit
/// is not the one holding them, and nothing is counted processed on it.
/// Fails before the fix: the check before COMMIT saw a transaction open and took it for the
/// batch's: every message `Processed`, yet effects 0 and 1 and every dedup row were gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_restarts_the_transaction_fails_alone() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let handler = Careless::new(&[(1, Care::RestartTransaction)]);
    run_batch(
        &db,
        db.pool.clone(),
        5,
        handler,
        &[(1, "handler_aborted_transaction")],
    )
    .await?;
    Ok(())
}

/// A handler that ends the transaction (`ROLLBACK`) lets the handlers after it in its batch
/// write in autocommit; that cannot be undone (see the guide's consumer page), but it is found before
/// COMMIT: no message is counted processed without its dedup row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_ends_the_transaction_is_found_out() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let c = DedupConsumer::new(
        db.pool.clone(),
        config(),
        Careless::new(&[(1, Care::EndTransaction)]),
    )?;
    let (ids, messages) = batch(4);
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    let aborted = Outcome::Quarantined("handler_aborted_transaction");
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            aborted,
            Outcome::Processed,
            Outcome::Processed
        ]
    );
    assert_eq!(dedup_rows(&db.pool, &ids).await?, 3);
    assert_eq!(c.stats().processed, 3);
    // Messages 2 and 3 wrote in autocommit behind the batch's back, then again alone.
    assert_eq!(effects(&db.pool).await?, [2, 3, 0, 2, 3]);
    Ok(())
}

/// A proxied connection: what cuts it, and its task.
type Proxied = (CancellationToken, tokio::task::JoinHandle<()>);

/// A TCP proxy to the database whose connections can be cut (a network reset, a failover
/// behind a load balancer): the client sees its connection lost, the server no error.
#[derive(Debug, Clone, Default)]
struct CuttableProxy {
    port: u16,
    open: Arc<Mutex<Vec<Proxied>>>,
}

impl CuttableProxy {
    async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let proxy = Self {
            port: listener.local_addr()?.port(),
            open: Arc::default(),
        };
        let open = proxy.open.clone();
        let upstream = PgConnectOptions::from_str(&outbox_tests::database_url())?;
        let upstream = format!("{}:{}", upstream.get_host(), upstream.get_port());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let cut = CancellationToken::new();
                let task = tokio::spawn({
                    let cut = cut.clone();
                    async move {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            () = cut.cancelled() => {}
                        }
                    }
                });
                open.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((cut, task));
            }
        });
        Ok(proxy)
    }

    /// Closes every connection open now, and returns once they are closed.
    async fn cut(&self) {
        let open = std::mem::take(&mut *self.open.lock().unwrap_or_else(|p| p.into_inner()));
        for (cut, task) in open {
            cut.cancel();
            let _ = task.await;
        }
    }
}

/// Fails its message's first attempt, cuts the connections under its second and returns
/// the error its statement meets, records the effect on later ones.
#[derive(Debug, Clone)]
struct CutUnder {
    proxy: CuttableProxy,
    calls: Arc<Mutex<u32>>,
}

impl Handler<Step> for CutUnder {
    async fn handle(
        &self,
        event: &Event<Step>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            *calls += 1;
            *calls
        };
        match call {
            1 => return Err(HandlerError::retry("first attempt fails")),
            2 => self.proxy.cut().await,
            _ => {}
        }
        sqlx::query("INSERT INTO effects (n) VALUES ($1)")
            .bind(event.payload.n)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// A connection lost under a message retried alone, with the database answering on a new
/// one, is no failure of the message unless its handler held the transaction for as long as
/// the server ends such sessions after (`idle_in_transaction_session_timeout`): a network
/// reset or a failover behind a proxy costs the message no attempt.
/// Fails before the fix: the message was blamed for it (its second and last attempt) and
/// quarantined as `handler_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_under_a_brief_handler_costs_its_message_no_attempt() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let proxy = CuttableProxy::start().await?;
    let options = PgConnectOptions::from_str(&outbox_tests::database_url())?
        .host("127.0.0.1")
        .port(proxy.port)
        .options([
            ("search_path", db.schema.as_str()),
            ("idle_in_transaction_session_timeout", "10s"),
        ]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    let handler = CutUnder {
        proxy: proxy.clone(),
        calls: Arc::default(),
    };
    let c = DedupConsumer::new(pool, config(), handler)?;
    let (ids, messages) = batch(1);
    let cancel = CancellationToken::new();
    let first = c.process_batch(&messages, &cancel).await;
    assert!(
        matches!(first, Err(outbox_consumer::ConsumerError::Database(_))),
        "an outage, retried without counting: {first:?}"
    );
    assert_eq!(
        c.process_batch(&messages, &cancel).await?,
        [Outcome::Processed]
    );
    assert_eq!(c.stats().handler_errors, 1, "{:?}", c.stats());
    assert_eq!(quarantined(&db.pool).await?, []);
    assert_eq!(effects(&db.pool).await?, [0]);
    assert_eq!(dedup_rows(&db.pool, &ids).await?, 1);
    Ok(())
}

/// A statement cancelled by `statement_timeout` (57014) is its handler's failure when it
/// returns it, and aborts the transaction when it does not.
/// Fails before the fix: the handler after the one that ignored the timeout was blamed, and
/// the replayed batch's COMMIT was a silent ROLLBACK (effect 2 lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_past_the_statement_timeout_fails_its_own_handler() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let pool = pool_with(&db, &[("statement_timeout", "200ms")]).await?;
    let handler = Careless::new(&[(1, Care::SlowStatement), (3, Care::SwallowSlowStatement)]);
    run_batch(
        &db,
        pool,
        5,
        handler,
        &[(1, "handler_failed"), (3, "handler_aborted_transaction")],
    )
    .await?;
    let rows = quarantined(&db.pool).await?;
    assert!(
        rows.iter()
            .all(|(_, _, e)| e.contains("57014") || e.contains("25P02")),
        "{rows:?}"
    );
    Ok(())
}

/// The committed offset of partition 0 of `topic` for `group`.
fn committed_offset(group: &str, topic: &str) -> Result<Offset> {
    let consumer: BaseConsumer = consumer_config(&kafka_bootstrap(), group).create()?;
    let mut partitions = TopicPartitionList::new();
    partitions.add_partition(topic, 0);
    let committed = consumer.committed_offsets(partitions, Duration::from_secs(10))?;
    Ok(committed
        .find_partition(topic, 0)
        .map_or(Offset::Invalid, |p| p.offset()))
}

/// Through the Kafka loop, with offsets stored: every offset committed is covered, each
/// message either has its effect or a quarantine row.
/// Fails before the fix: the batch's COMMIT was a silent ROLLBACK, yet its offsets were
/// stored and committed (effects lost, nothing quarantined).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_loop_stores_no_offset_past_a_rolled_back_batch() -> Result<()> {
    const N: i64 = 6;
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let topic = random_topic(1).await?;
    for n in 0..N {
        let id = EventId::new().to_string();
        let payload = format!(r#"{{"n":{n}}}"#);
        produce_raw(
            &topic,
            Some(0),
            Some("k"),
            Some(payload.as_bytes()),
            &[("id", id.as_bytes())],
        )
        .await?;
    }
    let group = unique("g");
    let handler = Careless::new(&[(2, Care::SwallowFailed)]);
    let c = DedupConsumer::new(db.pool.clone(), config(), handler)?;
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), &group))?;
    stream.subscribe(&[topic.as_str()])?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (c, shutdown) = (c.clone(), shutdown.clone());
        async move { c.run(stream, shutdown).await }
    });
    eventually("every message is handled or quarantined", WAIT, || async {
        let s = c.stats();
        Ok(s.processed + s.quarantined >= N as u64)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(effects(&db.pool).await?, [0, 1, 3, 4, 5]);
    let rows = quarantined(&db.pool).await?;
    assert_eq!(
        rows.iter()
            .map(|(o, r, _)| (*o, r.as_str()))
            .collect::<Vec<_>>(),
        [(2, "handler_aborted_transaction")]
    );
    assert_eq!(committed_offset(&group, &topic)?, Offset::Offset(N));
    Ok(())
}

/// Member one's handler: each event's first attempt fails (a retry follows, alone), its
/// second waits for `gate` and then says "quarantine", later ones record the effect.
#[derive(Debug, Clone)]
struct FailsThenWaits {
    calls: Arc<Mutex<HashMap<EventId, u32>>>,
    gate: CancellationToken,
}

impl Handler<Step> for FailsThenWaits {
    async fn handle(
        &self,
        event: &Event<Step>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let call = {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            let call = calls.entry(event.id).or_default();
            *call += 1;
            *call
        };
        match call {
            1 => Err(HandlerError::retry("first attempt fails")),
            2 => {
                self.gate.cancelled().await;
                Err(HandlerError::quarantine("the old owner gives up"))
            }
            _ => {
                sqlx::query("INSERT INTO effects (n) VALUES ($1)")
                    .bind(event.payload.n)
                    .execute(conn)
                    .await?;
                Ok(())
            }
        }
    }
}

/// Backends of the pool named `name` matching `state`, a `pg_stat_activity` condition.
async fn backends(db: &TestDb, name: &str, state: &'static str) -> Result<i64> {
    let sql =
        format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND {state}");
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(name)
        .fetch_one(&db.pool)
        .await?)
}

fn spawn_member<H: Handler<Step>>(
    c: DedupConsumer<Step, H>,
    group: &str,
    topic: &str,
    shutdown: &CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>> {
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), group))?;
    stream.subscribe(&[topic])?;
    let shutdown = shutdown.clone();
    Ok(tokio::spawn(async move { c.run(stream, shutdown).await }))
}

/// A message retried alone stops when its partition is revoked: it is not quarantined by a
/// member that no longer owns it while the new owner handles it.
/// Fails before the fix: the old owner's lone retry went on after the revocation and
/// quarantined the event the new owner handled (an effect and a quarantine row for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_partitions_lone_retry_stops() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let topic = random_topic(2).await?;
    for partition in 0..2 {
        let id = EventId::new().to_string();
        let payload = format!(r#"{{"n":{partition}}}"#);
        produce_raw(
            &topic,
            Some(partition),
            Some("x"),
            Some(payload.as_bytes()),
            &[("id", id.as_bytes())],
        )
        .await?;
    }
    let group = unique("g");
    let config = ConsumerConfig::new("c1")
        .max_attempts(5)
        .backoff(Duration::from_millis(10), Duration::from_millis(50));
    let shutdown = CancellationToken::new();
    // Member one takes both partitions; each event's lone retry waits inside its handler.
    let first_name = unique("first");
    let gate = CancellationToken::new();
    let first = DedupConsumer::new(
        db.pool_named(&first_name).await?,
        config.clone(),
        FailsThenWaits {
            calls: Arc::default(),
            gate: gate.clone(),
        },
    )?;
    let run_first = spawn_member(first.clone(), &group, &topic, &shutdown)?;
    eventually("member one retries both events alone", WAIT, || async {
        Ok(backends(&db, &first_name, "state = 'idle in transaction'").await? == 2)
    })
    .await?;

    // Member two joins and takes a partition: its dedup insert waits on member one's.
    let second_name = unique("second");
    let second = DedupConsumer::new(
        db.pool_named(&second_name).await?,
        config,
        Careless::new(&[]),
    )?;
    let run_second = spawn_member(second.clone(), &group, &topic, &shutdown)?;
    eventually("member two owns a partition", WAIT, || async {
        Ok(backends(&db, &second_name, "wait_event_type = 'Lock'").await? > 0)
    })
    .await?;
    gate.cancel();
    eventually("member two handled its event", WAIT, || async {
        Ok(second.stats().processed >= 1)
    })
    .await?;
    eventually("each event is handled or quarantined", WAIT, || async {
        let effects = effects(&db.pool).await?.len();
        Ok(effects + quarantined(&db.pool).await?.len() >= 2)
    })
    .await?;
    shutdown.cancel();
    run_first.await??;
    run_second.await??;

    // Each event once: an effect (its partition's owner handled it) or a quarantine row (its
    // owner gave up on it), never both.
    let mut seen = effects(&db.pool).await?;
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT partition::bigint, reason FROM outbox_consumer_quarantine")
            .fetch_all(&db.pool)
            .await?;
    seen.extend(rows.iter().map(|(p, _)| *p));
    seen.sort_unstable();
    assert_eq!(seen, [0, 1], "effects and quarantine rows: {rows:?}");
    Ok(())
}

/// A payload whose hand-written `Deserialize` panics on a field it cannot parse, as
/// `.parse().unwrap()` does.
#[derive(Debug)]
struct Parsed {
    n: i64,
}

impl<'de> Deserialize<'de> for Parsed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            n: String,
        }
        let raw = Raw::deserialize(d)?;
        match raw.n.parse() {
            Ok(n) => Ok(Self { n }),
            Err(_) => panic!("careless parser: {:?} is not a number", raw.n),
        }
    }
}

#[derive(Debug, Clone)]
struct RecordParsed;

impl Handler<Parsed> for RecordParsed {
    async fn handle(
        &self,
        event: &Event<Parsed>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (n) VALUES ($1)")
            .bind(event.payload.n)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// Fails before the fix: the panic in `Deserialize` ran outside any `catch_unwind`, the
/// partition's worker died ("task panicked"), nothing was quarantined and the record after it
/// was never handled; every member that took the partition over died on the same offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_whose_deserialize_panics_is_quarantined_and_the_next_one_handled() -> Result<()>
{
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), config(), RecordParsed)?;
    let messages: Vec<OwnedMessage> = ["7", "x", "9"]
        .iter()
        .enumerate()
        .map(|(i, n)| event_message("t", i as i64, EventId::new(), &format!(r#"{{"n":"{n}"}}"#)))
        .collect();
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::Quarantined("deserialize_panicked"),
            Outcome::Processed
        ]
    );
    assert_eq!(effects(&db.pool).await?, [7, 9]);
    let rows = quarantined(&db.pool).await?;
    assert_eq!(rows.len(), 1);
    assert!(
        rows[0]
            .2
            .contains(r#"careless parser: "x" is not a number"#),
        "the panic's message is the error: {rows:?}"
    );
    Ok(())
}

/// Fails before the fix: the `COMMIT` of message 1's handler committed the dedup rows of the
/// whole batch (inserted before any handler ran); when message 3's handler then failed, its
/// replay found its id recorded (`DuplicateStored`): never handled, never quarantined, its
/// offset stored. Now the handler's `COMMIT` fails (migration 0015's gate), the transaction
/// rolls back whole, and message 1 fails alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_fails_alone_and_loses_no_other_message() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let handler = Careless::new(&[(1, Care::Commit), (3, Care::Fail)]);
    run_batch(
        &db,
        db.pool.clone(),
        5,
        handler,
        &[(1, "handler_failed"), (3, "handler_failed")],
    )
    .await?;
    let rows = quarantined(&db.pool).await?;
    assert!(
        rows[0]
            .2
            .contains("ended the consumer's transaction (COMMIT)"),
        "the quarantine says what the handler did: {rows:?}"
    );
    let gate: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dedup_gate")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(gate, 0, "no gate row outlives its transaction");
    Ok(())
}

/// Cuts the connections under every attempt of its message and returns the error its
/// statement meets: a proxy's idle limit (PgBouncer's `idle_transaction_timeout`) below how
/// long the handler holds the transaction.
#[derive(Debug, Clone)]
struct AlwaysCut {
    proxy: CuttableProxy,
}

impl Handler<Step> for AlwaysCut {
    async fn handle(
        &self,
        event: &Event<Step>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.proxy.cut().await;
        sqlx::query("INSERT INTO effects (n) VALUES ($1)")
            .bind(event.payload.n)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// Fails before the fix: each cut counted as an outage (the database answered on another
/// connection, and the handler had not held the transaction as long as the server's own
/// limit), so the message was retried forever, uncharged, its partition stalled with no
/// handler error counted. A few cuts in a row still cost nothing; past them each counts, and
/// the message is quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_under_every_try_is_charged_after_a_few() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let proxy = CuttableProxy::start().await?;
    let options = PgConnectOptions::from_str(&outbox_tests::database_url())?
        .host("127.0.0.1")
        .port(proxy.port)
        .options([("search_path", db.schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    let c = DedupConsumer::new(pool, config(), AlwaysCut { proxy })?;
    let (_, messages) = batch(1);
    let cancel = CancellationToken::new();
    // The partition worker retries after an outage as this loop does; bounded here.
    let mut outages = 0;
    let outcomes = loop {
        match c.process_batch(&messages, &cancel).await {
            Ok(outcomes) => break outcomes,
            Err(outbox_consumer::ConsumerError::Database(_)) if outages < 30 => outages += 1,
            Err(error) => anyhow::bail!("after {outages} outages: {error}"),
        }
    };
    assert_eq!(outcomes, [Outcome::Quarantined("handler_failed")]);
    assert!(outages >= 5, "a few cuts cost nothing: {outages}");
    assert_eq!(
        c.stats().handler_errors,
        u64::from(ATTEMPTS),
        "{:?}",
        c.stats()
    );
    let rows = quarantined(&db.pool).await?;
    assert!(
        rows[0].2.contains("cut under the message's transaction"),
        "{rows:?}"
    );
    assert_eq!(effects(&db.pool).await?, Vec::<i64>::new());
    Ok(())
}

/// A handler that leaks a transaction of its own (a sqlx `Transaction` it forgets) turns the
/// consumer's `COMMIT` into a `RELEASE SAVEPOINT`: nothing is committed. Fails before the fix:
/// every outcome was `Processed` and the offsets would be stored, but the connection went back
/// to the pool inside the open transaction, which rolled back later: all five effects and
/// dedup rows lost. Now the leaking message fails alone, the others commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_leaks_a_transaction_fails_alone_and_loses_no_other_message() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let handler = Careless::new(&[(2, Care::LeakTransaction)]);
    run_batch(&db, db.pool.clone(), 5, handler, &[(2, "handler_failed")]).await?;
    let rows = quarantined(&db.pool).await?;
    assert!(
        rows[0].2.contains("left a transaction of its own open"),
        "{rows:?}"
    );
    Ok(())
}

/// A handler that sets the session's `search_path` (to a schema without the consumer's tables)
/// changes nothing the consumer does: its statements name their schema, and the check before
/// `COMMIT` sets the path back, so the next batch on the same connection finds its tables
/// and the handlers theirs. Fails before the fix: the check before `COMMIT` looked for the
/// gate and dedup tables in the handler's schema, and every message was quarantined; with the
/// path left set, the next batch's statements went elsewhere too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_sets_the_search_path_changes_nothing_for_the_consumer() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    // One connection: the next batch runs on the session the handler changed.
    let pool = pool_of(&db, &[], 1).await?;
    let c = run_batch(
        &db,
        pool.clone(),
        5,
        Careless::new(&[(4, Care::SetSearchPath)]),
        &[],
    )
    .await?;
    let (_, messages) = batch(5);
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(outcomes, vec![Outcome::Processed; 5]);
    assert_eq!(effects(&db.pool).await?.len(), 10, "each effect once");
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&pool)
        .await?;
    assert_eq!(
        path, db.schema,
        "the session's path is the consumer's again"
    );
    Ok(())
}

/// A handler that leaks a transaction and then fails: its rollback undoes only the leaked
/// savepoint, and the connection would go back to the pool inside the consumer's transaction.
/// Fails before the fix: on a one-connection pool the next attempt began a savepoint of that
/// transaction, found its own uncommitted dedup row and counted the message a duplicate, and
/// the messages after it were blamed for the check that failed in the wrong transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_leaks_a_transaction_and_fails_poisons_no_connection() -> Result<()> {
    let db = TestDb::new().await?;
    tables(&db.pool).await?;
    let pool = pool_of(&db, &[], 1).await?;
    let handler = Careless::new(&[(2, Care::LeakThenFail)]);
    run_batch(&db, pool, 5, handler, &[(2, "handler_failed")]).await?;
    Ok(())
}
