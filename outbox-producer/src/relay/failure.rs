use rdkafka::error::{KafkaError, RDKafkaErrorCode};

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
}
