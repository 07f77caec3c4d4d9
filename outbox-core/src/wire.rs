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
//! | timestamp | `created_at` (milliseconds; the consumer's `Event::timestamp`) | |
//!
//! Application headers travel as further UTF-8 headers. A copy of a quarantined message that
//! an operator requeued for one consumer also carries [`HEADER_REQUEUE_FOR`].
//!
//! A record carries `id` and `type` at most once each: Kafka lets a header name repeat, and a
//! repeated contract header is ambiguous (which one names the event?), so [`decode`] rejects
//! it rather than picking one. Only the contract headers must be UTF-8; other producers'
//! headers may hold any bytes.

/// Header carrying the event id (the dedup key).
pub const HEADER_ID: &str = "id";
/// Header carrying the event type.
pub const HEADER_TYPE: &str = "type";

/// Header naming the consumer a requeued copy is for. `outbox quarantine requeue` publishes a
/// message a consumer quarantined again, to the topic and partition it came from, where every
/// consumer group reads it; the copy carries this header once, its value the name of that
/// consumer (UTF-8, as `ConsumerConfig::name`), in place of any it carried before.
///
/// A dedup consumer skips a record carrying this header unless one of its values is its own
/// name, byte for byte: no handler, no dedup row, its offset stored (`Outcome::NotForUs`).
/// The consumer named handles it as any other record, deduplicated by its event id. Clients
/// that do not read this header (consumers not built on `outbox-consumer`, sink connectors)
/// receive the copy as a redelivery of an event they have seen; Kafka's at-least-once
/// delivery already obliges them to tolerate one. A copy naming no consumer that runs is
/// skipped by all, and its quarantine row is gone: when the consumer was renamed since it
/// quarantined the message, requeue with `--to-consumer <its new name>`. Producers of events
/// never set this header.
pub const HEADER_REQUEUE_FOR: &str = "outbox-requeue-for";

/// Prefix of the default topic, followed by the aggregate type.
pub const DEFAULT_TOPIC_PREFIX: &str = "outbox.event.";

/// Prefix of the `topic` column of an action a dispatcher performs instead of a relay
/// publishing it: `dispatch:<destination>`. Kafka topic names cannot contain `:`, so no topic
/// is ever mistaken for a destination; the relay never claims these rows.
pub const DISPATCH_TOPIC_PREFIX: &str = "dispatch:";

/// Longest destination name (the rest of a `topic` after [`DISPATCH_TOPIC_PREFIX`]).
pub const DESTINATION_MAX_LEN: usize = 200;

/// The `topic` of the actions of `destination`, or why it is not a destination name: 1 to
/// [`DESTINATION_MAX_LEN`] ASCII letters, digits, `.`, `_` or `-`.
pub fn dispatch_topic(destination: &str) -> Result<String, crate::CoreError> {
    let valid = !destination.is_empty()
        && destination.len() <= DESTINATION_MAX_LEN
        && destination
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(format!("{DISPATCH_TOPIC_PREFIX}{destination}"))
    } else {
        Err(crate::CoreError::InvalidEvent(format!(
            "destination {:?} must be 1 to {DESTINATION_MAX_LEN} ASCII letters, digits, '.', '_' or '-'",
            crate::escape(destination)
        )))
    }
}

/// Whether a row with this `topic` is an action for a dispatcher.
pub fn is_dispatch_topic(topic: &str) -> bool {
    topic.starts_with(DISPATCH_TOPIC_PREFIX)
}

/// Header names the contract owns; applications may not set them.
pub const RESERVED_HEADERS: &[&str] = &[HEADER_ID, HEADER_TYPE, HEADER_REQUEUE_FOR];

/// The topic Debezium's router would pick for `aggregate_type`.
pub fn default_topic(aggregate_type: &str) -> String {
    format!("{DEFAULT_TOPIC_PREFIX}{aggregate_type}")
}

/// Whether `name` is one of [`RESERVED_HEADERS`].
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS.contains(&name)
}

use std::collections::BTreeMap;

use crate::{Envelope, EventId};

