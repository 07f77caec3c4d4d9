//! Shared layer of the outbox framework: the event envelope, the wire contract, table names
//! and the migrations that create every table the framework uses.
//!
//! # Delivery semantics
//! The producer side (`outbox-producer`) writes an event in the same Postgres transaction as
//! the state change that decided it, so both commit or neither does; its relay publishes each
//! committed event to Kafka **at least once**, in order per aggregate id. The consumer side
//! (`outbox-consumer`) records each event id in its own transaction with the handler's state,
//! so the **effect** of an event happens once per consumer even though delivery may repeat.
//!
//! ```no_run
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_core::CoreError> {
//! outbox_core::migrate(&pool).await?;
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod envelope;
mod error;
mod escape;
mod ident;
mod kafka_check;
pub mod kafka_secrets;
mod last_client_error;
#[cfg(feature = "prometheus")]
mod metrics_endpoint;
mod migrate;
mod partition;
mod prune;
mod quarantine_audit;
mod quarantine_table;
mod retry;
mod server_version;
pub mod trace;
mod transport_security;
pub mod wire;

pub use envelope::{Envelope, EventId, NewEvent};
pub use error::CoreError;
pub use escape::{Escaped, EscapedBytes, escape, escape_bytes};
pub use ident::{Ident, TableNames};
pub use kafka_check::{KafkaCheckFailure, check_connection, check_connection_with_context};
pub use last_client_error::{LastClientError, RecordingContext};
#[cfg(feature = "prometheus")]
pub use metrics_endpoint::serve_metrics;
pub use migrate::{MIGRATOR, migrate, migrate_with, migrator};
pub use partition::{java_partition, murmur2};
pub use prune::{delete_in_batches, delete_while_full, prune_unlock, try_prune_lock};
pub use quarantine_audit::{AuditEntry, quarantine_audit};
pub use quarantine_table::{
    ActionNote, QuarantineAction, QuarantineColumns, QuarantineSide, QuarantineTable,
};
pub use retry::backoff;
pub use server_version::{MIN_POSTGRES, check_server_version};
pub use transport_security::{check_database_tls, check_kafka_tls, check_kafka_tls_with};

/// The grants of each part's least-privileged role, as SQL for the tables' owner to run
/// (`outbox-core/sql/roles.sql`; the guide, operating, "Roles"). Roles are the operator's: it grants to
/// roles that exist, under the names its comments say to replace, and creates none.
pub const ROLES_SQL: &str = include_str!("../sql/roles.sql");
