use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use outbox_core::EventId;

/// One Kafka header as received: its name and its value's bytes (`None`: no value).
pub type RawHeader = (String, Option<Vec<u8>>);

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
    /// The headers whose values are UTF-8 text, by name (a name that repeats keeps its last
    /// value; `id` and `type` never repeat, such records are quarantined).
    pub headers: BTreeMap<String, String>,
    /// Every header as received, in order, bytes intact: what another producer's binary
    /// headers are read from. (A record with a header name that is not UTF-8 or has a NUL
    /// inside never reaches a handler: it is quarantined as `invalid_header_name`.)
    pub raw_headers: Vec<RawHeader>,
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
