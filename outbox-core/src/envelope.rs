use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{CoreError, trace, wire};

/// The identity of one decided action or event. A UUIDv7, so ids sort by creation time.
///
/// Consumers deduplicate on it, and handlers pass it on as the idempotency key of the calls
/// they make to outside systems.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, sqlx::Type)]
#[serde(transparent)]
#[sqlx(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A fresh UUIDv7.
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }

    /// Wraps an existing id (for example one decoded from a header).
    pub const fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The id as a UUID.
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for EventId {
    type Err = uuid::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

impl From<Uuid> for EventId {
    fn from(id: Uuid) -> Self {
        Self(id)
    }
}

/// An event the application has decided on, before it is written to the outbox.
///
/// ```
/// # use outbox_core::NewEvent;
/// let event = NewEvent::new("invoice", "inv-42", "InvoiceRequested", &serde_json::json!({"cents": 1200}))?
///     .with_header("tenant", "acme")?;
/// assert_eq!(event.topic(), "outbox.event.invoice");
/// # Ok::<(), outbox_core::CoreError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct NewEvent {
    id: EventId,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: serde_json::Value,
    headers: BTreeMap<String, String>,
    topic: String,
}

impl NewEvent {
    /// An event about aggregate `aggregate_id` of kind `aggregate_type`. The aggregate id is the
    /// Kafka key, so events of one aggregate keep their order. The topic defaults to
    /// `outbox.event.<aggregate_type>` (Debezium's default routing).
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: &impl Serialize,
    ) -> Result<Self, CoreError> {
        let aggregate_type = non_empty("aggregate type", aggregate_type.into())?;
        Ok(Self {
            id: EventId::new(),
            topic: wire::default_topic(&aggregate_type),
            aggregate_id: non_empty("aggregate id", aggregate_id.into())?,
            event_type: non_empty("event type", event_type.into())?,
            payload: serde_json::to_value(payload)?,
            headers: BTreeMap::new(),
            aggregate_type,
        })
    }

    /// Uses a given id instead of a fresh one (for example an id the caller already stored).
    pub fn with_id(mut self, id: EventId) -> Self {
        self.id = id;
        self
    }

    /// Publishes to `topic` instead of the default.
    pub fn with_topic(mut self, topic: impl Into<String>) -> Result<Self, CoreError> {
        self.topic = non_empty("topic", topic.into())?;
        Ok(self)
    }

    /// Makes this event an action for the dispatcher of `destination` (see
    /// `outbox_producer::dispatch`) instead of an event for Kafka: no relay publishes it.
    pub fn for_dispatcher(mut self, destination: &str) -> Result<Self, CoreError> {
        self.topic = wire::dispatch_topic(destination)?;
        Ok(self)
    }

    /// Adds an application header. Names the wire contract reserves are refused.
    pub fn with_header(
        mut self,
        name: impl Into<String>,
        value: impl Into<String>,
    ) -> Result<Self, CoreError> {
        let name = non_empty("header name", name.into())?;
        if wire::is_reserved_header(&name) {
            return Err(CoreError::InvalidEvent(format!(
                "header {name:?} is reserved by the wire contract"
            )));
        }
        let value = value.into();
        if name == trace::HEADER_TRACEPARENT {
            value.parse::<trace::TraceParent>()?;
        }
        self.headers.insert(name, value);
        Ok(self)
    }

    /// Carries the W3C trace context of the code that decided the event, so the consumer's
    /// span continues that trace. `tracestate` goes with it when given. With the producer's
    /// `opentelemetry` feature, `enqueue` captures the current span's context by itself.
    pub fn with_trace_context(
        mut self,
        traceparent: trace::TraceParent,
        tracestate: Option<&str>,
    ) -> Self {
        self.headers.insert(
            trace::HEADER_TRACEPARENT.to_owned(),
            traceparent.to_string(),
        );
        match tracestate {
            Some(state) if !state.is_empty() => {
                self.headers
                    .insert(trace::HEADER_TRACESTATE.to_owned(), state.to_owned());
            }
            _ => {
                self.headers.remove(trace::HEADER_TRACESTATE);
            }
        }
        self
    }

    /// The trace context this event carries, if any.
    pub fn traceparent(&self) -> Option<trace::TraceParent> {
        self.headers.get(trace::HEADER_TRACEPARENT)?.parse().ok()
    }

    /// The event id.
    pub fn id(&self) -> EventId {
        self.id
    }

    /// The aggregate type (Debezium's `aggregatetype`).
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }

    /// The aggregate id: the Kafka key and the unit of ordering.
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }

    /// The event type (Debezium's `type`).
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// The JSON payload.
    pub fn payload(&self) -> &serde_json::Value {
        &self.payload
    }

    /// Application headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }

    /// The Kafka topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }
}

fn non_empty(what: &str, value: String) -> Result<String, CoreError> {
    if value.is_empty() {
        Err(CoreError::InvalidEvent(format!("{what} must not be empty")))
    } else {
        Ok(value)
    }
}

/// An event as it was stored and published: what a consumer decodes.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope<P = serde_json::Value> {
    /// The event id (header `id`).
    pub id: EventId,
    /// The aggregate id (the Kafka key).
    pub aggregate_id: String,
    /// The event type (header `type`), when the producer sent one.
    pub event_type: Option<String>,
    /// The decoded payload (the Kafka value).
    pub payload: P,
    /// Every header of the message, the contract's included.
    pub headers: BTreeMap<String, String>,
}

impl<P> Envelope<P> {
    /// The W3C trace context the producer attached, if any and valid.
    pub fn traceparent(&self) -> Option<trace::TraceParent> {
        self.headers.get(trace::HEADER_TRACEPARENT)?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_are_v7_and_round_trip() {
        let id = EventId::new();
        assert_eq!(id.as_uuid().get_version_num(), 7);
        assert_eq!(id.to_string().parse::<EventId>().ok(), Some(id));
    }

    #[test]
    fn rejects_empty_fields_and_reserved_headers() {
        let p = serde_json::json!({});
        assert!(NewEvent::new("", "k", "t", &p).is_err());
        assert!(NewEvent::new("a", "", "t", &p).is_err());
        assert!(NewEvent::new("a", "k", "", &p).is_err());
        let e = NewEvent::new("a", "k", "t", &p).expect("valid");
        assert!(e.clone().with_header(wire::HEADER_ID, "x").is_err());
        assert!(e.clone().with_topic("").is_err());
        assert!(matches!(
            e.clone().with_header("traceparent", "00-nope"),
            Err(CoreError::InvalidTraceContext(_))
        ));
        assert_eq!(
            e.with_header("tenant", "acme").expect("ok").headers().len(),
            1
        );
    }

    #[test]
    fn carries_trace_context_in_headers() {
        let tp: trace::TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .expect("valid");
        let e = NewEvent::new("a", "k", "t", &serde_json::json!({}))
            .expect("valid")
            .with_trace_context(tp, Some("vendor=1"));
        assert_eq!(e.traceparent(), Some(tp));
        assert_eq!(
            e.headers().get("tracestate").map(String::as_str),
            Some("vendor=1")
        );
        assert!(
            e.with_trace_context(tp, None)
                .headers()
                .get("tracestate")
                .is_none()
        );
    }
}
