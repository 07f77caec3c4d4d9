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
//! Application headers travel as further UTF-8 headers.

/// Header carrying the event id (the dedup key).
pub const HEADER_ID: &str = "id";
/// Header carrying the event type.
pub const HEADER_TYPE: &str = "type";

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
    /// A header value is not UTF-8.
    #[error("header {0:?} is not UTF-8")]
    InvalidHeader(String),
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
            Self::MissingPayload => "missing_payload",
            Self::InvalidJson(_) => "invalid_json",
        }
    }
}

/// Decodes a record's parts under the contract. The `id` header may be plain UUID text (this
/// relay, Debezium's `SimpleHeaderConverter`) or a JSON string (Debezium's `JsonConverter`).
pub fn decode<'h>(
    key: Option<&[u8]>,
    headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
    payload: Option<&[u8]>,
) -> Result<Envelope<serde_json::Value>, DecodeError> {
    let mut decoded = BTreeMap::new();
    for (name, value) in headers {
        let value = std::str::from_utf8(value.unwrap_or_default())
            .map_err(|_| DecodeError::InvalidHeader(name.to_owned()))?;
        decoded.insert(name.to_owned(), value.to_owned());
    }
    let id = decoded.get(HEADER_ID).ok_or(DecodeError::MissingId)?;
    let id = id.trim().trim_matches('"');
    let id = id
        .parse::<EventId>()
        .map_err(|_| DecodeError::InvalidId(id.to_owned()))?;
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
}
