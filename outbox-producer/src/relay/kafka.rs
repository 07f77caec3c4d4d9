use std::collections::HashMap;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::failure::{FailureKind, classify};

/// Settings the relay's at-least-once, in-order promise rests on. They are applied on top of
/// whatever the caller configured, since the relay's guarantees are false without them.
const REQUIRED: &[(&str, &str)] = &[
    // Retries inside librdkafka keep per-partition order and never duplicate.
    ("enable.idempotence", "true"),
    ("acks", "all"),
    // Java's partitioner (murmur2 of the key bytes), which Debezium, Kafka Connect and every
    // Java producer use. librdkafka's default (`consistent_random`, CRC32) puts a key on
    // another partition than a Java client would, so after a switch between the relay and
    // Debezium a key's events would sit on two partitions and per-key order would break.
    ("partitioner", "murmur2_random"),
];

/// A producer configuration for `bootstrap_servers` with the relay's required settings and
/// a delivery timeout short enough that a dead broker surfaces as a retryable failure.
pub fn producer_config(bootstrap_servers: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap_servers)
        .set("message.timeout.ms", "30000")
        .set("linger.ms", "0")
        // librdkafka's default since 1.x, pinned: a produce request written while the one
        // before it is unacknowledged must not wait for the broker's delayed ACK (the relay
        // batches itself).
        .set("socket.nagle.disable", "true");
    enforce_required(&mut config);
    config
}

pub(crate) fn enforce_required(config: &mut ClientConfig) {
    for (key, value) in REQUIRED {
        if config.get(key).is_some_and(|v| v != *value) {
            tracing::warn!(key, value, "overriding producer setting the relay requires");
        }
        config.set(*key, *value);
    }
}

/// Whether a broker answers a metadata request within `timeout` (for `topic`, or for all
/// topics): tells a record's own failure from an unreachable cluster. Off the async runtime,
/// since librdkafka blocks.
pub(crate) async fn broker_answers<C: rdkafka::client::ClientContext + 'static>(
    producer: &rdkafka::producer::FutureProducer<C>,
    topic: Option<String>,
    timeout: std::time::Duration,
) -> bool {
    use rdkafka::producer::Producer;
    let producer = producer.clone();
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(topic.as_deref(), timeout)
            .is_ok()
    })
    .await
    .unwrap_or(false)
}

/// What a metadata request said about a topic whose record failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TopicAnswer {
    /// No broker answered: the cluster is unreachable.
    NoAnswer,
    /// A broker answered and knows the topic (with no error, or a leader or in-sync replica
    /// error): a failure on it is an outage of its partition. With its partition count.
    Known(i32),
    /// A broker answered with this error for the topic (not there, not authorized, invalid):
    /// the row's failure.
    Refused(RDKafkaErrorCode),
}

/// Asks the cluster about `topics` in one metadata request (for the one topic, or for all
/// when there are several) within `timeout`, off the async runtime. A topic missing from the
/// answer is [`RDKafkaErrorCode::UnknownTopicOrPartition`] (a broker leaves topics a client may
/// not describe out of an answer about all topics).
pub(crate) async fn ask_about<C: rdkafka::client::ClientContext + 'static>(
    producer: &rdkafka::producer::FutureProducer<C>,
    topics: Vec<String>,
    timeout: std::time::Duration,
) -> HashMap<String, TopicAnswer> {
    use rdkafka::producer::Producer;
    let producer = producer.clone();
    let no_answer = |topics: &[String]| {
        topics
            .iter()
            .map(|t| (t.clone(), TopicAnswer::NoAnswer))
            .collect()
    };
    let asked = topics.clone();
    tokio::task::spawn_blocking(move || {
        let one = match topics.as_slice() {
            [topic] => Some(topic.as_str()),
            _ => None,
        };
        let Ok(metadata) = producer.client().fetch_metadata(one, timeout) else {
            return no_answer(&topics);
        };
        topics
            .iter()
            .map(|topic| {
                let answer = match metadata.topics().iter().find(|t| t.name() == topic) {
                    None => TopicAnswer::Refused(RDKafkaErrorCode::UnknownTopicOrPartition),
                    Some(t) => {
                        topic_answer(t.error().map(RDKafkaErrorCode::from), partition_count(t))
                    }
                };
                (topic.clone(), answer)
            })
            .collect()
    })
    .await
    .unwrap_or_else(|_| no_answer(&asked))
}

/// What a topic's metadata `error` means for a record of it that went unanswered. Only no
/// error, or a leader or in-sync replica error, make it an outage of the record's partition;
/// any other error (not authorized, invalid, missing) is the row's own failure.
fn topic_answer(error: Option<RDKafkaErrorCode>, partitions: i32) -> TopicAnswer {
    match error {
        None => TopicAnswer::Known(partitions),
        Some(code) if classify(&KafkaError::MessageProduction(code)) == FailureKind::Outage => {
            TopicAnswer::Known(partitions)
        }
        Some(code) => TopicAnswer::Refused(code),
    }
}

fn partition_count(topic: &rdkafka::metadata::MetadataTopic) -> i32 {
    i32::try_from(topic.partitions().len()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_leader_and_replica_errors_make_an_outage() {
        use RDKafkaErrorCode as C;
        assert_eq!(topic_answer(None, 3), TopicAnswer::Known(3));
        assert_eq!(
            topic_answer(Some(C::LeaderNotAvailable), 3),
            TopicAnswer::Known(3)
        );
        for code in [
            C::TopicAuthorizationFailed,
            C::InvalidTopic,
            C::UnknownTopicOrPartition,
        ] {
            assert_eq!(topic_answer(Some(code), 3), TopicAnswer::Refused(code));
        }
    }
}
