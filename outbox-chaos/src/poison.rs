//! Malformed records, produced by a plain rdkafka producer straight into the live topic:
//! one of each kind the consumer must quarantine (reason names as `outbox-consumer` stores
//! them), spread over the partitions.

use anyhow::Result;
use outbox_core::{EventId, wire};
use sqlx::PgPool;

use crate::children::EVENT_TYPE;
use crate::kafka::{plain_producer, produce_raw};

/// What the `id` header of a malformed record carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdHeader {
    /// No `id` header at all.
    None,
    /// This text (not a UUID).
    Text(&'static str),
    /// A fresh, valid event id.
    Valid,
}

/// One kind of malformed record.
#[derive(Debug)]
struct Kind<'a> {
    reason: &'static str,
    id: IdHeader,
    event_type: &'a str,
    payload: &'a [u8],
}

/// Larger than the consumers' `max_payload_bytes` (16 KiB).
const OVERSIZED: usize = 20 * 1024;

/// Injects one record of each kind into `topic` (partitions chosen round-robin from
/// `round`) and records them in `chaos_poison`. Returns how many were injected.
pub(crate) async fn inject(
    pool: &PgPool,
    brokers: &str,
    topic: &str,
    partitions: i32,
    round: u32,
) -> Result<usize> {
    let producer = plain_producer(brokers)?;
    let good_payload = br#"{"key":"poison","version":0,"pad":""}"#.to_vec();
    let big_payload = format!(
        r#"{{"key":"poison","version":0,"pad":"{}"}}"#,
        "p".repeat(OVERSIZED)
    );
    let kinds = [
        Kind {
            reason: "missing_id",
            id: IdHeader::None,
            event_type: EVENT_TYPE,
            payload: &good_payload,
        },
        Kind {
            reason: "invalid_id",
            id: IdHeader::Text("not-a-uuid"),
            event_type: EVENT_TYPE,
            payload: &good_payload,
        },
        Kind {
            reason: "invalid_json",
            id: IdHeader::Valid,
            event_type: EVENT_TYPE,
            payload: b"{not json",
        },
        Kind {
            reason: "wrong_shape",
            id: IdHeader::Valid,
            event_type: EVENT_TYPE,
            payload: br#"{"unexpected":true}"#,
        },
        Kind {
            reason: "too_large",
            id: IdHeader::Valid,
            event_type: EVENT_TYPE,
            payload: big_payload.as_bytes(),
        },
        Kind {
            reason: "unknown_type",
            id: IdHeader::Valid,
            event_type: "NotAChaosEvent",
            payload: &good_payload,
        },
    ];
    let mut injected = 0;
    let count = kinds.len();
    for (i, kind) in kinds.into_iter().enumerate() {
        let partition = i32::try_from((round as usize * count + i) % partitions as usize)?;
        let id = (kind.id == IdHeader::Valid).then(|| *EventId::new().as_uuid());
        let id_text = match kind.id {
            IdHeader::None => None,
            IdHeader::Text(text) => Some(text.to_owned()),
            IdHeader::Valid => id.map(|u| u.to_string()),
        };
        let mut headers = vec![(wire::HEADER_TYPE, kind.event_type)];
        if let Some(text) = id_text.as_deref() {
            headers.push((wire::HEADER_ID, text));
        }
        let offset = produce_raw(
            &producer,
            topic,
            partition,
            "poison",
            kind.payload,
            &headers,
        )
        .await?;
        // Recorded at once: if the broker fails half-way, what was injected is still known.
        sqlx::query(
            "INSERT INTO chaos_poison (event_id, partition, kafka_offset, expected_reason, epoch) \
             VALUES ($1, $2, $3, $4, (SELECT count(*) FROM chaos_topic_deletions))",
        )
        .bind(id)
        .bind(partition)
        .bind(offset)
        .bind(kind.reason)
        .execute(pool)
        .await?;
        injected += 1;
    }
    Ok(injected)
}
