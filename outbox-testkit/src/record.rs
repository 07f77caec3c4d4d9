//! Kafka records as the consumer receives them, built without a broker: the wire contract's
//! record of a [`NewEvent`], or any bytes at all.

use outbox_consumer::RawHeader;
use outbox_core::{NewEvent, wire};
use rdkafka::Timestamp;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};

/// A Kafka record before it has a partition and an offset: what a producer sends.
///
/// [`RawRecord::from`] a [`NewEvent`] is the record the relay (or Debezium's Outbox Event
/// Router) publishes for it, under the wire contract (`outbox_core::wire`): topic
/// [`NewEvent::topic`], key the aggregate id, value the JSON payload, headers `id`, `type`,
/// then the event's application headers, timestamp the time it was built (the relay's is the
/// row's `created_at`). Change any part of it, or start from [`RawRecord::new`], to make a
/// record that breaks the contract: the fields are public.
///
/// Header names are UTF-8 (rdkafka builds headers from `&str`); a name may hold a NUL. Header
/// values, the key and the payload are any bytes.
///
/// ```
/// use outbox_core::NewEvent;
/// use outbox_testkit::RawRecord;
///
/// let event = NewEvent::new("invoice", "inv-1", "InvoiceRequested", &serde_json::json!({"cents": 1}))?;
/// let record = RawRecord::from(&event).with_payload(&b"{not json"[..]);
/// assert_eq!(record.key.as_deref(), Some(&b"inv-1"[..]));
/// assert_eq!(record.headers[0].0, "id");
/// # Ok::<(), outbox_core::CoreError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawRecord {
    /// The topic.
    pub topic: String,
    /// The partition; `None`: the key's partition as the relay's producer picks it (Java's
    /// `murmur2` of the key, [`outbox_core::java_partition`]), partition 0 for a record
    /// without a key.
    pub partition: Option<i32>,
    /// The key (`None`: no key).
    pub key: Option<Vec<u8>>,
    /// The value (`None`: no value, a tombstone).
    pub payload: Option<Vec<u8>>,
    /// The headers, in order; a name may repeat (`None`: a header without a value).
    pub headers: Vec<RawHeader>,
    /// The record's create time in milliseconds since the Unix epoch (`None`: not available).
    pub timestamp_ms: Option<i64>,
}

impl RawRecord {
    /// A record of `topic` with no key, no value, no header, no timestamp.
    pub fn new(topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            partition: None,
            key: None,
            payload: None,
            headers: Vec::new(),
            timestamp_ms: None,
        }
    }

    /// Sets the key.
    pub fn with_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the value.
    pub fn with_payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.payload = Some(payload.into());
        self
    }

    /// Appends a header with `value` (after those there are, even of the same name).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), Some(value.into())));
        self
    }

    /// Removes every header named `name`.
    pub fn without_header(mut self, name: &str) -> Self {
        self.headers.retain(|(n, _)| n != name);
        self
    }

    /// Puts the record in `partition` instead of its key's.
    pub fn in_partition(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }

    /// The partition this record goes to among `partitions` (more than zero): its own
    /// [`Self::partition`], else its key's as the relay's producer picks it, else 0.
    pub fn partition_among(&self, partitions: i32) -> i32 {
        match (self.partition, &self.key) {
            (Some(partition), _) => partition,
            (None, Some(key)) => outbox_core::java_partition(key, partitions.max(1)),
            (None, None) => 0,
        }
    }

    /// The record as a consumer reads it from `partition` at `offset`: what
    /// `outbox_consumer::DedupConsumer::process` takes.
    pub fn to_message(&self, partition: i32, offset: i64) -> OwnedMessage {
        let headers = self.headers.iter().fold(
            OwnedHeaders::new_with_capacity(self.headers.len()),
            |hs, (key, value)| {
                hs.insert(Header {
                    key,
                    value: value.as_deref(),
                })
            },
        );
        OwnedMessage::new(
            self.payload.clone(),
            self.key.clone(),
            self.topic.clone(),
            self.timestamp_ms
                .map_or(Timestamp::NotAvailable, Timestamp::CreateTime),
            partition,
            offset,
            (!self.headers.is_empty()).then_some(headers),
        )
    }
}

