//! A test kit for applications built on the outbox framework: test your consumer handlers
//! through the real dedup path on your own PostgreSQL without Kafka, and read what your
//! producer's transactions enqueued without a relay.
//!
//! # What it drives
//! [`HandlerKit`] runs your handler in an `outbox_consumer::DedupConsumer`, the consumer
//! `dedup_consume` runs, fed with records built in memory as the relay publishes them
//! (`outbox_core::wire`; [`RawRecord`]) instead of records read from Kafka:
//! - the real dedup transaction: the event id's row and your handler's writes commit together
//!   on your database, or neither does; a redelivered id is skipped by the in-memory cache or
//!   by the dedup table;
//! - the real batches: a partition's records in one transaction, rolled back and replayed
//!   around a failing handler, so that its failure takes no other message's effect with it;
//! - the real failure policy (`ConsumerConfig::max_attempts`, backoff, `Block` or
//!   `Quarantine`) and the real quarantine, which keeps a record whole, bytes and all
//!   ([`HandlerKit::quarantined`]);
//! - Kafka's side of a crash, simulated: the kit keeps each partition's records and stored
//!   offsets, so a crash between a transaction's commit and its offset store, then a restart,
//!   redelivers the record to a new consumer whose cache is empty
//!   ([`HandlerKit::crash_after_commit_then_redeliver`]).
//!
//! Every delivery returns the consumer's `Outcome`s, and your test asserts on your own
//! tables that the effect happened once.
//!
//! What it does not drive: Kafka itself (fetching, the consumer group, rebalances and revoked
//! partitions, offset commits to the broker, the prefetch budget), the relay, and Debezium.
//! Those are the framework's to test (its `outbox-tests` crate runs them against a real
//! broker); the kit tests what is yours, the handler and what the producer enqueues.
//!
//! The kit migrates nothing: your test database gets the framework's tables as your
//! application's does (`outbox_consumer::migrate`), and your own.
//!
//! # The producer side
//! [`enqueued`] reads the outbox as a connection sees it: inside your transaction, before it
//! commits, the rows it enqueued; from another connection, what committed. No relay runs.
//! [`Enqueued::to_event`] hands a row on to a [`HandlerKit`], producer to handler without
//! Kafka.
//!
//! # Example
//! A handler that credits an account (running it twice would credit twice), tested through
//! a delivery, a redelivery, a batch with a failing message, and a crash between the commit
//! and the offset store; each time the balance shows the effect happened once.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use outbox_consumer::{ConsumerConfig, Event, HandlerError, Outcome};
//! use outbox_core::NewEvent;
//! use outbox_testkit::HandlerKit;
//! use sqlx::{PgConnection, PgPool};
//!
//! #[derive(serde::Deserialize)]
//! struct Deposit {
//!     account: String,
//!     cents: i64,
//! }
//!
//! async fn credit(event: &Event<Deposit>, conn: &mut PgConnection) -> Result<(), HandlerError> {
//!     if event.payload.cents <= 0 {
//!         return Err(HandlerError::quarantine("a deposit must be positive"));
//!     }
//!     sqlx::query("UPDATE accounts SET cents = cents + $2 WHERE id = $1")
//!         .bind(&event.payload.account)
//!         .bind(event.payload.cents)
//!         .execute(conn)
//!         .await?;
//!     Ok(())
//! }
//!
//! fn deposit(account: &str, cents: i64) -> NewEvent {
//!     let payload = serde_json::json!({ "account": account, "cents": cents });
//!     NewEvent::new("account", account, "Deposited", &payload).expect("a valid event")
//! }
//!
//! async fn balance(pool: &PgPool, account: &str) -> Result<i64, sqlx::Error> {
//!     sqlx::query_scalar("SELECT cents FROM accounts WHERE id = $1")
//!         .bind(account)
//!         .fetch_one(pool)
//!         .await
//! }
//!
//! // `pool`: a test database with `outbox_consumer::migrate` run and an `accounts` table
//! // holding ('alice', 0).
//! async fn each_deposit_is_credited_once(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
//!     let config = ConsumerConfig::new("ledger")
//!         .backoff(Duration::from_millis(1), Duration::from_millis(10));
//!     let mut kit = HandlerKit::new(pool.clone(), config, credit)?;
//!
//!     // Delivered, then delivered again: credited once.
//!     let first = deposit("alice", 100);
//!     assert_eq!(kit.deliver(&first).await?, Outcome::Processed);
//!     assert_eq!(kit.deliver_again(&first).await?, Outcome::DuplicateCached);
//!     assert_eq!(balance(&pool, "alice").await?, 100);
//!
//!     // A batch with a failing message: the others are credited, once each.
//!     let batch = [deposit("alice", 10), deposit("alice", -5), deposit("alice", 1)];
//!     let outcomes = kit.deliver_batch(&batch).await?;
//!     assert_eq!(
//!         outcomes,
//!         [
//!             Outcome::Processed,
//!             Outcome::Quarantined("handler_rejected"),
//!             Outcome::Processed,
//!         ]
//!     );
//!     assert_eq!(balance(&pool, "alice").await?, 111);
//!     assert_eq!(kit.quarantined().await?.len(), 1);
//!
//!     // A crash between the commit and the offset store: the restarted consumer gets the
//!     // record again, and the dedup table says it was handled.
//!     let last = deposit("alice", 1000);
//!     let crash = kit.crash_after_commit_then_redeliver(&last).await?;
//!     assert_eq!(crash.before_crash, Outcome::Processed);
//!     assert_eq!(crash.after_restart, Outcome::DuplicateStored);
//!     assert_eq!(balance(&pool, "alice").await?, 1111);
//!     Ok(())
//! }
//! ```
//!
//! The same test, runnable, with a schema of its own per test, is in the guide's "Testing
//! your handlers and producers" page (`docs/src/testing.md`) and in this crate's
//! `tests/example.rs`.

mod enqueued;
mod kit;
mod record;

pub use enqueued::{Enqueued, EnqueuedStatus, enqueued};
pub use kit::{CrashRedelivery, HandlerKit};
pub use record::RawRecord;
