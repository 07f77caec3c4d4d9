//! Sending a claimed batch. A key's rows go out in waves: a row leaves the client only once
//! its key's earlier rows of the batch on other topics were acknowledged, so a delivery
//! report that fails one row can still hold back the key's later rows. Rows of one key on one
//! topic go out together: they share a partition, where the idempotent producer keeps them
//! in order.

use std::collections::{HashMap, HashSet};

use futures::future::join_all;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use super::row::{OutboxRow, RowDefect};

/// What became of one row of a batch.
pub(crate) enum Outcome {
    /// Kafka acknowledged it.
    Delivered,
    /// The client or the broker failed it.
    Failed(KafkaError),
    /// It cannot become a record under the wire contract.
    Defective(RowDefect),
    /// Not sent: an earlier row of its key in this batch was not delivered.
    Deferred,
    /// Shutdown's grace period ended before its delivery report came.
    Unconfirmed,
}

/// The wave of each row: 0 for a key's first row in the batch, one more than the previous
/// row of its key when that one goes to another topic, the same wave otherwise.
fn waves(rows: &[OutboxRow]) -> Vec<usize> {
    let mut last: HashMap<&str, (usize, &str)> = HashMap::new();
    rows.iter()
        .map(|row| {
            let wave = match last.get(row.aggregateid.as_str()) {
                Some(&(wave, topic)) if topic == row.topic => wave,
                Some(&(wave, _)) => wave + 1,
                None => 0,
            };
            last.insert(&row.aggregateid, (wave, &row.topic));
            wave
        })
        .collect()
}

/// Hands `row` to the producer.
fn send(producer: &FutureProducer, row: &OutboxRow) -> Result<DeliveryFuture, Outcome> {
    let headers = row.kafka_headers().map_err(Outcome::Defective)?;
    let record = FutureRecord::to(&row.topic)
        .key(row.aggregateid.as_bytes())
        .payload(row.payload.as_bytes())
        .headers(headers)
        .timestamp(row.created_at.timestamp_millis());
    producer
        .send_result(record)
        .map_err(|(error, _)| Outcome::Failed(error))
}

/// The delivery report of one record, or [`Outcome::Unconfirmed`] once `expired`.
async fn await_report(delivery: DeliveryFuture, expired: &CancellationToken) -> Outcome {
    tokio::select! {
        report = delivery => match report {
            Ok(Ok(_)) => Outcome::Delivered,
            Ok(Err((error, _))) => Outcome::Failed(error),
            Err(_canceled) => Outcome::Failed(KafkaError::Canceled),
        },
        () = expired.cancelled() => Outcome::Unconfirmed,
    }
}

/// Sends `row` with nothing else in flight, so that it travels in a record batch of its own.
async fn send_alone(
    producer: &FutureProducer,
    row: &OutboxRow,
    expired: &CancellationToken,
) -> Outcome {
    match send(producer, row) {
        Ok(delivery) => await_report(delivery, expired).await,
        Err(outcome) => outcome,
    }
}

fn is_size_rejection(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Failed(KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge
        ))
    )
}

/// Sends `rows` (in sequence order) and waits for their delivery reports, or until `expired`.
pub(crate) async fn publish(
    producer: &FutureProducer,
    rows: &[OutboxRow],
    expired: &CancellationToken,
) -> Vec<Outcome> {
    let waves = waves(rows);
    let mut outcomes: Vec<Option<Outcome>> = rows.iter().map(|_| None).collect();
    let mut held: HashSet<&str> = HashSet::new();
    for wave in 0..=waves.iter().copied().max().unwrap_or(0) {
        let mut in_flight = Vec::new();
        for (i, row) in rows.iter().enumerate().filter(|(i, _)| waves[*i] == wave) {
            let key = row.aggregateid.as_str();
            let outcome = if expired.is_cancelled() {
                Outcome::Unconfirmed
            } else if held.contains(key) {
                Outcome::Deferred
            } else {
                match send(producer, row) {
                    Ok(delivery) => {
                        in_flight.push((i, delivery));
                        continue;
                    }
                    Err(outcome) => outcome,
                }
            };
            held.insert(key);
            outcomes[i] = Some(outcome);
        }
        let reports = join_all(
            in_flight
                .into_iter()
                .map(|(i, delivery)| async move { (i, await_report(delivery, expired).await) }),
        )
        .await;
        // A broker rejects a whole record batch that is over its size limit: every row that
        // shared it fails as if too large. Sent again one at a time, each row's own size
        // decides, and healthy rows are not quarantined with the oversized one.
        let rejected_together = reports.iter().filter(|(_, o)| is_size_rejection(o)).count() > 1;
        let mut again = Vec::new();
        for (i, outcome) in reports {
            if rejected_together && is_size_rejection(&outcome) {
                again.push(i);
                continue;
            }
            if !matches!(outcome, Outcome::Delivered) {
                held.insert(&rows[i].aggregateid);
            }
            outcomes[i] = Some(outcome);
        }
        again.sort_unstable();
        for i in again {
            let row = &rows[i];
            let outcome = if held.contains(row.aggregateid.as_str()) {
                Outcome::Deferred
            } else {
                send_alone(producer, row, expired).await
            };
            if !matches!(outcome, Outcome::Delivered) {
                held.insert(&row.aggregateid);
            }
            outcomes[i] = Some(outcome);
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::Deferred))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use outbox_core::EventId;
    use sqlx::types::Json;

    fn row(key: &str, topic: &str) -> OutboxRow {
        OutboxRow {
            seq: 0,
            id: EventId::new(),
            aggregateid: key.into(),
            event_type: "T".into(),
            payload: "{}".into(),
            headers: Json(serde_json::json!({})),
            topic: topic.into(),
            created_at: Utc::now(),
            attempts: 0,
        }
    }

    #[test]
    fn a_keys_row_on_another_topic_waits_for_the_next_wave() {
        let rows = [
            row("a", "t1"),
            row("b", "t1"),
            row("a", "t1"),
            row("a", "t2"),
            row("b", "t2"),
            row("a", "t1"),
        ];
        assert_eq!(waves(&rows), [0, 0, 0, 1, 1, 2]);
    }
}
