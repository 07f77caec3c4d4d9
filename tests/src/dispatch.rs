//! What the dispatcher tests share: an idempotent destination's ledger, actions of the
//! `billing` destination, a quick configuration, and reading an action's state.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_producer::dispatch::{Action, ActionState, DispatcherConfig, outcome};
use outbox_producer::{EventId, NewEvent, TableNames};
use serde_json::json;

use crate::{TestDb, count_status};

/// What the destination applied: each idempotency key once, and each key's payloads `n` in
/// the order they were applied.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Calls made, repeats included.
    pub calls: AtomicUsize,
    /// Each key's first answer.
    pub applied: Mutex<HashMap<String, serde_json::Value>>,
    /// Each aggregate's payloads `n`, in the order applied.
    pub order: Mutex<BTreeMap<String, Vec<i64>>>,
}

impl Ledger {
    /// Applies `action` once per idempotency key; a repeat gets the first answer back.
    pub fn apply(&self, action: &Action) -> serde_json::Value {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut applied = self.applied.lock().expect("ledger");
        if let Some(answer) = applied.get(&action.idempotency_key()) {
            return answer.clone();
        }
        let payload: serde_json::Value = action.payload_as().unwrap_or_default();
        let n = payload["n"].as_i64().unwrap_or(-1);
        self.order
            .lock()
            .expect("ledger")
            .entry(action.key.clone())
            .or_default()
            .push(n);
        let answer = json!({ "charge": format!("ch_{}", applied.len() + 1), "n": n });
        applied.insert(action.idempotency_key(), answer.clone());
        answer
    }

    /// Keys applied.
    pub fn charges(&self) -> usize {
        self.applied.lock().expect("ledger").len()
    }
}

/// An action of destination `billing` for aggregate `task/key`, payload `{"key", "n"}`.
pub fn action(key: &str, n: i64) -> Result<NewEvent> {
    Ok(
        NewEvent::new("task", key, "Charge", &json!({ "key": key, "n": n }))?
            .for_dispatcher("billing")?,
    )
}

/// Enqueues `events` in one transaction.
pub async fn enqueue(db: &TestDb, events: &[NewEvent]) -> Result<Vec<EventId>> {
    let mut tx = db.pool.begin().await?;
    let ids = outbox_producer::enqueue_all(&mut tx, events).await?;
    tx.commit().await?;
    Ok(ids)
}

/// Quick backoff and polling for tests.
pub fn config() -> DispatcherConfig {
    DispatcherConfig::new("billing")
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(50))
        .shutdown_timeout(Duration::from_secs(5))
}

/// The action's state, as the agent reads it.
pub async fn state(db: &TestDb, id: EventId) -> Result<Option<ActionState>> {
    let mut conn = db.pool.acquire().await?;
    Ok(outcome(&mut conn, &TableNames::default(), id).await?)
}

/// Actions done.
pub async fn dispatched(db: &TestDb) -> Result<i64> {
    count_status(&db.pool, "published").await
}

/// A dispatcher running on a task of its own, until [`Running::stop`].
#[derive(Debug)]
pub struct Running {
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), outbox_producer::ProducerError>>,
}

impl Running {
    /// Starts `dispatcher.run`.
    pub fn start<E: outbox_producer::dispatch::Executor>(
        dispatcher: &outbox_producer::dispatch::Dispatcher<E>,
    ) -> Self {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn({
            let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
            async move { dispatcher.run(shutdown).await }
        });
        Self { shutdown, task }
    }

    /// Shuts it down and returns what `run` returned.
    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        self.task.await??;
        Ok(())
    }
}
