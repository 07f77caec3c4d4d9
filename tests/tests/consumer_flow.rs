//! How the consumer's poll loop copes with slow partitions and rebalances: real Postgres,
//! real Apache Kafka broker.

use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{ConsumerConfig, DedupConsumer, Event, consumer_config, stream_consumer};
use outbox_core::EventId;
use outbox_tests::{TestDb, eventually, kafka_bootstrap, random_topic, unique};
use rdkafka::ClientConfig;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Deserialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(90);

#[derive(Debug, Deserialize)]
struct Order {
    n: i64,
}

/// Sends `count` events with key `key` to `partition`, all in flight at once.
async fn send_many(topic: &str, partition: i32, key: &str, count: i64) -> Result<()> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        // Many records per batch, so that a paused and resumed partition fetches from inside
        // one (what a broker must serve correctly; tansu's memory storage did not).
        .set("linger.ms", "5")
        .create()?;
    let sends = (0..count).map(|n| {
        let id = EventId::new().to_string();
        let payload = format!(r#"{{"n":{n}}}"#);
        let producer = &producer;
        async move {
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: "id",
                    value: Some(id.as_bytes()),
                })
                .insert(Header {
                    key: "type",
                    value: Some(b"OrderPlaced".as_slice()),
                });
            producer
                .send(
                    FutureRecord::to(topic)
                        .partition(partition)
                        .key(key)
                        .payload(&payload)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
        }
    });
    futures::future::try_join_all(sends).await?;
    Ok(())
}

/// Backends of the pool named `name` (see `TestDb::pool_named`) matching `state`, a
/// `pg_stat_activity` condition written by the test.
async fn backends(db: &TestDb, name: &str, state: &'static str) -> Result<i64> {
    let sql =
        format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND {state}");
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(name)
        .fetch_one(&db.pool)
        .await?)
}

async fn effects_table(pool: &PgPool) -> Result<()> {
    // No unique constraint: a double effect shows as a second row.
    sqlx::query("CREATE TABLE effects (event_id UUID, key TEXT, n BIGINT)")
        .execute(pool)
        .await?;
    Ok(())
}

/// (rows, distinct event ids) of `key`'s effects, or of all when `key` is `None`.
async fn effects(pool: &PgPool, key: Option<&str>) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id) FROM effects WHERE $1::text IS NULL OR key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await?)
}

