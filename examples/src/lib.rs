//! Shared code of the runnable examples. The `agent` binary is the README's demo
//! (`scripts/demo`, `scripts/demo --dispatch`); `examples/` holds one runnable example per
//! pattern (`cargo run -p outbox-examples --example <name>`), each run by
//! `tests/examples_run.rs`; `debezium/` the connector configuration that matches the relay.

pub mod agent;
pub mod billing_api;
pub mod setup;
