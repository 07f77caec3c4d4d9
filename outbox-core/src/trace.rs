//! W3C Trace Context across the outbox.
//!
//! A `traceparent` (and optional `tracestate`) header stored with an event travels through the
//! relay as an ordinary Kafka header, so the consumer's span continues the trace of the request
//! that decided the event, however long the event waited in the outbox. Any client that speaks
//! W3C Trace Context (Debezium's router passes the header through) interoperates.
//!
//! With the `opentelemetry` feature, [`current`] reads the context of the current `tracing`
//! span (through `tracing-opentelemetry`) and [`set_parent`] makes a span the child of a
//! received context; the producer and consumer crates use both when their own
//! `opentelemetry` feature is on.

use std::fmt;
use std::str::FromStr;

use crate::CoreError;

/// Header carrying the W3C `traceparent`.
pub const HEADER_TRACEPARENT: &str = "traceparent";
/// Header carrying the W3C `tracestate` (vendor data that goes with `traceparent`).
pub const HEADER_TRACESTATE: &str = "tracestate";

/// A parsed W3C `traceparent`: `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`.
///
/// ```
/// # use outbox_core::trace::TraceParent;
/// let tp: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse()?;
/// assert!(tp.sampled());
/// assert_eq!(tp.to_string(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
/// # Ok::<(), outbox_core::CoreError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: u128,
    parent_id: u64,
    flags: u8,
}

impl TraceParent {
    /// A context from its parts; `None` when an id is zero (the specification's invalid value).
    pub fn new(trace_id: u128, parent_id: u64, flags: u8) -> Option<Self> {
        (trace_id != 0 && parent_id != 0).then_some(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id.
    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The id of the span that is the parent of whatever continues this context.
    pub fn parent_id(&self) -> u64 {
        self.parent_id
    }

    /// The trace flags byte.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the caller sampled this trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({self})")
    }
}

impl FromStr for TraceParent {
    type Err = CoreError;

    /// Parses by the W3C rules: lowercase hex, version `ff` forbidden, version `00` exactly
    /// 55 characters, later versions at least that with any extra fields after a `-`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |why: &str| CoreError::InvalidTraceContext(format!("{s:?}: {why}"));
        let version = s
            .get(0..2)
            .and_then(|v| hex(v, 2))
            .ok_or_else(|| invalid("bad version"))?;
        match version {
            "ff" => return Err(invalid("version ff is forbidden")),
            "00" if s.len() != 55 => return Err(invalid("version 00 is 55 characters")),
            _ if s.len() > 55 && s.as_bytes()[55] != b'-' => {
                return Err(invalid("unexpected data after the flags"));
            }
            _ => {}
        }
        let fields = s.get(0..55).ok_or_else(|| invalid("too short"))?;
        let parts: Vec<&str> = fields.split('-').collect();
        let [_, trace, parent, flags] = parts[..] else {
            return Err(invalid("expected four fields"));
        };
        let trace_id = hex(trace, 32)
            .and_then(|h| u128::from_str_radix(h, 16).ok())
            .ok_or_else(|| invalid("bad trace id"))?;
        let parent_id = hex(parent, 16)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| invalid("bad parent id"))?;
        let flags = hex(flags, 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .ok_or_else(|| invalid("bad flags"))?;
        Self::new(trace_id, parent_id, flags).ok_or_else(|| invalid("all-zero id"))
    }
}

/// `part` when it is exactly `len` lowercase hex digits.
fn hex(part: &str, len: usize) -> Option<&str> {
    (part.len() == len && part.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .then_some(part)
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceParent;

    /// The trace context of the current `tracing` span, with its `tracestate` header value
    /// when there is one; `None` when no OpenTelemetry layer is installed or no span is active.
    pub fn current() -> Option<(TraceParent, Option<String>)> {
        let context = tracing::Span::current().context();
        let span = context.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return None;
        }
        let parent = TraceParent::new(
            u128::from_be_bytes(sc.trace_id().to_bytes()),
            u64::from_be_bytes(sc.span_id().to_bytes()),
            sc.trace_flags().to_u8(),
        )?;
        let state = sc.trace_state().header();
        Some((parent, (!state.is_empty()).then_some(state)))
    }

    /// Makes `span` a child of the remote context `parent` (with `tracestate`, when valid).
    /// Does nothing when no OpenTelemetry layer is installed.
    pub fn set_parent(span: &tracing::Span, parent: TraceParent, tracestate: Option<&str>) {
        let state = tracestate
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let remote = SpanContext::new(
            TraceId::from_bytes(parent.trace_id.to_be_bytes()),
            SpanId::from_bytes(parent.parent_id.to_be_bytes()),
            TraceFlags::new(parent.flags),
            true,
            state,
        );
        // Fails only without an OpenTelemetry layer, where there is no trace to join.
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
}

#[cfg(feature = "opentelemetry")]
pub use otel::{current, set_parent};

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_the_specification_example() {
        let tp: TraceParent = EXAMPLE.parse().expect("valid");
        assert_eq!(tp.trace_id(), 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(tp.parent_id(), 0x00f067aa0ba902b7);
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), EXAMPLE);
    }

    #[test]
    fn accepts_future_versions_with_extra_fields() {
        let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-what-ever";
        let tp: TraceParent = future.parse().expect("future versions parse");
        assert!(!tp.sampled());
        assert_eq!(tp.to_string(), EXAMPLE.replace("-01", "-00"));
    }

    #[test]
    fn rejects_what_the_specification_forbids() {
        for bad in [
            "",
            "00",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        ] {
            assert!(
                matches!(
                    bad.parse::<TraceParent>(),
                    Err(CoreError::InvalidTraceContext(_))
                ),
                "{bad:?} must be rejected"
            );
        }
    }
}