/// A consumer recording each event's effect after waiting for `gate` when `blocks` says so.
fn gated_consumer(
    pool: PgPool,
    config: ConsumerConfig,
    blocks: fn(&Event<Order>) -> bool,
    gate: CancellationToken,
) -> Result<DedupConsumer<Order, impl outbox_consumer::Handler<Order>>> {
    Ok(DedupConsumer::new(
        pool,
        config,
        outbox_consumer::boxed(move |event: &Event<Order>, conn| {
            let (gate, blocked) = (gate.clone(), blocks(event));
            Box::pin(async move {
                if blocked {
                    gate.cancelled().await;
                }
                sqlx::query("INSERT INTO effects (event_id, key, n) VALUES ($1, $2, $3)")
                    .bind(event.id)
                    .bind(&event.key)
                    .bind(event.payload.n)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }),
    )?)
}

fn spawn<H: outbox_consumer::Handler<Order>>(
    consumer: &DedupConsumer<Order, H>,
    topic: &str,
    group: &str,
    shutdown: &CancellationToken,
) -> Result<tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>> {
    let stream = stream_consumer(
        consumer_config(&kafka_bootstrap(), group)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500"),
    )?;
    stream.subscribe(&[topic])?;
    let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
    Ok(tokio::spawn(
        async move { consumer.run(stream, shutdown).await },
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_partition_does_not_stop_the_others() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(2).await?;
    // Far more than one batch (256), and all of it received before the other partition's
    // events.
    send_many(&topic, 0, "slow", 600).await?;
    send_many(&topic, 1, "fast", 20).await?;

    let gate = CancellationToken::new();
    let consumer = gated_consumer(
        db.pool.clone(),
        ConsumerConfig::new("c1"),
        |e| e.key == "slow",
        gate.clone(),
    )?;
    let shutdown = CancellationToken::new();
    let run = spawn(&consumer, &topic, &unique("g"), &shutdown)?;
    eventually(
        "the other partition is handled while one handler is stuck",
        WAIT,
        || async { Ok(effects(&db.pool, Some("fast")).await? == (20, 20)) },
    )
    .await?;
    assert_eq!(effects(&db.pool, Some("slow")).await?, (0, 0));

    gate.cancel();
    eventually("the stuck partition catches up", WAIT, || async {
        Ok(effects(&db.pool, None).await?.1 == 620)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(effects(&db.pool, None).await?, (620, 620), "once per event");
    assert_eq!(consumer.stats().processed, 620);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_queued_for_a_revoked_partition_are_dropped_not_handled() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(2).await?;
    for partition in 0..2 {
        send_many(&topic, partition, &format!("k{partition}"), 100).await?;
    }
    let group = unique("g");
    let first_name = unique("first");
    let first_pool = db.pool_named(&first_name).await?;

    // The first member gets both partitions and blocks in the first event of each, with the
    // rest queued behind it.
    let gate = CancellationToken::new();
    let first = gated_consumer(
        first_pool,
        ConsumerConfig::new("c1"),
        |_| true,
        gate.clone(),
    )?;
    let shutdown = CancellationToken::new();
    let run_first = spawn(&first, &topic, &group, &shutdown)?;
    eventually("the first member is inside both handlers", WAIT, || async {
        Ok(backends(&db, &first_name, "state = 'idle in transaction'").await? == 2)
    })
    .await?;

    // A second member joins: the rebalance revokes the first member's partitions. The second
    // re-reads from offset 0, and its dedup insert of a message the first still holds waits
    // on the first's transaction: that wait shows the rebalance is done.
    let second_name = unique("second");
    let second = gated_consumer(
        db.pool_named(&second_name).await?,
        ConsumerConfig::new("c1"),
        |_| false,
        CancellationToken::new(),
    )?;
    let run_second = spawn(&second, &topic, &group, &shutdown)?;
    eventually("the second member owns a partition", WAIT, || async {
        Ok(backends(&db, &second_name, "wait_event_type = 'Lock'").await? > 0)
    })
    .await?;

    gate.cancel();
    eventually("every event has its effect", WAIT, || async {
        Ok(effects(&db.pool, None).await?.1 == 200)
    })
    .await?;
    shutdown.cancel();
    run_first.await??;
    run_second.await??;
    assert_eq!(effects(&db.pool, None).await?, (200, 200), "once per event");
    assert!(
        first.stats().revoked_skipped > 0,
        "the first member dropped what it had queued for revoked partitions: {:?}",
        first.stats()
    );
    Ok(())
}

/// `run` takes partitions as the group assigns them, each on its own queue split before it
/// fetches; partitions assigned by hand would fetch into the main queue, out of the workers'
/// reach, so such a consumer is refused before it handles anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_a_consumer_with_partitions_assigned_by_hand() -> Result<()> {
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(1).await?;
    send_many(&topic, 0, "k", 5).await?;
    let consumer = gated_consumer(
        db.pool.clone(),
        ConsumerConfig::new("c1"),
        |_| false,
        CancellationToken::new(),
    )?;
    let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), &unique("g")))?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    assignment.add_partition_offset(&topic, 0, rdkafka::Offset::Beginning)?;
    stream.assign(&assignment)?;
    let refused =
        tokio::time::timeout(WAIT, consumer.run(stream, CancellationToken::new())).await?;
    assert!(
        matches!(refused, Err(outbox_consumer::ConsumerError::Config(_))),
        "{refused:?}"
    );
    assert_eq!(effects(&db.pool, None).await?, (0, 0), "nothing handled");
    Ok(())
}

/// Sends `per_partition` events of about 1 KB to each of `partitions`, all in flight at once.
async fn send_backlog(topic: &str, partitions: i32, per_partition: i64) -> Result<()> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .set("linger.ms", "5")
        .create()?;
    let pad = "x".repeat(1000);
    let sends =
        (0..partitions).flat_map(|partition| (0..per_partition).map(move |n| (partition, n)));
    let sends = sends.map(|(partition, n)| {
        let (producer, pad) = (&producer, &pad);
        async move {
            let id = EventId::new().to_string();
            let payload = format!(r#"{{"n":{n},"pad":"{pad}"}}"#);
            let headers = OwnedHeaders::new().insert(Header {
                key: "id",
                value: Some(id.as_bytes()),
            });
            producer
                .send(
                    FutureRecord::to(topic)
                        .partition(partition)
                        .key(&format!("k{partition}"))
                        .payload(&payload)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
        }
    });
    futures::future::try_join_all(sends).await?;
    Ok(())
}

/// What librdkafka's statistics say its partition queues hold, at most and lately.
#[derive(Debug, Default)]
struct Queued {
    peak: std::sync::atomic::AtomicU64,
    last: std::sync::atomic::AtomicU64,
    reports: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Clone, Default)]
struct QueuedStats(std::sync::Arc<Queued>);

impl rdkafka::ClientContext for QueuedStats {
    fn stats(&self, statistics: rdkafka::Statistics) {
        use std::sync::atomic::Ordering::SeqCst;
        let bytes: u64 = statistics
            .topics
            .values()
            .flat_map(|t| t.partitions.values())
            .map(|p| p.fetchq_size)
            .sum();
        self.0.last.store(bytes, SeqCst);
        self.0.peak.fetch_max(bytes, SeqCst);
        self.0.reports.fetch_add(1, SeqCst);
    }
}

/// librdkafka prefetches per partition queue, and each partition has its own: with many
/// partitions and a backlog, a member held (partitions × `queued.max.messages.kbytes`). The
/// member's `prefetch_budget_bytes` bounds what it holds as a whole, however many partitions
/// it owns: librdkafka's queues (its statistics) and the messages taken from them but not yet
/// handled (`stats().prefetched_bytes`) stay within the budget plus one fetch response and a
/// small allowance per partition (24 × 130 KB here, against 12 MB of backlog), while every
/// handler is stuck; then every event is handled once (partitions were paused and
/// resumed against the real broker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_stays_within_the_budget_whatever_the_partition_count() -> Result<()> {
    use std::sync::atomic::Ordering::SeqCst;
    const PARTITIONS: i32 = 24;
    const PER_PARTITION: i64 = 500;
    const BUDGET: u64 = 1024 * 1024;
    // librdkafka's whole fetch response, read into the partitions' queues at once.
    const ONE_FETCH: u64 = 1024 * 1024;
    // What librdkafka may hold per partition besides: its queue (`queued.max.messages.kbytes`,
    // 64 KiB as `stream_consumer` sets it), one fetch of the partition, and the message that
    // crossed the partition's share.
    const PARTITION_FETCH: u64 = 64 * 1024;
    const PER_PARTITION_SLACK: u64 = 64 * 1024 + PARTITION_FETCH + 2048;
    let db = TestDb::new().await?;
    effects_table(&db.pool).await?;
    let topic = random_topic(PARTITIONS).await?;
    send_backlog(&topic, PARTITIONS, PER_PARTITION).await?;

    let gate = CancellationToken::new();
    let consumer = gated_consumer(
        db.pool.clone(),
        // Batches smaller than a partition's backlog, so that most of it waits in the queues.
        ConsumerConfig::new("c1")
            .max_batch_size(16)
            .prefetch_budget_bytes(usize::try_from(BUDGET)?),
        |_| true,
        gate.clone(),
    )?;
    let queued = QueuedStats::default();
    let stream = outbox_consumer::stream_consumer_with_context(
        consumer_config(&kafka_bootstrap(), &unique("g"))
            .set("statistics.interval.ms", "50")
            .set("fetch.max.bytes", ONE_FETCH.to_string())
            .set("max.partition.fetch.bytes", PARTITION_FETCH.to_string()),
        queued.clone(),
    )?;
    stream.subscribe(&[&topic])?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(stream, shutdown).await }
    });

    // Every handler is stuck: the member fetches until its budget is full, then should stop.
    let held = || consumer.stats().prefetched_bytes + queued.0.last.load(SeqCst);
    eventually("the member has fetched its budget", WAIT, || async {
        Ok(held() >= BUDGET)
    })
    .await?;
    let reports = queued.0.reports.load(SeqCst);
    eventually("20 more statistics reports", WAIT, || async {
        Ok(queued.0.reports.load(SeqCst) >= reports + 20)
    })
    .await?;
    let peak = consumer.stats().prefetched_bytes_peak + queued.0.peak.load(SeqCst);
    let bound = BUDGET + ONE_FETCH + u64::try_from(PARTITIONS)? * PER_PARTITION_SLACK;
    assert!(
        peak <= bound,
        "held {peak} bytes at most (librdkafka's queues {}, taken {}), over the budget \
         {BUDGET} and one fetch",
        queued.0.peak.load(SeqCst),
        consumer.stats().prefetched_bytes_peak
    );

    gate.cancel();
    let events = i64::from(PARTITIONS) * PER_PARTITION;
    eventually("every event has its effect", WAIT, || async {
        Ok(effects(&db.pool, None).await?.1 == events)
    })
    .await?;
    shutdown.cancel();
    run.await??;
    assert_eq!(
        effects(&db.pool, None).await?,
        (events, events),
        "once per event"
    );
    assert_eq!(
        consumer.stats().prefetched_bytes,
        0,
        "{:?}",
        consumer.stats()
    );
    Ok(())
}
