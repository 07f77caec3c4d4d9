//! Plain rdkafka clients, independent of the framework: topic creation, the injector of
//! malformed records. The checker reads the topic back with `outbox_tests::read_all_from`.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

/// Creates `topic` with `replication` replicas (the broker does not auto-create topics),
/// retrying until the broker answers.
pub(crate) async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
    replication: usize,
) -> Result<()> {
    let replication = i32::try_from(replication)?;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = admin
            .create_topics(
                &[NewTopic::new(
                    topic,
                    partitions,
                    TopicReplication::Fixed(replication),
                )],
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