/// Why a record does not satisfy the wire contract. Each is a reason to quarantine the record,
/// never to drop it or to stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No `id` header.
    #[error("missing `id` header")]
    MissingId,
    /// The `id` header is not a UUID.
    #[error("`id` header is not a UUID: {0}")]
    InvalidId(String),
    /// The key is not UTF-8.
    #[error("key is not UTF-8")]
    InvalidKey,
    /// A contract header (`id`, `type`) is not UTF-8.
    #[error("header {0:?} is not UTF-8")]
    InvalidHeader(String),
    /// The record carries the `id` header more than once.
    #[error("`id` header appears {0} times")]
    AmbiguousId(usize),
    /// The record carries the `type` header more than once.
    #[error("`type` header appears {0} times")]
    AmbiguousType(usize),
    /// The record has no value.
    #[error("record has no payload")]
    MissingPayload,
    /// The value is not JSON.
    #[error("payload is not JSON: {0}")]
    InvalidJson(String),
}

impl DecodeError {
    /// A short stable name for the reason, as stored in quarantine tables.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingId => "missing_id",
            Self::InvalidId(_) => "invalid_id",
            Self::InvalidKey => "invalid_key",
            Self::InvalidHeader(_) => "invalid_header",
            Self::AmbiguousId(_) => "ambiguous_id",
            Self::AmbiguousType(_) => "ambiguous_type",
            Self::MissingPayload => "missing_payload",
            Self::InvalidJson(_) => "invalid_json",
        }
    }
}

/// Decodes a record's parts under the contract. The `id` header may be plain UUID text (this
/// relay, Debezium's `SimpleHeaderConverter`) or a JSON string (Debezium's `JsonConverter`).
///
/// The envelope's `headers` hold the headers whose values are UTF-8 (a repeated name other
/// than `id` and `type` keeps its last value); headers of other producers that are not text
/// are left out of it, not an error.
pub fn decode<'h>(
    key: Option<&[u8]>,
    headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
    payload: Option<&[u8]>,
) -> Result<Envelope<serde_json::Value>, DecodeError> {
    let mut decoded = BTreeMap::new();
    let (mut ids, mut types) = (0_usize, 0_usize);
    for (name, value) in headers {
        let text = std::str::from_utf8(value.unwrap_or_default());
        if is_reserved_header(name) {
            if name == HEADER_ID {
                ids += 1;
            } else if name == HEADER_TYPE {
                types += 1;
            }
            let text = text.map_err(|_| DecodeError::InvalidHeader(name.to_owned()))?;
            decoded.insert(name.to_owned(), text.to_owned());
        } else if let Ok(text) = text {
            decoded.insert(name.to_owned(), text.to_owned());
        }
    }
    // Checked before the id is read: with two, there is no id to read.
    if ids > 1 {
        return Err(DecodeError::AmbiguousId(ids));
    }
    let id = parse_id(decoded.get(HEADER_ID).ok_or(DecodeError::MissingId)?)?;
    if types > 1 {
        return Err(DecodeError::AmbiguousType(types));
    }
    let aggregate_id = std::str::from_utf8(key.unwrap_or_default())
        .map_err(|_| DecodeError::InvalidKey)?
        .to_owned();
    let payload = payload.ok_or(DecodeError::MissingPayload)?;
    let payload =
        serde_json::from_slice(payload).map_err(|e| DecodeError::InvalidJson(e.to_string()))?;
    Ok(Envelope {
        id,
        aggregate_id,
        event_type: decoded.get(HEADER_TYPE).cloned(),
        payload,
        headers: decoded,
    })
}

/// The event id of a record, by the rules of [`decode`], whatever else is wrong with the
/// record: what a quarantine row can still name it by.
pub fn event_id<'h>(
    headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
) -> Result<EventId, DecodeError> {
    let mut ids = headers.into_iter().filter(|(name, _)| *name == HEADER_ID);
    let (first, more) = (ids.next(), ids.count());
    let (_, value) = first.ok_or(DecodeError::MissingId)?;
    if more > 0 {
        return Err(DecodeError::AmbiguousId(more + 1));
    }
    let text = std::str::from_utf8(value.unwrap_or_default())
        .map_err(|_| DecodeError::InvalidHeader(HEADER_ID.to_owned()))?;
    parse_id(text)
}

