//! Plain rdkafka clients, independent of the framework: topic creation, the injector of
//! malformed records. The checker reads the topic back with `outbox_tests::read_all_from`.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

/// How a topic is created.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TopicSpec<'a> {
    pub(crate) partitions: i32,
    pub(crate) replication: usize,
    /// Topic configs (`max.message.bytes`, ...).
    pub(crate) configs: &'a [(&'a str, &'a str)],
}

/// Creates `topic` (the broker does not auto-create topics), retrying until the broker
/// answers. `fresh`: the topic was just deleted, and "already exists" means the deletion is
/// not complete yet (retried), not success.
pub(crate) async fn create_topic(
    brokers: &str,
    topic: &str,
    spec: TopicSpec<'_>,
    fresh: bool,
) -> Result<()> {
    let replication = i32::try_from(spec.replication)?;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut new = NewTopic::new(topic, spec.partitions, TopicReplication::Fixed(replication));
        for (key, value) in spec.configs {
            new = new.set(key, value);
        }
        let attempt = admin
            .create_topics(
                &[new],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await;
        let error = match attempt {
            Ok(results) => match results.into_iter().find_map(Result::err) {
                None => return Ok(()),
                Some((_, RDKafkaErrorCode::TopicAlreadyExists)) if !fresh => return Ok(()),
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

/// Sets `topic`'s configs to `configs`: every one it should have, since the broker replaces
/// the topic's whole set (the non-incremental AlterConfigs).
pub(crate) async fn set_topic_configs(
    brokers: &str,
    topic: &str,
    configs: &[(&str, &str)],
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let alter = configs.iter().fold(
        AlterConfig::new(ResourceSpecifier::Topic(topic)),
        |a, (k, v)| a.set(k, v),
    );
    // A node that just came back may not serve the request yet: asked again for a minute.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = admin
            .alter_configs(
                [&alter],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await;
        let error = match attempt {
            Ok(results) => match results.into_iter().find_map(Result::err) {
                None => return Ok(()),
                Some((_, code)) => format!("altering the configs of {topic}: {code}"),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            bail!("{error}");
        }
        tracing::info!(%error, "topic configs not altered yet; retrying");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Deletes `topic` and waits until no broker lists it any more.
pub(crate) async fn delete_topic(brokers: &str, topic: &str) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let results = admin
        .delete_topics(
            &[topic],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    if let Some((name, code)) = results.into_iter().find_map(Result::err) {
        bail!("deleting topic {name}: {code}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while topic_listed(brokers, topic).await? {
        if Instant::now() >= deadline {
            bail!("topic {topic} still listed 60 s after its deletion");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Whether the cluster's metadata lists `topic` (with partitions).
async fn topic_listed(brokers: &str, topic: &str) -> Result<bool> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let metadata = client.fetch_metadata(None, Duration::from_secs(10))?;
        Ok(metadata
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    })
    .await?
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
