//! Consumer side of the outbox framework: [`dedup_consume`] runs a handler **once per
//! (consumer name, event id)** however often Kafka delivers the event.
//!
//! # Delivery semantics
//! Kafka delivers at least once. Each partition's worker takes the messages queued for it
//! (up to `max_batch_size`, never waiting for more), drops those whose id is in an in-memory
//! cache of recent ids, and, in one Postgres transaction, inserts the batch's ids into a
//! dedup table (the ids already there are duplicates, skipped) and runs the handler of each
//! new id, in offset order, on that same transaction. Commit makes the handlers' state and
//! "seen" durable together; a rollback undoes both. The offsets are stored only after that
//! commit, so a crash anywhere redelivers, and the redelivery is recognised as a duplicate.
//! A failing handler takes no other message with it: the batch is rolled back and replayed
//! around it, and only its message is retried or quarantined. Side effects outside Postgres
//! (an HTTP call, an email) cannot join the transaction: pass [`Event::idempotency_key`] to
//! them. Effects inside it can: a handler that enqueues a follow-up event with
//! `outbox_producer::enqueue` on its connection makes consume → decide → enqueue happen once.
//!
//! Messages that break the wire contract or the configured limits, and messages whose handler
//! keeps failing (under the default [`HandlerFailurePolicy::Quarantine`]), are stored whole in
//! a quarantine table with the reason, and the partition moves on. Under
//! [`HandlerFailurePolicy::ParkKey`] such a message parks its Kafka key instead: it and the
//! key's later messages on the partition are stored in order in the park table, the other keys
//! flow on, and a release ([`parked::release`], `outbox parked release`) has the consumer
//! handle the key's messages in order, each once: order per key holds, and no key waits for
//! another.
//!
//! Dedup rows live in day slices of the dedup table (range partitions on the day of a UUIDv7
//! event id, [`dedup_slice`]; ids that carry no time share a timeless slice) until [`prune`]
//! drops their day whole; see its docs for choosing the TTL and what it promises. A consumer
//! makes a day's slice the first time it meets that day, so a missing slice never fails it,
//! but only for the days of its window (the TTL, `ConsumerConfig::dedup_ttl`, back from
//! today): an id dated earlier is recorded in the slice of the day it is handled, and looked
//! for in every slice. Whatever the ids, a consumer makes at most the TTL in days + 2 slices
//! a day.
//!
//! # Observability
//! Each message is handled inside an `outbox.consume` span whose `traceparent` field is the
//! W3C trace context the producer attached. Counters and a latency histogram go to the
//! `metrics` facade (`serve_metrics`, under the `prometheus` feature, lists the names).
//!
//! # Features
//! - `opentelemetry`: the received trace context becomes the parent of the `outbox.consume`
//!   span (through `tracing-opentelemetry`), so handler spans join the producer's trace.
//! - `prometheus`: `serve_metrics` serves the metrics on an HTTP endpoint.
//! - `fault-injection`: crash hooks for tests; never in production.
//!
//! Each assigned partition has its own librdkafka queue and worker, beside the Kafka poll
//! loop, so a slow handler never stops polling: a partition whose handler falls behind is
//! paused once it holds its share of [`ConsumerConfig::prefetch_budget_bytes`] (the budget
//! divided by the partitions assigned, so the member's memory does not grow with their
//! number), and the member keeps its partitions however long a handler (or a database
//! outage) takes.
//! Messages fetched for a partition that a rebalance takes away are dropped, not handled: the
//! partition's new owner reads them from the committed offset.
//!
//! ```no_run
//! # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_consumer::ConsumerError> {
//! use outbox_consumer::{Event, consumer_config, dedup_consume};
//! use sqlx::PgConnection;
//! use tokio_util::sync::CancellationToken;
//!
//! async fn record(event: &Event<serde_json::Value>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
//!     sqlx::query("INSERT INTO seen (id) VALUES ($1)").bind(event.id).execute(conn).await?;
//!     Ok(())
//! }
//!
//! let kafka = consumer_config("127.0.0.1:9092", "billing");
//! dedup_consume(&kafka, pool, record)
//!     .topics(["outbox.event.invoice"])
//!     .run(CancellationToken::new())
//!     .await
//! # }
//! ```

mod assignment;
mod batch;
mod config;
mod consume;
mod consumer;
mod decode;
mod dedup_transaction;
mod error;
mod event;
mod failure;
mod handler;
mod header_list;
mod headers;
mod park;
pub mod parked;
mod partition_stream;
mod permit;
mod prefetch;
mod prune;
mod pruner;
pub mod quarantine;
mod quarantine_prune;
mod requeue;
mod runner;
mod slice;
mod span;
mod sql;

pub use assignment::{DedupContext, stream_consumer, stream_consumer_with_context};
pub use config::{ConsumerConfig, HandlerFailurePolicy};
pub use consume::{DedupConsume, dedup_consume};
pub use consumer::{ConsumerStats, DedupConsumer, Outcome};
pub use error::ConsumerError;
pub use event::{Event, RawHeader};
pub use handler::{BoxError, Boxed, Handler, HandlerError, HandlerFn, HandlerFuture, boxed};
pub use headers::ReceivedHeader;
#[cfg(feature = "prometheus")]
pub use outbox_core::serve_metrics;
pub use outbox_core::trace;
pub use outbox_core::{
    EventId, KafkaCheckFailure, LastClientError, MIGRATOR, TableNames, check_connection,
    check_connection_with_context, migrate, wire,
};
pub use prune::{DedupPruned, prune};
pub use pruner::DedupPruner;
pub use quarantine_prune::{prune_quarantine, prune_quarantine_batch};
pub use runner::consumer_config;
pub use slice::{SLICES_AHEAD, TIMELESS, dedup_slice, ensure_dedup_slices, today};
