//! Malformed records, produced by a plain rdkafka producer straight into the live topic:
//! one of each kind the consumer must quarantine (reason names as `outbox-consumer` stores
//! them), spread over the partitions.

use anyhow::Result;
use outbox_core::{EventId, wire};
use sqlx::PgPool;
use uuid::Uuid;

use crate::children::EVENT_TYPE;
use crate::kafka::{plain_producer, produce_raw};

/// One injected record and the quarantine reason it must get.
#[derive(Debug, Clone)]
struct Poison {
    event_id: Option<Uuid>,
    partition: i32,
    offset: i64,
    reason: &'static str,
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
    // (reason, carries a valid id, type header, payload, id header override)
    let kinds: [(&'static str, bool, &str, &[u8], Option<&str>); 6] = [
        ("missing_id", false, EVENT_TYPE, &good_payload, None),
        (
            "invalid_id",
            false,
            EVENT_TYPE,
            &good_payload,
            Some("not-a-uuid"),
        ),
        ("invalid_json", true, EVENT_TYPE, b"{not json", None),
        (
            "wrong_shape",
            true,
            EVENT_TYPE,
            br#"{"unexpected":true}"#,
            None,
        ),
        ("too_large", true, EVENT_TYPE, big_payload.as_bytes(), None),
        ("unknown_type", true, "NotAChaosEvent", &good_payload, None),
    ];
    let mut injected = Vec::new();
    for (i, (reason, with_id, event_type, payload, bad_id)) in kinds.into_iter().enumerate() {
        let partition = i32::try_from((round as usize * kinds_len() + i) % partitions as usize)?;
        let id = with_id.then(|| *EventId::new().as_uuid());
        let id_text = id.map(|u| u.to_string());
        let mut headers = vec![(wire::HEADER_TYPE, event_type)];
        if let Some(text) = id_text.as_deref().or(bad_id) {
            headers.push((wire::HEADER_ID, text));
        }
        let offset = produce_raw(&producer, topic, partition, "poison", payload, &headers).await?;
        injected.push(Poison {
            event_id: id,
            partition,
            offset,
            reason,
        });
    }
    for p in &injected {
        sqlx::query(
            "INSERT INTO chaos_poison (event_id, partition, kafka_offset, expected_reason) VALUES ($1, $2, $3, $4)",
        )
        .bind(p.event_id)
        .bind(p.partition)
        .bind(p.offset)
        .bind(p.reason)
        .execute(pool)
        .await?;
    }
    Ok(injected.len())
}

const fn kinds_len() -> usize {
    6
}
