use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use outbox_core::{EventId, wire};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use sqlx::types::Json;

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

/// One claimed outbox row.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct OutboxRow {
    pub(crate) seq: i64,
    pub(crate) id: EventId,
    pub(crate) aggregateid: String,
    #[sqlx(rename = "type")]
    pub(crate) event_type: String,
    pub(crate) payload: String,
    pub(crate) headers: Json<BTreeMap<String, String>>,
    pub(crate) topic: String,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) attempts: i32,
}

impl OutboxRow {
    /// The Kafka headers of this row under the wire contract.
    pub(crate) fn kafka_headers(&self) -> OwnedHeaders {
        let id = self.id.to_string();
        let contract = [
            (wire::HEADER_ID, id.as_str()),
            (wire::HEADER_TYPE, self.event_type.as_str()),
        ];
        contract
            .into_iter()
            .chain(self.headers.0.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .fold(
                OwnedHeaders::new_with_capacity(2 + self.headers.0.len()),
                |h, (key, value)| {
                    h.insert(Header {
                        key,
                        value: Some(value),
                    })
                },
            )
    }
}
