//! From a Kafka record to the handler's [`Event`]: the wire contract (`outbox_core::wire`) and
//! the consumer's own limits. Nothing here touches the database, so a record is rejected
//! before any transaction is begun; the caller quarantines it with the reason given.

use chrono::{TimeZone, Utc};
use outbox_core::{Envelope, wire};
use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use crate::headers::{self, Read};
use crate::slice::{dedup_slice, today};
use crate::{ConsumerConfig, Event, RawHeader};

/// Why a record cannot be handled: the quarantine row's `reason` and `error`, and the event id
/// when one could be read unambiguously.
#[derive(Debug)]
pub(crate) struct Rejected {
    pub(crate) reason: &'static str,
    pub(crate) error: String,
    pub(crate) event_id: Option<Uuid>,
}

impl Rejected {
    /// Whether it parks its key under `ParkKey`: all but a copy requeued for another
    /// consumer, which is quarantined whatever the policy (`requeue.rs`).
    pub(crate) fn parks(&self) -> bool {
        self.reason != crate::requeue::UNSEEN
    }

    fn new(reason: &'static str, error: String, event_id: Option<Uuid>) -> Self {
        Self {
            reason,
            error,
            event_id,
        }
    }
}

/// Decodes `message` under the wire contract and `config`'s limits.
pub(crate) fn decode<P: DeserializeOwned>(
    config: &ConsumerConfig,
    message: &OwnedMessage,
    read: &[Read<'_>],
) -> Result<Event<P>, Rejected> {
    let payload = message.payload();
    if let Some(len) = payload.map(<[u8]>::len)
        && len > config.max_payload_bytes
    {
        // Checked first: a huge payload is not worth parsing to find out what else is wrong.
        let error = format!(
            "payload of {len} bytes exceeds {}",
            config.max_payload_bytes
        );
        return Err(Rejected::new("too_large", error, None));
    }
    let whole = || {
        read.iter().filter_map(|h| match h {
            Read::Whole(name, value) => Some((*name, *value)),
            _ => None,
        })
    };
    // A name rdkafka could not read, or one with a NUL inside (`id\0x` reads as `id`), is
    // not the contract's: the record is not decoded with it.
    if let Some(error) = headers::name_defect(read) {
        let id = crate::requeue::event_id(read);
        return Err(Rejected::new("invalid_header_name", error, id));
    }
    // A requeue header naming no consumer: every consumer would take the copy for another's.
    if let Err(error) = crate::requeue::targets(read) {
        let id = crate::requeue::event_id(read);
        return Err(Rejected::new("invalid_requeue_header", error, id));
    }
    let raw_headers: Vec<RawHeader> = whole()
        .map(|(name, value)| (name.to_owned(), value.map(<[u8]>::to_vec)))
        .collect();
    let headers = whole();
    let Envelope {
        id,
        aggregate_id,
        event_type,
        payload,
        headers,
    } = wire::decode(message.key(), headers.clone(), payload).map_err(|e| {
        let id = wire::event_id(headers).ok().map(|id| *id.as_uuid());
        Rejected::new(e.kind(), e.to_string(), id)
    })?;
    let uuid = Some(*id.as_uuid());
    // Each day a UUIDv7 id names inside the consumer's window gets a dedup slice table, made
    // when first met and dropped once the day is past the TTL (ids dated before the window go
    // to the slice of the day they are handled, `slice.rs`): ids dated ahead would make
    // tables that stay for as long, one per distinct day a producer's clock or a crafted id
    // names. A day of slack covers clocks that disagree and the slice made ahead for tomorrow.
    let (day, latest) = (dedup_slice(id.as_uuid()), today().saturating_add(1));
    if day > latest {
        let error = format!(
            "event id {id} is dated day {day} since the epoch, after day {latest}: \
             requeue it once its day has come, or correct its producer's clock"
        );
        return Err(Rejected::new("id_ahead", error, uuid));
    }
    if let Some(allowed) = &config.event_types
        && !event_type.as_ref().is_some_and(|t| allowed.contains(t))
    {
        let error = format!("event type {event_type:?} is not accepted");
        return Err(Rejected::new("unknown_type", error, uuid));
    }
    // A hand-written `Deserialize` may panic (`.parse().unwrap()` on a field): the record is
    // quarantined like one of the wrong shape. Uncaught, the panic killed the partition's
    // worker, and every member taking the partition over died on the same offset.
    let payload = match std::panic::catch_unwind(|| serde_json::from_value::<P>(payload)) {
        Ok(decoded) => decoded.map_err(|e| Rejected::new("wrong_shape", e.to_string(), uuid))?,
        Err(panic) => {
            let error = format!(
                "the payload's Deserialize panicked: {}",
                crate::dedup_transaction::panic_message(&*panic)
            );
            return Err(Rejected::new("deserialize_panicked", error, uuid));
        }
    };
    Ok(Event {
        id,
        key: aggregate_id,
        event_type,
        payload,
        headers,
        raw_headers,
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
        timestamp: message
            .timestamp()
            .to_millis()
            .and_then(|ms| Utc.timestamp_millis_opt(ms).single()),
    })
}
