//! [`HandlerFailurePolicy::ParkKey`]: a record given up on parks its key, and the key's later
//! records on that partition are parked behind it, in offset order, in the park table
//! (migration 0016), while the partition's other keys flow on and its offset advances.
//!
//! Each partition's parked keys are loaded once per assignment (a key parked by the member
//! that owned the partition before is parked here too) and kept in memory: with nothing
//! parked, a batch costs one map lookup more, no statement. The partition's worker alone
//! parks and unparks its keys, so the set in memory and the table agree without locks:
//! records of a parked key are parked in the batch's transaction (or their own), and the
//! key is added to the set once that commits.
//!
//! An operator releases a key in the table (`outbox parked release`); the worker of its
//! partition looks for releases every [`RELEASE_POLL`] while it has keys parked, and replays
//! the key's records through the handler, head first, each on the same path as a fetched
//! message (dedup row and handler in one transaction, under the failure policy). A record
//! handled (or found handled already: a crash between its commit and its row's delete) is
//! deleted from the park; when none is left, the key is unparked and its next records flow.
//! A record that fails again parks the key again (the release is cleared), with what failed.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};
use serde::de::DeserializeOwned;
use sqlx::SqlStr;
use tokio_util::sync::CancellationToken;

use crate::consumer::{Inner, bump};
use crate::headers::ReceivedHeader;
use crate::permit::Turn;
use crate::quarantine::QuarantinedMessage;
use crate::{ConsumerError, DedupConsumer, Handler, HandlerFailurePolicy, Outcome};

/// How often a partition's worker with keys parked looks for keys released.
pub(crate) const RELEASE_POLL: Duration = Duration::from_secs(1);

/// Reason of a record parked behind its key.
pub(crate) const KEY_PARKED: &str = "key_parked";

/// Where a record set aside goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Aside {
    Quarantine,
    /// Behind its key; `head`: it parks the key itself (it was given up on), rather than
    /// being behind a key parked already.
    Park {
        head: bool,
    },
}

/// `message`'s key, if it has one to keep the order of: a missing or empty key has none (the
/// relay never writes one; another producer's records without a key go to any partition).
pub(crate) fn key_of(message: &OwnedMessage) -> Option<&[u8]> {
    message.key().filter(|key| !key.is_empty())
}

impl Aside {
    /// Where `message`, given up on, goes: it parks its key under `ParkKey` when it has one.
    pub(crate) fn of<P, H>(inner: &Inner<P, H>, message: &OwnedMessage) -> Self {
        if inner.config.on_handler_failure == HandlerFailurePolicy::ParkKey
            && key_of(message).is_some()
        {
            Self::Park { head: true }
        } else {
            Self::Quarantine
        }
    }

    /// The statement that stores it (`quarantine::store` binds it).
    pub(crate) fn sql<P, H>(self, inner: &Inner<P, H>) -> &SqlStr {
        match self {
            Self::Quarantine => &inner.sql().quarantine,
            Self::Park { head: true } => &inner.sql().park_head,
            Self::Park { head: false } => &inner.sql().park_behind,
        }
    }
}

/// Parked keys per partition, with how many records each holds; a partition is present once
/// its keys were loaded.
#[derive(Debug, Default)]
pub(crate) struct Parks(Mutex<HashMap<(String, i32), Keys>>);

/// A partition's parked keys, with how many records each holds.
type Keys = HashMap<Vec<u8>, u64>;

