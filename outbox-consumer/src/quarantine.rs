//! The consumer's quarantine table: how a message is stored in it, and the operator's
//! actions on what it holds.
//!
//! A row keeps the message whole (key, value, headers), so that `outbox quarantine requeue`
//! can publish it again exactly as it was received. The headers are kept as bytes, in order,
//! in `header_bytes` (`header_list.rs` has the format): a header value may hold any bytes, a
//! NUL included, which neither JSONB nor TEXT can. The `headers` column is a view of them for
//! people: each name maps to its value as a JSON string when it is UTF-8 without a NUL, to
//! `{"hex": "<bytes>"}` otherwise, to `null` for a header without a value, and to an array of
//! those, in the order received, when the name repeats. Rows written before migration 0006
//! have no `header_bytes`; their `headers` column is read instead (it lost only the order
//! between different names).
//!
//! A row is unique per position and record: a redelivered message is stored once, a
//! different record at an offset a row already holds (a topic deleted and made again, a
//! cluster failed over) gets its own row.

use chrono::{DateTime, Utc};
use outbox_core::{
    ActionNote, QuarantineAction, QuarantineColumns, QuarantineSide, QuarantineTable, TableNames,
};
use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use serde_json::{Map, Value};
use sqlx::{PgConnection, SqlStr};
use uuid::Uuid;

use crate::failure::is_unavailable;
use crate::headers::{Read, ReceivedHeader};
use crate::{ConsumerError, RawHeader, header_list};

/// Marker of a header value that is not UTF-8, or holds a NUL, in the `headers` column.
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
    /// Headers for people, encoded as the [module docs](self) say. [`Self::received_headers`]
    /// and [`Self::record_headers`] read the headers themselves.
    pub headers: sqlx::types::Json<serde_json::Map<String, serde_json::Value>>,
    /// The headers as bytes ([`Self::received_headers`] decodes them); `None` in rows written
    /// before migration 0006.
    #[serde(skip)]
    pub header_bytes: Option<Vec<u8>>,
    /// The record's timestamp, as Kafka gave it; `None` in rows written before migration 0016
    /// or when the record had none.
    pub record_timestamp: Option<DateTime<Utc>>,
}

impl QuarantinedMessage {
    /// The headers as they were received, in order, with what could be read of each (see
    /// [`ReceivedHeader`]). Rows written before migration 0006 keep the order of a repeated
    /// name's values, not the order between names.
    pub fn received_headers(&self) -> Result<Vec<ReceivedHeader>, ConsumerError> {
        match &self.header_bytes {
            Some(column) => header_list::decode(column)
                .map_err(|e| ConsumerError::InvalidQuarantineRow(format!("row {}: {e}", self.id))),
            None => Ok(self
                .json_headers()?
                .into_iter()
                .map(|(name, value)| ReceivedHeader::Whole { name, value })
                .collect()),
        }
    }

    /// The headers as they were received: name and value bytes, a repeated name once per
    /// value in its original order. An error when a header's name could not be read in full
    /// (not UTF-8, or with a NUL inside): such a message cannot be published again as it was.
    pub fn record_headers(&self) -> Result<Vec<RawHeader>, ConsumerError> {
        self.received_headers()?
            .into_iter()
            .enumerate()
            .map(|(i, header)| match header {
                ReceivedHeader::Whole { name, value } => Ok((name, value)),
                _ => Err(ConsumerError::InvalidQuarantineRow(format!(
                    "row {}: the name of header {i} is not UTF-8 or has a NUL inside: no Kafka \
                     client here sends such a name, so the message cannot be published again \
                     as received",
                    self.id
                ))),
            })
            .collect()
    }

