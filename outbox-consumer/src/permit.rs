//! A partition's turn among the `max_concurrent_partitions` that may run at once. A message
//! waiting out a retry backoff gives its turn back for the wait: a partition stuck on one
//! failing message (or waiting for the database) would otherwise take a turn for as long as
//! it stays stuck, and as many stuck partitions as there are turns would stall every other
//! partition of the member.

use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tokio_util::sync::CancellationToken;

use crate::ConsumerError;

#[derive(Debug)]
pub(crate) struct Turn<'a> {
    permits: Option<&'a Semaphore>,
    held: Option<SemaphorePermit<'a>>,
}

impl<'a> Turn<'a> {
    /// No limit: for [`crate::DedupConsumer::process`] called on its own.
    pub(crate) fn unlimited() -> Self {
        Self {
            permits: None,
            held: None,
        }
    }

    /// Waits for a turn among `permits`.
    pub(crate) async fn take(permits: &'a Semaphore) -> Result<Self, ConsumerError> {
        let mut turn = Self {
            permits: Some(permits),
            held: None,
        };
        turn.retake().await?;
        Ok(turn)
    }

    /// Sleeps `delay` without the turn, then waits for it again (behind partitions that
    /// asked first). `false` if `shutdown` came first; the turn is not retaken then.
    pub(crate) async fn back_off(
        &mut self,
        delay: Duration,
        shutdown: &CancellationToken,
    ) -> Result<bool, ConsumerError> {
        self.held = None;
        // Nothing is open during the sleep, so it may be cut short by shutdown.
        tokio::select! {
            () = shutdown.cancelled() => return Ok(false),
            () = tokio::time::sleep(delay) => {}
        }
        self.retake().await?;
        Ok(true)
    }

    async fn retake(&mut self) -> Result<(), ConsumerError> {
        if let Some(permits) = self.permits {
            let permit = permits
                .acquire()
                .await
                .map_err(|e| ConsumerError::Worker(e.to_string()))?;
            self.held = Some(permit);
        }
        Ok(())
    }
}
