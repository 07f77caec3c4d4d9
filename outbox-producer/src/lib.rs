//! Producer side of the outbox framework: write decided events in the same Postgres
//! transaction as the state change ([`Outbox::enqueue`]), and relay committed events to Kafka
//! ([`Relay`]).
//!
//! # Delivery semantics
//! - **Atomic intent**: an event is in the outbox if and only if the transaction that wrote
//!   it committed. Recovery replays the stored event; nothing re-decides it.
//! - **At least once**: a row is marked published only after Kafka acknowledged it
//!   (`acks=all`). A crash between the acknowledgement and the mark republishes the same
//!   event id; consumers deduplicate on it (see `outbox-consumer`).
//! - **Order per aggregate id** (the Kafka key), with one relay or many: see [`relay`].
//! - **Poison rows never stall the outbox**: permanent failures are quarantined at once,
//!   transient ones after `max_attempts` with backoff; other keys keep flowing.
//! - **Actions performed without Kafka** ([`dispatch`]): a [`dispatch::Dispatcher`] calls the
//!   user's executor for each action, with the event id as idempotency key, and records the
//!   answer with the row. At least once: a crash, shutdown or timeout between the call and
//!   the record makes the call again **with the same key**, so an API that honours
//!   idempotency keys applies it once.
//!
//! # Features
//! - `opentelemetry`: [`Outbox::enqueue`] stores the current span's W3C trace context
//!   (`traceparent`, `tracestate` headers) with events that carry none, so the consumer's span
//!   continues the trace that decided the event. Without it, attach one explicitly with
//!   [`NewEvent::with_trace_context`].
//! - `http`: `dispatch::HttpExecutor`, a dispatcher's executor that performs each action as
//!   an HTTP request with `Idempotency-Key: <event id>` (the same key on every attempt; a 409
//!   from an API still processing that key is retried) and stores the answer's body as the
//!   outcome (see `dispatch::http` for the mapping of answers to outcomes).
//! - `prometheus`: `serve_metrics` serves the relay's metrics on an HTTP endpoint.
//! - `http`: `dispatch::HttpExecutor`, the dispatcher's executor for HTTP APIs (reqwest).
//! - `fault-injection`: crash hooks for tests; never in production.
//!
//! ```no_run
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_producer::{Relay, RelayConfig, producer_config};
//! use tokio_util::sync::CancellationToken;
//!
//! outbox_producer::migrate(&pool).await?;
//! let relay = Relay::new(pool, &producer_config("127.0.0.1:9092"), RelayConfig::default())?;
//! let shutdown = CancellationToken::new();
//! tokio::spawn({ let relay = relay.clone(); let shutdown = shutdown.clone(); async move { relay.run(shutdown).await } });
//! // ... later
//! shutdown.cancel();
//! # Ok(()) }
//! ```

pub mod dispatch;
mod enqueue;
mod error;
mod lane;
mod maintenance;
pub mod quarantine;
pub mod relay;
mod sql;

pub use enqueue::{Outbox, enqueue, enqueue_all};
pub use error::ProducerError;
pub use maintenance::{OutboxStats, STATS_COUNT_CAP, prune_published, stats};
#[cfg(feature = "prometheus")]
pub use outbox_core::serve_metrics;
pub use outbox_core::trace;
pub use outbox_core::{
    EventId, KafkaCheckFailure, LastClientError, MIGRATOR, NewEvent, TableNames, check_connection,
    check_connection_with_context, migrate, wire,
};
pub use relay::{AfterPublish, BatchReport, QuarantinePolicy, Relay, RelayConfig, producer_config};
