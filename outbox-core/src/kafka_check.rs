//! Asking a Kafka cluster whether a client configuration reaches it, and naming what failed.
//!
//! librdkafka treats a refused password or an untrusted certificate like a broker that does
//! not answer: it retries forever, a metadata request ends in "broker transport failure", and
//! the reason reaches only the client's error callback. So a relay or a consumer with a wrong
//! secret would wait as if for an outage. [`check_connection`] asks for the cluster's metadata
//! with a probe client of the same configuration and, when none comes, returns what the
//! probe's callback was told: authentication refused, TLS failed, or no answer.
//! librdkafka's reasons name the mechanism and the failing step, never a secret.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::{ClientContext, DefaultClientContext, OAuthToken};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::CoreError;

/// Why a client configuration does not reach its cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KafkaCheckFailure {
    /// The cluster refused the client's credentials (SASL).
    Authentication,
    /// The TLS handshake failed: an untrusted or unreadable certificate, a key that does not
    /// decrypt, a client certificate the broker refused.
    Tls,
    /// The configuration is refused by librdkafka itself.
    Config,
    /// No broker answered within the time given.
    Unreachable,
}

impl KafkaCheckFailure {
    /// Whether waiting cannot help: credentials, certificates and configuration are wrong
    /// until someone changes them, while an unreachable cluster may come back.
    pub fn needs_a_change(self) -> bool {
        !matches!(self, Self::Unreachable)
    }
}

impl std::fmt::Display for KafkaCheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Authentication => "the cluster refused the client's credentials",
            Self::Tls => "the TLS handshake with the cluster failed",
            Self::Config => "the Kafka client configuration is refused",
            Self::Unreachable => "no Kafka broker answered",
        })
    }
}

/// Asks the cluster `config` names for its metadata, within `timeout`; returns how many
/// brokers it has. Blocks the calling thread (from async code, call it through
/// `spawn_blocking`). Fails with [`CoreError::KafkaCheck`].
pub fn check_connection(config: &ClientConfig, timeout: Duration) -> Result<usize, CoreError> {
    check_connection_with_context(config, DefaultClientContext, timeout)
}

/// [`check_connection`] with the client context the application uses, for what it provides
/// to the client (an OAUTHBEARER token, say).
pub fn check_connection_with_context<C: ClientContext + 'static>(
    config: &ClientConfig,
    context: C,
    timeout: Duration,
) -> Result<usize, CoreError> {
    let probe: BaseConsumer<Probe<C>> = probe_config(config)
        .create_with_context(Probe {
            inner: context,
            reported: Mutex::new(None),
        })
        .map_err(|error| CoreError::KafkaCheck {
            failure: KafkaCheckFailure::Config,
            reason: crate::kafka_secrets::redact_error(error, config).to_string(),
        })?;
    let deadline = Instant::now() + timeout;
    let failed = loop {
        // Serving the probe's queue is what hands librdkafka an OAUTHBEARER token from the
        // context (it connects only once it has one) and delivers errors to the context:
        // short metadata requests in between, never one blocking wait.
        let _ = probe.poll(POLL);
        let left = deadline.saturating_duration_since(Instant::now());
        let error = match probe.fetch_metadata(None, left.clamp(POLL, ASK)) {
            Ok(metadata) => return Ok(metadata.brokers().len()),
            Err(error) => error,
        };
        let precise = probe
            .context()
            .reported()
            .is_some_and(|(failure, _)| failure.needs_a_change());
        if precise || Instant::now() >= deadline {
            break error;
        }
    };
    // A cause may still be on its way through the queue.
    let until = Instant::now() + REPORT_WAIT;
    while probe.context().reported().is_none() && Instant::now() < until {
        let _ = probe.poll(POLL);
    }
    let (failure, reason) = probe
        .context()
        .reported()
        .unwrap_or_else(|| (KafkaCheckFailure::Unreachable, failed.to_string()));
    Err(CoreError::KafkaCheck { failure, reason })
}

/// How long the check serves the probe's queue at a time.
const POLL: Duration = Duration::from_millis(100);
/// The longest one metadata request of the check waits.
const ASK: Duration = Duration::from_millis(500);

/// How long the check serves the probe's queue for a cause after it gave up.
const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The probe takes the application's settings but no consumer group (it would look up a
/// group coordinator, which an ACL'd cluster logs as a denial).
fn probe_config(config: &ClientConfig) -> ClientConfig {
    let mut probe = ClientConfig::new();
    // `config_map` hides secrets' values; `get` gives them.
    for key in config.config_map().into_keys() {
        if let Some(value) = config.get(key)
            && !PRODUCER_ONLY.contains(&key)
            && !key.starts_with("group.")
        {
            probe.set(key, value);
        }
    }
    probe.set_log_level(config.log_level);
    probe
}

