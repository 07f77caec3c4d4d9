//! An AI agent that sends invoices, crashed on purpose at every step between deciding and
//! charging, to show that each decision is made once and each invoice is charged once.
//!
//! - [`model`]: a deterministic stand-in for the language model that counts its invocations.
//! - [`billing`]: a stand-in for an external payment API that honours idempotency keys.
//! - [`worker`]: one process of the agent service: decide → commit state + outbox event →
//!   relay → billing consumer, with a [`CrashPoint`] that kills the process mid-way.
//! - [`scenario`]: runs the worker as child processes (a crashing one, then a restarted one)
//!   and checks the end state.
//! - [`dispatch`]: the same agent without Kafka: a dispatcher calls the billing service over
//!   HTTP and the agent reads the charge id from the stored outcome.

pub mod billing;
pub mod crash;
pub mod dispatch;
pub mod model;
pub mod scenario;
pub mod schema;
pub mod worker;

pub use crash::{CRASH_EXIT_CODE, CrashPoint, CrashSwitch};
