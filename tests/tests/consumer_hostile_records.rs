//! Records no client library of ours would write, sent as Go and C producers can: NUL bytes in
//! header values and in the `id` header, header names that are not UTF-8 or have a NUL inside,
//! and a different record at an offset the quarantine already holds. Each is quarantined with
//! its bytes, and the good record behind it is handled: nothing stalls, nothing panics.

use std::time::Duration;

use anyhow::{Result, bail, ensure};
use outbox_consumer::quarantine::{QuarantinedMessage, list_quarantined};
use outbox_consumer::{
    ConsumerConfig, ConsumerError, DedupConsumer, DedupContext, Event, HandlerError, Outcome,
    ReceivedHeader, TableNames, consumer_config, stream_consumer,
};
use outbox_core::EventId;
use outbox_tests::{ByteHeader, TestDb, kafka_bootstrap, produce_bytes, random_topic, unique};
use rdkafka::consumer::{Consumer, StreamConsumer};
use serde::Deserialize;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
struct Order {
    n: i64,
}

async fn record_effect(event: &Event<Order>, conn: &mut PgConnection) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (event_id, n) VALUES ($1, $2)")
        .bind(event.id)
        .bind(event.payload.n)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn db() -> Result<TestDb> {
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effects (event_id UUID, n BIGINT)")
        .execute(&db.pool)
        .await?;
    Ok(db)
}

fn stream(topic: &str) -> Result<StreamConsumer<DedupContext>> {
    let mut config = consumer_config(&kafka_bootstrap(), &unique("g"));
    config.set("session.timeout.ms", "6000");
    let consumer = stream_consumer(&config)?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}

