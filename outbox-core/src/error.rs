use thiserror::Error;

/// Errors of the shared layer: configuration, envelopes and migrations.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A table name given in configuration is not a safe SQL identifier.
    #[error("invalid identifier {name:?}: {reason}")]
    InvalidIdentifier {
        /// The rejected name, as given.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A field of an event is empty or otherwise unusable.
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    /// A `traceparent` is not valid W3C Trace Context.
    #[error("invalid trace context {0}")]
    InvalidTraceContext(String),
    /// The payload could not be serialized to JSON.
    #[error("payload is not serializable to JSON: {0}")]
    Payload(#[from] serde_json::Error),
    /// Applying the migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The PostgreSQL server is older than [`crate::MIN_POSTGRES`].
    #[error("{0}")]
    UnsupportedServer(String),

    /// The metrics endpoint could not be installed.
    #[error("{0}")]
    Metrics(String),
    /// A Kafka client configuration does not reach its cluster
    /// ([`check_connection`](crate::check_connection)).
    #[error("{failure}: {reason}")]
    KafkaCheck {
        /// What failed.
        failure: crate::KafkaCheckFailure,
        /// librdkafka's reason, escaped, without the configuration's values.
        reason: String,
    },
    /// A quarantine action named a table that is not that side's quarantine (not listed in
    /// `outbox_quarantine_tables`); nothing was changed.
    #[error("{table} is not a quarantine table of the {side} side ({why}); nothing was changed")]
    NotAQuarantineTable {
        /// The table as named.
        table: String,
        /// The side it was named for.
        side: crate::QuarantineSide,
        /// Why it does not qualify.
        why: &'static str,
    },
    /// A quarantine action found rows it was to act on held by another transaction (another
    /// action, or a consumer, in flight); nothing was done to them.
    #[error(
        "rows {keys:?} of {table} are held by another session (another action in flight); nothing was done to them"
    )]
    QuarantineRowsBusy {
        /// The table, schema-qualified.
        table: String,
        /// The rows asked for.
        keys: Vec<i64>,
    },
    /// The current role may not take a quarantine action or may not record it; nothing was
    /// done.
    #[error("role {role} lacks {missing}; nothing was done")]
    QuarantinePrivilege {
        /// The role (`current_user`).
        role: String,
        /// The privileges it lacks.
        missing: String,
    },
    /// Connection settings that could hand a password to whoever answers on the network (see
    /// [`crate::check_database_tls`], [`crate::check_kafka_tls`]): what is wrong, and what to
    /// set instead.
    #[error("{0}")]
    InsecureTransport(String),
    /// A database error.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
