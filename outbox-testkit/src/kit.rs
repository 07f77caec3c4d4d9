//! [`HandlerKit`]: a dedup consumer fed from in-memory partitions instead of Kafka.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use outbox_consumer::quarantine::{QuarantinedMessage, list_quarantined};
use outbox_consumer::{
    ConsumerConfig, ConsumerError, ConsumerStats, DedupConsumer, Event, Handler, HandlerError,
    Outcome,
};
use outbox_core::{EventId, NewEvent};
use rdkafka::message::OwnedMessage;
use serde::de::DeserializeOwned;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::RawRecord;

/// The user's handler, shared by the consumer that runs now and the one a restart builds.
struct Shared<H>(Arc<H>);

impl<P: Sync + 'static, H: Handler<P>> Handler<P> for Shared<H> {
    async fn handle(&self, event: &Event<P>, conn: &mut PgConnection) -> Result<(), HandlerError> {
        self.0.handle(event, conn).await
    }
}

/// Where a record is: topic, partition, offset.
type Position = (String, i32, i64);

/// One partition of the kit's log.
#[derive(Debug, Default)]
struct Partition {
    /// The records, at offsets 0, 1, ...
    records: Vec<OwnedMessage>,
    /// Whether each record's offset was stored: the committed offset is the first one not
    /// stored (what a restarted consumer reads from).
    stored: Vec<bool>,
}

impl Partition {
    fn committed(&self) -> usize {
        self.stored
            .iter()
            .position(|s| !s)
            .unwrap_or(self.stored.len())
    }
}

/// What became of an event delivered once, then again after a crash between its commit and
/// its offset store ([`HandlerKit::crash_after_commit_then_redeliver`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CrashRedelivery {
    /// The outcome of the delivery whose offset was never stored: [`Outcome::Processed`] for
    /// a new event (its effect committed).
    pub before_crash: Outcome,
    /// The outcome of the same record delivered to the restarted consumer:
    /// [`Outcome::DuplicateStored`] for an event whose effect committed (the restarted
    /// consumer's cache is empty; the dedup table answers).
    pub after_restart: Outcome,
}

/// Drives a consumer handler through the real dedup path, on a real PostgreSQL, with records
/// built in memory instead of read from Kafka.
///
/// The kit runs an [`outbox_consumer::DedupConsumer`] (its `process_batch`, the code
/// `dedup_consume` runs per partition batch) with the given pool, configuration and handler:
/// the wire-contract decoding, the in-memory cache, the dedup insert and the handler in one
/// transaction, the failure policy with its retries and backoff, the quarantine. It keeps each
/// partition's records and which offsets were stored, as Kafka and the consumer's offset
/// store would: a delivery stores its offsets once the consumer returns, except where a
/// crash is simulated ([`Self::crash_after_commit_then_redeliver`]), and [`Self::restart`]
/// redelivers every record from the first offset not stored, to a new consumer.
///
/// Records go to the topic of their event ([`NewEvent::topic`]), to the partition of their
/// key among [`Self::partitions`] (1 unless set), at the next offset there. A call's records
/// are handled per partition, in offset order, in batches of at most
/// `ConsumerConfig::max_batch_size` (the partitions one after another).
///
/// The kit migrates nothing: run the framework's migrations on the test database as the
/// application does (`outbox_consumer::migrate`, or `migrate_with` for the
/// `ConsumerConfig::tables` given), with the handler's own tables. Each kit is one consumer
/// name (`ConsumerConfig::name`, required): two kits with the same name on one database
/// share their dedup rows, as two members of one consumer would.
///
/// Retries wait `ConsumerConfig::backoff_base` and more, as in production: give tests a short
/// backoff (`config.backoff(Duration::from_millis(1), Duration::from_millis(10))`). Under
/// `HandlerFailurePolicy::Block`, a handler that never succeeds makes the delivery wait
/// forever, as it would stall a partition.
///
/// Not covered: Kafka itself (fetching, rebalances and revoked partitions, commits to the
/// broker, the consumer's prefetch budget), the relay and Debezium (the records are built as
/// they publish them; see [`RawRecord`]).
pub struct HandlerKit<P, H> {
    pool: PgPool,
    config: ConsumerConfig,
    handler: Arc<H>,
    consumer: DedupConsumer<P, Shared<H>>,
    partitions: i32,
    log: BTreeMap<(String, i32), Partition>,
    /// Where each event id was last appended.
    appended: HashMap<EventId, Position>,
    shutdown: CancellationToken,
}

