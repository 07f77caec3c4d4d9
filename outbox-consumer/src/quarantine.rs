//! The consumer's quarantine table: how a message is stored in it, and the operator's
//! actions on what it holds.
//!
//! A row keeps the message whole (key, value, headers), so that `outbox quarantine requeue`
//! can publish it again exactly as it was received. Header values may be any bytes, and a
//! name may repeat (that is what an `ambiguous_id` message is), so the `headers` column maps
//! each name to its value as a JSON string when it is UTF-8, to `{"hex": "<bytes>"}` when it
//! is not, to `null` for a header without a value, and to an array of those, in the order
//! received, when the name repeats. Only the order between different names is not kept
//! (JSONB does not keep object order).

use chrono::{DateTime, Utc};
use outbox_core::{QuarantineTable, TableNames};
use rdkafka::Message;
use rdkafka::message::{Headers, OwnedMessage};
use serde_json::{Map, Value};
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use crate::{ConsumerError, RawHeader};

/// Marker of a header value that is not UTF-8 in the `headers` column.
const BINARY_MARKER: &str = "hex";

/// A quarantined message, whole: enough to publish it again exactly as it was received.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize)]
#[non_exhaustive]
pub struct QuarantinedMessage {
    /// Quarantine row id: what `discard` takes.
    pub id: i64,
    /// Consumer that quarantined it.
    pub consumer: String,
    /// Where it was read.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// The event id, when it could be decoded.
    pub event_id: Option<Uuid>,
    /// Reason kind (`invalid_json`, `handler_failed`, ...).
    pub reason: String,
    /// The error in words.
    pub error: String,
    /// When it was quarantined.
    pub quarantined_at: DateTime<Utc>,
    /// The raw key.
    pub message_key: Option<Vec<u8>>,
    /// The raw value.
    pub payload: Option<Vec<u8>>,
    /// Headers, encoded as the [module docs](self) say; [`Self::record_headers`] decodes them.
    pub headers: sqlx::types::Json<serde_json::Map<String, serde_json::Value>>,
}

impl QuarantinedMessage {
    /// The headers as they were received: name and value bytes, a repeated name once per
    /// value in its original order.
    pub fn record_headers(&self) -> Result<Vec<RawHeader>, ConsumerError> {
        let mut headers = Vec::new();
        for (name, value) in self.headers.0.iter() {
            let values = match value {
                Value::Array(values) => values.as_slice(),
                single => std::slice::from_ref(single),
            };
            for value in values {
                let bytes = header_bytes(value).ok_or_else(|| {
                    ConsumerError::InvalidQuarantineRow(format!(
                        "row {}: header {name:?} is not a string, null or {{\"{BINARY_MARKER}\": ...}}: {value}",
                        self.id
                    ))
                })?;
                headers.push((name.clone(), bytes));
            }
        }
        Ok(headers)
    }
}

/// Writes `message` into the quarantine table. A message already there (redelivered) is
/// left as it is.
pub(crate) async fn record(
    conn: &mut PgConnection,
    insert: SqlStr,
    consumer: &str,
    message: &OwnedMessage,
    event_id: Option<Uuid>,
    reason: &str,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(insert)
        .bind(consumer)
        .bind(message.topic())
        .bind(message.partition())
        .bind(message.offset())
        .bind(event_id)
        .bind(message.key())
        .bind(message.payload())
        .bind(Value::Object(headers_json(message)))
        .bind(reason)
        .bind(error)
        .execute(conn)
        .await?;
    Ok(())
}

fn headers_json(message: &OwnedMessage) -> Map<String, Value> {
    let mut map = Map::new();
    for header in message.headers().into_iter().flat_map(|hs| hs.iter()) {
        let value = header_value(header.value);
        match map.get_mut(header.key) {
            None => {
                map.insert(header.key.to_owned(), value);
            }
            Some(Value::Array(values)) => values.push(value),
            Some(first) => *first = Value::Array(vec![first.take(), value]),
        }
    }
    map
}

fn header_value(value: Option<&[u8]>) -> Value {
    match value.map(std::str::from_utf8) {
        None => Value::Null,
        Some(Ok(text)) => Value::String(text.to_owned()),
        Some(Err(_)) => {
            let bytes = value.unwrap_or_default();
            let hex = bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
            Value::Object(Map::from_iter([(BINARY_MARKER.to_owned(), hex.into())]))
        }
    }
}

fn header_bytes(value: &Value) -> Option<Option<Vec<u8>>> {
    match value {
        Value::Null => Some(None),
        Value::String(text) => Some(Some(text.clone().into_bytes())),
        Value::Object(map) if map.len() == 1 => {
            let hex = map.get(BINARY_MARKER)?.as_str()?;
            if hex.len() % 2 != 0 || !hex.is_ascii() {
                return None;
            }
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()
                .map(Some)
        }
        _ => None,
    }
}

const COLUMNS: &str = "id, consumer, topic, partition, \"offset\", event_id, reason, error, quarantined_at, \
                       message_key, payload, headers";

fn quarantine(tables: &TableNames) -> QuarantineTable<'_> {
    QuarantineTable::new(&tables.consumer_quarantine, COLUMNS, "id", "TRUE")
}

/// The oldest `limit` quarantined messages, of every consumer.
pub async fn list_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    limit: i64,
) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
    Ok(quarantine(tables).list(conn, limit).await?)
}

/// Quarantined messages with the given ids.
pub async fn get_quarantined(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
    Ok(quarantine(tables).get(conn, ids).await?)
}

/// Deletes quarantined messages (after they were requeued, or to drop them for good).
pub async fn discard(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
) -> Result<u64, ConsumerError> {
    Ok(quarantine(tables).discard(conn, ids).await?)
}

#[cfg(test)]
mod tests {
    use rdkafka::message::{Header, OwnedHeaders, Timestamp};

    use super::*;

    #[test]
    fn headers_round_trip_through_the_column_whatever_their_bytes() {
        let received: Vec<(&str, Option<&[u8]>)> = vec![
            ("id", Some(b"a")),
            ("bin", Some(&[0xff, 0x00, 0xc3])),
            ("id", Some(b"b")),
            ("none", None),
            ("id", Some(&[0xfe])),
        ];
        let headers = received
            .iter()
            .fold(OwnedHeaders::new(), |hs, (key, value)| {
                hs.insert(Header { key, value: *value })
            });
        let message = OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(headers),
        );
        let json = headers_json(&message);
        assert_eq!(
            Value::Object(json.clone()),
            serde_json::json!({
                "id": ["a", "b", {"hex": "fe"}],
                "bin": {"hex": "ff00c3"},
                "none": null,
            })
        );
        let row = QuarantinedMessage {
            id: 1,
            consumer: "c".into(),
            topic: "t".into(),
            partition: 0,
            offset: 0,
            event_id: None,
            reason: "ambiguous_id".into(),
            error: String::new(),
            quarantined_at: Utc::now(),
            message_key: None,
            payload: None,
            headers: sqlx::types::Json(json),
        };
        let mut decoded = row.record_headers().expect("decodes");
        let mut expected: Vec<(String, Option<Vec<u8>>)> = received
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.map(<[u8]>::to_vec)))
            .collect();
        // Names keep their values' order; only the order between names is the column's.
        decoded.sort_by(|a, b| a.0.cmp(&b.0));
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(decoded, expected);
    }
}
