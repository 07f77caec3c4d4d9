use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::RelayConfig;

/// Whether retrying a failed publish can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// The same record will fail again (too large, invalid topic, not authorized).
    Permanent,
    /// The broker may accept it later (unreachable, timed out, topic not there yet).
    Transient,
}

pub(crate) fn classify(error: &KafkaError) -> FailureKind {
    use RDKafkaErrorCode as C;
    let code = match error {
        KafkaError::MessageProduction(code) => *code,
        _ => return FailureKind::Transient,
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
        _ => FailureKind::Transient,
    }
}

/// Delay before retry number `attempts + 1` (see [`outbox_core::backoff`]).
pub(crate) fn backoff(config: &RelayConfig, attempts: u32) -> Duration {
    outbox_core::backoff(config.backoff_base, config.backoff_max, attempts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_and_topic_errors_are_permanent_timeouts_are_not() {
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
            FailureKind::Transient
        );
        assert_eq!(
            classify(&e(RDKafkaErrorCode::UnknownTopicOrPartition)),
            FailureKind::Transient
        );
        assert_eq!(classify(&KafkaError::Canceled), FailureKind::Transient);
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