fn parse_id(text: &str) -> Result<EventId, DecodeError> {
    let id = text.trim().trim_matches('"');
    id.parse::<EventId>()
        .map_err(|_| DecodeError::InvalidId(id.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h<'a>(pairs: &'a [(&'a str, &'a str)]) -> Vec<(&'a str, Option<&'a [u8]>)> {
        pairs
            .iter()
            .map(|(k, v)| (*k, Some(v.as_bytes())))
            .collect()
    }

    #[test]
    fn decodes_relay_and_debezium_id_forms() {
        let id = EventId::new().to_string();
        let quoted = format!("\"{id}\"");
        for form in [id.as_str(), quoted.as_str()] {
            let e = decode(
                Some(b"k"),
                h(&[("id", form), ("type", "T")]),
                Some(br#"{"a":1}"#),
            )
            .expect("decodes");
            assert_eq!(e.id.to_string(), id);
            assert_eq!(e.aggregate_id, "k");
            assert_eq!(e.event_type.as_deref(), Some("T"));
            assert_eq!(e.payload, serde_json::json!({"a": 1}));
        }
    }

    #[test]
    fn names_each_contract_violation() {
        let id = EventId::new().to_string();
        let ok_headers = [("id", id.as_str())];
        assert_eq!(
            decode(None, h(&[]), Some(b"{}")),
            Err(DecodeError::MissingId)
        );
        assert!(matches!(
            decode(None, h(&[("id", "nope")]), Some(b"{}")),
            Err(DecodeError::InvalidId(_))
        ));
        assert_eq!(
            decode(Some(&[0xff]), h(&ok_headers), Some(b"{}")),
            Err(DecodeError::InvalidKey)
        );
        assert_eq!(
            decode(None, h(&ok_headers), None),
            Err(DecodeError::MissingPayload)
        );
        assert!(matches!(
            decode(None, h(&ok_headers), Some(b"{not json")),
            Err(DecodeError::InvalidJson(_))
        ));
    }

    #[test]
    fn a_repeated_contract_header_is_ambiguous_and_a_binary_foreign_one_is_not_an_error() {
        let id = EventId::new().to_string();
        let other = EventId::new().to_string();
        let twice = [("id", id.as_str()), ("id", other.as_str())];
        assert_eq!(
            decode(None, h(&twice), Some(b"{}")),
            Err(DecodeError::AmbiguousId(2))
        );
        let types = [("id", id.as_str()), ("type", "A"), ("type", "A")];
        assert_eq!(
            decode(None, h(&types), Some(b"{}")),
            Err(DecodeError::AmbiguousType(2))
        );
        let binary: &[u8] = &[0xff, 0xfe];
        let headers = [("id", Some(id.as_bytes())), ("bin", Some(binary))];
        assert_eq!(event_id(headers).map(|e| e.to_string()), Ok(id.clone()));
        assert_eq!(event_id(h(&twice)), Err(DecodeError::AmbiguousId(2)));
        let e = decode(None, headers, Some(b"{}")).expect("a foreign binary header is fine");
        assert!(!e.headers.contains_key("bin"));
        let headers = [("id", Some(id.as_bytes())), ("type", Some(binary))];
        assert_eq!(
            decode(None, headers, Some(b"{}")),
            Err(DecodeError::InvalidHeader("type".into()))
        );
    }

    #[test]
    fn a_name_is_matched_whole_a_nul_inside_it_included() {
        let id = EventId::new().to_string();
        let headers = [("id\0x", Some(id.as_bytes())), ("type\0", Some(&b"T"[..]))];
        assert_eq!(event_id(headers), Err(DecodeError::MissingId));
        assert_eq!(
            decode(None, headers, Some(b"{}")),
            Err(DecodeError::MissingId)
        );
    }
}