    fn json_headers(&self) -> Result<Vec<RawHeader>, ConsumerError> {
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

/// Reason of a quarantine row whose full form the database refused.
pub(crate) const REFUSED: &str = "quarantine_refused";

/// What a quarantine row says about its message, besides the message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) event_id: Option<Uuid>,
    pub(crate) reason: &'static str,
    pub(crate) error: &'a str,
}

/// Writes `message` into the quarantine table and returns the reason stored. The same record
/// already there (redelivered) is left as it is.
///
/// The database refusing the row for what it holds (any answer but an outage: a value it
/// cannot store, an operator's constraint or trigger) must not stall the partition, as
/// retrying a refusal would: the message is then stored with what cannot be refused (its
/// bytes, the reasons in ASCII) as [`REFUSED`]. The full row is tried in a savepoint when
/// `conn` is in a transaction, so the caller's transaction survives the refusal. `Err` when
/// the database is unavailable, or refused that row too.
pub(crate) async fn store(
    conn: &mut PgConnection,
    insert: &SqlStr,
    message: &OwnedMessage,
    entry: Entry<'_>,
) -> Result<&'static str, sqlx::Error> {
    // Errors quote the record (an `id` header with a NUL): TEXT cannot hold a NUL.
    let error = entry.error.replace('\0', "\\0");
    let full = Entry {
        error: &error,
        ..entry
    };
    let mut attempt = sqlx::Connection::begin(&mut *conn).await?;
    match insert_row(&mut attempt, insert.clone(), message, full, true).await {
        Ok(()) => {
            attempt.commit().await?;
            Ok(entry.reason)
        }
        Err(refused) if !is_unavailable(&refused) => {
            attempt.rollback().await?;
            let error = format!(
                "{}: {error}; the full quarantine row was refused: {refused}",
                entry.reason
            )
            .escape_default()
            .to_string();
            tracing::error!(consumer = entry.consumer, topic = message.topic(),
                partition = message.partition(), offset = message.offset(), %error,
                "the database refused the quarantine row; storing the message's bytes alone");
            let bytes_alone = Entry {
                reason: REFUSED,
                error: &error,
                ..entry
            };
            insert_row(conn, insert.clone(), message, bytes_alone, false).await?;
            Ok(REFUSED)
        }
        Err(unavailable) => Err(unavailable),
    }
}

/// Inserts the row; `people_view` false writes `{}` as the `headers` view (the headers' bytes
/// are kept either way).
async fn insert_row(
    conn: &mut PgConnection,
    insert: SqlStr,
    message: &OwnedMessage,
    entry: Entry<'_>,
    people_view: bool,
) -> Result<(), sqlx::Error> {
    let read = crate::headers::read(message);
    let view = if people_view {
        headers_json(&read)
    } else {
        Map::new()
    };
    sqlx::query(insert)
        .bind(entry.consumer)
        .bind(message.topic())
        .bind(message.partition())
        .bind(message.offset())
        .bind(entry.event_id)
        .bind(message.key())
        .bind(message.payload())
        .bind(Value::Object(view))
        .bind(header_list::encode(&read))
        .bind(entry.reason)
        .bind(entry.error)
        .bind(record_timestamp(message))
        .execute(conn)
        .await?;
    Ok(())
}

/// `message`'s timestamp, whichever kind it is.
pub(crate) fn record_timestamp(message: &OwnedMessage) -> Option<DateTime<Utc>> {
    message
        .timestamp()
        .to_millis()
        .and_then(DateTime::from_timestamp_millis)
}

