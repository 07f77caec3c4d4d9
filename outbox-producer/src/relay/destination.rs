//! Kafka as a lane's destination: publish a batch, ask the cluster about what went
//! unanswered, learn which partitions are out, and say each row's verdict.

use std::collections::HashMap;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};
use tokio_util::sync::CancellationToken;

use super::RelayConfig;
use super::failure::{FailureKind, classify};
use super::kafka::{self, TopicAnswer, broker_answers};
use super::outages::Outages;
use super::publish::{self, Outcome};
use crate::ProducerError;
use crate::lane::{Destination, Failed, Failure, OutboxRow, Verdict};
use outbox_core::{LastClientError, RecordingContext};

/// How long the relay waits for a broker to answer after a batch failed with no answer.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// How often an idle relay asks an unreachable cluster whether it is back, and how long it
/// waits for the answer: together, how soon after a broker's return publishing resumes.
const BROKER_PROBE_INTERVAL: Duration = Duration::from_secs(1);
const BROKER_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) struct Kafka<C: ClientContext + 'static> {
    producer: FutureProducer<RecordingContext<C>>,
    /// What the producer's context last heard from librdkafka.
    pub(super) client_error: LastClientError,
    /// Partitions known to be out, and partition counts, across batches.
    outages: Mutex<Outages>,
    /// For the outage wait and the metrics' label.
    config: RelayConfig,
    #[cfg(feature = "fault-injection")]
    crash_after_ack: AtomicBool,
}

impl<C: ClientContext + 'static> Kafka<C> {
    pub(super) fn new(
        producer: FutureProducer<RecordingContext<C>>,
        client_error: LastClientError,
        config: &RelayConfig,
    ) -> Self {
        Self {
            producer,
            client_error,
            outages: Mutex::default(),
            config: config.clone(),
            #[cfg(feature = "fault-injection")]
            crash_after_ack: AtomicBool::new(false),
        }
    }

    #[cfg(feature = "fault-injection")]
    pub(super) fn crash_after_next_ack(&self) {
        self.crash_after_ack.store(true, Ordering::SeqCst);
    }

    fn outages(&self) -> MutexGuard<'_, Outages> {
        self.outages.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the cluster says about each topic with a record that went unanswered (whether
    /// it answers at all; whether the topic is there), or that failed for its partition while
    /// the topic's partition count is not known: one metadata request within one deadline,
    /// [`BROKER_CHECK_TIMEOUT`]. Partition counts are kept for the next batches.
    async fn ask_about_failures(
        &self,
        rows: &[OutboxRow],
        outcomes: &[Outcome],
    ) -> HashMap<String, TopicAnswer> {
        let mut topics: Vec<String> = Vec::new();
        {
            let outages = self.outages();
            for (row, outcome) in rows.iter().zip(outcomes) {
                let ask = match outcome {
                    Outcome::Failed(e, _) => match classify(e) {
                        FailureKind::NoAnswer => true,
                        FailureKind::Outage => !outages.knows_partitions_of(&row.topic),
                        _ => false,
                    },
                    _ => false,
                };
                if ask && !topics.contains(&row.topic) {
                    topics.push(row.topic.clone());
                }
            }
        }
        if topics.is_empty() {
            return HashMap::new();
        }
        let answers = kafka::ask_about(&self.producer, topics, BROKER_CHECK_TIMEOUT).await;
        let mut outages = self.outages();
        for (topic, answer) in &answers {
            if let TopicAnswer::Known(count) = answer {
                outages.set_partition_count(topic, *count);
            }
        }
        answers
    }

    /// Learns from a batch's outcomes which partitions are out (a record failed there for
    /// its partition) and which take writes again (a record was acknowledged there).
    fn learn(
        &self,
        rows: &[OutboxRow],
        outcomes: &[Outcome],
        answers: &HashMap<String, TopicAnswer>,
    ) {
        let mut outages = self.outages();
        let now = std::time::Instant::now();
        for (row, outcome) in rows.iter().zip(outcomes) {
            match outcome {
                Outcome::Delivered(partition) => {
                    if outages.mark_up(&row.topic, *partition) {
                        tracing::info!(topic = %outbox_core::escape(&row.topic), partition, "partition takes writes again");
                    }
                    if outages
                        .partition_of(row)
                        .is_some_and(|computed| computed != *partition)
                    {
                        // The topic has more partitions than the relay knew.
                        outages.forget_partition_count(&row.topic);
                    }
                }
                Outcome::Failed(error, partition) => {
                    let outage = match classify(error) {
                        FailureKind::Outage => true,
                        FailureKind::NoAnswer => {
                            matches!(answers.get(&row.topic), Some(TopicAnswer::Known(_)))
                        }
                        _ => false,
                    };
                    if let Some(partition) = partition
                        .or_else(|| outages.partition_of(row))
                        .filter(|_| outage)
                    {
                        let wait = crate::lane::outage_wait(&self.config);
                        tracing::warn!(topic = %outbox_core::escape(&row.topic), partition, probe_in = ?wait, %error, "partition out: its rows wait unsent until a probe is acknowledged");
                        outages.mark_out(&row.topic, partition, now + wait);
                    }
                }
                _ => {}
            }
        }
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!("outbox_relay_partitions_out", "table" => self.config.tables.outbox.as_str().to_owned())
            .set(outages.len() as f64);
    }
}

