//! The span each message is handled in, continuing the producer's trace.

#[cfg(feature = "opentelemetry")]
use outbox_core::trace::HEADER_TRACESTATE;
use outbox_core::trace::{HEADER_TRACEPARENT, TraceParent};
use rdkafka::Message;
use rdkafka::message::OwnedMessage;

/// An `outbox.consume` span for `message`. Its `traceparent` field holds the W3C context the
/// producer attached (a valid one only); with the `opentelemetry` feature that context also
/// becomes the span's parent, so the handler's spans join the trace that decided the event.
pub(crate) fn message_span(consumer: &str, message: &OwnedMessage) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox.consume",
        consumer,
        topic = message.topic(),
        partition = message.partition(),
        offset = message.offset(),
        traceparent = tracing::field::Empty,
    );
    // Read without rdkafka's accessor, which panics on a header name that is not UTF-8.
    let header = |name: &str| crate::headers::text(message, name);
    if let Some(parent) = header(HEADER_TRACEPARENT).and_then(|v| v.parse::<TraceParent>().ok()) {
        span.record("traceparent", tracing::field::display(parent));
        #[cfg(feature = "opentelemetry")]
        outbox_core::trace::set_parent(&span, parent, header(HEADER_TRACESTATE));
    }
    span
}