/// Settings a consumer refuses or warns about, which a relay's configuration holds.
const PRODUCER_ONLY: &[&str] = &[
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "partitioner",
    "compression.type",
    "compression.codec",
    "linger.ms",
    "queue.buffering.max.ms",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "batch.num.messages",
    "batch.size",
    "retries",
    "message.send.max.retries",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "transactional.id",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
];

struct Probe<C> {
    inner: C,
    reported: Mutex<Option<(KafkaCheckFailure, String)>>,
}

impl<C> Probe<C> {
    fn reported(&self) -> Option<(KafkaCheckFailure, String)> {
        self.reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl<C: ClientContext> ClientContext for Probe<C> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = C::ENABLE_REFRESH_OAUTH_TOKEN;

    fn log(&self, _level: RDKafkaLogLevel, _fac: &str, _message: &str) {
        // The check reports what failed itself; librdkafka's retries would only repeat it.
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let Some(failure) = classify(error.rdkafka_error_code(), reason) else {
            return;
        };
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The first precise cause wins over a later, vaguer one.
        if reported
            .as_ref()
            .is_none_or(|(first, _)| !first.needs_a_change())
        {
            *reported = Some((failure, reason.escape_debug().to_string()));
        }
    }

    fn generate_oauth_token(
        &self,
        oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.inner.generate_oauth_token(oauthbearer_config)
    }
}

impl<C: ClientContext> ConsumerContext for Probe<C> {}

/// What a client error says of the configuration; `None` for "all brokers down", which says
/// nothing the error before it did not. librdkafka reports a connection lost during the TLS
/// or SASL handshake with the SSL or authentication code too ("SSL handshake failed:
/// Disconnected", "... Local: Broker transport failure"): those are outages, not a wrong
/// certificate or password.
fn classify(code: Option<RDKafkaErrorCode>, reason: &str) -> Option<KafkaCheckFailure> {
    let lower = reason.to_ascii_lowercase();
    let lost = [
        "disconnected",
        "timed out",
        "connection refused",
        "transport failure",
    ]
    .iter()
    .any(|words| lower.contains(words));
    // An OpenSSL alert or verification failure: the broker refused the client's
    // certificate (reported as a transport failure), or the client the broker's.
    let refused_certificate = lower.contains("certificate") || lower.contains("alert");
    Some(match code {
        Some(RDKafkaErrorCode::AllBrokersDown) => return None,
        _ if refused_certificate => KafkaCheckFailure::Tls,
        _ if lost => KafkaCheckFailure::Unreachable,
        Some(RDKafkaErrorCode::Authentication) => KafkaCheckFailure::Authentication,
        Some(RDKafkaErrorCode::SSL) => KafkaCheckFailure::Tls,
        _ => KafkaCheckFailure::Unreachable,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_connection_is_no_wrong_password_or_certificate() {
        use KafkaCheckFailure as F;
        use RDKafkaErrorCode as C;
        let cases = [
            (
                C::Authentication,
                "sasl_ssl://h:9094/bootstrap: SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512",
                F::Authentication,
            ),
            (
                C::Authentication,
                "sasl_ssl://h:9094/bootstrap: Failed to initialize SASL authentication: SASL Handshake failed: Local: Broker transport failure",
                F::Unreachable,
            ),
            (
                C::SSL,
                "ssl://h:9095/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified",
                F::Tls,
            ),
            (
                C::BrokerTransportFailure,
                "ssl://h:9095/bootstrap: Receive failed: error:0A000412:SSL routines::sslv3 alert bad certificate: SSL alert number 42",
                F::Tls,
            ),
            (
                C::BrokerTransportFailure,
                "ssl://h:9092/bootstrap: SSL handshake failed: Disconnected: connecting to a PLAINTEXT broker listener?",
                F::Unreachable,
            ),
            (
                C::BrokerTransportFailure,
                "h:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused",
                F::Unreachable,
            ),
        ];
        for (code, reason, expected) in cases {
            assert_eq!(classify(Some(code), reason), Some(expected), "{reason}");
        }
        assert_eq!(
            classify(Some(C::AllBrokersDown), "1/1 brokers are down"),
            None
        );
    }
}
