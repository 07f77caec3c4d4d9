//! Fuzzing the consumer's input: records built from arbitrary bytes (header names and values
//! with NUL, values that are not UTF-8, repeated, empty and many headers, payloads of any bytes,
//! ids of any shape and date) go through the real decode → dedup → quarantine path on real
//! Postgres. Whatever they hold: no panic, no call that fails to return, no `Err` while the
//! database is up (the runner would retry that batch forever), and each record is either
//! handled once (a redelivery adds nothing) or quarantined with its key, payload and headers
//! intact; a sentinel record after them is handled.
//!
//! What must be handled is the wire contract (`outbox_core::wire`) read from the bytes sent,
//! written out again below ([`expect`]): a record is handled when it carries exactly one header
//! named exactly `id` whose UTF-8 text (plain or a JSON string) is a UUID, at most one `type`
//! (UTF-8), a UTF-8 key or none, and a JSON payload within `max_payload_bytes`, and its id is
//! not a UUIDv7 dated more than a day ahead; every other record is quarantined. A header
//! name that holds NUL is read in full and quarantines its record (`id\0x` never counts as
//! `id`), except when it has no value (a null, not an empty one): librdkafka tells a name's
//! length only through where its value starts, so such a name reads as its part before the
//! NUL, and the contract is applied to what the record reads as.
//!
//! However many ids of whatever dates arrive, the dedup table gets no slice per day named
//! outside the TTL window (one bucket at most).
//!
//! The handler side is fuzzed too: handlers that fail their first runs by returning an error,
//! rejecting, panicking inside or before their future, or ignoring a failed statement; each
//! event is handled once or quarantined after its attempts, and costs no other event.
//!
//! `OUTBOX_FUZZ_CASES` (default 100; half as many handler cases) and
//! `OUTBOX_FUZZ_BROKER_CASES` (default 6) set the case counts; `scripts/fuzz` runs many more.
//! A failure prints proptest's minimal input.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use outbox_consumer::ReceivedHeader;
use outbox_consumer::quarantine::QuarantinedMessage;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, Outcome, TIMELESS, consumer_config, dedup_consume,
    dedup_slice, today,
};
use outbox_tests::{TestDb, create_topic, eventually, kafka_bootstrap, unique};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A call that has not returned after this long is a stall, not a slow machine.
const STALL: Duration = Duration::from_secs(30);
/// Small, so that payloads over it are cheap to make.
const MAX_PAYLOAD: usize = 512;
const TTL_DAYS: i32 = 7;
const DAY_MS: u64 = 86_400_000;

type RawHeader = (String, Option<Vec<u8>>);

/// One record as sent.
#[derive(Clone)]
struct Rec {
    key: Option<Vec<u8>>,
    headers: Vec<RawHeader>,
    payload: Option<Vec<u8>>,
}

/// Bytes shown escaped, so a shrunk case reads as what was sent.
struct Esc<'a>(&'a [u8]);

impl fmt::Debug for Esc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b\"{}\"", self.0.escape_ascii())
    }
}

fn esc(bytes: &Option<Vec<u8>>) -> Option<Esc<'_>> {
    bytes.as_deref().map(Esc)
}

impl fmt::Debug for Rec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers: Vec<_> = self
            .headers
            .iter()
            .map(|(name, value)| (Esc(name.as_bytes()), esc(value)))
            .collect();
        f.debug_struct("Rec")
            .field("key", &esc(&self.key))
            .field("headers", &headers)
            .field("payload", &esc(&self.payload))
            .finish()
    }
}

#[derive(Clone)]
struct Case {
    records: Vec<Rec>,
    /// One `process_batch` for all, or `process` per record.
    batch: bool,
}

/// One record a line.
struct Lines<'a>(&'a [Rec]);

impl fmt::Debug for Lines<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (offset, rec) in self.0.iter().enumerate() {
            writeln!(f, "  offset {offset}: {rec:?}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = if self.batch {
            "one batch"
        } else {
            "one at a time"
        };
        write!(f, "{how}, then the sentinel:\n{:?}", Lines(&self.records))
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn bytes(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), len)
}

fn v7_at(range: std::ops::Range<u64>) -> impl Strategy<Value = Uuid> {
    (range, any::<[u8; 10]>())
        .prop_map(|(ms, random)| uuid::Builder::from_unix_timestamp_millis(ms, &random).into_uuid())
}

/// UUIDs of every kind and date.
fn uuid() -> impl Strategy<Value = Uuid> {
    let now = now_ms();
    let ttl = u64::try_from(TTL_DAYS).unwrap_or(7) * DAY_MS;
    prop_oneof![
        // Recent, as the relay makes them (a day ahead at most is accepted).
        4 => v7_at(now - ttl - DAY_MS..now + DAY_MS / 2),
        2 => v7_at(0..now - ttl - 2 * DAY_MS),
        1 => v7_at(now + 3 * DAY_MS..1 << 48),
        1 => v7_at(0..1 << 48),
        1 => Just(Uuid::now_v7()),
        1 => any::<[u8; 16]>().prop_map(|b| uuid::Builder::from_random_bytes(b).into_uuid()),
        1 => Just(Uuid::nil()),
        1 => Just(Uuid::max()),
        1 => any::<[u8; 16]>().prop_map(Uuid::from_bytes),
    ]
}

/// An `id` header's value: a UUID in one of the forms text can take, with NUL or padding,
/// or garbage.
fn id_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => (uuid(), 0..10_u8).prop_map(|(id, form)| {
            let h = id.hyphenated().to_string();
            match form {
                0 => format!("\"{h}\""),
                1 => id.simple().to_string(),
                2 => id.urn().to_string(),
                3 => id.braced().to_string(),
                4 => h.to_uppercase(),
                5 => format!(" {h}\n"),
                6 => format!("{h}\0"),
                7 => format!("\0{h}"),
                8 => format!("{}\0{}", &h[..8], &h[9..]),
                _ => h,
            }
            .into_bytes()
        }),
        1 => any::<String>().prop_map(String::into_bytes),
        1 => bytes(0..40),
    ]
}

fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => Just("id".to_owned()),
        2 => Just("type".to_owned()),
        1 => Just(String::new()),
        1 => Just("traceparent".to_owned()),
        1 => Just("id\0".to_owned()),
        1 => Just("id\0x".to_owned()),
        1 => Just("type\0".to_owned()),
        1 => Just("\0id".to_owned()),
        2 => "[a-z\\x00]{0,6}",
        2 => any::<String>(),
    ]
}

fn header_value() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        1 => Just(None),
        1 => Just(Some(Vec::new())),
        // A small big-endian integer, as Java clients write (a DLT offset header).
        1 => any::<u32>().prop_map(|n| Some(u64::from(n).to_be_bytes().to_vec())),
        2 => id_value().prop_map(Some),
        2 => "[a-z\\x00]{0,8}".prop_map(|s| Some(s.into_bytes())),
        1 => Just(Some(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec())),
        2 => bytes(0..40).prop_map(Some),
    ]
}

fn headers() -> impl Strategy<Value = Vec<RawHeader>> {
    let others = prop_oneof![
        12 => proptest::collection::vec((header_name(), header_value()), 0..5),
        // Many: the count shrinks to none.
        1 => proptest::collection::vec((header_name(), header_value()), 0..400),
    ];
    let id = proptest::option::weighted(0.85, id_value());
    let event_type = proptest::option::weighted(0.4, header_value());
    (others, id, event_type, any::<Index>(), any::<Index>()).prop_map(
        |(mut headers, id, event_type, at_id, at_type)| {
            if let Some(value) = event_type {
                let at = at_type.index(headers.len() + 1);
                headers.insert(at, ("type".to_owned(), value));
            }
            if let Some(value) = id {
                let at = at_id.index(headers.len() + 1);
                headers.insert(at, ("id".to_owned(), Some(value)));
            }
            headers
        },
    )
}

fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<String>().prop_map(Value::from),
        "[a-z\\x00]{0,4}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map(any::<String>(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn payload() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        8 => json().prop_map(|v| Some(serde_json::to_vec(&v).expect("a Value serialises"))),
        1 => Just(None),
        1 => Just(Some(Vec::new())),
        2 => bytes(0..64).prop_map(Some),
        1 => bytes(MAX_PAYLOAD + 1..MAX_PAYLOAD + 64).prop_map(Some),
        1 => "[a-z\\x00]{0,700}".prop_map(|s| Some(serde_json::to_vec(&s).expect("a string serialises"))),
    ]
}

fn key() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        1 => Just(None),
        3 => "[a-z0-9/\\x00]{0,8}".prop_map(|s| Some(s.into_bytes())),
        1 => bytes(0..16).prop_map(Some),
    ]
}

fn record() -> impl Strategy<Value = Rec> {
    (key(), headers(), payload()).prop_map(|(key, headers, payload)| Rec {
        key,
        headers,
        payload,
    })
}

/// Records, some of them sent again later in the same run (a duplicate inside a batch).
fn records(max: usize) -> impl Strategy<Value = Vec<Rec>> {
    (
        proptest::collection::vec(record(), 0..max),
        proptest::collection::vec(any::<Index>(), 0..3),
    )
        .prop_map(|(mut records, again)| {
            if !records.is_empty() {
                for at in again {
                    let copy = records[at.index(records.len())].clone();
                    records.push(copy);
                }
            }
            records
        })
}

/// The last record of every run: a plain valid event.
fn sentinel() -> Rec {
    Rec {
        key: Some(b"sentinel".to_vec()),
        headers: vec![(
            "id".to_owned(),
            Some(Uuid::now_v7().to_string().into_bytes()),
        )],
        payload: Some(b"{}".to_vec()),
    }
}

/// What the contract says of a record.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Handled once under this id.
    Handled(Uuid),
    /// Quarantined.
    Quarantined,
    /// Handled under this id or quarantined: an id dated on the day that became "more than a
    /// day ahead" while the case ran.
    Either(Uuid),
}

/// The wire contract, read from the bytes sent (see the module docs), for a run that began
/// on day `first` and ended on day `last`.
fn expect(rec: &Rec, first: i32, last: i32) -> Expect {
    fn text(v: &Option<Vec<u8>>) -> Option<&str> {
        std::str::from_utf8(v.as_deref().unwrap_or_default()).ok()
    }
    if rec
        .headers
        .iter()
        .any(|(name, value)| name.contains('\0') && value.is_some())
    {
        return Expect::Quarantined;
    }
    let read: Vec<(&str, &Option<Vec<u8>>)> = rec
        .headers
        .iter()
        .map(|(name, value)| (name.split('\0').next().unwrap_or_default(), value))
        .collect();
    let ids: Vec<_> = read.iter().filter(|(n, _)| *n == "id").collect();
    let types: Vec<_> = read.iter().filter(|(n, _)| *n == "type").collect();
    let valid = rec
        .payload
        .as_ref()
        .is_some_and(|p| p.len() <= MAX_PAYLOAD && serde_json::from_slice::<Value>(p).is_ok())
        && ids.len() == 1
        && types.len() <= 1
        && types.iter().all(|(_, v)| text(v).is_some())
        && rec
            .key
            .as_deref()
            .is_none_or(|k| std::str::from_utf8(k).is_ok());
    let id = ids
        .first()
        .and_then(|(_, v)| text(v))
        .and_then(|t| Uuid::parse_str(t.trim().trim_matches('"')).ok());
    let Some(id) = id.filter(|_| valid) else {
        return Expect::Quarantined;
    };
    let day = dedup_slice(&id);
    if day > last.saturating_add(1) {
        return Expect::Quarantined;
    }
    if day > first.saturating_add(1) {
        return Expect::Either(id);
    }
    Expect::Handled(id)
}