fn headers_json(read: &[Read<'_>]) -> Map<String, Value> {
    let mut map = Map::new();
    for header in read {
        let (name, value) = match header {
            Read::Whole(name, value) => ((*name).to_owned(), header_value(*value)),
            // Shown, not read back: `header_bytes` holds its bytes.
            Read::Bytes(name, value) => (
                format!(
                    "<name not UTF-8 or with a NUL: \"{}\">",
                    name.escape_ascii()
                ),
                header_value(*value),
            ),
        };
        match map.get_mut(&name) {
            None => {
                map.insert(name, value);
            }
            Some(Value::Array(values)) => values.push(value),
            Some(first) => *first = Value::Array(vec![first.take(), value]),
        }
    }
    map
}

fn header_value(value: Option<&[u8]>) -> Value {
    match value {
        None => Value::Null,
        // JSONB cannot hold U+0000.
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) if !text.contains('\0') => Value::String(text.to_owned()),
            _ => {
                let hex = bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
                Value::Object(Map::from_iter([(BINARY_MARKER.to_owned(), hex.into())]))
            }
        },
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

pub(crate) const COLUMNS: QuarantineColumns = QuarantineColumns {
    all: "id, consumer, topic, partition, \"offset\", event_id, reason, error, quarantined_at, \
          message_key, payload, headers, header_bytes, record_timestamp",
    key: "id",
    held: "TRUE",
    event_id: "event_id",
    consumer: "consumer",
    // A requeue publishes a copy, then deletes the row.
    requeue: None,
};

pub(crate) fn quarantine(tables: &TableNames) -> QuarantineTable<'_> {
    QuarantineTable::new(
        QuarantineSide::Consumer,
        &tables.consumer_quarantine,
        &COLUMNS,
    )
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

/// Checks that `tables.consumer_quarantine` is a consumer quarantine the migrations made
/// (registered in `outbox_quarantine_tables`); returns its schema-qualified name, or
/// `CoreError::NotAQuarantineTable`. Check before publishing copies of its rows: `requeued`
/// and `discard` check it again themselves.
pub async fn verify(conn: &mut PgConnection, tables: &TableNames) -> Result<String, ConsumerError> {
    Ok(quarantine(tables).verify(conn).await?)
}

/// Deletes quarantined messages for good, and records it (with `note`) in
/// `outbox_quarantine_audit`, in one statement. Returns how many there were. A table that is
/// not a registered consumer quarantine is refused with `CoreError::NotAQuarantineTable`,
/// nothing changed.
pub async fn discard(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
    note: &ActionNote,
) -> Result<u64, ConsumerError> {
    Ok(quarantine(tables).discard(conn, ids, note).await?)
}

/// Checks, before a requeue publishes anything, that `tables.consumer_quarantine` is a
/// registered consumer quarantine (as [`verify`]) and that the current role may delete from it
/// and record the action: a copy is published only when the row it copies can be removed
/// and audited. A missing privilege is `CoreError::QuarantinePrivilege`.
pub async fn check_requeue(
    conn: &mut PgConnection,
    tables: &TableNames,
) -> Result<(), ConsumerError> {
    Ok(quarantine(tables)
        .check_privileges(conn, QuarantineAction::Requeue)
        .await?)
}

/// The quarantined message `id`, locked for the caller's transaction (`None`: it is gone,
/// discarded or requeued meanwhile): publish its copy, then [`requeued`], then commit, so that
/// no other action publishes or discards it meanwhile. A message another transaction holds is
/// not waited for: `CoreError::QuarantineRowsBusy`.
pub async fn claim(
    conn: &mut PgConnection,
    tables: &TableNames,
    id: i64,
) -> Result<Option<QuarantinedMessage>, ConsumerError> {
    Ok(quarantine(tables).lock(conn, &[id]).await?.pop())
}

/// Deletes quarantined messages once copies of them were published again (the broker
/// acknowledged them), recorded in `outbox_quarantine_audit` as a requeue (with `note`: where
/// the copies went), in one statement. Returns how many there were; checked as [`discard`].
/// Run it in the transaction that [`claim`]ed them.
pub async fn requeued(
    conn: &mut PgConnection,
    tables: &TableNames,
    ids: &[i64],
    note: &ActionNote,
) -> Result<u64, ConsumerError> {
    Ok(quarantine(tables).requeue(conn, ids, note).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::test_message as message;

    fn row(headers: Map<String, Value>, header_bytes: Option<Vec<u8>>) -> QuarantinedMessage {
        QuarantinedMessage {
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
            headers: sqlx::types::Json(headers),
            header_bytes,
            record_timestamp: None,
        }
    }

    fn owned(received: &[(&str, Option<&[u8]>)]) -> Vec<RawHeader> {
        received
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.map(<[u8]>::to_vec)))
            .collect()
    }

    #[test]
    fn headers_round_trip_through_the_columns_whatever_their_bytes() {
        let received: Vec<(&str, Option<&[u8]>)> = vec![
            ("id", Some(b"a")),
            ("bin", Some(&[0xff, 0x00, 0xc3])),
            ("id", Some(b"b")),
            ("none", None),
            ("id", Some(&[0xfe])),
            // Valid UTF-8, yet JSONB cannot hold it: a Java client's offset header.
            ("dlt", Some(&[0, 0, 0, 42])),
        ];
        let message = message(&received);
        let read = crate::headers::read(&message);
        let json = headers_json(&read);
        assert_eq!(
            Value::Object(json.clone()),
            serde_json::json!({
                "id": ["a", "b", {"hex": "fe"}],
                "bin": {"hex": "ff00c3"},
                "none": null,
                "dlt": {"hex": "0000002a"},
            })
        );
        // A new row: every header, in order, from its bytes.
        let new = row(json.clone(), Some(header_list::encode(&read)));
        assert_eq!(new.record_headers().expect("decodes"), owned(&received));

        // A row written before migration 0006: from the view, names in the column's order.
        let old = row(json, None);
        let mut decoded = old.record_headers().expect("decodes");
        let mut expected = owned(&received);
        decoded.sort_by(|a, b| a.0.cmp(&b.0));
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(decoded, expected);
    }

    #[test]
    fn a_name_that_is_no_contract_name_is_kept_but_not_sent_again() {
        let message = message(&[("id\0x", Some(b"v")), ("ok", Some(b"w"))]);
        let read = crate::headers::read(&message);
        let json = headers_json(&read);
        let stored = row(json, Some(header_list::encode(&read)));
        assert_eq!(
            stored.received_headers().expect("decodes"),
            [
                ReceivedHeader::Bytes {
                    name: b"id\0x".to_vec(),
                    value: Some(b"v".to_vec())
                },
                ReceivedHeader::Whole {
                    name: "ok".into(),
                    value: Some(b"w".to_vec())
                },
            ]
        );
        assert!(matches!(
            stored.record_headers(),
            Err(ConsumerError::InvalidQuarantineRow(_))
        ));
    }
}