/// The headers a quarantine row holds, as `outbox quarantine` reads them.
fn whole(headers: &[ByteHeader<'_>]) -> Result<Vec<ReceivedHeader>> {
    headers
        .iter()
        .map(|(name, value)| {
            Ok(ReceivedHeader::Whole {
                name: String::from_utf8(name.to_vec())?,
                value: value.map(<[u8]>::to_vec),
            })
        })
        .collect()
}

/// Sends `bad` (key, value, headers as bytes) then a good event to a new topic, runs a consumer
/// until the good one took effect, and returns the quarantine's rows. Fails when the consumer
/// stops (a panicking worker ends `run`) or the good event is not handled in time (a stalled
/// partition).
async fn bad_then_good(
    db: &TestDb,
    bad: (Option<&[u8]>, Option<&[u8]>, &[ByteHeader<'_>]),
) -> Result<Vec<QuarantinedMessage>> {
    let topic = random_topic(1).await?;
    produce_bytes(&topic, 0, bad.0, bad.1, bad.2).await?;
    let good = EventId::new();
    let good_id = good.to_string();
    produce_bytes(
        &topic,
        0,
        Some(b"k"),
        Some(br#"{"n":2}"#),
        &[(b"id", Some(good_id.as_bytes()))],
    )
    .await?;

    let consumer = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record_effect)?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (consumer, shutdown, stream) = (consumer.clone(), shutdown.clone(), stream(&topic)?);
        async move { consumer.run(stream, shutdown).await }
    });
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
            .bind(good)
            .fetch_one(&db.pool)
            .await?;
        if effects == 1 {
            break;
        }
        if run.is_finished() {
            let ended: Result<(), ConsumerError> = run.await?;
            bail!("the consumer stopped before the good record: {ended:?}");
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the good record behind the bad one was not handled within {WAIT:?}: {:?}",
                consumer.stats()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    run.await??;
    let stats = consumer.stats();
    ensure!((stats.processed, stats.quarantined) == (1, 1), "{stats:?}");
    let mut conn = db.pool.acquire().await?;
    Ok(list_quarantined(&mut conn, &TableNames::default(), 10).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_a_header_value_is_quarantined_with_its_bytes_and_the_partition_flows()
-> Result<()> {
    let db = db().await?;
    let id = EventId::new().to_string();
    // A Java client's dead-letter offset header: a big-endian integer, valid UTF-8 with NULs.
    let offset_header: &[u8] = &[0, 0, 0, 0, 0, 0, 0, 42];
    let headers: &[ByteHeader<'_>] = &[
        (b"id", Some(id.as_bytes())),
        (b"kafka_dlt-original-offset", Some(offset_header)),
        (b"empty", Some(b"")),
        (b"none", None),
    ];
    // Quarantined for its payload; the insert of its headers is what used to fail.
    let rows = bad_then_good(&db, (Some(b"k\0k"), Some(b"{not json\0"), headers)).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, "invalid_json");
    assert_eq!(rows[0].event_id, Some(id.parse()?));
    assert_eq!(rows[0].message_key.as_deref(), Some(&b"k\0k"[..]));
    assert_eq!(rows[0].payload.as_deref(), Some(&b"{not json\0"[..]));
    assert_eq!(rows[0].received_headers()?, whole(headers)?);
    // What `outbox quarantine requeue` sends back: every header, in order, bytes intact.
    let sent: Vec<(String, Option<Vec<u8>>)> = headers
        .iter()
        .map(|(n, v)| {
            (
                String::from_utf8_lossy(n).into_owned(),
                v.map(<[u8]>::to_vec),
            )
        })
        .collect();
    assert_eq!(rows[0].record_headers()?, sent);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_the_id_header_is_quarantined_with_its_bytes_and_the_partition_flows() -> Result<()>
{
    let db = db().await?;
    let id = format!("{}\0", EventId::new());
    let headers: &[ByteHeader<'_>] = &[(b"id", Some(id.as_bytes())), (b"type", Some(b"T"))];
    let rows = bad_then_good(&db, (Some(b"k"), Some(br#"{"n":1}"#), headers)).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, "invalid_id");
    assert!(
        !rows[0].error.contains('\0') && rows[0].error.contains("\\0"),
        "the error names the NUL, escaped: {:?}",
        rows[0].error
    );
    assert_eq!(rows[0].payload.as_deref(), Some(&br#"{"n":1}"#[..]));
    assert_eq!(rows[0].received_headers()?, whole(headers)?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_quarantined_and_the_partition_flows() -> Result<()> {
    let db = db().await?;
    let id = EventId::new().to_string();
    let headers: &[ByteHeader<'_>] = &[
        (b"id", Some(id.as_bytes())),
        (&[0xff, 0xfe], Some(b"v")),
        (b"after", Some(&[0x00, 0xff])),
    ];
    let rows = bad_then_good(&db, (Some(b"k"), Some(br#"{"n":1}"#), headers)).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, "invalid_header_name");
    assert_eq!(rows[0].event_id, Some(id.parse()?));
    assert_eq!(rows[0].payload.as_deref(), Some(&br#"{"n":1}"#[..]));
    // Every header kept in order, that one's name as its bytes.
    // Fails before names were read through librdkafka's call: its name and value were lost.
    let mut expected = whole(&[headers[0], headers[2]])?;
    expected.insert(
        1,
        ReceivedHeader::Bytes {
            name: vec![0xff, 0xfe],
            value: Some(b"v".to_vec()),
        },
    );
    assert_eq!(rows[0].received_headers()?, expected);
    assert!(
        rows[0]
            .error
            .contains(r#"header 1: its name "\xff\xfe" is not UTF-8"#),
        "{}",
        rows[0].error
    );
    assert!(
        rows[0].record_headers().is_err(),
        "not sent again with a header missing"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_with_a_nul_does_not_pass_for_id() -> Result<()> {
    let db = db().await?;
    let id = EventId::new().to_string();
    // librdkafka shows names as C strings: `id\0x` reads as `id`.
    let headers: &[ByteHeader<'_>] = &[(b"id\0x", Some(id.as_bytes())), (b"type", Some(b"T"))];
    let rows = bad_then_good(&db, (Some(b"k"), Some(br#"{"n":1}"#), headers)).await?;
    assert_eq!(rows.len(), 1, "quarantined, not handled as event {id}");
    assert_eq!(rows[0].reason, "invalid_header_name");
    assert_eq!(rows[0].event_id, None, "`id\\0x` names no event");
    // Its name's bytes in full, its value whole.
    let mut expected = whole(&headers[1..])?;
    expected.insert(
        0,
        ReceivedHeader::Bytes {
            name: b"id\0x".to_vec(),
            value: Some(id.clone().into_bytes()),
        },
    );
    assert_eq!(rows[0].received_headers()?, expected);
    Ok(())
}

/// librdkafka shows `outbox-requeue-for\0x` as `outbox-requeue-for`: the record is no
/// requeued copy, and it is quarantined like any other name with a NUL.
/// Fails before the fix: it passed for a copy for the consumer `nobody`, and every consumer
/// skipped it (`NotForUs`, its offset stored): never handled, never quarantined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_with_a_nul_does_not_pass_for_a_requeue_target() -> Result<()> {
    let db = db().await?;
    let id = EventId::new().to_string();
    let headers: &[ByteHeader<'_>] = &[
        (b"id", Some(id.as_bytes())),
        (b"outbox-requeue-for\0x", Some(b"nobody")),
    ];
    let rows = bad_then_good(&db, (Some(b"k"), Some(br#"{"n":1}"#), headers)).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, "invalid_header_name");
    assert_eq!(rows[0].event_id, Some(id.parse()?));
    Ok(())
}

/// A different record at an offset a quarantine row holds (the topic was deleted and made
/// again, or a cluster failed over to one with other offsets).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_record_at_a_reused_offset_is_quarantined_too() -> Result<()> {
    let db = db().await?;
    let consumer = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record_effect)?;
    let topic = unique("outbox.test");
    let shutdown = CancellationToken::new();
    let message = |offset: i64, payload: &[u8], id: Option<&str>| {
        let headers = id.map(|id| {
            rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: "id",
                value: Some(id),
            })
        });
        rdkafka::message::OwnedMessage::new(
            Some(payload.to_vec()),
            Some(b"k".to_vec()),
            topic.clone(),
            rdkafka::Timestamp::NotAvailable,
            0,
            offset,
            headers,
        )
    };
    let first = message(5, b"{first", None);
    let redelivered = message(5, b"{first", None);
    let other = message(5, b"{other", None);
    let good = EventId::new();
    for m in [&first, &redelivered, &other] {
        assert_eq!(
            consumer.process(m, &shutdown).await?,
            Outcome::Quarantined("missing_id")
        );
    }
    let good_id = good.to_string();
    assert_eq!(
        consumer
            .process(&message(6, br#"{"n":1}"#, Some(&good_id)), &shutdown)
            .await?,
        Outcome::Processed
    );
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT payload FROM outbox_consumer_quarantine ORDER BY id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        payloads,
        [b"{first".to_vec(), b"{other".to_vec()],
        "the redelivery is stored once, the other record at its offset too"
    );
    Ok(())
}

/// The database refusing the full row for what it holds (here an operator's constraint) is no
/// outage: the message is stored with its bytes alone, and the partition flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantine_row_the_database_refuses_is_stored_as_bytes_and_the_partition_flows()
-> Result<()> {
    let db = db().await?;
    sqlx::query(
        "ALTER TABLE outbox_consumer_quarantine \
         ADD CONSTRAINT no_json_view CHECK (headers = '{}'::jsonb)",
    )
    .execute(&db.pool)
    .await?;
    let headers: &[ByteHeader<'_>] = &[(b"x", Some(b"\0\xff")), (b"id", Some(b"not-a-uuid"))];
    let rows = bad_then_good(&db, (Some(b"k"), Some(b"{broken"), headers)).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].reason, "quarantine_refused");
    assert!(
        rows[0].error.starts_with("invalid_id: ") && rows[0].error.contains("no_json_view"),
        "{}",
        rows[0].error
    );
    assert_eq!(rows[0].message_key.as_deref(), Some(&b"k"[..]));
    assert_eq!(rows[0].payload.as_deref(), Some(&b"{broken"[..]));
    assert_eq!(rows[0].received_headers()?, whole(headers)?);
    Ok(())
}

/// A row written before migration 0006 (headers in JSONB only) is read as before, and the
/// same position takes a new row for another record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_the_bytes_column_stay_readable() -> Result<()> {
    let db = TestDb::before_migration(6).await?;
    sqlx::query(
        "INSERT INTO outbox_consumer_quarantine \
            (consumer, topic, partition, \"offset\", message_key, payload, headers, reason, error) \
         VALUES ('c1', 't', 0, 5, 'k'::bytea, '{old'::bytea, \
                 '{\"id\": [\"a\", {\"hex\": \"ff00\"}], \"n\": null}', 'invalid_id', 'e')",
    )
    .execute(&db.pool)
    .await?;
    outbox_core::migrate(&db.pool).await?;
    let consumer = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record_effect)?;
    let other = rdkafka::message::OwnedMessage::new(
        Some(b"{new".to_vec()),
        Some(b"k".to_vec()),
        "t".to_owned(),
        rdkafka::Timestamp::NotAvailable,
        0,
        5,
        None,
    );
    assert_eq!(
        consumer.process(&other, &CancellationToken::new()).await?,
        Outcome::Quarantined("missing_id")
    );
    let mut conn = db.pool.acquire().await?;
    let rows = list_quarantined(&mut conn, &TableNames::default(), 10).await?;
    assert_eq!(rows.len(), 2);
    let mut old = rows[0].record_headers()?;
    old.sort();
    assert_eq!(
        old,
        [
            ("id".to_owned(), Some(b"a".to_vec())),
            ("id".to_owned(), Some(vec![0xff, 0x00])),
            ("n".to_owned(), None),
        ]
    );
    assert_eq!(rows[1].payload.as_deref(), Some(&b"{new"[..]));
    assert_eq!(rows[1].record_headers()?, []);
    Ok(())
}