fn message(topic: &str, offset: i64, rec: &Rec) -> OwnedMessage {
    let headers = rec.headers.iter().fold(
        OwnedHeaders::new_with_capacity(rec.headers.len()),
        |hs, (name, value)| {
            hs.insert(Header {
                key: name.as_str(),
                value: value.as_deref(),
            })
        },
    );
    OwnedMessage::new(
        rec.payload.clone(),
        rec.key.clone(),
        topic.to_owned(),
        rdkafka::Timestamp::CreateTime(i64::try_from(now_ms()).unwrap_or(0)),
        0,
        offset,
        Some(headers),
    )
}

/// The handler: one row per run, no constraint, so a second run shows as a second row.
async fn record_effect(event: &Event<Value>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO fuzz_effects (topic, event_id, \"offset\") VALUES ($1, $2, $3)")
        .bind(&event.topic)
        .bind(event.id.as_uuid())
        .bind(event.offset)
        .execute(conn)
        .await?;
    Ok(())
}

fn config(name: &str) -> ConsumerConfig {
    ConsumerConfig::new(name)
        .max_payload_bytes(MAX_PAYLOAD)
        .dedup_ttl(Duration::from_secs(
            u64::try_from(TTL_DAYS).unwrap_or(7) * 86_400,
        ))
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
}

/// What a run left in the database for its topic.
#[derive(Debug, PartialEq)]
struct Seen {
    /// (event id, offset) of each handler run.
    effects: Vec<(Uuid, i64)>,
    quarantined: BTreeMap<i64, QuarantinedMessage>,
}

async fn seen(pool: &PgPool, consumer: &str, topic: &str) -> Result<Seen> {
    let effects = sqlx::query_as(
        "SELECT event_id, \"offset\" FROM fuzz_effects WHERE topic = $1 ORDER BY \"offset\"",
    )
    .bind(topic)
    .fetch_all(pool)
    .await?;
    let rows: Vec<QuarantinedMessage> = sqlx::query_as(
        "SELECT id, consumer, topic, partition, \"offset\", event_id, reason, error, \
         quarantined_at, message_key, payload, headers, header_bytes, record_timestamp \
         FROM outbox_consumer_quarantine \
         WHERE consumer = $1 AND topic = $2",
    )
    .bind(consumer)
    .bind(topic)
    .fetch_all(pool)
    .await?;
    let mut quarantined = BTreeMap::new();
    for row in rows {
        ensure!(
            row.partition == 0,
            "quarantined in partition {}",
            row.partition
        );
        if let Some(other) = quarantined.insert(row.offset, row) {
            bail!("offset {} quarantined twice: {other:?}", other.offset);
        }
    }
    Ok(Seen {
        effects,
        quarantined,
    })
}

/// The headers a quarantine row holds (the test sends UTF-8 names only).
fn stored_headers(row: &QuarantinedMessage) -> Result<Vec<(String, Option<Vec<u8>>)>> {
    row.received_headers()?
        .into_iter()
        .map(|header| match header {
            ReceivedHeader::Whole { name, value } => Ok((name, value)),
            ReceivedHeader::Bytes { name, value } => Ok((String::from_utf8(name)?, value)),
            other => bail!("a header name the test never sends: {other:?}"),
        })
        .collect()
}

/// The quarantine row holds the record as sent: key, payload, and the headers as a multiset
/// (a name's values in their order; a name with NUL and no value is stored up to its NUL).
fn intact(offset: i64, rec: &Rec, row: &QuarantinedMessage) -> Result<()> {
    let what = || {
        format!(
            "quarantine row of offset {offset} ({}: {})",
            row.reason, row.error
        )
    };
    ensure!(
        row.message_key == rec.key,
        "{}: key {:?}",
        what(),
        esc(&row.message_key)
    );
    ensure!(
        row.payload == rec.payload,
        "{}: payload {:?}",
        what(),
        esc(&row.payload)
    );
    let mut stored =
        stored_headers(row).with_context(|| format!("{}: headers unreadable", what()))?;
    for (name, value) in &rec.headers {
        let as_read = match value {
            None => name.split('\0').next().unwrap_or_default(),
            Some(_) => name,
        };
        let found = stored.iter().position(|(n, v)| n == as_read && v == value);
        let Some(at) = found else {
            bail!(
                "{}: header {:?} = {:?} missing; stored {:?}",
                what(),
                Esc(name.as_bytes()),
                esc(value),
                Rec {
                    key: None,
                    headers: stored,
                    payload: None
                }
            );
        };
        stored.remove(at);
    }
    ensure!(
        stored.is_empty(),
        "{}: headers never sent: {stored:?}",
        what()
    );
    // The order of one name's values is kept.
    let mut sent: HashMap<&str, Vec<&Option<Vec<u8>>>> = HashMap::new();
    for (name, value) in &rec.headers {
        sent.entry(name.as_str()).or_default().push(value);
    }
    // Not for a name that one with NUL and no value is stored as.
    let cut: Vec<&str> = rec
        .headers
        .iter()
        .filter(|(n, v)| n.contains('\0') && v.is_none())
        .filter_map(|(n, _)| n.split('\0').next())
        .collect();
    let stored = stored_headers(row)?;
    for (name, values) in sent
        .iter()
        .filter(|(n, _)| !n.contains('\0') && !cut.contains(n))
    {
        let got: Vec<_> = stored
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .collect();
        ensure!(
            &got == values,
            "{}: values of {name:?} out of order",
            what()
        );
    }
    Ok(())
}

