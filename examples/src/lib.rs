//! Shared code of the runnable examples. The `agent` binary is the README's demo.

pub mod agent;
pub mod billing_api;