impl Parks {
    fn lock(&self) -> MutexGuard<'_, HashMap<(String, i32), Keys>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn loaded(&self, topic: &str, partition: i32) -> bool {
        self.lock().contains_key(&(topic.to_owned(), partition))
    }

    /// Whether `key` is parked on the partition.
    pub(crate) fn contains(&self, topic: &str, partition: i32, key: &[u8]) -> bool {
        self.lock()
            .get(&(topic.to_owned(), partition))
            .is_some_and(|keys| keys.contains_key(key))
    }

    /// Whether any key is parked on the partition.
    pub(crate) fn any(&self, topic: &str, partition: i32) -> bool {
        self.lock()
            .get(&(topic.to_owned(), partition))
            .is_some_and(|keys| !keys.is_empty())
    }

    /// Counts a record parked under `key` (committed); how many it holds now.
    pub(crate) fn add(&self, topic: &str, partition: i32, key: &[u8]) -> u64 {
        let mut parks = self.lock();
        let keys = parks.entry((topic.to_owned(), partition)).or_default();
        let n = keys.entry(key.to_vec()).or_default();
        *n = n.saturating_add(1);
        *n
    }

    fn remove(&self, topic: &str, partition: i32, key: &[u8]) {
        if let Some(keys) = self.lock().get_mut(&(topic.to_owned(), partition)) {
            keys.remove(key);
        }
    }

    /// Forgets the partition's keys: the next batch loads them again (after a rebalance,
    /// another member may have parked some).
    pub(crate) fn forget(&self, topic: &str, partition: i32) {
        self.lock().remove(&(topic.to_owned(), partition));
    }
}