/// A row's verdict from its publish outcome and what the cluster said about its topic
/// afterwards: nothing (the relay's failure, the row is left as it was), an error for the
/// topic such as missing or not authorized (the row's failure), or that it knows the topic
/// (an outage of the partition: the row waits, charged nothing).
fn verdict(row: &OutboxRow, outcome: Outcome, answers: &HashMap<String, TopicAnswer>) -> Verdict {
    let (kind, error) = match outcome {
        Outcome::Delivered(_) => return Verdict::Done(None),
        Outcome::Deferred => return Verdict::Deferred,
        Outcome::Unconfirmed => return Verdict::Unconfirmed,
        Outcome::Defective(defect) => (Failure::Permanent, defect.to_string()),
        Outcome::Waiting(partition) => {
            let mut failed = Failed::new(
                Failure::Outage,
                format!("partition {partition} is out; not sent"),
            );
            failed.unsent = true;
            return Verdict::Failed(failed);
        }
        Outcome::Failed(error, _) => match classify(&error) {
            FailureKind::NoAnswer => match answers.get(&row.topic) {
                Some(TopicAnswer::Refused(code)) => {
                    // Not authorized or invalid for good; missing or other errors may pass.
                    let kind = match classify(&KafkaError::MessageProduction(*code)) {
                        FailureKind::Permanent => Failure::Permanent,
                        _ => Failure::Transient,
                    };
                    (kind, format!("{error}; the topic's metadata: {code}"))
                }
                Some(TopicAnswer::Known(_)) => (Failure::Outage, error.to_string()),
                Some(TopicAnswer::NoAnswer) | None => return Verdict::Unreachable,
            },
            FailureKind::Permanent => (Failure::Permanent, error.to_string()),
            FailureKind::Transient => (Failure::Transient, error.to_string()),
            FailureKind::Outage => (Failure::Outage, error.to_string()),
        },
    };
    Verdict::Failed(Failed::new(kind, error))
}

impl<C: ClientContext + 'static> Destination for Kafka<C> {
    async fn deliver(
        &self,
        rows: &[OutboxRow],
        expired: &CancellationToken,
    ) -> Result<Vec<Verdict>, ProducerError> {
        let gate = self.outages().gate(rows);
        let outcomes = publish::publish(&self.producer, rows, &gate, expired).await;
        let answers = self.ask_about_failures(rows, &outcomes).await;
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            // Every send now fails: recording those failures would walk healthy rows to
            // quarantine. The error leaves the batch pending, untouched.
            return Err(ProducerError::FatalProducer { code, reason });
        }
        #[cfg(feature = "fault-injection")]
        if self.crash_after_ack.swap(false, Ordering::SeqCst) {
            // Dropping the transaction rolls it back, exactly as a dead process would.
            return Err(ProducerError::InjectedFault(
                "crash after ack, before marking",
            ));
        }
        self.learn(rows, &outcomes, &answers);
        Ok(rows
            .iter()
            .zip(outcomes)
            .map(|(row, outcome)| verdict(row, outcome, &answers))
            .collect())
    }

    async fn wait_until_answers(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(BROKER_PROBE_INTERVAL) => {}
            }
            let probe = broker_answers(&self.producer, None, BROKER_PROBE_TIMEOUT);
            tokio::select! {
                () = shutdown.cancelled() => return,
                answered = probe => if answered {
                    tracing::info!("a broker answers again; relay resumes");
                    return;
                },
            }
        }
    }

    /// Flushes the producer with what is left of the grace period, off the async runtime
    /// (it blocks).
    async fn finish(&self, timeout: Duration) -> Result<(), ProducerError> {
        let producer = self.producer.clone();
        let flushed = tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| ProducerError::Config(format!("flush task failed: {e}")))?;
        match flushed {
            Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) => {
                tracing::warn!(
                    ?timeout,
                    "producer flush timed out; unmarked rows stay pending and will be republished"
                );
                Ok(())
            }
            other => Ok(other?),
        }
    }

    fn last_error(&self) -> Option<String> {
        self.client_error.get()
    }
}
