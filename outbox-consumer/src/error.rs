use rdkafka::error::KafkaError;
use thiserror::Error;

/// Errors of the consumer side. Bad messages are not errors: they are quarantined.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Invalid table names or migration failure.
    #[error(transparent)]
    Core(#[from] outbox_core::CoreError),
    /// A database error; the message is retried, never skipped.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The Kafka client could not be created or used.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// A partition worker stopped abnormally (a panic outside the handler); the consumer
    /// stops so that no later offset is stored past the message it left unhandled.
    #[error("partition worker failed: {0}")]
    Worker(String),
    /// The consumer configuration is not usable.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// A fault injected by a test (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[error("injected fault: {0}")]
    InjectedFault(&'static str),
}
