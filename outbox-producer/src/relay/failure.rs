use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::RelayConfig;

/// Whose failure a failed publish is, and whether retrying it can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// The row's own, for good: the same record will fail again (too large, invalid topic,
    /// not authorized, malformed headers). Quarantined at once.
    Permanent,
    /// The row's own, for now: the broker answered and refused this record (topic not there
    /// yet). Charged an attempt and retried after a backoff.
    Transient,
    /// The record's partition cannot take writes now (no leader, the leader unreachable,
    /// fewer in-sync replicas than `min.insync.replicas`): an outage of that partition, not
    /// the row's failure. The row is charged nothing and waits; other partitions flow.
    Outage,
    /// No broker answered for this record (timed out, connection down, client queue full):
    /// the relay's failure, not the row's. When a broker still answers a metadata request,
    /// the record's partition is out ([`Self::Outage`]), or its topic does not exist (then
    /// the row names a topic that is not there: [`Self::Transient`]).
    NoAnswer,
}

pub(crate) fn classify(error: &KafkaError) -> FailureKind {
    use RDKafkaErrorCode as C;
    let code = match error {
        KafkaError::MessageProduction(code) => *code,
        // Canceled: the client went away before it reported; nothing was said about the record.
        _ => return FailureKind::NoAnswer,
    };
    match code {
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::InvalidRecord
        | C::MessageBatchTooLarge
        | C::InvalidTopic
        | C::InvalidArgument
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::UnsupportedForMessageFormat => FailureKind::Permanent,
        C::MessageTimedOut
        | C::BrokerTransportFailure
        | C::AllBrokersDown
        | C::Resolve
        | C::OperationTimedOut
        | C::QueueFull
        | C::PurgeQueue
        | C::PurgeInflight
        | C::RequestTimedOut
        | C::NetworkException => FailureKind::NoAnswer,
        C::NotEnoughReplicas
        | C::NotEnoughReplicasAfterAppend
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::BrokerNotAvailable
        | C::ReplicaNotAvailable
        | C::KafkaStorageError
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch => FailureKind::Outage,
        _ => FailureKind::Transient,
    }
}

/// Longest pause before a row whose partition was out is tried again. Each try costs the
/// batch up to `message.timeout.ms` of waiting, so this also bounds how much of the relay's
/// time one partition's outage takes from the others.
const OUTAGE_WAIT_MAX: Duration = Duration::from_secs(30);

/// Delay before a row whose partition was out is tried again: `backoff_max`, at most
/// [`OUTAGE_WAIT_MAX`], with jitter. It does not grow with the outage: the partition may
/// come back at any time, and the row must follow soon after.
pub(crate) fn outage_wait(config: &RelayConfig) -> Duration {
    outbox_core::backoff(
        config.backoff_max.min(OUTAGE_WAIT_MAX),
        config.backoff_max.min(OUTAGE_WAIT_MAX),
        0,
    )
}

/// Delay before retry number `attempts + 1` (see [`outbox_core::backoff`]).
pub(crate) fn backoff(config: &RelayConfig, attempts: u32) -> Duration {
    outbox_core::backoff(config.backoff_base, config.backoff_max, attempts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_and_topic_errors_are_permanent_silence_is_no_answer() {
        let e = |c| KafkaError::MessageProduction(c);
        assert_eq!(
            classify(&e(RDKafkaErrorCode::MessageSizeTooLarge)),
            FailureKind::Permanent
        );
        assert_eq!(
            classify(&e(RDKafkaErrorCode::InvalidTopic)),
            FailureKind::Permanent
        );
        assert_eq!(
            classify(&e(RDKafkaErrorCode::MessageTimedOut)),
            FailureKind::NoAnswer
        );
        assert_eq!(
            classify(&e(RDKafkaErrorCode::UnknownTopicOrPartition)),
            FailureKind::Transient
        );
        assert_eq!(classify(&KafkaError::Canceled), FailureKind::NoAnswer);
        assert_eq!(
            classify(&e(RDKafkaErrorCode::NotEnoughReplicas)),
            FailureKind::Outage
        );
        assert_eq!(
            classify(&e(RDKafkaErrorCode::LeaderNotAvailable)),
            FailureKind::Outage
        );
    }

    #[test]
    fn backoff_grows_jitters_and_caps() {
        let config =
            RelayConfig::default().backoff(Duration::from_millis(100), Duration::from_secs(1));
        for attempts in 0..40 {
            let cap = Duration::from_millis(100 * 2_u64.saturating_pow(attempts))
                .min(Duration::from_secs(1));
            let d = backoff(&config, attempts);
            assert!(
                d >= cap / 2 && d < cap,
                "attempt {attempts}: {d:?} not in [{:?}, {cap:?})",
                cap / 2
            );
        }
    }
}
