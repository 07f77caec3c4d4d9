//! The Kafka record a claimed outbox row becomes.

use outbox_core::wire;
use rdkafka::message::{Header, OwnedHeaders};

use crate::lane::OutboxRow;

/// Why a row cannot become a record under the wire contract: the row's own, permanent failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RowDefect {
    /// `headers` is JSONB that serde_json cannot read (a number outside `f64`, nesting deeper
    /// than 127 levels).
    #[error("headers cannot be read: {0}")]
    HeadersUnreadable(String),
    /// `headers` is not a JSON object.
    #[error("headers must be a JSON object of strings, found a JSON {0}")]
    HeadersNotObject(&'static str),
    /// A header value is not a JSON string.
    #[error("header {0:?} must be a JSON string, found a JSON {1}")]
    HeaderNotString(String, &'static str),
    /// An application header carries a contract header's name: sent, it would be a second
    /// `id` or `type` header and make the record ambiguous to every consumer.
    #[error("header {0:?} is reserved by the wire contract")]
    ReservedHeader(String),
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

impl OutboxRow {
    /// The Kafka headers of this row under the wire contract: `id`, `type`, then the
    /// application's headers.
    pub(crate) fn kafka_headers(&self) -> Result<OwnedHeaders, RowDefect> {
        let headers: serde_json::Value = serde_json::from_str(&self.headers)
            .map_err(|e| RowDefect::HeadersUnreadable(e.to_string()))?;
        let serde_json::Value::Object(app) = &headers else {
            return Err(RowDefect::HeadersNotObject(json_kind(&headers)));
        };
        let id = self.id.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(2 + app.len())
            .insert(Header {
                key: wire::HEADER_ID,
                value: Some(id.as_str()),
            })
            .insert(Header {
                key: wire::HEADER_TYPE,
                value: Some(self.event_type.as_str()),
            });
        for (key, value) in app {
            if wire::is_reserved_header(key) {
                return Err(RowDefect::ReservedHeader(key.clone()));
            }
            let serde_json::Value::String(value) = value else {
                return Err(RowDefect::HeaderNotString(key.clone(), json_kind(value)));
            };
            headers = headers.insert(Header {
                key,
                value: Some(value.as_str()),
            });
        }
        Ok(headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::Headers;
    use serde_json::json;

    fn row(headers: serde_json::Value) -> OutboxRow {
        let mut row = crate::lane::test_row("order", "k", "t");
        row.headers = headers.to_string();
        row
    }

    #[test]
    fn contract_headers_come_first_then_the_applications() {
        let r = row(json!({ "tenant": "acme" }));
        let h = r.kafka_headers().expect("valid");
        let names: Vec<&str> = h.iter().map(|h| h.key).collect();
        assert_eq!(names, ["id", "type", "tenant"]);
    }

    #[test]
    fn malformed_or_reserved_headers_are_the_rows_defect() {
        assert_eq!(
            row(json!([1])).kafka_headers().err(),
            Some(RowDefect::HeadersNotObject("array"))
        );
        assert_eq!(
            row(json!({ "n": 1 })).kafka_headers().err(),
            Some(RowDefect::HeaderNotString("n".into(), "number"))
        );
        for name in wire::RESERVED_HEADERS {
            assert_eq!(
                row(json!({ *name: "x" })).kafka_headers().err(),
                Some(RowDefect::ReservedHeader((*name).into()))
            );
        }
    }
}
