//! Plain rdkafka clients, independent of the framework: topic creation, the injector of
//! malformed records, and the checker's read-back of the whole topic.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Header of the end markers [`read_all`] appends (never returned, never consumed: the
/// consumers are stopped before the read-back).
const SENTINEL_HEADER: &str = "outbox-chaos-sentinel";

/// Creates `topic` (tansu does not auto-create), retrying until the broker answers.
pub(crate) async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await;
        let error = match attempt {
            Ok(results) => match results.into_iter().find_map(Result::err) {
                None | Some((_, RDKafkaErrorCode::TopicAlreadyExists)) => return Ok(()),
                Some((name, code)) => format!("creating topic {name}: {code}"),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            bail!("{error}");
        }
        tracing::debug!(%error, "topic not created yet; retrying");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A plain producer (not the relay's): for malformed records and end markers.
pub(crate) fn plain_producer(brokers: &str) -> Result<FutureProducer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "30000")
        .create()?)
}

/// Produces one raw record to `partition`; returns its offset.
pub(crate) async fn produce_raw(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    key: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> Result<i64> {
    let mut owned = OwnedHeaders::new();
    for (k, v) in headers {
        owned = owned.insert(Header {
            key: k,
            value: Some(*v),
        });
    }
    let record = FutureRecord::to(topic)
        .partition(partition)
        .key(key)
        .payload(payload)
        .headers(owned);
    let delivery = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)?;
    Ok(delivery.offset)
}

/// One record read back.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) key: String,
    pub(crate) headers: BTreeMap<String, String>,
}

/// Reads everything in `topic` as of now, duplicates included, in offset order per
/// partition. tansu's high watermark lags, so instead of trusting it this appends a marker
/// to every partition and reads until each marker has come back.
pub(crate) async fn read_all(
    brokers: &str,
    topic: &str,
    partitions: i32,
    timeout: Duration,
) -> Result<Vec<Record>> {
    let token = uuid::Uuid::new_v4().to_string();
    let producer = plain_producer(brokers)?;
    for p in 0..partitions {
        produce_raw(&producer, topic, p, "", b"", &[(SENTINEL_HEADER, &token)]).await?;
    }
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("chaos-reader-{token}"))
        .set("enable.auto.commit", "false")
        .create()?;
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + timeout;
        let mut open: HashSet<i32> = (0..partitions).collect();
        let mut records = Vec::new();
        while !open.is_empty() {
            if Instant::now() >= deadline {
                bail!("timed out reading {topic}: partitions {open:?} not read to the end");
            }
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = message?;
            let text =
                |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
            let headers: BTreeMap<String, String> = message
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| (h.key.to_owned(), text(h.value)))
                        .collect()
                })
                .unwrap_or_default();
            match headers.get(SENTINEL_HEADER) {
                Some(t) if *t == token => {
                    open.remove(&message.partition());
                }
                Some(_) => {}
                None => records.push(Record {
                    partition: message.partition(),
                    offset: message.offset(),
                    key: text(message.key()),
                    headers,
                }),
            }
        }
        Ok(records)
    })
    .await?
}