/// The properties over what a run left: each record handled once under its id or quarantined
/// whole, as the contract says.
fn verify(recs: &[Rec], expects: &[Expect], seen: &Seen) -> Result<()> {
    let mut handled: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for (id, offset) in &seen.effects {
        handled.entry(*id).or_default().push(*offset);
    }
    for (id, offsets) in &handled {
        ensure!(
            offsets.len() == 1,
            "event {id} handled {} times, at offsets {offsets:?}",
            offsets.len()
        );
    }
    for (id, offset) in &seen.effects {
        let expected = usize::try_from(*offset).ok().and_then(|i| expects.get(i));
        ensure!(
            matches!(expected, Some(Expect::Handled(e) | Expect::Either(e)) if e == id),
            "handled as event {id} at offset {offset}, whose record the contract says is {expected:?}"
        );
        ensure!(
            !seen.quarantined.contains_key(offset),
            "offset {offset} both handled and quarantined"
        );
    }
    if let Some((offset, _)) = seen
        .quarantined
        .iter()
        .find(|(o, _)| usize::try_from(**o).map_or(true, |i| i >= recs.len()))
    {
        bail!("quarantined an offset never sent: {offset}");
    }
    for (i, (rec, expected)) in recs.iter().zip(expects).enumerate() {
        let offset = i64::try_from(i)?;
        let row = seen.quarantined.get(&offset);
        match (expected, row) {
            (Expect::Handled(_), Some(row)) => bail!(
                "offset {offset} quarantined ({}: {}) though the contract accepts it",
                row.reason,
                row.error
            ),
            (Expect::Handled(id) | Expect::Either(id), None) => ensure!(
                handled.contains_key(id),
                "offset {offset} (event {id}) neither handled nor quarantined"
            ),
            (Expect::Quarantined, None) => {
                bail!("offset {offset} breaks the contract and is not quarantined")
            }
            (Expect::Quarantined | Expect::Either(_), Some(row)) => intact(offset, rec, row)?,
        }
    }
    Ok(())
}

/// The outcomes returned agree with what the database holds.
fn agree(outcomes: &[Outcome], seen: &Seen) -> Result<()> {
    let processed: HashMap<i64, Uuid> = seen.effects.iter().map(|(id, o)| (*o, *id)).collect();
    for (i, outcome) in outcomes.iter().enumerate() {
        let offset = i64::try_from(i)?;
        let ok = match outcome {
            Outcome::Processed => processed.contains_key(&offset),
            Outcome::Quarantined(_) => seen.quarantined.contains_key(&offset),
            Outcome::DuplicateCached | Outcome::DuplicateStored => {
                !processed.contains_key(&offset) && !seen.quarantined.contains_key(&offset)
            }
            _ => false,
        };
        ensure!(
            ok,
            "offset {offset}: outcome {outcome:?} disagrees with the database"
        );
    }
    Ok(())
}

/// Feeds `messages` to `consumer`, in one batch or one at a time; a call that does not return
/// within [`STALL`], or returns `Err` with the database up, fails.
async fn drive<P, H>(
    consumer: &DedupConsumer<P, H>,
    messages: &[OwnedMessage],
    batch: bool,
) -> Result<Vec<Outcome>>
where
    P: serde::de::DeserializeOwned + Send + Sync + 'static,
    H: outbox_consumer::Handler<P>,
{
    let shutdown = CancellationToken::new();
    let mut outcomes = Vec::new();
    let chunks: Vec<&[OwnedMessage]> = if batch {
        vec![messages]
    } else {
        messages.chunks(1).collect()
    };
    for chunk in chunks {
        let call = consumer.process_batch(chunk, &shutdown);
        let done = tokio::time::timeout(STALL, call).await.with_context(|| {
            format!(
                "stall: process_batch of offsets {}.. did not return within {STALL:?}",
                chunk[0].offset_value()
            )
        })?;
        let done = done.with_context(|| {
            format!(
                "process_batch of offsets {}.. returned Err with the database up (the runner \
                 would retry it forever)",
                chunk[0].offset_value()
            )
        })?;
        ensure!(
            done.len() == chunk.len(),
            "{} outcomes for {} messages: {done:?}",
            done.len(),
            chunk.len()
        );
        outcomes.extend(done);
    }
    Ok(outcomes)
}

trait OffsetValue {
    fn offset_value(&self) -> i64;
}

impl OffsetValue for OwnedMessage {
    fn offset_value(&self) -> i64 {
        rdkafka::Message::offset(self)
    }
}

/// One schema for a whole fuzz run, and the dedup slices its cases made.
#[derive(Debug)]
struct Run {
    db: TestDb,
    day_at_start: i32,
    /// First days of the dedup table's slices outside the TTL window after the last case.
    outside: Mutex<BTreeSet<i32>>,
}

/// First days of the dedup table's range partitions (its slices) outside the window of days
/// an id of a record within the TTL can name, the timeless slice aside.
async fn slices_outside(run: &Run) -> Result<BTreeSet<i32>> {
    let window = run.day_at_start - TTL_DAYS - 1..=today() + 2;
    let firsts: Vec<Option<i32>> = sqlx::query_scalar(
        "SELECT substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \\(''?(-?[0-9]+)')::int \
         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox_consumer_dedup'::regclass",
    )
    .fetch_all(&run.db.pool)
    .await?;
    Ok(firsts
        .into_iter()
        .flatten()
        .filter(|d| !window.contains(d) && *d != TIMELESS)
        .collect())
}

/// However many ids of whatever dates the cases send, the dedup table gets slices for days
/// within the TTL window and at most one more over the whole run (a bucket for the rest):
/// never one per day named. A case fails when it adds one beyond that, so the minimal failing
/// case is one that does.
async fn slices_bounded(run: &Run) -> Result<()> {
    let now = slices_outside(run).await?;
    let mut before = run.outside.lock().unwrap_or_else(|p| p.into_inner());
    let made: Vec<i32> = now.difference(&before).copied().collect();
    let earlier = before.len();
    *before = now;
    ensure!(
        made.is_empty() || before.len() <= 1,
        "made dedup slices for days {made:?}, out of the TTL window (and {earlier} such slices \
         before): a slice per day named, however far back"
    );
    Ok(())
}

