//! Debezium interoperability, against the real Kafka Connect worker with Debezium's Postgres
//! connector and Outbox Event Router (settings: `outbox_tests::outbox_connector_config`).
//! Each test runs its own connector, replication slot and publication on its own schema and
//! topics, and removes them at the end, failed or not.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use outbox_consumer::{Event, consumer_config, dedup_consume};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{
    OutboxConnector, PayloadMode, TestDb, create_topic, eventually, kafka_bootstrap, unique,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// One record as the broker holds it, bytes untouched.
#[derive(Debug, Clone)]
struct Raw {
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    fn header_names(&self) -> BTreeSet<&str> {
        self.headers.iter().map(|(n, _)| n.as_str()).collect()
    }
}

fn kafka_client(group: &str) -> Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?)
}

/// Records in `topic` by its high watermarks (nothing deleted: the sum is the record count).
async fn record_count(topic: &str, partitions: i32) -> Result<i64> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let client = kafka_client(&unique("count"))?;
        let mut total = 0;
        for p in 0..partitions {
            let (low, high) = client.fetch_watermarks(&topic, p, Duration::from_secs(10))?;
            total += high - low;
        }
        Ok(total)
    })
    .await?
}

/// Every record of `topic`, once no producer writes to it any more: reads each partition up
/// to its high watermark.
async fn read_raw(topic: &str, partitions: i32) -> Result<Vec<Raw>> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let client = kafka_client(&unique("raw"))?;
        let mut assignment = TopicPartitionList::new();
        let mut remaining = HashMap::new();
        for p in 0..partitions {
            let (_, high) = client.fetch_watermarks(&topic, p, Duration::from_secs(10))?;
            if high > 0 {
                assignment.add_partition_offset(&topic, p, Offset::Beginning)?;
                remaining.insert(p, high);
            }
        }
        client.assign(&assignment)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut records = Vec::new();
        while !remaining.is_empty() {
            if std::time::Instant::now() >= deadline {
                bail!("timed out reading {topic}: {remaining:?} left");
            }
            let Some(message) = client.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = message?;
            let headers = m
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                        .collect()
                })
                .unwrap_or_default();
            records.push(Raw {
                partition: m.partition(),
                offset: m.offset(),
                key: m.key().map(<[u8]>::to_vec),
                value: m.payload().map(<[u8]>::to_vec),
                headers,
            });
            if remaining
                .get(&m.partition())
                .is_some_and(|h| m.offset() + 1 >= *h)
            {
                remaining.remove(&m.partition());
            }
        }
        Ok(records)
    })
    .await?
}

/// The outbox rows as written: id -> (aggregateid, type, payload, application headers).
type Rows = HashMap<Uuid, (String, String, Value, Value)>;

async fn outbox_rows(db: &TestDb) -> Result<Rows> {
    let rows: Vec<(Uuid, String, String, Value, Value)> =
        sqlx::query_as("SELECT id, aggregateid, type, payload, headers FROM outbox_events")
            .fetch_all(&db.pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(id, key, ty, payload, headers)| (id, (key, ty, payload, headers)))
        .collect())
}

/// Removes the connector, its slot and its publication, then returns the test's outcome
/// (a panic removes them in `Drop`).
async fn finish(mut connector: OutboxConnector, outcome: Result<()>) -> Result<()> {
    let cleaned = connector.stop().await;
    outcome?;
    cleaned.context("removing the connector, its slot and its publication")
}

