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
    /// The relay configuration is not usable.
    #[error("invalid relay configuration: {0}")]
    Config(String),
    /// A fault injected by a test (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[error("injected fault: {0}")]
    InjectedFault(&'static str),
}
