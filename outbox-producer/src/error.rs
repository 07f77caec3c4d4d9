use rdkafka::error::KafkaError;
use thiserror::Error;

/// Errors of the producer side.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProducerError {
    /// Invalid configuration, table name or event.
    #[error(transparent)]
    Core(#[from] outbox_core::CoreError),
    /// A database error; the caller's transaction should be rolled back.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The Kafka client could not be created or used.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The producer hit a fatal error (for an idempotent producer: its sequence or epoch was
    /// lost, so it can no longer guarantee order or no duplicates). Nothing was recorded for
    /// the batch: its rows stay pending with their attempt counts. Build a new relay.
    #[error("fatal producer error ({code:?}): {reason}")]
    FatalProducer {
        /// librdkafka's error code.
        code: rdkafka::types::RDKafkaErrorCode,
        /// librdkafka's description.
        reason: String,
    },
    /// A value stored in the outbox table cannot be read back: another writer's JSONB that
    /// serde_json refuses (a number outside `f64`, nesting deeper than 127 levels). Only the
    /// one row is concerned.
    #[error("unreadable stored value: {0}")]
    Unreadable(String),
    /// The relay configuration is not usable.
    #[error("invalid relay configuration: {0}")]
    Config(String),
    /// A fault injected by a test (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[error("injected fault: {0}")]
    InjectedFault(&'static str),
}