/// Effects of the consumer under test: one row per handler call, in handling order.
async fn effects_table(db: &TestDb) -> Result<()> {
    sqlx::query(
        "CREATE TABLE effects (seq BIGSERIAL, event_id UUID, key TEXT, n BIGINT, payload JSONB)",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// Spawns an unchanged `dedup_consume` on `topic` whose handler records each effect.
fn spawn_consumer(
    db: &TestDb,
    topic: &str,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>> {
    let (pool, shutdown, topic) = (db.pool.clone(), shutdown.clone(), topic.to_owned());
    tokio::spawn(async move {
        let kafka = consumer_config(&kafka_bootstrap(), &unique("g"));
        async fn record(event: &Event<Value>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
            sqlx::query("INSERT INTO effects (event_id, key, n, payload) VALUES ($1, $2, $3, $4)")
                .bind(event.id)
                .bind(&event.key)
                .bind(event.payload["n"].as_i64())
                .bind(&event.payload)
                .execute(conn)
                .await?;
            Ok(())
        }
        dedup_consume(&kafka, pool, record)
            .topics([topic])
            .run(shutdown)
            .await
    })
}

async fn count(db: &TestDb, sql: &'static str) -> Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(&db.pool).await?)
}

/// Asserts: one effect per outbox row, with the row's id, key and payload, and per key in
/// `n` order without gaps.
async fn assert_effects_once_in_order(db: &TestDb, total: i64) -> Result<()> {
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT event_id) FROM effects")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!((effects, distinct), (total, total), "one effect per event");
    let matching = count(
        db,
        "SELECT count(*) FROM effects e JOIN outbox_events o ON o.id = e.event_id \
         WHERE o.aggregateid = e.key AND o.payload = e.payload",
    )
    .await?;
    assert_eq!(
        matching, total,
        "every effect has its row's id, key and payload"
    );
    let out_of_order: Vec<(String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT key, n, prev FROM (SELECT key, n, lag(n) OVER (PARTITION BY key ORDER BY seq) AS prev \
         FROM effects) e WHERE n <> coalesce(prev + 1, 0)",
    )
    .fetch_all(&db.pool)
    .await?;
    assert!(
        out_of_order.is_empty(),
        "effects out of key order (key, n, previous n): {out_of_order:?}"
    );
    let untyped = count(db, "SELECT count(*) FROM effects WHERE n IS NULL").await?;
    assert_eq!(untyped, 0, "payloads without their `n`");
    let quarantined = count(db, "SELECT count(*) FROM outbox_consumer_quarantine").await?;
    assert_eq!(quarantined, 0, "the consumer quarantined Debezium records");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn debezium_records_are_handled_once_each_in_key_order_by_dedup_consume() -> Result<()> {
    const KEYS: i64 = 16;
    const ROUNDS: i64 = 8;
    const PARTITIONS: i32 = 6;
    // Per round and key: one event in a transaction of its own, one in a transaction with
    // every key's, two in one `enqueue_all` statement with every key's.
    const PER_ROUND: i64 = 4;
    let total = KEYS * ROUNDS * PER_ROUND;
    let db = TestDb::new().await?;
    let topic = unique("outbox.test.dbz");
    create_topic(&topic, PARTITIONS).await?;
    effects_table(&db).await?;

    let connector = OutboxConnector::start(&db, PayloadMode::Text).await?;
    let outcome = async {
            let shutdown = CancellationToken::new();
            let consuming = spawn_consumer(&db, &topic, &shutdown);
            let (half_tx, half_rx) = tokio::sync::oneshot::channel();
            let writing = tokio::spawn({
                let (pool, topic) = (db.pool.clone(), topic.clone());
                async move {
                    let mut next = vec![0_i64; KEYS as usize];
                    let mut event = |k: i64| -> Result<NewEvent> {
                        let n = next[k as usize];
                        next[k as usize] += 1;
                        Ok(NewEvent::new(
                            "agent",
                            format!("agent-{k}"),
                            "Step",
                            &json!({ "n": n, "round": n / PER_ROUND, "text": format!("step {n} of agent-{k}") }),
                        )?
                        .with_topic(&topic)?)
                    };
                    let mut half = Some(half_tx);
                    for round in 0..ROUNDS {
                        for k in 0..KEYS {
                            let mut tx = pool.begin().await?;
                            outbox_producer::enqueue(&mut tx, &event(k)?).await?;
                            tx.commit().await?;
                        }
                        let mut tx = pool.begin().await?;
                        for k in 0..KEYS {
                            outbox_producer::enqueue(&mut tx, &event(k)?).await?;
                        }
                        tx.commit().await?;
                        let mut batch = Vec::new();
                        for k in 0..KEYS {
                            batch.push(event(k)?);
                            batch.push(event(k)?);
                        }
                        let mut tx = pool.begin().await?;
                        outbox_producer::enqueue_all(&mut tx, &batch).await?;
                        tx.commit().await?;
                        if round == ROUNDS / 2 - 1
                            && let Some(half) = half.take()
                        {
                            let _ = half.send(());
                        }
                    }
                    anyhow::Ok(())
                }
            });
            // Halfway, while rows keep coming, Debezium restarts from its committed offset,
            // just after a batch of rows sharing one transaction. (Each row of an
            // `enqueue_all` statement has an LSN of its own, as test_decoding shows; the
            // first shares it with BEGIN and the previous COMMIT: the resume-position cases
            // of debezium DBZ-5915/DBZ-6204. Rows sharing one LSN, debezium #7531, come from
            // COPY, which `enqueue_all` does not use.)
            half_rx.await.context("the writer stopped early")?;
            connector.restart().await?;
            writing.await??;
            assert_eq!(count(&db, "SELECT count(*) FROM outbox_events").await?, total);

            eventually("every event has its effect", Duration::from_secs(120), || async {
                Ok(count(&db, "SELECT count(*) FROM effects").await? >= total)
            })
            .await?;
            shutdown.cancel();
            consuming.await??;
            assert_effects_once_in_order(&db, total).await?;
            let delivered = record_count(&topic, PARTITIONS).await?;
            assert!(delivered >= total, "Debezium published {delivered} of {total} rows");
            println!("debezium published {delivered} records for {total} rows (restart included)");
            // Debezium does not mark rows: they stay pending for a relay.
            assert_eq!(outbox_tests::count_status(&db.pool, "pending").await?, total);
            Ok(())
        }
    .await;
    finish(connector, outcome).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_and_debezium_publish_identical_records_to_the_same_partition() -> Result<()> {
    relay_and_debezium_agree(PayloadMode::Text).await
}

/// With `table.expand.json.payload=true` and `JsonConverter`, values agree as JSON but for
/// two differences: object members that are `null` are dropped, and a payload the router
/// cannot give a Connect schema (here: an array mixing strings and booleans) is sent as a JSON
/// string holding the payload's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expanded_json_payloads_agree_as_json_except_untypable_ones() -> Result<()> {
    relay_and_debezium_agree(PayloadMode::Expanded).await
}

/// `value` with its object members whose value is `null` removed, at any depth: what the
/// expanded payload keeps.
fn without_null_members(value: &Value) -> Value {
    match value {
        Value::Object(members) => Value::Object(
            members
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_null_members(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_null_members).collect()),
        other => other.clone(),
    }
}

/// Every 10th key's payloads hold an array mixing types.
fn untypable(k: usize) -> bool {
    k % 10 == 3
}

/// Rows written once, published by Debezium to their topic, then by the relay to the same
/// topic: every id appears twice, Debezium's copy first, and both copies agree on partition,
/// key bytes, value, the `id` header bytes and the `type` header.
async fn relay_and_debezium_agree(mode: PayloadMode) -> Result<()> {
    const KEYS: usize = 60;
    const PARTITIONS: i32 = 6;
    let db = TestDb::new().await?;
    // The default topic, `outbox.event.<aggregatetype>`, reaches both through the row's
    // `topic` column.
    let aggregate_type = unique("order");
    let topic = outbox_core::wire::default_topic(&aggregate_type);
    create_topic(&topic, PARTITIONS).await?;
    let payload = |k: usize, n: usize| {
        json!({
            "n": n,
            "key": format!("ключ-{k}"),
            "amount": { "cents": 1200 + k, "ratio": 0.1, "neg": -3, "big": 12_345_678_901_234_i64 },
            "tags": ["a", "\"quoted\" \\ back", "é✓"],
            "nested": [{ "a": 1, "b": [1, 2] }, { "a": 2, "b": [] }],
            "empty": {},
            "none": null,
            "flag": true,
            "mixed": if untypable(k) { json!(["a", true, null]) } else { json!(["b"]) },
        })
    };
    let key = |k: usize| format!("order-{k}-{}", k * 7919);

    let connector = OutboxConnector::start(&db, mode).await?;
    let outcome = async {
            // Per key: one event alone, one in an `enqueue_all` batch of 20 events (rows of
            // one statement), one in a transaction with several keys.
            let mut tx = db.pool.begin().await?;
            let mut one = NewEvent::new(&aggregate_type, key(0), "OrderPlaced", &payload(0, 0))?;
            one = one.with_header("tenant", "acme")?;
            outbox_producer::enqueue(&mut tx, &one).await?;
            tx.commit().await?;
            for k in 1..KEYS {
                let mut tx = db.pool.begin().await?;
                let event = NewEvent::new(&aggregate_type, key(k), "OrderPlaced", &payload(k, 0))?;
                outbox_producer::enqueue(&mut tx, &event).await?;
                tx.commit().await?;
            }
            for chunk in (0..KEYS).collect::<Vec<_>>().chunks(20) {
                let batch = chunk
                    .iter()
                    .map(|&k| NewEvent::new(&aggregate_type, key(k), "OrderPriced", &payload(k, 1)))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut tx = db.pool.begin().await?;
                outbox_producer::enqueue_all(&mut tx, &batch).await?;
                tx.commit().await?;
            }
            for chunk in (0..KEYS).collect::<Vec<_>>().chunks(7) {
                let mut tx = db.pool.begin().await?;
                for &k in chunk {
                    let event =
                        NewEvent::new(&aggregate_type, key(k), "OrderShipped", &payload(k, 2))?;
                    outbox_producer::enqueue(&mut tx, &event).await?;
                }
                tx.commit().await?;
            }
            let rows = outbox_rows(&db).await?;
            let total = rows.len() as i64;
            assert_eq!(total, 3 * KEYS as i64);

            // Debezium first: all its records are in before the relay sends any.
            eventually("Debezium published every row", Duration::from_secs(90), || async {
                Ok(record_count(&topic, PARTITIONS).await? >= total)
            })
            .await?;
            let relay = Relay::new(
                db.pool.clone(),
                &producer_config(&kafka_bootstrap()),
                RelayConfig::default().batch_size(50),
            )?;
            while relay.run_once().await?.claimed > 0 {}
            assert_eq!(outbox_tests::count_status(&db.pool, "published").await?, total);
            // The relay's marks are UPDATEs, which the router skips: a row written after them
            // (published by Debezium only) shows Debezium has read past them.
            let marker = NewEvent::new(&aggregate_type, "marker", "Marker", &json!({}))?;
            let mut tx = db.pool.begin().await?;
            let marker_id = outbox_producer::enqueue(&mut tx, &marker).await?;
            tx.commit().await?;
            eventually("Debezium published the marker", Duration::from_secs(60), || async {
                Ok(record_count(&topic, PARTITIONS).await? > 2 * total)
            })
            .await?;

            let records = read_raw(&topic, PARTITIONS).await?;
            assert_eq!(
                records.len() as i64,
                2 * total + 1,
                "each row once from each producer, the marker once, nothing for the UPDATEs"
            );
            let mut by_id: BTreeMap<Uuid, Vec<Raw>> = BTreeMap::new();
            for record in records {
                let id = std::str::from_utf8(record.header("id").context("no id header")?)?;
                by_id.entry(id.parse()?).or_default().push(record);
            }
            assert_eq!(by_id.remove(marker_id.as_uuid()).map(|r| r.len()), Some(1));
            let (mut same_value_bytes, mut as_string, mut partitions_used, mut keys) =
                (0, 0, BTreeSet::new(), BTreeSet::new());
            for (id, mut copies) in by_id {
                let (key, ty, payload, app_headers) =
                    rows.get(&id).with_context(|| format!("record for unknown id {id}"))?;
                assert_eq!(copies.len(), 2, "event {id}: {copies:?}");
                copies.sort_by_key(|r| r.offset);
                let (dbz, relay) = (&copies[0], &copies[1]);
                assert_eq!(
                    dbz.partition, relay.partition,
                    "event {id} of key {key:?}: Debezium and the relay chose different partitions"
                );
                partitions_used.insert(dbz.partition);
                keys.insert(key.clone());
                for (who, r) in [("debezium", dbz), ("relay", relay)] {
                    assert_eq!(r.key.as_deref(), Some(key.as_bytes()), "{who} key of {id}");
                    let mut value: Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default())
                        .with_context(|| format!("{who} value of {id} is not JSON"))?;
                    let k: usize = key.split('-').nth(1).unwrap_or_default().parse()?;
                    if who == "debezium" && mode == PayloadMode::Expanded && untypable(k) {
                        let text = value.as_str().with_context(|| format!("{id}: expected Debezium's string fallback, got {value}"))?;
                        value = serde_json::from_str(text)?;
                        as_string += 1;
                        assert_eq!(&value, payload, "{who} value of {id}");
                    } else if who == "debezium" && mode == PayloadMode::Expanded {
                        assert_eq!(value, without_null_members(payload), "{who} value of {id}");
                    } else {
                        assert_eq!(&value, payload, "{who} value of {id}");
                    }
                    assert_eq!(r.header("id"), Some(id.to_string().as_bytes()), "{who} id header");
                    assert_eq!(r.header("type"), Some(ty.as_bytes()), "{who} type header");
                }
                assert_eq!(dbz.header_names(), BTreeSet::from(["id", "type"]), "Debezium's headers of {id}");
                // Application headers travel with the relay only: the router has no way to
                // spread the `headers` column into Kafka headers.
                let mut relay_names = BTreeSet::from(["id", "type"]);
                relay_names.extend(app_headers.as_object().into_iter().flatten().map(|(k, _)| k.as_str()));
                assert_eq!(relay.header_names(), relay_names, "relay's headers of {id}");
                if dbz.value == relay.value {
                    same_value_bytes += 1;
                } else if mode == PayloadMode::Text {
                    bail!(
                        "event {id}: Debezium's value {:?} is not the relay's {:?}",
                        String::from_utf8_lossy(dbz.value.as_deref().unwrap_or_default()),
                        String::from_utf8_lossy(relay.value.as_deref().unwrap_or_default())
                    );
                }
            }
            assert!(keys.len() >= 50, "{} keys", keys.len());
            assert_eq!(partitions_used.len(), PARTITIONS as usize, "keys spread over every partition");
            if mode == PayloadMode::Expanded {
                let expected = rows.values().filter(|(key, ..)| key.split('-').nth(1).and_then(|k| k.parse().ok()).is_some_and(untypable)).count();
                assert_eq!(as_string, expected, "payloads sent as strings");
            }
            println!(
                "{mode:?}: {total} events, {} keys, {} partitions: partition, key, id and type agree; values equal as JSON, {same_value_bytes} of {total} byte for byte, {as_string} sent by Debezium as a JSON string",
                keys.len(),
                partitions_used.len()
            );
            Ok(())
        }
    .await;
    finish(connector, outcome).await
}

/// Relays running `run`, and the token that stops them.
type Relays = (
    CancellationToken,
    Vec<tokio::task::JoinHandle<Result<(), outbox_producer::ProducerError>>>,
);

/// Relays running `run` until their token is cancelled.
fn spawn_relays(db: &TestDb, count: usize) -> Result<Relays> {
    let stop = CancellationToken::new();
    let mut handles = Vec::new();
    for _ in 0..count {
        let relay = Relay::new(
            db.pool.clone(),
            &producer_config(&kafka_bootstrap()),
            RelayConfig::default().batch_size(100),
        )?;
        let stop = stop.clone();
        handles.push(tokio::spawn(async move { relay.run(stop).await }));
    }
    Ok((stop, handles))
}

async fn stop_relays((stop, handles): Relays) -> Result<()> {
    stop.cancel();
    for handle in handles {
        handle.await??;
    }
    Ok(())
}

/// Enqueues until `stop`: one event per transaction, and every tenth transaction an
/// `enqueue_all` batch of two events for each of five keys. Returns the events written.
async fn write_until(
    pool: sqlx::PgPool,
    topic: String,
    keys: i64,
    stop: CancellationToken,
) -> Result<i64> {
    let mut next = vec![0_i64; keys as usize];
    let mut event = |k: i64| -> Result<NewEvent> {
        let n = next[k as usize];
        next[k as usize] += 1;
        Ok(
            NewEvent::new("agent", format!("agent-{k}"), "Step", &json!({ "n": n }))?
                .with_topic(&topic)?,
        )
    };
    let (mut i, mut written) = (0_i64, 0_i64);
    while !stop.is_cancelled() {
        i += 1;
        let mut tx = pool.begin().await?;
        if i % 10 == 0 {
            let mut batch = Vec::new();
            for j in 0..5 {
                let k = (i + j) % keys;
                batch.push(event(k)?);
                batch.push(event(k)?);
            }
            written += outbox_producer::enqueue_all(&mut tx, &batch).await?.len() as i64;
        } else {
            outbox_producer::enqueue(&mut tx, &event(i % keys)?).await?;
            written += 1;
        }
        tx.commit().await?;
        // Pacing, a few hundred events a second: a steady load, not a flood.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(written)
}

/// The switch to CDC and back while a producer keeps writing and a `dedup_consume`
/// consumer keeps handling:
/// 1. relays run;
/// 2. the connector's slot is created, the relays publish every row committed before it,
///    the connector starts on that slot (so Debezium publishes only rows committed after
///    it), then the relays stop;
/// 3. Debezium alone publishes;
/// 4. the connector is deleted, the relays start again and republish every row Debezium
///    published (still `pending` for them).
///
/// Nothing is lost, every duplicate is absorbed, and each key's effects stay in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switching_from_relays_to_debezium_and_back_under_load_keeps_every_event_once_in_order()
-> Result<()> {
    const KEYS: i64 = 20;
    const PARTITIONS: i32 = 6;
    const STEP: i64 = 200;
    let db = TestDb::with_pool_size(16).await?;
    let topic = unique("outbox.test.switch");
    create_topic(&topic, PARTITIONS).await?;
    effects_table(&db).await?;
    let effects = || count(&db, "SELECT count(*) FROM effects");
    let rows = || count(&db, "SELECT count(*) FROM outbox_events");

    let shutdown = CancellationToken::new();
    let consuming = spawn_consumer(&db, &topic, &shutdown);
    let stop_writing = CancellationToken::new();
    let writing = tokio::spawn(write_until(
        db.pool.clone(),
        topic.clone(),
        KEYS,
        stop_writing.clone(),
    ));
    let mut connector = OutboxConnector::new(&db, PayloadMode::Text);
    let outcome = async {
        let relays = spawn_relays(&db, 2)?;
        eventually("relays carry events", Duration::from_secs(60), || async {
            Ok(effects().await? >= STEP)
        })
        .await?;

        // Relays -> Debezium.
        connector.create_slot(&db.schema).await?;
        let backlog: Vec<i64> =
            sqlx::query_scalar("SELECT seq FROM outbox_events WHERE status = 'pending'")
                .fetch_all(&db.pool)
                .await?;
        eventually(
            "the relays published every row committed before the slot",
            Duration::from_secs(60),
            || async {
                let left: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox_events WHERE seq = ANY($1) AND status = 'pending'",
                )
                .bind(&backlog)
                .fetch_one(&db.pool)
                .await?;
                Ok(left == 0)
            },
        )
        .await?;
        connector.launch().await?;
        stop_relays(relays).await?;
        let switched = rows().await?;
        println!(
            "relays -> Debezium at {switched} rows ({} pending before the slot)",
            backlog.len()
        );

        // Debezium alone.
        eventually(
            "Debezium alone carries events",
            Duration::from_secs(90),
            || async { Ok(effects().await? >= switched + STEP) },
        )
        .await?;
        let pending = outbox_tests::count_status(&db.pool, "pending").await?;
        assert!(
            pending >= STEP,
            "Debezium does not mark rows ({pending} pending)"
        );

        // Debezium -> relays.
        connector.stop().await?;
        let relays = spawn_relays(&db, 2)?;
        let back = rows().await?;
        println!("Debezium -> relays at {back} rows, {pending}+ rows pending to republish");
        eventually(
            "relays carry events again",
            Duration::from_secs(90),
            || async { Ok(effects().await? >= back + STEP) },
        )
        .await?;

        stop_writing.cancel();
        let total = writing.await??;
        assert_eq!(rows().await?, total);
        eventually(
            "the outbox drained and every event took effect",
            Duration::from_secs(120),
            || async {
                Ok(outbox_tests::count_status(&db.pool, "pending").await? == 0
                    && effects().await? >= total)
            },
        )
        .await?;
        stop_relays(relays).await?;
        shutdown.cancel();
        assert_effects_once_in_order(&db, total).await?;
        let delivered = record_count(&topic, PARTITIONS).await?;
        assert!(
            delivered > total,
            "the switches delivered duplicates ({delivered} records for {total} events)"
        );
        println!(
            "{total} events, {delivered} records delivered, {} duplicates absorbed",
            delivered - total
        );
        Ok(())
    }
    .await;
    stop_writing.cancel();
    shutdown.cancel();
    let consumed = consuming.await;
    finish(connector, outcome).await?;
    consumed??;
    Ok(())
}

/// Why the switch waits for the relays to publish what committed before the slot: started
/// while a relay still holds an older row of a key, Debezium publishes the key's newer row
/// first, and the consumer handles the two out of order (the relay's copy of the newer row
/// comes later and is a duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn debezium_started_before_a_lagging_relay_catches_up_overtakes_its_backlog() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = unique("outbox.test.overtake");
    create_topic(&topic, 3).await?;
    effects_table(&db).await?;
    let enqueue = |n: i64| {
        let (pool, topic) = (db.pool.clone(), topic.clone());
        async move {
            let event = NewEvent::new("agent", "agent-1", "Step", &json!({ "n": n }))?
                .with_topic(&topic)?;
            let mut tx = pool.begin().await?;
            outbox_producer::enqueue(&mut tx, &event).await?;
            tx.commit().await?;
            anyhow::Ok(())
        }
    };
    let shutdown = CancellationToken::new();
    let consuming = spawn_consumer(&db, &topic, &shutdown);
    // Row 0 commits while the relay lags (here: does not run).
    enqueue(0).await?;
    let connector = OutboxConnector::start(&db, PayloadMode::Text).await?;
    let outcome = async {
        enqueue(1).await?;
        eventually(
            "Debezium's row 1 took effect",
            Duration::from_secs(60),
            || async { Ok(count(&db, "SELECT count(*) FROM effects").await? >= 1) },
        )
        .await?;
        let relay = Relay::new(
            db.pool.clone(),
            &producer_config(&kafka_bootstrap()),
            RelayConfig::default(),
        )?;
        while relay.run_once().await?.claimed > 0 {}
        eventually(
            "the relay's row 0 took effect",
            Duration::from_secs(60),
            || async { Ok(count(&db, "SELECT count(*) FROM effects").await? >= 2) },
        )
        .await?;
        shutdown.cancel();
        let order: Vec<i64> = sqlx::query_scalar("SELECT n FROM effects ORDER BY seq")
            .fetch_all(&db.pool)
            .await?;
        assert_eq!(
            order,
            vec![1, 0],
            "row 1 (Debezium) was handled before row 0 (relay)"
        );
        Ok(())
    }
    .await;
    shutdown.cancel();
    let consumed = consuming.await;
    finish(connector, outcome).await?;
    consumed??;
    Ok(())
}
