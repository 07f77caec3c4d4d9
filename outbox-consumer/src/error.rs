use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use thiserror::Error;

/// Errors of the consumer side. Bad messages are not errors: they are quarantined.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Invalid table names or migration failure.
    #[error(transparent)]
    Core(#[from] outbox_core::CoreError),
    /// The database could not be reached; the message is retried, never skipped. (An error
    /// the database returned for a message's transaction is not this: it counts as a failed
    /// attempt of that message.)
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The Kafka client could not be created or used.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The Kafka client hit a fatal error and can no longer consume (a static member fenced
    /// by another with its `group.instance.id`, ...). Messages being handled finished; the
    /// rest are redelivered to whoever consumes next. Build a new consumer to go on.
    #[error("fatal kafka consumer error ({code}): {reason}")]
    KafkaFatal {
        /// librdkafka's code for the underlying error.
        code: RDKafkaErrorCode,
        /// librdkafka's description.
        reason: String,
    },
    /// A row of the consumer's quarantine table cannot be read back (its `headers` were
    /// written by something else than the consumer).
    #[error("invalid quarantine row: {0}")]
    InvalidQuarantineRow(String),
    /// A partition worker stopped abnormally (a panic outside the handler); the consumer
    /// stops so that no later offset is stored past the message it left unhandled.
    #[error("partition worker failed: {0}")]
    Worker(String),
    /// `parked::skip` was given a parked message that is not the first of its key: the
    /// messages of a key are dropped in order, or its order would change.
    #[error(
        "parked message {id} is not the first of its key; the first is {head}: skip that one first (or release the key)"
    )]
    NotParkedHead {
        /// The message given.
        id: i64,
        /// The first message parked under its key.
        head: i64,
    },
    /// `parked::skip` was given a parked message whose key's release is under way: its
    /// consumer may be running that message's handler. Skip it if the release parks the key
    /// again.
    #[error(
        "parked message {id}: its key's release is under way; skip it if the release parks the key again"
    )]
    ParkedKeyReleasing {
        /// The message given.
        id: i64,
    },
    /// The consumer configuration is not usable.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// A fault injected by a test (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[error("injected fault: {0}")]
    InjectedFault(&'static str),
}
