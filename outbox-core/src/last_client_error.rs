//! librdkafka's last client-level error, kept by a client context for the application.

use std::sync::{Arc, Mutex, PoisonError};

use rdkafka::error::KafkaError;
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