async fn in_memory_case(run: Arc<Run>, case: Case) -> Result<()> {
    let db = &run.db;
    let (topic, name) = (unique("fuzz"), unique("c"));
    let mut recs = case.records;
    recs.push(sentinel());
    let messages: Vec<OwnedMessage> = (0..)
        .zip(&recs)
        .map(|(offset, rec)| message(&topic, offset, rec))
        .collect();
    let first_day = today();
    let consumer = DedupConsumer::new(db.pool.clone(), config(&name), record_effect)?;
    let outcomes = drive(&consumer, &messages, case.batch).await?;
    let after_first = seen(&db.pool, &name, &topic).await?;
    // Redelivered to the same instance (its cache), then to a new one (the dedup table).
    let cached = drive(&consumer, &messages, case.batch).await?;
    let restarted = DedupConsumer::new(db.pool.clone(), config(&name), record_effect)?;
    let stored = drive(&restarted, &messages, !case.batch).await?;
    let last_day = today();
    let expects: Vec<Expect> = recs
        .iter()
        .map(|r| expect(r, first_day, last_day))
        .collect();

    verify(&recs, &expects, &after_first)?;
    agree(&outcomes, &after_first)?;
    ensure!(
        outcomes.last() == Some(&Outcome::Processed),
        "the sentinel was not handled: {:?}",
        outcomes.last()
    );
    let after_all = seen(&db.pool, &name, &topic).await?;
    ensure!(
        after_all.effects == after_first.effects,
        "a redelivery changed the effects: {:?} then {:?}",
        after_first.effects,
        after_all.effects
    );
    ensure!(
        after_all
            .quarantined
            .keys()
            .eq(after_first.quarantined.keys()),
        "a redelivery changed what is quarantined"
    );
    for (again, how) in [
        (&cached, "to the same instance"),
        (&stored, "to a new instance"),
    ] {
        for (i, (first, then)) in outcomes.iter().zip(again).enumerate() {
            let quarantined = matches!(first, Outcome::Quarantined(_));
            ensure!(
                *then != Outcome::Processed
                    && quarantined == matches!(then, Outcome::Quarantined(_)),
                "offset {i} redelivered {how}: {then:?} after {first:?}"
            );
        }
    }
    slices_bounded(&run).await
}

async fn broker_case(fuzz_run: Arc<Run>, records: Vec<Rec>) -> Result<()> {
    let db = &fuzz_run.db;
    let topic = unique("fuzz");
    create_topic(&topic, 1).await?;
    let mut recs = records;
    recs.push(sentinel());
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("linger.ms", "0")
        .create()?;
    for (i, rec) in recs.iter().enumerate() {
        let headers = rec.headers.iter().fold(
            OwnedHeaders::new_with_capacity(rec.headers.len()),
            |hs, (name, value)| {
                hs.insert(Header {
                    key: name.as_str(),
                    value: value.as_deref(),
                })
            },
        );
        let mut record = FutureRecord::<[u8], [u8]>::to(&topic)
            .partition(0)
            .headers(headers);
        if let Some(key) = &rec.key {
            record = record.key(key);
        }
        if let Some(payload) = &rec.payload {
            record = record.payload(payload);
        }
        let delivery = producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)?;
        ensure!(
            delivery.offset == i64::try_from(i)?,
            "record {i} landed at offset {}",
            delivery.offset
        );
    }
    let first_day = today();
    let name = unique("c");
    let kafka = consumer_config(&kafka_bootstrap(), &name);
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (pool, topic, name, shutdown) = (
            db.pool.clone(),
            topic.clone(),
            name.clone(),
            shutdown.clone(),
        );
        async move {
            dedup_consume(&kafka, pool, record_effect)
                .topics([topic])
                .config(config(&name))
                .run(shutdown)
                .await
        }
    });
    let sentinel = i64::try_from(recs.len() - 1)?;
    let handled = eventually("the sentinel handled", STALL, || async {
        if run.is_finished() {
            bail!("the consumer stopped before the sentinel was handled");
        }
        let done: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM fuzz_effects WHERE topic = $1 AND \"offset\" = $2)",
        )
        .bind(&topic)
        .bind(sentinel)
        .fetch_one(&db.pool)
        .await?;
        Ok(done)
    })
    .await;
    shutdown.cancel();
    let stopped = tokio::time::timeout(STALL, run)
        .await
        .context("stall: the consumer did not stop")?;
    match stopped {
        Ok(Ok(())) => {}
        Ok(Err(e)) => bail!("the consumer failed: {e}"),
        Err(e) => bail!("the consumer panicked: {e}"),
    }
    handled?;
    let last_day = today();
    let expects: Vec<Expect> = recs
        .iter()
        .map(|r| expect(r, first_day, last_day))
        .collect();
    verify(&recs, &expects, &seen(&db.pool, &name, &topic).await?)?;
    slices_bounded(&fuzz_run).await
}

fn cases(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `check` on `cases` values of `strategy`, each on a tokio runtime against one schema,
/// and reports proptest's minimal failing value.
fn fuzz<S, F, Fut>(cases: u32, strategy: S, check: F) -> Result<()>
where
    S: Strategy,
    S::Value: fmt::Debug,
    F: Fn(Arc<Run>, S::Value) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let run = rt.block_on(async {
        let db = TestDb::new().await?;
        sqlx::query("CREATE TABLE fuzz_effects (topic TEXT, event_id UUID, \"offset\" BIGINT)")
            .execute(&db.pool)
            .await?;
        let run = Run {
            day_at_start: today(),
            outside: Mutex::default(),
            db,
        };
        *run.outside.lock().unwrap_or_else(|p| p.into_inner()) = slices_outside(&run).await?;
        anyhow::Ok(Arc::new(run))
    })?;
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        // Shrinking stops at whichever comes first: a case costs a few tens of milliseconds
        // in memory, half a second through the broker, and a stalled one 30 s.
        max_shrink_iters: 4096,
        max_shrink_time: 60_000,
        ..Config::default()
    });
    let result = runner.run(&strategy, |value| {
        rt.block_on(check(Arc::clone(&run), value))
            .map_err(|e| TestCaseError::fail(format!("{e:#}")))
    });
    match result {
        Ok(()) => Ok(()),
        Err(TestError::Fail(reason, value)) => {
            bail!("{reason}\nminimal failing input: {value:?}")
        }
        Err(e) => bail!("{e}"),
    }
}

