//! Batches: one transaction for what a partition has queued, and a failing handler that takes
//! no other message with it. Real Postgres; the run-loop tests also the real broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, ConsumerError, DedupConsumer, Event, HandlerError, HandlerFailurePolicy,
    Outcome, boxed, consumer_config, dedup_consume, stream_consumer, stream_consumer_with_context,
};
use outbox_core::EventId;
use outbox_tests::{
    TestDb, event_message, eventually, kafka_bootstrap, produce_raw, random_topic, unique,
};
use rdkafka::consumer::Consumer;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientContext, Statistics};
use serde::Deserialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// The most messages librdkafka's statistics have shown taken from one partition's queue by
/// the consumer or still queued in it: the application's own client context, which the
/// consumer's wraps.
#[derive(Debug, Clone, Default)]
struct QueuedMessages(Arc<AtomicI64>);

impl ClientContext for QueuedMessages {
    fn stats(&self, statistics: Statistics) {
        let queued = statistics
            .topics
            .values()
            .flat_map(|t| t.partitions.values())
            .map(|p| p.app_offset.max(0) + p.fetchq_cnt)
            .max()
            .unwrap_or(0);
        self.0.fetch_max(queued, Ordering::SeqCst);
    }
}

#[derive(Debug, Deserialize)]
struct Step {
    n: i64,
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect must show as a second row; `seq` is the order in
    // which effects were written.
    sqlx::query("CREATE TABLE effects (seq BIGSERIAL, n BIGINT)")
        .execute(pool)
        .await?;
    Ok(())
}

async fn record(event: &Event<Step>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (n) VALUES ($1)")
        .bind(event.payload.n)
        .execute(conn)
        .await?;
    Ok(())
}

