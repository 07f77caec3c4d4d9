//! The relay producer's client context: the application's, wrapped so the relay can say why
//! no broker answers.

use rdkafka::client::{ClientContext, OAuthToken};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::statistics::Statistics;

pub(crate) use outbox_core::LastClientError as LastError;

/// Forwards everything to the application's context `C`, keeping librdkafka's last
/// client-level error (a refused password, a failed TLS handshake, a broker down).
/// librdkafka's context is out of reach once the producer holds it, so the relay keeps this
/// handle on the error it records.
pub(crate) struct RelayContext<C> {
    inner: C,
    last_error: LastError,
}

impl<C> RelayContext<C> {
    pub(crate) fn new(inner: C, last_error: LastError) -> Self {
        Self { inner, last_error }
    }
}

impl<C: ClientContext> ClientContext for RelayContext<C> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = C::ENABLE_REFRESH_OAUTH_TOKEN;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        self.inner.log(level, fac, log_message);
    }

    fn stats(&self, statistics: Statistics) {
        self.inner.stats(statistics);
    }

    fn stats_raw(&self, statistics: &[u8]) {
        self.inner.stats_raw(statistics);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.last_error.record(&error, reason);
        self.inner.error(error, reason);
    }

    fn generate_oauth_token(
        &self,
        oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.inner.generate_oauth_token(oauthbearer_config)
    }
}