#[test]
fn records_of_any_bytes_are_handled_once_or_quarantined_whole() -> Result<()> {
    let strategy =
        (records(10), any::<bool>()).prop_map(|(records, batch)| Case { records, batch });
    fuzz(cases("OUTBOX_FUZZ_CASES", 100), strategy, in_memory_case)
}

#[test]
fn records_of_any_bytes_from_the_broker_are_handled_once_or_quarantined_whole() -> Result<()> {
    let strategy = records(6).prop_map(|records| Case {
        records,
        batch: true,
    });
    fuzz(
        cases("OUTBOX_FUZZ_BROKER_CASES", 6),
        strategy,
        |run, case| broker_case(run, case.records),
    )
}

/// What a fuzzed handler does with an event: fail its first `fails` runs in the way `mode`
/// says, then succeed.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
struct Plan {
    mode: Mode,
    fails: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
enum Mode {
    /// Returns `HandlerError::Retry`.
    Retry,
    /// Returns `HandlerError::Quarantine`: the event is quarantined at its first failure.
    Reject,
    /// Panics inside its future.
    Panic,
    /// Panics before returning its future.
    PanicBeforeFuture,
    /// Ignores a failed statement (`let _ = ...`) and returns `Ok`: its transaction is aborted.
    Swallow,
}

const HANDLER_ATTEMPTS: u32 = 3;

impl Plan {
    /// Whether the event ends up handled (else quarantined): every failed run counts as one
    /// of its attempts, whatever the way it failed.
    fn handled(self) -> bool {
        self.fails == 0 || (self.mode != Mode::Reject && self.fails < HANDLER_ATTEMPTS)
    }
}

fn plan() -> impl Strategy<Value = Plan> {
    let mode = prop_oneof![
        Just(Mode::Retry),
        Just(Mode::Reject),
        Just(Mode::Panic),
        Just(Mode::PanicBeforeFuture),
        Just(Mode::Swallow),
    ];
    // Most events are handled at once: a failing one must cost none of them.
    let fails = prop_oneof![3 => Just(0), 2 => 0..=HANDLER_ATTEMPTS + 1];
    (mode, fails).prop_map(|(mode, fails)| Plan { mode, fails })
}

/// A handler written as a user may write one, failing as its event's plan says. The trait's
/// `handle` is a plain function returning a future, so it can panic before returning it.
#[derive(Debug, Default)]
struct Fuzzed {
    /// Runs so far, by event id.
    runs: Mutex<HashMap<Uuid, u32>>,
    /// Runs that got past their own statement, by event id.
    decided: Mutex<HashMap<Uuid, u32>>,
}

impl outbox_consumer::Handler<Plan> for Fuzzed {
    fn handle(
        &self,
        event: &Event<Plan>,
        conn: &mut PgConnection,
    ) -> impl Future<Output = Result<(), outbox_consumer::HandlerError>> + Send {
        let run = {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            let n = runs.entry(*event.id.as_uuid()).or_insert(0);
            *n += 1;
            *n
        };
        let plan = event.payload;
        if run <= plan.fails && plan.mode == Mode::PanicBeforeFuture {
            panic!("the handler panics before returning its future, run {run}");
        }
        async move {
            sqlx::query(
                "INSERT INTO fuzz_handler_effects (topic, event_id, run) VALUES ($1, $2, $3)",
            )
            .bind(&event.topic)
            .bind(event.id.as_uuid())
            .bind(i32::try_from(run).unwrap_or(i32::MAX))
            .execute(&mut *conn)
            .await?;
            // A run whose insert failed met another handler's aborted transaction: it never
            // got to decide, so it is not one of the runs its plan fails.
            let own = {
                let mut decided = self.decided.lock().unwrap_or_else(|p| p.into_inner());
                let n = decided.entry(*event.id.as_uuid()).or_insert(0);
                *n += 1;
                *n
            };
            let failing = if plan.mode == Mode::PanicBeforeFuture {
                run <= plan.fails
            } else {
                own <= plan.fails
            };
            if !failing {
                return Ok(());
            }
            match plan.mode {
                Mode::Retry | Mode::PanicBeforeFuture => Err(outbox_consumer::HandlerError::retry(
                    format!("fails run {run}"),
                )),
                Mode::Reject => Err(outbox_consumer::HandlerError::quarantine("rejects")),
                Mode::Panic => panic!("the handler panics in its future, run {run}"),
                Mode::Swallow => {
                    let _ = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
                    Ok(())
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
struct HandlerCase {
    plans: Vec<Plan>,
    batch: bool,
}

async fn handler_case(run: Arc<Run>, case: HandlerCase) -> Result<()> {
    let db = &run.db;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS fuzz_handler_effects (topic TEXT, event_id UUID, run INT)",
    )
    .execute(&db.pool)
    .await?;
    let (topic, name) = (unique("fuzz"), unique("c"));
    let mut plans = case.plans;
    plans.push(Plan {
        mode: Mode::Retry,
        fails: 0,
    });
    let ids: Vec<Uuid> = plans.iter().map(|_| Uuid::now_v7()).collect();
    let messages: Vec<OwnedMessage> = (0..)
        .zip(plans.iter().zip(&ids))
        .map(|(offset, (plan, id))| {
            let rec = Rec {
                key: Some(b"k".to_vec()),
                headers: vec![("id".to_owned(), Some(id.to_string().into_bytes()))],
                payload: Some(serde_json::to_vec(plan).expect("a plan serialises")),
            };
            message(&topic, offset, &rec)
        })
        .collect();
    let handler = Fuzzed::default();
    let config = ConsumerConfig::new(&name)
        .max_attempts(HANDLER_ATTEMPTS)
        .backoff(Duration::from_millis(1), Duration::from_millis(5));
    let consumer = DedupConsumer::new(db.pool.clone(), config, handler)?;
    // A panic that escapes the consumer fails the case (proptest catches it).
    let outcomes = drive(&consumer, &messages, case.batch).await?;
    let effects: Vec<(Uuid, i32)> =
        sqlx::query_as("SELECT event_id, run FROM fuzz_handler_effects WHERE topic = $1")
            .bind(&topic)
            .fetch_all(&db.pool)
            .await?;
    let quarantined: Vec<(i64, String)> = sqlx::query_as(
        "SELECT \"offset\", reason FROM outbox_consumer_quarantine WHERE consumer = $1 AND topic = $2",
    )
    .bind(&name)
    .bind(&topic)
    .fetch_all(&db.pool)
    .await?;
    for (i, ((plan, id), outcome)) in plans.iter().zip(&ids).zip(&outcomes).enumerate() {
        let offset = i64::try_from(i)?;
        let committed: Vec<i32> = effects
            .iter()
            .filter(|(e, _)| e == id)
            .map(|(_, run)| *run)
            .collect();
        let reason = quarantined
            .iter()
            .find(|(o, _)| *o == offset)
            .map(|(_, r)| r);
        let once = committed.len() == 1 && reason.is_none() && *outcome == Outcome::Processed;
        let held_back =
            committed.is_empty() && reason.is_some() && matches!(outcome, Outcome::Quarantined(_));
        // A swallowed failure in a batch of several cannot be told from its neighbours' runs
        // without a check per message: the batch is replayed one message at a time and that
        // run is not counted (nor one cut short by a neighbour's failure), so the event may
        // have more runs than `max_attempts`; it must still cost no other event anything.
        if case.batch && plan.mode == Mode::Swallow && plan.fails >= HANDLER_ATTEMPTS {
            ensure!(
                once || held_back,
                "offset {offset} ({plan:?}) should be handled once or quarantined with no \
                 effect: outcome {outcome:?}, effects committed by runs {committed:?}, \
                 quarantined {reason:?}"
            );
        } else if plan.handled() {
            ensure!(
                committed.len() == 1 && reason.is_none() && *outcome == Outcome::Processed,
                "offset {offset} ({plan:?}) should be handled once: outcome {outcome:?}, \
                 effects committed by runs {committed:?}, quarantined {reason:?}"
            );
        } else {
            ensure!(
                committed.is_empty()
                    && reason.is_some()
                    && matches!(outcome, Outcome::Quarantined(_)),
                "offset {offset} ({plan:?}) should be quarantined with no effect: outcome \
                 {outcome:?}, effects committed by runs {committed:?}, quarantined {reason:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn handlers_that_fail_in_any_way_cost_no_other_event_and_double_none() -> Result<()> {
    let strategy = (proptest::collection::vec(plan(), 0..8), any::<bool>())
        .prop_map(|(plans, batch)| HandlerCase { plans, batch });
    fuzz(cases("OUTBOX_FUZZ_CASES", 100) / 2, strategy, handler_case)
}

/// Cases the fuzz found, run every time. The first lost the panic's counted attempt when the
/// replay of the swallowing message before it failed too (a fourth run of a handler allowed
/// three); the second blamed a handler for the 25P02 its neighbour's swallowed error caused.
#[test]
fn handler_cases_the_fuzz_found_stay_fixed() -> Result<()> {
    let found = [
        HandlerCase {
            plans: vec![
                Plan {
                    mode: Mode::Swallow,
                    fails: 2,
                },
                Plan {
                    mode: Mode::PanicBeforeFuture,
                    fails: 3,
                },
            ],
            batch: true,
        },
        HandlerCase {
            plans: vec![
                Plan {
                    mode: Mode::Swallow,
                    fails: 1,
                },
                Plan {
                    mode: Mode::Reject,
                    fails: 1,
                },
            ],
            batch: true,
        },
    ];
    for case in found {
        fuzz(1, Just(case), handler_case)?;
    }
    Ok(())
}

/// An event of a `ParkKey` case: its key (one of a few) and how its handler fails.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
struct KeyedPlan {
    key: u8,
    plan: Plan,
}

fn keyed_plan() -> impl Strategy<Value = KeyedPlan> {
    // A panic, a retry error and a rejection park a key alike; a swallowed failure is the
    // handler fuzz's to try.
    let mode = prop_oneof![Just(Mode::Retry), Just(Mode::Reject), Just(Mode::Panic)];
    let fails = prop_oneof![3 => Just(0), 2 => 0..=HANDLER_ATTEMPTS + 1];
    (0..3_u8, mode, fails).prop_map(|(key, mode, fails)| KeyedPlan {
        key,
        plan: Plan { mode, fails },
    })
}

/// Fails each event's first `fails` runs as its plan says; records each run that commits, in
/// commit order.
#[derive(Debug, Default)]
struct KeyedFuzzed {
    runs: Mutex<HashMap<Uuid, u32>>,
}

impl outbox_consumer::Handler<KeyedPlan> for KeyedFuzzed {
    fn handle(
        &self,
        event: &Event<KeyedPlan>,
        conn: &mut PgConnection,
    ) -> impl Future<Output = Result<(), outbox_consumer::HandlerError>> + Send {
        let run = {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            let n = runs.entry(*event.id.as_uuid()).or_insert(0);
            *n += 1;
            *n
        };
        let plan = event.payload.plan;
        async move {
            sqlx::query(
                "INSERT INTO fuzz_park_effects (topic, key, event_id, \"offset\") \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(&event.topic)
            .bind(&event.key)
            .bind(event.id.as_uuid())
            .bind(event.offset)
            .execute(&mut *conn)
            .await?;
            if run > plan.fails {
                return Ok(());
            }
            match plan.mode {
                Mode::Reject => Err(outbox_consumer::HandlerError::quarantine("rejects")),
                Mode::Panic => panic!("the handler panics in its future, run {run}"),
                _ => Err(outbox_consumer::HandlerError::retry(format!(
                    "fails run {run}"
                ))),
            }
        }
    }
}

#[derive(Debug, Clone)]
struct ParkCase {
    events: Vec<KeyedPlan>,
    batch: bool,
    /// The order keys are released in, round after round.
    releases: Vec<u8>,
}

/// Under `ParkKey`, whatever fails how and whatever is released in which order: each key's
/// events take effect in offset order, each once, none before the key's first failure is
/// released, and nothing of another key waits for it.
async fn park_case(run: Arc<Run>, case: ParkCase) -> Result<()> {
    let db = &run.db;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS fuzz_park_effects (seq BIGINT GENERATED ALWAYS AS IDENTITY, \
         topic TEXT, key TEXT, event_id UUID, \"offset\" BIGINT)",
    )
    .execute(&db.pool)
    .await?;
    let (topic, name) = (unique("fuzz"), unique("c"));
    let ids: Vec<Uuid> = case.events.iter().map(|_| Uuid::now_v7()).collect();
    let messages: Vec<OwnedMessage> = (0..)
        .zip(case.events.iter().zip(&ids))
        .map(|(offset, (event, id))| {
            let rec = Rec {
                key: Some(format!("k{}", event.key).into_bytes()),
                headers: vec![("id".to_owned(), Some(id.to_string().into_bytes()))],
                payload: Some(serde_json::to_vec(event).expect("a plan serialises")),
            };
            message(&topic, offset, &rec)
        })
        .collect();
    let config = ConsumerConfig::new(&name)
        .max_attempts(HANDLER_ATTEMPTS)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .on_handler_failure(outbox_consumer::HandlerFailurePolicy::ParkKey);
    let consumer = DedupConsumer::new(db.pool.clone(), config, KeyedFuzzed::default())?;
    let outcomes = drive(&consumer, &messages, case.batch).await?;
    // Before any release: each key's events up to its first that fails for good are handled,
    // that one and the rest parked.
    let mut parked_keys = BTreeSet::new();
    for (i, (event, outcome)) in case.events.iter().zip(&outcomes).enumerate() {
        let parks = parked_keys.contains(&event.key) || !event.plan.handled();
        if parks {
            parked_keys.insert(event.key);
        }
        ensure!(
            parks == matches!(outcome, Outcome::Parked(_))
                && (parks || *outcome == Outcome::Processed),
            "offset {i} ({event:?}): outcome {outcome:?}, its key parked before: {parks}"
        );
    }
    // Releases, round after round, until no released key is parked (a plan fails at most
    // `HANDLER_ATTEMPTS + 1` runs; a rejection costs a release per run).
    let tables = outbox_core::TableNames::default();
    let shutdown = CancellationToken::new();
    let still_parked = |key: u8| {
        let (pool, name) = (db.pool.clone(), name.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_consumer_quarantine_parked_keys \
                 WHERE consumer = $1 AND message_key = $2",
            )
            .bind(&name)
            .bind(format!("k{key}").into_bytes())
            .fetch_one(&pool)
            .await?;
            anyhow::Ok(n > 0)
        }
    };
    for _ in 0..(case.events.len() * 6) {
        let mut any = false;
        for key in &case.releases {
            any |= still_parked(*key).await?;
        }
        if !any {
            break;
        }
        for key in &case.releases {
            let mut conn = db.pool.acquire().await?;
            outbox_consumer::parked::release(
                &mut conn,
                &tables,
                format!("k{key}").as_bytes(),
                Some(&name),
            )
            .await?;
            drop(conn);
            while tokio::time::timeout(STALL, consumer.replay_released(&topic, 0, &shutdown))
                .await
                .context("stall: replay_released")??
            {}
        }
    }
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_consumer_quarantine_parked WHERE consumer = $1",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await?;
    let released: BTreeSet<u8> = case.releases.iter().copied().collect();
    let effects: Vec<(String, Uuid, i64)> = sqlx::query_as(
        "SELECT key, event_id, \"offset\" FROM fuzz_park_effects WHERE topic = $1 ORDER BY seq",
    )
    .bind(&topic)
    .fetch_all(&db.pool)
    .await?;
    for key in 0..3_u8 {
        let name = format!("k{key}");
        let offsets: Vec<i64> = effects
            .iter()
            .filter(|(k, _, _)| *k == name)
            .map(|(_, _, o)| *o)
            .collect();
        let all: Vec<i64> = (0..)
            .zip(&case.events)
            .filter(|(_, e)| e.key == key)
            .map(|(o, _)| o)
            .collect();
        if !parked_keys.contains(&key) || released.contains(&key) {
            ensure!(
                offsets == all,
                "key {name}: effects at offsets {offsets:?} in commit order, expected each of \
                 {all:?} once, in order"
            );
        } else {
            ensure!(
                all.starts_with(&offsets),
                "key {name}, never released: effects {offsets:?}, a prefix of {all:?} expected"
            );
        }
    }
    let distinct: BTreeSet<Uuid> = effects.iter().map(|(_, id, _)| *id).collect();
    ensure!(
        distinct.len() == effects.len(),
        "an effect twice: {effects:?}"
    );
    let never: i64 = case
        .events
        .iter()
        .zip(0..)
        .filter(|(e, _)| parked_keys.contains(&e.key) && !released.contains(&e.key))
        .count()
        .try_into()?;
    let expected_left = never
        - i64::try_from(
            effects
                .iter()
                .filter(|(k, _, _)| {
                    parked_keys
                        .iter()
                        .any(|p| !released.contains(p) && *k == format!("k{p}"))
                })
                .count(),
        )?;
    ensure!(
        left == expected_left,
        "{left} records left parked, expected {expected_left} (of keys never released)"
    );
    Ok(())
}

#[test]
fn parked_keys_keep_each_keys_order_and_handle_each_event_once() -> Result<()> {
    let strategy = (
        proptest::collection::vec(keyed_plan(), 0..10),
        any::<bool>(),
        proptest::collection::vec(0..3_u8, 0..4),
    )
        .prop_map(|(events, batch, releases)| ParkCase {
            events,
            batch,
            releases,
        });
    fuzz(cases("OUTBOX_FUZZ_CASES", 100) / 4, strategy, park_case)
}