impl From<&NewEvent> for RawRecord {
    fn from(event: &NewEvent) -> Self {
        let id = event.id().to_string();
        let mut headers: Vec<RawHeader> = Vec::with_capacity(2 + event.headers().len());
        headers.push((wire::HEADER_ID.to_owned(), Some(id.into_bytes())));
        headers.push((
            wire::HEADER_TYPE.to_owned(),
            Some(event.event_type().as_bytes().to_vec()),
        ));
        headers.extend(
            event
                .headers()
                .iter()
                .map(|(name, value)| (name.clone(), Some(value.as_bytes().to_vec()))),
        );
        Self {
            topic: event.topic().to_owned(),
            partition: None,
            key: Some(event.aggregate_id().as_bytes().to_vec()),
            // The relay sends the JSONB column's text; the bytes differ in spacing, not in value.
            payload: Some(event.payload().to_string().into_bytes()),
            headers,
            timestamp_ms: Some(chrono::Utc::now().timestamp_millis()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Message;
    use rdkafka::message::Headers;

    #[test]
    fn an_events_record_follows_the_wire_contract() -> Result<(), outbox_core::CoreError> {
        let event = NewEvent::new("order", "o-7", "OrderPlaced", &serde_json::json!({"n": 1}))?
            .with_header("tenant", "acme")?
            .with_header("a-first", "x")?;
        let message = RawRecord::from(&event).to_message(2, 41);
        assert_eq!(message.topic(), "outbox.event.order");
        assert_eq!((message.partition(), message.offset()), (2, 41));
        assert_eq!(message.key(), Some(&b"o-7"[..]));
        let payload: serde_json::Value =
            serde_json::from_slice(message.payload().unwrap_or_default())
                .map_err(|e| outbox_core::CoreError::InvalidEvent(e.to_string()))?;
        assert_eq!(payload, serde_json::json!({"n": 1}));
        let headers: Vec<(String, Option<Vec<u8>>)> = message
            .headers()
            .into_iter()
            .flat_map(|h| h.iter())
            .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
            .collect();
        let id = event.id().to_string();
        assert_eq!(
            headers,
            [
                ("id".to_owned(), Some(id.into_bytes())),
                ("type".to_owned(), Some(b"OrderPlaced".to_vec())),
                ("a-first".to_owned(), Some(b"x".to_vec())),
                ("tenant".to_owned(), Some(b"acme".to_vec())),
            ]
        );
        assert!(matches!(message.timestamp(), Timestamp::CreateTime(_)));
        Ok(())
    }

    #[test]
    fn a_record_goes_to_its_keys_partition_unless_told_otherwise() {
        let keyed = RawRecord::new("t").with_key(&b"21"[..]);
        // Kafka's own vector: murmur2("21") = -973932308.
        assert_eq!(
            keyed.partition_among(7),
            (-973_932_308_i32 & 0x7fff_ffff) % 7
        );
        assert_eq!(keyed.partition_among(1), 0);
        assert_eq!(RawRecord::new("t").partition_among(4), 0);
        assert_eq!(keyed.in_partition(3).partition_among(4), 3);
    }

    #[test]
    fn hostile_parts_arrive_as_given() {
        let record = RawRecord::new("t")
            .with_key(vec![0xff, 0xfe])
            .with_header("id", &b"not-a-uuid"[..])
            .with_header("id", &b"again"[..])
            .with_header("n\0ul", vec![0, 159, 146, 150]);
        let mut record = record;
        record.headers.push(("none".into(), None));
        let message = record.to_message(0, 0);
        assert_eq!(message.key(), Some(&[0xff, 0xfe][..]));
        assert_eq!(message.payload(), None);
        assert_eq!(message.timestamp(), Timestamp::NotAvailable);
        let headers = message.headers().map_or(0, |h| h.count());
        assert_eq!(headers, 4);
        assert_eq!(
            RawRecord::new("t")
                .to_message(0, 0)
                .headers()
                .map(|h| h.count()),
            None
        );
        let stripped = record.without_header("id");
        assert_eq!(stripped.headers.len(), 2);
    }
}
