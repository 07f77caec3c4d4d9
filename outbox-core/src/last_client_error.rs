//! librdkafka's last client-level error, kept by a client context for the application.

use std::sync::{Arc, Mutex, PoisonError};

use rdkafka::client::{ClientContext, OAuthToken};
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::statistics::Statistics;
use rdkafka::types::RDKafkaErrorCode;

/// The last client error librdkafka reported (a refused password, a TLS handshake that
/// failed, a lost broker connection), escaped. A client context records it; a clone read
/// elsewhere sees it, since librdkafka keeps the context once the client holds it. "All
/// brokers down" never overwrites the cause before it. librdkafka's reasons name the
/// mechanism and the step that failed, never a secret.
#[derive(Debug, Clone, Default)]
pub struct LastClientError(Arc<Mutex<Option<String>>>);

impl LastClientError {
    /// The error, as `"<error>: <reason>"`.
    pub fn get(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records what a context's `ClientContext::error` was told.
    pub fn record(&self, error: &KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            return;
        }
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(format!("{error}: {}", reason.escape_debug()));
    }
}

/// A client context that forwards everything to the application's context `C` and records
/// librdkafka's client errors in a [`LastClientError`]: the relay's producer and the
/// consumer's `DedupContext` are built on it. Take [`Self::last_error`] before handing the
/// context to a client, which keeps it out of reach.
#[derive(Debug, Default)]
pub struct RecordingContext<C> {
    inner: C,
    last_error: LastClientError,
}

impl<C> RecordingContext<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Self {
            inner,
            last_error: LastClientError::default(),
        }
    }

    /// A handle on the errors this context records.
    pub fn last_error(&self) -> LastClientError {
        self.last_error.clone()
    }

    /// The application's context.
    pub fn inner(&self) -> &C {
        &self.inner
    }
}

impl<C: ClientContext> ClientContext for RecordingContext<C> {
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
