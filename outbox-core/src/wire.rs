//! The wire contract: how an outbox row becomes a Kafka record. It is public and stable, and
//! matches what Debezium's Outbox Event Router emits with its defaults, so consumers cannot
//! tell the polling relay from CDC:
//!
//! | Kafka record | source | Debezium default |
//! |---|---|---|
//! | topic | `outbox.event.<aggregatetype>`, or the row's explicit topic | `route.topic.replacement=outbox.event.${routedByValue}` |
//! | key | `aggregateid`, UTF-8 | `table.field.event.key=aggregateid` |
//! | value | `payload`, JSON | `table.field.event.payload=payload` |
//! | header `id` | event id, UUID text | `table.field.event.id=id` |
//! | header `type` | event type | `table.fields.additional.placement=type:header:type` |
//! | timestamp | `created_at` (milliseconds) | |
//!
//! Application headers travel as further UTF-8 headers.

/// Header carrying the event id (the dedup key).
pub const HEADER_ID: &str = "id";
/// Header carrying the event type.
pub const HEADER_TYPE: &str = "type";
/// Header carrying the W3C trace context, when one was captured at enqueue.
pub const HEADER_TRACEPARENT: &str = "traceparent";

/// Prefix of the default topic, followed by the aggregate type.
pub const DEFAULT_TOPIC_PREFIX: &str = "outbox.event.";

/// Header names the contract owns; applications may not set them.
pub const RESERVED_HEADERS: &[&str] = &[HEADER_ID, HEADER_TYPE];

/// The topic Debezium's router would pick for `aggregate_type`.
pub fn default_topic(aggregate_type: &str) -> String {
    format!("{DEFAULT_TOPIC_PREFIX}{aggregate_type}")
}

/// Whether `name` is one of [`RESERVED_HEADERS`].
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS.contains(&name)
}
