//! Sending a claimed batch. Each aggregate's rows form a chain: a row leaves the client only
//! once the previous row of its aggregate in the batch was acknowledged, and a row that is not
//! acknowledged stops its chain. Chains of different aggregates run side by side.
//!
//! Why not send a key's rows together and trust the idempotent producer's order? librdkafka
//! splits them over several produce requests when they do not fit one (`batch.num.messages`,
//! `batch.size`, a linger that ended); when one request fails for good (a record over the
//! topic's `max.message.bytes`), it bumps its epoch and delivers the later requests anyway
//! (it is not gap-less by default), and a delivery timeout is not covered even when it is. A
//! key's later rows would then reach the wire ahead of (or, under `BlockKey`, past) an earlier
//! row that failed. With one row per aggregate in flight, no configuration and no broker answer
//! can do that.
//!
//! A row whose partition the relay knows to be out is not sent (see [`super::outages`]): it
//! stops its chain like a failure, and costs the batch no wait.

use futures::future::join_all;
use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use super::outages::Gate;
use super::row::RowDefect;
use crate::lane::{OutboxRow, chains};

/// What became of one row of a batch.
pub(crate) enum Outcome {
    /// Kafka acknowledged it, on this partition.
    Delivered(i32),
    /// The client or the broker failed it; the partition it was meant for, when assigned.
    Failed(KafkaError, Option<i32>),
    /// Not sent: its partition (this one) is known to be out.
    Waiting(i32),
    /// It cannot become a record under the wire contract.
    Defective(RowDefect),
    /// Not sent: an earlier row of its aggregate in this batch was not delivered.
    Deferred,
    /// Shutdown's grace period ended before its delivery report came.
    Unconfirmed,
}

/// Hands `row` to the producer.
fn send<C: ClientContext + 'static>(
    producer: &FutureProducer<C>,
    row: &OutboxRow,
) -> Result<DeliveryFuture, Outcome> {
    let headers = row.kafka_headers().map_err(Outcome::Defective)?;
    let record = FutureRecord::to(&row.topic)
        .key(row.aggregateid.as_bytes())
        .payload(row.payload.as_bytes())
        .headers(headers)
        .timestamp(row.created_at.timestamp_millis());
    producer
        .send_result(record)
        .map_err(|(error, _)| Outcome::Failed(error, None))
}

/// The delivery report of one record, or [`Outcome::Unconfirmed`] once `expired`.
async fn await_report(delivery: DeliveryFuture, expired: &CancellationToken) -> Outcome {
    tokio::select! {
        report = delivery => match report {
            Ok(Ok(delivery)) => Outcome::Delivered(delivery.partition),
            Ok(Err((error, message))) => {
                use rdkafka::Message;
                let partition = message.partition();
                Outcome::Failed(error, (partition >= 0).then_some(partition))
            }
            Err(_canceled) => Outcome::Failed(KafkaError::Canceled, None),
        },
        () = expired.cancelled() => Outcome::Unconfirmed,
    }
}

/// Sends `row` and waits for its delivery report.
async fn send_and_wait<C: ClientContext + 'static>(
    producer: &FutureProducer<C>,
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
        Outcome::Failed(
            KafkaError::MessageProduction(
                RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge
            ),
            _
        )
    )
}

/// Sends one aggregate's rows, each after the previous one was acknowledged; stops at the
/// first that was not, or at the first whose partition `gate` keeps closed. Returns the
/// outcome of each row it tried.
async fn run_chain<C: ClientContext + 'static>(
    producer: &FutureProducer<C>,
    rows: &[OutboxRow],
    chain: &[usize],
    gate: &Gate,
    expired: &CancellationToken,
) -> Vec<(usize, Outcome)> {
    let mut outcomes = Vec::new();
    for &i in chain {
        if expired.is_cancelled() {
            break;
        }
        let outcome = match gate.admit(i, &rows[i].topic) {
            Ok(()) => send_and_wait(producer, &rows[i], expired).await,
            Err(partition) => Outcome::Waiting(partition),
        };
        let delivered = matches!(outcome, Outcome::Delivered(_));
        outcomes.push((i, outcome));
        if !delivered {
            break;
        }
    }
    outcomes
}

/// Sends `rows` (in sequence order) that `gate` admits and waits for their delivery reports, or until `expired`.
pub(crate) async fn publish<C: ClientContext + 'static>(
    producer: &FutureProducer<C>,
    rows: &[OutboxRow],
    gate: &Gate,
    expired: &CancellationToken,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = rows.iter().map(|_| None).collect();
    let chains = chains(rows);
    let reports = join_all(
        chains
            .iter()
            .map(|chain| run_chain(producer, rows, chain, gate, expired)),
    )
    .await;
    for (i, outcome) in reports.into_iter().flatten() {
        outcomes[i] = Some(outcome);
    }
    // A broker rejects a whole record batch that is over its size limit: every row that
    // shared it fails as if too large, whatever its key. With nothing else in flight now, each
    // is sent again alone, so its own size decides and healthy rows are not quarantined with
    // the oversized one. Each stopped its chain, so nothing of its aggregate went after it.
    let mut rejected: Vec<usize> = (0..rows.len())
        .filter(|&i| outcomes[i].as_ref().is_some_and(is_size_rejection))
        .collect();
    if rejected.len() > 1 {
        rejected.sort_unstable();
        for i in rejected {
            outcomes[i] = Some(if expired.is_cancelled() {
                Outcome::Unconfirmed
            } else {
                send_and_wait(producer, &rows[i], expired).await
            });
        }
    }
    let unsent = || {
        if expired.is_cancelled() {
            Outcome::Unconfirmed
        } else {
            Outcome::Deferred
        }
    };
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or_else(unsent))
        .collect()
}