/// The effects, in the order they were written.
async fn effects(pool: &PgPool) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar("SELECT n FROM effects ORDER BY seq")
        .fetch_all(pool)
        .await?)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_one_transaction_and_its_duplicates_and_rejects_are_sorted_in_it() -> Result<()>
{
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (ids, mut messages) = batch(4);
    // The second event again, and a record without an id, inside the batch.
    messages.insert(2, event_message("t", 9, ids[1], r#"{"n":1}"#));
    messages.insert(
        3,
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "t".into(),
            rdkafka::Timestamp::NotAvailable,
            0,
            10,
            None,
        ),
    );
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::Processed,
            Outcome::DuplicateStored,
            Outcome::Quarantined("missing_id"),
            Outcome::Processed,
            Outcome::Processed,
        ]
    );
    assert_eq!(c.stats().transactions, 1, "{:?}", c.stats());
    assert_eq!(effects(&db.pool).await?, [0, 1, 2, 3]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_once_in_a_batch_takes_no_other_effect_and_doubles_none() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let failures = Arc::new(AtomicU32::new(0));
    let handler = {
        let failures = Arc::clone(&failures);
        boxed(move |event: &Event<Step>, conn| {
            let fail = event.payload.n == 3 && failures.fetch_add(1, Ordering::SeqCst) == 0;
            Box::pin(async move {
                record(event, conn).await?;
                if fail {
                    return Err(HandlerError::retry("the fourth fails once, after writing"));
                }
                Ok(())
            })
        })
    };
    let config =
        ConsumerConfig::new("c1").backoff(Duration::from_millis(1), Duration::from_millis(5));
    let c = DedupConsumer::new(db.pool.clone(), config, handler)?;
    let (_, messages) = batch(8);
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(outcomes, vec![Outcome::Processed; 8]);
    assert_eq!(
        effects(&db.pool).await?,
        [0, 1, 2, 3, 4, 5, 6, 7],
        "once each, in offset order"
    );
    let s = c.stats();
    assert_eq!((s.processed, s.handler_errors), (8, 1), "{s:?}");
    // The failed batch, the three before the failing one, the failing one alone, the rest.
    assert_eq!(s.transactions, 4, "{s:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_failing_for_good_is_quarantined_alone_and_the_batch_goes_on() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let handler = boxed(|event: &Event<Step>, conn| {
        Box::pin(async move {
            record(event, conn).await?;
            match event.payload.n {
                2 => Err(HandlerError::retry("keeps failing")),
                5 => Err(HandlerError::quarantine("can never be done")),
                _ => Ok(()),
            }
        })
    });
    let config = ConsumerConfig::new("c1")
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let c = DedupConsumer::new(db.pool.clone(), config, handler)?;
    let (ids, messages) = batch(7);
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::Processed,
            Outcome::Quarantined("handler_failed"),
            Outcome::Processed,
            Outcome::Processed,
            Outcome::Quarantined("handler_rejected"),
            Outcome::Processed,
        ]
    );
    assert_eq!(
        effects(&db.pool).await?,
        [0, 1, 3, 4, 6],
        "failed effects undone"
    );
    // Three attempts of the one, a single one of the other: retrying it cannot help.
    assert_eq!(c.stats().handler_errors, 4, "{:?}", c.stats());
    let quarantined: Vec<(EventId, String)> = sqlx::query_as(
        "SELECT event_id, reason FROM outbox_consumer_quarantine ORDER BY \"offset\"",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(
        quarantined,
        [
            (ids[2], "handler_failed".to_owned()),
            (ids[5], "handler_rejected".to_owned())
        ]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_saying_quarantine_is_not_retried_even_under_block() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    async fn reject(_: &Event<Step>, _: &mut PgConnection) -> Result<(), HandlerError> {
        Err(HandlerError::quarantine("not a valid invoice"))
    }
    let config = ConsumerConfig::new("c1").on_handler_failure(HandlerFailurePolicy::Block);
    let c = DedupConsumer::new(db.pool.clone(), config, reject)?;
    let (_, messages) = batch(1);
    let outcome = c.process(&messages[0], &CancellationToken::new()).await?;
    assert_eq!(outcome, Outcome::Quarantined("handler_rejected"));
    assert_eq!(c.stats().handler_errors, 1);
    Ok(())
}

/// The crash the issue names: a batch committed, its offsets not stored. Its messages come
/// again and are all duplicates; no effect is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_a_batchs_commit_and_its_offset_store_is_absorbed() -> Result<()> {
    const N: i64 = 60;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    let ids: Vec<EventId> = (0..N).map(|_| EventId::new()).collect();
    for (n, id) in ids.iter().enumerate() {
        let id = id.to_string();
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
    // The first message's handler waits until at least 41 messages were either taken into
    // its batch or queued behind it (librdkafka's statistics say so): the batch holding event
    // 30 then holds at least 40 (the first one, or the next, which takes what is queued).
    let gate = CancellationToken::new();
    let handler = {
        let gate = gate.clone();
        boxed(move |event: &Event<Step>, conn| {
            let gate = gate.clone();
            Box::pin(async move {
                if event.payload.n == 0 {
                    gate.cancelled().await;
                }
                record(event, conn).await?;
                Ok(())
            })
        })
    };
    let config = ConsumerConfig::new("c1");
    let c = DedupConsumer::new(db.pool.clone(), config.clone(), handler)?;
    c.crash_after_commit_of(ids[30]);
    let group = unique("g");
    let queued = QueuedMessages::default();
    let stream = stream_consumer_with_context(
        consumer_config(&kafka_bootstrap(), &group).set("statistics.interval.ms", "100"),
        queued.clone(),
    )?;
    stream.subscribe(&[topic.as_str()])?;
    let run = tokio::spawn({
        let c = c.clone();
        async move { c.run(stream, CancellationToken::new()).await }
    });
    eventually("41 messages fetched", WAIT, || async {
        Ok(queued.0.load(Ordering::SeqCst) >= 41)
    })
    .await?;
    gate.cancel();
    let crashed = tokio::time::timeout(WAIT, run).await??;
    assert!(
        matches!(crashed, Err(ConsumerError::InjectedFault(_))),
        "{crashed:?}"
    );
    let before = c.stats();
    assert!(
        before.processed >= 40 && before.transactions <= 2,
        "a batch of at least 40 committed in one transaction: {before:?}"
    );
    let committed = effects(&db.pool).await?;
    assert_eq!(committed, (0..before.processed as i64).collect::<Vec<_>>());

    // Restarted in the same group: the crashed batch's offsets were never stored.
    let restarted = DedupConsumer::new(db.pool.clone(), config, record)?;
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), &group))?;
    stream.subscribe(&[topic.as_str()])?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (c, shutdown) = (restarted.clone(), shutdown.clone());
        async move { c.run(stream, shutdown).await }
    });
    eventually("every event has its effect", WAIT, || async {
        Ok(effects(&db.pool).await?.len() as i64 >= N)
    })
    .await?;
    eventually("the whole redelivery is handled", WAIT, || async {
        let s = restarted.stats();
        Ok(s.processed + s.duplicates_stored >= N as u64 - 1)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(effects(&db.pool).await?, (0..N).collect::<Vec<_>>());
    let after = restarted.stats();
    assert!(
        after.duplicates_stored >= 40,
        "the crashed batch came again, as duplicates: {after:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_consume_needs_a_topic_and_wraps_the_applications_client_context() -> Result<()> {
    // The context is moved into the client; it reports through a shared counter.
    #[derive(Clone, Default)]
    struct Statistics(Arc<AtomicU32>);
    impl rdkafka::ClientContext for Statistics {
        fn stats_raw(&self, _: &[u8]) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let kafka = consumer_config(&kafka_bootstrap(), &unique("g"));
    let none = dedup_consume(&kafka, db.pool.clone(), record)
        .run(CancellationToken::new())
        .await;
    assert!(matches!(none, Err(ConsumerError::Config(_))), "{none:?}");

    let shared = Statistics::default();
    let topic = random_topic(1).await?;
    let mut kafka = kafka;
    kafka.set("statistics.interval.ms", "100");
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (pool, context, shutdown) = (db.pool.clone(), shared.clone(), shutdown.clone());
        async move {
            dedup_consume(&kafka, pool, record)
                .topics([topic])
                .context(context)
                .run(shutdown)
                .await
        }
    });
    eventually(
        "the application's context received statistics",
        WAIT,
        || async { Ok(shared.0.load(Ordering::SeqCst) >= 2) },
    )
    .await?;
    shutdown.cancel();
    run.await??;
    Ok(())
}

/// The dedup inserts `run` made, in order: whether each used `ON CONFLICT`.
async fn dedup_inserts<F: std::future::Future>(run: F) -> (F::Output, Vec<bool>) {
    use tracing::instrument::WithSubscriber;
    let statements = outbox_tests::Statements::default();
    let output = run
        .with_subscriber(tracing::Dispatch::new(statements.clone()))
        .await;
    let inserts = statements
        .all()
        .iter()
        // The dedup inserts (the statement also inserts the transaction's gate row).
        // (schema-qualified: `INSERT INTO "<schema>"."outbox_consumer_dedup" ...`).
        .filter(|s| {
            s.contains("INSERT INTO")
                && s.contains(".\"outbox_consumer_dedup\" (consumer, event_id, slice)")
        })
        .map(|s| s.contains("ON CONFLICT"))
        .collect();
    (output, inserts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_ids_are_inserted_plainly_and_recorded_ones_send_the_batch_to_on_conflict() -> Result<()>
{
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let first = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (_, messages) = batch(4);
    let shutdown = CancellationToken::new();
    // New ids: one plain insert (no speculative insertion per row).
    let (outcomes, inserts) = dedup_inserts(first.process_batch(&messages[..2], &shutdown)).await;
    assert_eq!(outcomes?, [Outcome::Processed, Outcome::Processed]);
    assert_eq!(inserts, [false]);

    // A second instance (an empty cache, as after a restart) gets all four: the plain insert
    // meets the two recorded ids, and the batch is done again with ON CONFLICT.
    let second = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (outcomes, inserts) = dedup_inserts(second.process_batch(&messages, &shutdown)).await;
    assert_eq!(
        outcomes?,
        [
            Outcome::DuplicateStored,
            Outcome::DuplicateStored,
            Outcome::Processed,
            Outcome::Processed,
        ]
    );
    assert_eq!(inserts, [false, true]);
    assert_eq!(effects(&db.pool).await?, [0, 1, 2, 3], "each effect once");

    // Redeliveries come in runs: the next batch starts with ON CONFLICT; finding every id
    // new, it lets the one after go back to the plain insert.
    let (_, more) = batch(2);
    let (outcomes, inserts) = dedup_inserts(second.process_batch(&more[..1], &shutdown)).await;
    assert_eq!(outcomes?, [Outcome::Processed]);
    assert_eq!(inserts, [true]);
    let (outcomes, inserts) = dedup_inserts(second.process_batch(&more[1..], &shutdown)).await;
    assert_eq!(outcomes?, [Outcome::Processed]);
    assert_eq!(inserts, [false]);
    assert_eq!(second.stats().duplicates_stored, 2, "{:?}", second.stats());
    Ok(())
}

/// A record on partition 0 of `t` at `offset` with `headers` and `payload`.
fn record_with(offset: i64, headers: &[(&str, &[u8])], payload: &[u8]) -> OwnedMessage {
    let headers = headers
        .iter()
        .fold(rdkafka::message::OwnedHeaders::new(), |h, (key, value)| {
            h.insert(rdkafka::message::Header {
                key,
                value: Some(*value),
            })
        });
    OwnedMessage::new(
        Some(payload.to_vec()),
        Some(b"k".to_vec()),
        "t".into(),
        rdkafka::Timestamp::NotAvailable,
        0,
        offset,
        Some(headers),
    )
}

/// A copy `outbox quarantine requeue` made for another consumer is skipped whole by a consumer
/// that handled its event: not handled again, not quarantined; the consumer it names (one of
/// its values, byte for byte) handles it as any other record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeued_copy_is_handled_by_the_consumer_it_names_alone() -> Result<()> {
    use outbox_core::wire::HEADER_REQUEUE_FOR as FOR;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let ids: Vec<String> = (0..5).map(|_| EventId::new().to_string()).collect();
    let event = |n: usize, to: &[&'static [u8]]| {
        let mut headers: Vec<(&str, &[u8])> = vec![("id", ids[n].as_bytes())];
        headers.extend(to.iter().map(|to| (FOR, *to)));
        record_with(n as i64, &headers, format!(r#"{{"n":{n}}}"#).as_bytes())
    };
    // The originals of 0, 1 and 3, handled before their copies came.
    let originals = [event(0, &[]), event(1, &[]), event(3, &[])];
    let cancel = CancellationToken::new();
    c.process_batch(&originals, &cancel).await?;
    // A consumer that knows them from its dedup table only (restarted: its cache is empty).
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let messages = [
        event(0, &[b"c2"]),
        event(1, &[b"c2", b"c3"]),
        event(2, &[b"c2", b"c1"]),
        event(3, &[b"C1"]),
        event(4, &[]),
    ];
    let outcomes = c.process_batch(&messages, &cancel).await?;
    assert_eq!(
        outcomes,
        [
            Outcome::NotForUs,
            Outcome::NotForUs,
            Outcome::Processed,
            Outcome::NotForUs,
            Outcome::Processed,
        ]
    );
    // A batch of such copies alone begins no transaction.
    let before = c.stats().transactions;
    let outcomes = c.process_batch(&[event(0, &[b"c1 "])], &cancel).await?;
    assert_eq!(outcomes, [Outcome::NotForUs]);
    assert_eq!(c.stats().transactions, before);

    // In the order handled: the originals first.
    assert_eq!(effects(&db.pool).await?, [0, 1, 3, 2, 4]);
    let (recorded, quarantined): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_consumer_dedup), \
                (SELECT count(*) FROM outbox_consumer_quarantine)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!((recorded, quarantined), (5, 0));
    assert_eq!(c.stats().not_for_us, 4);
    Ok(())
}

/// Anyone who can write to a topic can add a requeue header naming another consumer: a
/// consumer that never handled the copy's event quarantines it, bytes and all, and handles
/// the records after it. Fails before the fix: each was `NotForUs`, skipped with a log line by
/// every consumer it did not name, its offset stored: never handled, never quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_requeue_header_is_quarantined_not_skipped() -> Result<()> {
    use outbox_core::wire::HEADER_REQUEUE_FOR as FOR;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (forged, next) = (EventId::new().to_string(), EventId::new().to_string());
    let messages = [
        record_with(0, &[("id", forged.as_bytes()), (FOR, b"c2")], br#"{"n":0}"#),
        // No id to look up: no consumer can have handled it.
        record_with(1, &[(FOR, b"c2")], b"{not json"),
        record_with(2, &[("id", next.as_bytes())], br#"{"n":2}"#),
    ];
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    let unseen = Outcome::Quarantined("requeue_unseen");
    assert_eq!(outcomes, [unseen.clone(), unseen, Outcome::Processed]);
    assert_eq!(effects(&db.pool).await?, [2]);
    let rows: Vec<(i64, Option<uuid::Uuid>, Vec<u8>, String)> = sqlx::query_as(
        "SELECT \"offset\", event_id, payload, error FROM outbox_consumer_quarantine \
         WHERE reason = 'requeue_unseen' ORDER BY \"offset\"",
    )
    .fetch_all(&db.pool)
    .await?;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!((rows[0].0, rows[0].1), (0, Some(forged.parse()?)));
    assert_eq!(rows[0].2, br#"{"n":0}"#);
    assert!(rows[0].3.contains("c2"), "{}", rows[0].3);
    assert_eq!(
        (rows[1].0, rows[1].1, &rows[1].2[..]),
        (1, None, &b"{not json"[..])
    );
    assert_eq!(c.stats().not_for_us, 0);
    Ok(())
}

/// A consumer behind by more than a requeue fetches the original and its copy in one batch:
/// the copy is seen, and skipped. Under `ParkKey`, a copy it never saw is quarantined without
/// parking its key: the key's next record is handled. Fails before the fix: the first copy was
/// `requeue_unseen` (looked up before the batch recorded its original), and the second parked
/// key `k`, so the last record was parked behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_copies_neither_park_a_key_nor_miss_an_original_in_their_batch() -> Result<()> {
    use outbox_core::wire::HEADER_REQUEUE_FOR as FOR;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let config = ConsumerConfig::new("c1")
        .on_handler_failure(outbox_consumer::HandlerFailurePolicy::ParkKey);
    let c = DedupConsumer::new(db.pool.clone(), config, record)?;
    let ids: Vec<String> = (0..3).map(|_| EventId::new().to_string()).collect();
    let messages = [
        record_with(0, &[("id", ids[0].as_bytes())], br#"{"n":0}"#),
        record_with(1, &[("id", ids[0].as_bytes()), (FOR, b"c2")], br#"{"n":0}"#),
        record_with(2, &[("id", ids[1].as_bytes()), (FOR, b"c2")], br#"{"n":1}"#),
        record_with(3, &[("id", ids[2].as_bytes())], br#"{"n":3}"#),
    ];
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::NotForUs,
            Outcome::Quarantined("requeue_unseen"),
            Outcome::Processed
        ]
    );
    assert_eq!(effects(&db.pool).await?, [0, 3]);
    let parked: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine_parked_keys")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(parked, 0, "no key parked");
    Ok(())
}

/// A record on partition 0 of `t` at `offset` whose headers may lack a value.
fn record_maybe(offset: i64, headers: &[(&str, Option<&[u8]>)], payload: &[u8]) -> OwnedMessage {
    let headers = headers
        .iter()
        .fold(rdkafka::message::OwnedHeaders::new(), |h, (key, value)| {
            h.insert(rdkafka::message::Header { key, value: *value })
        });
    OwnedMessage::new(
        Some(payload.to_vec()),
        Some(b"k".to_vec()),
        "t".into(),
        rdkafka::Timestamp::NotAvailable,
        0,
        offset,
        Some(headers),
    )
}

/// A requeue header that names no consumer (no value, an empty one, one that is not UTF-8)
/// makes no copy: every consumer would skip it as another's. It is quarantined.
/// Fails before the fix: each of them was `NotForUs`, skipped by every consumer, its offset
/// stored: never handled, never quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_header_naming_no_consumer_is_quarantined_not_skipped() -> Result<()> {
    use outbox_core::wire::HEADER_REQUEUE_FOR as FOR;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let ids: Vec<String> = (0..4).map(|_| EventId::new().to_string()).collect();
    let event = |n: usize, to: Option<&'static [u8]>| {
        let headers = [("id", Some(ids[n].as_bytes())), (FOR, to)];
        record_maybe(n as i64, &headers, format!(r#"{{"n":{n}}}"#).as_bytes())
    };
    let messages = [
        event(0, None),
        event(1, Some(b"")),
        event(2, Some(b"\xffc2")),
        event(3, Some(b"c2")),
    ];
    let outcomes = c
        .process_batch(&messages, &CancellationToken::new())
        .await?;
    let invalid = Outcome::Quarantined("invalid_requeue_header");
    // The last names a consumer, but this one never handled its event: no copy of its own.
    assert_eq!(
        outcomes,
        [
            invalid.clone(),
            invalid.clone(),
            invalid,
            Outcome::Quarantined("requeue_unseen")
        ]
    );
    assert_eq!(effects(&db.pool).await?, [] as [i64; 0]);
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM outbox_consumer_quarantine ORDER BY \"offset\"")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(reasons[..3], ["invalid_requeue_header"; 3]);
    assert_eq!(c.stats().not_for_us, 0);
    Ok(())
}

/// `stats()` counts each message's outcome once, as the metrics do: a batch the database
/// could not take (it is delivered again) has no outcome yet, and counts nothing.
/// Fails before the fix: its copy for another consumer and its cached duplicate were counted
/// when decoded, and again on each retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_retried_after_an_outage_counts_its_skipped_messages_once() -> Result<()> {
    use outbox_core::wire::HEADER_REQUEUE_FOR as FOR;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let pool = db.pool_named(&unique("outage")).await?;
    let c = DedupConsumer::new(pool.clone(), ConsumerConfig::new("c1"), record)?;
    let (ids, messages) = batch(2);
    let cancel = CancellationToken::new();
    assert_eq!(
        c.process_batch(&messages[..1], &cancel).await?,
        [Outcome::Processed]
    );
    let copy = record_with(
        2,
        &[("id", ids[0].to_string().as_bytes()), (FOR, b"c2")],
        br#"{"n":2}"#,
    );
    let retried = [copy, messages[0].clone(), messages[1].clone()];
    pool.close().await;
    for _ in 0..3 {
        assert!(c.process_batch(&retried, &cancel).await.is_err());
    }
    let stats = c.stats();
    assert_eq!(
        (stats.not_for_us, stats.duplicates_cached, stats.processed),
        (0, 0, 1),
        "{stats:?}"
    );
    let c = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    assert_eq!(
        c.process_batch(&retried, &cancel).await?,
        [
            Outcome::NotForUs,
            Outcome::DuplicateStored,
            Outcome::Processed
        ]
    );
    Ok(())
}
