use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use outbox_core::EventId;

/// A decoded event, as the handler receives it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Event<P> {
    /// The event id. Pass it on as the idempotency key of calls to outside systems
    /// ([`Self::idempotency_key`]).
    pub id: EventId,
    /// The Kafka key: the aggregate id.
    pub key: String,
    /// The `type` header, if any.
    pub event_type: Option<String>,
    /// The payload, decoded from JSON.
    pub payload: P,
    /// All headers.
    pub headers: BTreeMap<String, String>,
    /// Topic it was read from.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Offset in that partition.
    pub offset: i64,
    /// The record's timestamp (the outbox row's `created_at` for this relay).
    pub timestamp: Option<DateTime<Utc>>,
}

impl<P> Event<P> {
    /// The key for outside systems that deduplicate requests (payment providers, mailers):
    /// the same for every redelivery of this event.
    pub fn idempotency_key(&self) -> String {
        self.id.to_string()
    }
}