impl<P, H> DedupConsumer<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// Loads the keys parked on `topic`/`partition` unless they are known. Whatever the
    /// policy: keys parked under `ParkKey` stay parked, their records in order, after a switch
    /// to another policy, until released.
    pub(crate) async fn load_parks(
        &self,
        topic: &str,
        partition: i32,
    ) -> Result<(), ConsumerError> {
        let inner = &*self.inner;
        if inner.parks.loaded(topic, partition) {
            return Ok(());
        }
        let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(inner.sql().parked_keys.clone())
            .bind(&inner.name)
            .bind(topic)
            .bind(partition)
            .fetch_all(&inner.pool)
            .await?;
        let keys = rows
            .into_iter()
            .map(|(key, n)| (key, u64::try_from(n).unwrap_or_default()))
            .collect();
        inner
            .parks
            .lock()
            .insert((topic.to_owned(), partition), keys);
        Ok(())
    }

    /// Replays the keys released on `topic`/`partition`: each key's parked messages go through
    /// the handler in offset order (each once), and a key whose messages were all handled is
    /// unparked. [`run`](Self::run) does it for the partitions it owns, within a second of a
    /// release; a loop driving [`process_batch`](Self::process_batch) by hand calls it for
    /// the partitions it owns (it loads their parked keys again first: another member may have
    /// parked some since). At most
    /// [`ConsumerConfig::max_batch_size`](crate::ConsumerConfig::max_batch_size) messages per
    /// call; `Ok(true)`: there may be more, call again. `Err` when the database is unavailable.
    pub async fn replay_released(
        &self,
        topic: &str,
        partition: i32,
        shutdown: &CancellationToken,
    ) -> Result<bool, ConsumerError> {
        let inner = &*self.inner;
        inner.parks.forget(topic, partition);
        self.load_parks(topic, partition).await?;
        let replayed = || inner.counters.replayed.load(Ordering::Relaxed);
        let before = replayed();
        self.replay_keys(
            (topic, partition),
            shutdown,
            &mut Turn::unlimited(),
            &|| true,
        )
        .await?;
        Ok(replayed() - before >= inner.config.max_batch_size as u64)
    }

    /// Replays the records of the keys released on `topic`/`partition` (see the module docs)
    /// while the partition is `owned`, at most `max_batch_size` of them, so that the
    /// partition's other keys wait no longer than for a batch (the rest come at the next
    /// poll). `Ok(false)`: shutdown came.
    pub(crate) async fn replay_keys(
        &self,
        at: (&str, i32),
        shutdown: &CancellationToken,
        turn: &mut Turn<'_>,
        owned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<bool, ConsumerError> {
        let inner = &*self.inner;
        inner.know_session().await?;
        let mut budget = inner.config.max_batch_size;
        let released: Vec<Vec<u8>> = sqlx::query_scalar(inner.sql().released_keys.clone())
            .bind(&inner.name)
            .bind(at.0)
            .bind(at.1)
            .fetch_all(&inner.pool)
            .await?;
        for key in released {
            if let Some(going) = self
                .replay_key(at, &key, &mut budget, shutdown, turn, owned)
                .await?
            {
                return Ok(going);
            }
        }
        Ok(true)
    }

    /// Replays released `key`'s records, head first, while `budget` lasts: `None` when the
    /// key is done with (unparked, or parked again), `Some` when the replay must stop there
    /// (`false`: shutdown came).
    async fn replay_key(
        &self,
        (topic, partition): (&str, i32),
        key: &[u8],
        budget: &mut usize,
        shutdown: &CancellationToken,
        turn: &mut Turn<'_>,
        owned: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Option<bool>, ConsumerError> {
        let inner = &*self.inner;
        let sql = inner.sql();
        // The statements on the key's rows: `$1`..`$4` name it.
        let on_key = |statement: &SqlStr| {
            sqlx::query(statement.clone())
                .bind(&inner.name)
                .bind(topic)
                .bind(partition)
                .bind(key)
        };
        let shown = outbox_core::escape(&String::from_utf8_lossy(key)).to_string();
        tracing::info!(consumer = %inner.name, topic, partition, key = %shown, "replaying a released key");
        loop {
            if shutdown.is_cancelled() {
                return Ok(Some(false));
            }
            if !owned() || *budget == 0 {
                return Ok(Some(true));
            }
            *budget -= 1;
            let head: Option<QuarantinedMessage> = sqlx::query_as(sql.parked_head.clone())
                .bind(&inner.name)
                .bind(topic)
                .bind(partition)
                .bind(key)
                .fetch_optional(&inner.pool)
                .await?;
            let Some(head) = head else {
                on_key(&sql.unpark_key).execute(&inner.pool).await?;
                // Its row is gone either way (another member's replay may have taken it).
                inner.parks.remove(topic, partition, key);
                tracing::info!(consumer = %inner.name, topic, partition, key = %shown,
                    "key released: its records were handled");
                return Ok(None);
            };
            let Some(message) = as_received(&head) else {
                // Rebuilt, it would not be the record received: it stays, and says so.
                on_key(&sql.unreplayable)
                    .bind(head.id)
                    .execute(&inner.pool)
                    .await?;
                tracing::error!(consumer = %inner.name, topic, partition, offset = head.offset,
                    "a parked record whose header name is not UTF-8 cannot be replayed; skip it");
                return Ok(None);
            };
            let item = self
                .decode_items(std::slice::from_ref(&message))
                .await?
                .pop()
                .expect("one item per message");
            bump(&inner.counters.replayed);
            match self
                .alone(&message, &item, shutdown, turn, owned, None)
                .await?
            {
                // Parked again: the release is cleared, the key waits for the next.
                Outcome::Parked(_) => return Ok(None),
                Outcome::Abandoned => return Ok(Some(false)),
                Outcome::Revoked => return Ok(Some(true)),
                outcome => {
                    crate::consumer::record_metric(&inner.name, &outcome);
                    sqlx::query(sql.unpark_record.clone())
                        .bind(head.id)
                        .execute(&inner.pool)
                        .await?;
                }
            }
        }
    }
}

/// The record a parked row holds, as it was received; `None` when a header's name is not
/// UTF-8 (a header name is a `&str` to rdkafka) or the headers cannot be read.
fn as_received(row: &QuarantinedMessage) -> Option<OwnedMessage> {
    let headers = row
        .received_headers()
        .ok()?
        .into_iter()
        .map(|header| match header {
            ReceivedHeader::Whole { name, value } => Some((name, value)),
            // A name with a NUL inside is still UTF-8: the same name.
            ReceivedHeader::Bytes { name, value } => Some((String::from_utf8(name).ok()?, value)),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .fold(OwnedHeaders::new(), |headers, (name, value)| {
            headers.insert(Header {
                key: name.as_str(),
                value: value.as_deref(),
            })
        });
    let timestamp = row.record_timestamp.map_or(Timestamp::NotAvailable, |at| {
        Timestamp::CreateTime(at.timestamp_millis())
    });
    Some(OwnedMessage::new(
        row.payload.clone(),
        row.message_key.clone(),
        row.topic.clone(),
        timestamp,
        row.partition,
        row.offset,
        Some(headers),
    ))
}
