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
    let started = Instant::now();
    match probe.fetch_metadata(None, timeout) {
        Ok(metadata) => Ok(metadata.brokers().len()),
        Err(error) => {
            // Errors reach the callback through the probe's queue: serve it until one is
            // reported, for what is left of the time and at least a little more.
            let until = (started + timeout).max(Instant::now() + REPORT_WAIT);
            while probe.context().reported().is_none() && Instant::now() < until {
                let _ = probe.poll(Duration::from_millis(100));
            }
            let (failure, reason) = probe
                .context()
                .reported()
                .unwrap_or((KafkaCheckFailure::Unreachable, error.to_string()));
            Err(CoreError::KafkaCheck { failure, reason })
        }
    }
}

/// How long the check serves the probe's queue after the metadata request failed.
const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The probe takes the application's settings but never joins its consumer group.
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
    probe.set("group.id", "outbox-connection-check");
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
        let failure = match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::Authentication) => KafkaCheckFailure::Authentication,
            Some(RDKafkaErrorCode::SSL) => KafkaCheckFailure::Tls,
            // A broker that refuses the client's certificate ends the connection with a TLS
            // alert, which librdkafka reports as a transport failure.
            _ if reason.contains("SSL") || reason.contains("certificate") => KafkaCheckFailure::Tls,
            // "All brokers down" says nothing the transport failure before it did not.
            Some(RDKafkaErrorCode::AllBrokersDown) => return,
            _ => KafkaCheckFailure::Unreachable,
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