impl<P, H> std::fmt::Debug for HandlerKit<P, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerKit")
            .field("consumer", &self.consumer)
            .field("partitions", &self.partitions)
            .field(
                "records",
                &self
                    .log
                    .iter()
                    .map(|(k, p)| (k, p.records.len()))
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl<P, H> HandlerKit<P, H>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
{
    /// A kit running `handler` as the consumer `config.name` on `pool`. Errors as
    /// [`DedupConsumer::new`]: a configuration it refuses (no name, ...).
    pub fn new(pool: PgPool, config: ConsumerConfig, handler: H) -> Result<Self, ConsumerError> {
        let handler = Arc::new(handler);
        let consumer =
            DedupConsumer::new(pool.clone(), config.clone(), Shared(Arc::clone(&handler)))?;
        Ok(Self {
            pool,
            config,
            handler,
            consumer,
            partitions: 1,
            log: BTreeMap::new(),
            appended: HashMap::new(),
            shutdown: CancellationToken::new(),
        })
    }

    /// Spreads records over `partitions` partitions per topic (at least 1; 1 by default) by
    /// their key, as the relay's producer does, so that `Event::partition` and the per
    /// partition batches are as they would be on a topic with that many. Set it before the
    /// first delivery: records already delivered stay where they are.
    pub fn partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions.max(1);
        self
    }

    /// The consumer name: the scope of deduplication and of the quarantine rows.
    pub fn name(&self) -> &str {
        self.consumer.name()
    }

    /// The counters of the consumer running now (a [`Self::restart`] starts new ones).
    pub fn stats(&self) -> ConsumerStats {
        self.consumer.stats()
    }

    /// Delivers `event` as the relay publishes it (a new record at the next offset of its
    /// partition) and stores its offset. Returns what the consumer did: [`Outcome::Processed`]
    /// when the handler's transaction committed with the dedup row, a duplicate outcome when
    /// this consumer name had handled its id, [`Outcome::Quarantined`] when the record or the
    /// handler failed under the failure policy. `Err` only when the database could not be
    /// reached; the call's offsets are not stored then, so [`Self::restart`] redelivers its
    /// records (any that committed are then duplicates).
    pub async fn deliver(&mut self, event: &NewEvent) -> Result<Outcome, ConsumerError> {
        self.deliver_raw(RawRecord::from(event)).await
    }

    /// Delivers the very record `event` was last delivered as (same partition, same offset)
    /// again, as Kafka does to a consumer that restarts or takes the partition over before
    /// that offset was committed. The running consumer knows the id from its cache
    /// ([`Outcome::DuplicateCached`]); after [`Self::restart`] the dedup table answers
    /// ([`Outcome::DuplicateStored`]).
    ///
    /// # Panics
    /// When this kit never delivered `event`'s id.
    pub async fn deliver_again(&mut self, event: &NewEvent) -> Result<Outcome, ConsumerError> {
        let position = self.last_position(event, "deliver_again");
        let outcomes = self.handle(&[position]).await?;
        Ok(first(outcomes))
    }

    /// Delivers `event` again as a new record at the next offset of its partition, as when a
    /// relay published it twice (it crashed after Kafka acknowledged the record and before it
    /// marked the row published) or an operator requeued it. The id is the same, so the
    /// consumer skips it.
    ///
    /// # Panics
    /// When this kit never delivered `event`'s id.
    pub async fn republish(&mut self, event: &NewEvent) -> Result<Outcome, ConsumerError> {
        let (topic, partition, offset) = self.last_position(event, "republish");
        let record = self.log[&(topic.clone(), partition)].records[index(offset)].clone();
        let position = self.push(&topic, partition, Some(event.id()), |offset| {
            at_offset(&record, offset)
        });
        Ok(first(self.handle(&[position]).await?))
    }

    /// Delivers `events` as one poll would bring them: new records, appended in order, then
    /// handled per partition in offset order as batches (one transaction for a batch unless a
    /// handler fails: the failing message is retried alone under the failure policy, the
    /// others committed once). Returns the outcomes in the order of `events`.
    pub async fn deliver_batch(
        &mut self,
        events: &[NewEvent],
    ) -> Result<Vec<Outcome>, ConsumerError> {
        self.deliver_raw_batch(events.iter().map(RawRecord::from))
            .await
    }

    /// Delivers a record of any bytes: one that breaks the wire contract (no `id` header, a
    /// payload that is not JSON, binary headers, ...) or comes from another producer. A
    /// record the consumer cannot handle is quarantined whole ([`Self::quarantined`]).
    pub async fn deliver_raw(&mut self, record: RawRecord) -> Result<Outcome, ConsumerError> {
        Ok(first(self.deliver_raw_batch([record]).await?))
    }

    /// [`Self::deliver_batch`] for records of any bytes, events' records among them
    /// ([`RawRecord::from`]).
    pub async fn deliver_raw_batch(
        &mut self,
        records: impl IntoIterator<Item = RawRecord>,
    ) -> Result<Vec<Outcome>, ConsumerError> {
        let positions: Vec<Position> = records
            .into_iter()
            .map(|record| self.append(&record))
            .collect();
        self.handle(&positions).await
    }

    /// Delivers `event`, then crashes the consumer after its transaction committed and
    /// before its offset was stored, then restarts it: a new consumer (its cache empty) reads
    /// the partition again from the committed offset and gets the same record again. The
    /// effect must have happened once: [`CrashRedelivery::before_crash`] is
    /// [`Outcome::Processed`] and [`CrashRedelivery::after_restart`]
    /// [`Outcome::DuplicateStored`] for a handler that succeeds.
    ///
    /// Records delivered earlier whose offsets were not stored (a delivery that returned
    /// `Err`) are redelivered by the restart too, before this one.
    ///
    /// This is the window `DedupConsumer::crash_after_next_commit` (feature
    /// `fault-injection`) opens in a consumer reading Kafka; the kit needs no feature: it
    /// stores offsets itself, so it leaves this one unstored and drops the consumer.
    pub async fn crash_after_commit_then_redeliver(
        &mut self,
        event: &NewEvent,
    ) -> Result<CrashRedelivery, ConsumerError> {
        let mut crashed = self
            .crash_after_batch_commit_then_redeliver(std::slice::from_ref(event))
            .await?;
        Ok(crashed.swap_remove(0))
    }

    /// [`Self::crash_after_commit_then_redeliver`] for a batch: `events` are delivered as by
    /// [`Self::deliver_batch`], the consumer crashes once their transactions committed and
    /// before any of their offsets was stored, and the restarted consumer gets them all
    /// again. One [`CrashRedelivery`] per event, in order.
    pub async fn crash_after_batch_commit_then_redeliver(
        &mut self,
        events: &[NewEvent],
    ) -> Result<Vec<CrashRedelivery>, ConsumerError> {
        let positions: Vec<Position> = events
            .iter()
            .map(|event| self.append(&RawRecord::from(event)))
            .collect();
        let before = self.handle_unstored(&positions).await?;
        let after = self.restart_at().await?;
        Ok(positions
            .iter()
            .zip(before)
            .map(|(position, before_crash)| CrashRedelivery {
                before_crash,
                after_restart: after
                    .iter()
                    .find(|(p, _)| p == position)
                    .map_or(Outcome::Abandoned, |(_, o)| o.clone()),
            })
            .collect())
    }

    /// Restarts the consumer, as after a crash, a deployment or a rebalance: a new consumer
    /// (same name, configuration and handler; an empty cache, counters at zero) reads each
    /// partition again from its committed offset, the first whose offset was not stored.
    /// Returns the outcomes of the records redelivered that way, by topic, partition and
    /// offset (none when every delivery stored its offset).
    pub async fn restart(&mut self) -> Result<Vec<Outcome>, ConsumerError> {
        Ok(self
            .restart_at()
            .await?
            .into_iter()
            .map(|(_, o)| o)
            .collect())
    }

    /// The messages this consumer name quarantined, oldest first, whole (key, value, headers
    /// as bytes; `QuarantinedMessage::record_headers` reads the headers).
    pub async fn quarantined(&self) -> Result<Vec<QuarantinedMessage>, ConsumerError> {
        let mut conn = self.pool.acquire().await?;
        let all = list_quarantined(&mut conn, &self.config.tables, i64::MAX).await?;
        Ok(all
            .into_iter()
            .filter(|m| m.consumer == self.name())
            .collect())
    }

    /// Whether the dedup table records `id` as handled by this consumer name (a committed
    /// handler's transaction, or a committed duplicate of one).
    pub async fn is_recorded(&self, id: EventId) -> Result<bool, ConsumerError> {
        let query = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer = $1 AND event_id = $2)",
            self.config.tables.consumer_dedup
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(query))
            .bind(self.name())
            .bind(id)
            .fetch_one(&self.pool)
            .await?)
    }

    fn last_position(&self, event: &NewEvent, what: &str) -> Position {
        match self.appended.get(&event.id()) {
            Some(position) => position.clone(),
            None => panic!(
                "HandlerKit::{what}: event {} was never delivered by this kit; deliver it first",
                event.id()
            ),
        }
    }

    /// Appends `record` to its partition; returns where.
    fn append(&mut self, record: &RawRecord) -> Position {
        let partition = record.partition_among(self.partitions);
        let id = outbox_core::wire::event_id(
            record
                .headers
                .iter()
                .map(|(name, value)| (name.as_str(), value.as_deref())),
        )
        .ok();
        self.push(&record.topic, partition, id, |offset| {
            record.to_message(partition, offset)
        })
    }

    /// Appends the message `build` makes for the next offset of (`topic`, `partition`),
    /// carrying event `id`; returns where.
    fn push(
        &mut self,
        topic: &str,
        partition: i32,
        id: Option<EventId>,
        build: impl FnOnce(i64) -> OwnedMessage,
    ) -> Position {
        let log = self.log.entry((topic.to_owned(), partition)).or_default();
        let offset = log.records.len() as i64;
        log.records.push(build(offset));
        log.stored.push(false);
        let position = (topic.to_owned(), partition, offset);
        if let Some(id) = id {
            self.appended.insert(id, position.clone());
        }
        position
    }

    /// Handles the records at `positions` and stores their offsets; their outcomes in order.
    async fn handle(&mut self, positions: &[Position]) -> Result<Vec<Outcome>, ConsumerError> {
        let outcomes = self.handle_unstored(positions).await?;
        for (position, outcome) in positions.iter().zip(&outcomes) {
            // A shutdown's abandoned message is redelivered; the kit never shuts down.
            if *outcome != Outcome::Abandoned {
                let (topic, partition, offset) = position;
                if let Some(log) = self.log.get_mut(&(topic.clone(), *partition)) {
                    log.stored[index(*offset)] = true;
                }
            }
        }
        Ok(outcomes)
    }

    /// Handles the records at `positions`, per partition in offset order, in batches of at
    /// most `max_batch_size`; stores no offset. Their outcomes in the order of `positions`.
    async fn handle_unstored(
        &mut self,
        positions: &[Position],
    ) -> Result<Vec<Outcome>, ConsumerError> {
        let mut by_partition: BTreeMap<(String, i32), Vec<(i64, usize)>> = BTreeMap::new();
        let mut order: Vec<(String, i32)> = Vec::new();
        for (at, (topic, partition, offset)) in positions.iter().enumerate() {
            let key = (topic.clone(), *partition);
            if !by_partition.contains_key(&key) {
                order.push(key.clone());
            }
            by_partition.entry(key).or_default().push((*offset, at));
        }
        let mut outcomes = vec![Outcome::Abandoned; positions.len()];
        for key in order {
            let mut wanted = by_partition.remove(&key).unwrap_or_default();
            wanted.sort_unstable();
            let messages: Vec<OwnedMessage> = wanted
                .iter()
                .map(|(offset, _)| self.log[&key].records[index(*offset)].clone())
                .collect();
            let mut done = Vec::with_capacity(messages.len());
            for batch in messages.chunks(self.config.max_batch_size.max(1)) {
                let handled = self.consumer.process_batch(batch, &self.shutdown).await?;
                let abandoned = handled.len() < batch.len();
                done.extend(handled);
                if abandoned {
                    break;
                }
            }
            for ((_, at), outcome) in wanted.iter().zip(done) {
                outcomes[*at] = outcome;
            }
        }
        Ok(outcomes)
    }

    /// [`Self::restart`], with each outcome's position.
    async fn restart_at(&mut self) -> Result<Vec<(Position, Outcome)>, ConsumerError> {
        self.consumer = DedupConsumer::new(
            self.pool.clone(),
            self.config.clone(),
            Shared(Arc::clone(&self.handler)),
        )?;
        let positions: Vec<Position> = self
            .log
            .iter()
            .flat_map(|((topic, partition), log)| {
                (log.committed()..log.records.len())
                    .map(move |offset| (topic.clone(), *partition, offset as i64))
            })
            .collect();
        let outcomes = self.handle(&positions).await?;
        Ok(positions.into_iter().zip(outcomes).collect())
    }
}

/// `message` at `offset` of its partition.
fn at_offset(message: &OwnedMessage, offset: i64) -> OwnedMessage {
    use rdkafka::Message;
    OwnedMessage::new(
        message.payload().map(<[u8]>::to_vec),
        message.key().map(<[u8]>::to_vec),
        message.topic().to_owned(),
        message.timestamp(),
        message.partition(),
        offset,
        message.headers().cloned(),
    )
}

fn index(offset: i64) -> usize {
    usize::try_from(offset).unwrap_or(usize::MAX)
}

fn first(outcomes: Vec<Outcome>) -> Outcome {
    outcomes.into_iter().next().unwrap_or(Outcome::Abandoned)
}
