use rdkafka::ClientConfig;

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
        .set("linger.ms", "0");
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
pub(crate) async fn broker_answers(
    producer: &rdkafka::producer::FutureProducer,
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

/// What a metadata request said about a topic whose record went unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TopicAnswer {
    /// No broker answered: the cluster is unreachable.
    NoAnswer,
    /// A broker answered and the topic is not there: the row names a missing topic.
    Missing,
    /// A broker answered and knows the topic: one of its partitions cannot take writes.
    Known,
}

/// Asks the cluster about `topic` within `timeout`, off the async runtime.
pub(crate) async fn topic_answer(
    producer: &rdkafka::producer::FutureProducer,
    topic: String,
    timeout: std::time::Duration,
) -> TopicAnswer {
    use rdkafka::error::RDKafkaErrorCode;
    use rdkafka::producer::Producer;
    let producer = producer.clone();
    tokio::task::spawn_blocking(move || {
        let Ok(metadata) = producer.client().fetch_metadata(Some(&topic), timeout) else {
            return TopicAnswer::NoAnswer;
        };
        match metadata.topics().iter().find(|t| t.name() == topic) {
            None => TopicAnswer::Missing,
            Some(t) => match t.error().map(RDKafkaErrorCode::from) {
                Some(
                    RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic,
                ) => TopicAnswer::Missing,
                _ => TopicAnswer::Known,
            },
        }
    })
    .await
    .unwrap_or(TopicAnswer::NoAnswer)
}
