//! Shutdown's grace period: `shutdown_timeout` from the signal, whatever is in flight then.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Cancels [`Self::expired`] `timeout` after `shutdown` is cancelled.
pub(crate) struct Grace {
    pub(crate) expired: CancellationToken,
    ends_at: Arc<OnceLock<Instant>>,
    timer: JoinHandle<()>,
}

impl Grace {
    pub(crate) fn start(shutdown: CancellationToken, timeout: Duration) -> Self {
        let expired = CancellationToken::new();
        let ends_at = Arc::new(OnceLock::new());
        let timer = tokio::spawn({
            let (expired, ends_at) = (expired.clone(), ends_at.clone());
            async move {
                shutdown.cancelled().await;
                let end = *ends_at.get_or_init(|| Instant::now() + timeout);
                tokio::time::sleep_until(end).await;
                expired.cancel();
            }
        });
        Self {
            expired,
            ends_at,
            timer,
        }
    }

    /// What is left of the grace period (all of `fallback` if shutdown was not signalled).
    pub(crate) fn remaining(&self, fallback: Duration) -> Duration {
        self.ends_at.get().map_or(fallback, |end| {
            end.saturating_duration_since(Instant::now())
        })
    }
}

impl Drop for Grace {
    fn drop(&mut self) {
        self.timer.abort();
    }
}
