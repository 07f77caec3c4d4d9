//! Peak RSS of a relay and of a consumer, each in a process of its own under the P2 and P4
//! loads, against the floor: a process that opens the same clients and does no work; of a
//! consumer at P4's steady 1,000 msg/s, batched (the default) against one transaction per
//! message; and of a consumer with its defaults draining a backlog of 1 KB records on 48
//! partitions, against the same backlog on 4 (its prefetch budget is the member's, whatever
//! the partition count); and with its defaults on 1,000 partitions holding 64 records of 1 KB
//! each (a backlog the size of the budget), against the idle floor plus the budget.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use outbox_consumer::{ConsumerConfig, DedupConsumer, Handler, consumer_config, stream_consumer};
use outbox_producer::producer_config;
use outbox_tests::{TestDb, database_url, eventually, kafka_bootstrap, random_topic, unique};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::FutureProducer;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use crate::p4_consumer::{LATENCY_RUN, RATE};
use crate::sample::{Figure, Sample};
use crate::{Settings, p2_relay, p4_consumer};

const PARTITIONS: i32 = 4;
/// The partitions, records and record size of the backlog runs.
const WIDE: i32 = 48;
/// The partitions of the widest backlog run, and the records each holds.
const WIDEST: i32 = 1000;
const WIDEST_PER_PARTITION: usize = 64;
/// `ConsumerConfig::prefetch_budget_bytes`' default, in MiB.
const BUDGET_MIB: f64 = 64.0;
const BACKLOG: usize = 240_000;
const RECORD_BYTES: usize = 1000;

/// What a child process does before it reports its peak RSS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Role {
    /// Open the pool, the producer and the consumer; do nothing.
    Idle,
    /// Drain the outbox with one relay.
    Relay,
    /// Consume the topic with `dedup_consume` until every event has its effect.
    Consumer,
    /// Produce to the (empty) topic at P4's steady rate and consume it, batched by default.
    Steady,
    /// The same, one transaction per message (`max_batch_size(1)`).
    SteadyPerMessage,
}

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let db = TestDb::new().await?;
    p4_consumer::create_effects(&db.pool).await?;
    let exe = std::env::current_exe()?;
    let [mut idle, mut relay, mut consumer]: [Sample; 3] = Default::default();
    let [mut steady, mut steady_single]: [Sample; 2] = Default::default();
    let [mut wide, mut narrow, mut widest, mut floor_and_budget]: [Sample; 4] = Default::default();
    for round in 0..settings.rounds {
        let topic = random_topic(PARTITIONS).await?;
        p2_relay::fill(&db.pool, &topic, settings.events).await?;
        let child = |role| child_rss_mib(&exe, settings, role, &db.schema, &topic);
        idle.push(child(Role::Idle).await?);
        relay.push(child(Role::Relay).await?);
        consumer.push(child(Role::Consumer).await?);
        // Which of the steady runs goes first alternates; each has a topic of its own.
        let (first, second) = if round % 2 == 0 {
            (Role::Steady, Role::SteadyPerMessage)
        } else {
            (Role::SteadyPerMessage, Role::Steady)
        };
        for role in [first, second] {
            let steady_topic = random_topic(PARTITIONS).await?;
            let rss = child_rss_mib(&exe, settings, role, &db.schema, &steady_topic).await?;
            match role {
                Role::Steady => steady.push(rss),
                _ => steady_single.push(rss),
            }
        }
        // The backlog runs, in alternating order, each on a topic of its own.
        let order = if round % 2 == 0 {
            [WIDE, PARTITIONS]
        } else {
            [PARTITIONS, WIDE]
        };
        for partitions in order {
            let topic = random_topic(partitions).await?;
            produce_backlog(&topic, partitions, BACKLOG).await?;
            let rss = child_rss_mib_of(&exe, settings, Role::Consumer, &db.schema, &topic, BACKLOG)
                .await?;
            if partitions == WIDE {
                wide.push(rss);
            } else {
                narrow.push(rss);
            }
        }
        let records = WIDEST as usize * WIDEST_PER_PARTITION;
        let topic = random_topic(WIDEST).await?;
        leaders_elected(&topic, WIDEST).await?;
        produce_backlog(&topic, WIDEST, records).await?;
        widest.push(
            child_rss_mib_of(&exe, settings, Role::Consumer, &db.schema, &topic, records).await?,
        );
        floor_and_budget.push(idle.values[round] + BUDGET_MIB);
        eprintln!(
            "MEM round {round}: idle {:.1}, relay {:.1}, consumer {:.1} MiB; at {RATE}/s: \
             batched {:.1}, per message {:.1} MiB; backlog on {WIDE} partitions {:.1}, on \
             {PARTITIONS} {:.1}, {WIDEST} partitions x {WIDEST_PER_PARTITION} {:.1} MiB",
            idle.values[round],
            relay.values[round],
            consumer.values[round],
            steady.values[round],
            steady_single.values[round],
            wide.values[round],
            narrow.values[round],
            widest.values[round]
        );
    }
    let per = format!("{} events", settings.events);
    Ok(vec![
        Figure::at_least(
            "MEM",
            format!("relay peak RSS, own process, {per}"),
            "MiB",
            relay,
            "same clients, idle",
            idle.clone(),
            None,
        ),
        Figure::at_least(
            "MEM",
            format!("consumer peak RSS, own process, {per}"),
            "MiB",
            consumer,
            "same clients, idle",
            idle,
            None,
        ),
        Figure::at_most(
            "MEM",
            format!("consumer peak RSS at {RATE}/s, default"),
            "MiB",
            steady,
            "max_batch_size(1) (per message)",
            steady_single,
            None,
        ),
        Figure::at_least(
            "MEM",
            format!(
                "consumer peak RSS, {WIDE} partitions, {}k x 1 KB backlog",
                BACKLOG / 1000
            ),
            "MiB",
            wide,
            format!("same backlog on {PARTITIONS} partitions"),
            narrow,
            None,
        ),
        Figure::cost(
            "MEM",
            format!(
                "consumer peak RSS, {WIDEST} partitions x {WIDEST_PER_PARTITION} x 1 KB, defaults"
            ),
            "MiB",
            widest,
            "idle floor + the 64 MiB prefetch budget",
            floor_and_budget,
            Some(1.25),
        ),
    ])
}

/// Waits until each of `topic`'s `partitions` has a leader: a new topic's many partitions
/// are elected one by one, and records sent before time out.
async fn leaders_elected(topic: &str, partitions: i32) -> Result<()> {
    let client: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .create()?;
    eventually(
        "every partition has a leader",
        Duration::from_secs(120),
        || async {
            let metadata = client.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            Ok(metadata.topics().first().is_some_and(|t| {
                t.partitions().len() == partitions as usize
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            }))
        },
    )
    .await
}

/// Produces `records` records of `RECORD_BYTES` to `topic`, spread over its `partitions`.
async fn produce_backlog(topic: &str, partitions: i32, records: usize) -> Result<()> {
    use futures::StreamExt;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::FutureRecord;
    let producer: FutureProducer = producer_config(&kafka_bootstrap())
        .set("linger.ms", "20")
        // A broker's first write to each of a thousand new partitions makes its log files.
        .set("message.timeout.ms", "300000")
        .create()?;
    let pad = "x".repeat(RECORD_BYTES - 30);
    let sends = futures::stream::iter(0..records).map(|n| {
        let (producer, pad) = (&producer, &pad);
        async move {
            let id = outbox_core::EventId::new().to_string();
            let payload = format!(r#"{{"n":{n},"pad":"{pad}"}}"#);
            let key = format!("k{n}");
            let partition = i32::try_from(n)? % partitions;
            producer
                .send(
                    FutureRecord::to(topic)
                        .partition(partition)
                        .key(&key)
                        .payload(&payload)
                        .headers(OwnedHeaders::new().insert(Header {
                            key: "id",
                            value: Some(&id),
                        })),
                    Duration::from_secs(60),
                )
                .await
                .map_err(|(e, _)| e)?;
            anyhow::Ok(())
        }
    });
    let mut sends = sends.buffer_unordered(10_000);
    while let Some(sent) = sends.next().await {
        sent?;
    }
    Ok(())
}

/// Runs this executable in `role` and returns the peak RSS it reports.
async fn child_rss_mib(
    exe: &std::path::Path,
    settings: &Settings,
    role: Role,
    schema: &str,
    topic: &str,
) -> Result<f64> {
    child_rss_mib_of(exe, settings, role, schema, topic, settings.events).await
}

/// [`child_rss_mib`] for `events` events.
async fn child_rss_mib_of(
    exe: &std::path::Path,
    settings: &Settings,
    role: Role,
    schema: &str,
    topic: &str,
    events: usize,
) -> Result<f64> {
    let role_name = clap::ValueEnum::to_possible_value(&role)
        .context("a role without a name")?
        .get_name()
        .to_owned();
    let out = tokio::process::Command::new(exe)
        .args(["--role", &role_name, "--schema", schema, "--topic", topic])
        .args(["--events", &events.to_string()])
        .args(["--batch-size", &settings.batch_size.to_string()])
        .stderr(std::process::Stdio::inherit())
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "{role_name} child failed: {}",
        out.status
    );
    let stdout = String::from_utf8(out.stdout)?;
    let kib: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("peak_rss_kib="))
        .with_context(|| format!("{role_name} child printed no peak RSS: {stdout}"))?
        .parse()?;
    Ok(kib / 1024.0)
}

/// The child's side: do `role`'s work, then print `peak_rss_kib=<VmHWM>`.
pub(crate) async fn child(settings: &Settings, role: Role) -> Result<()> {
    let schema = settings.schema.as_deref().context("--schema")?;
    let topic = settings.topic.as_deref().context("--topic")?;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(
            PgConnectOptions::from_str(&database_url())?.options([("search_path", schema)]),
        )
        .await?;
    match role {
        Role::Idle => {
            let _relay = p2_relay::relay(&pool, settings)?;
            let stream: StreamConsumer =
                consumer_config(&kafka_bootstrap(), &unique("idle")).create()?;
            stream.subscribe(&[topic])?;
            stream.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        }
        Role::Relay => {
            let relay = p2_relay::relay(&pool, settings)?;
            let mut published = 0;
            loop {
                let report = relay.run_once().await?;
                if report.claimed == 0 {
                    break;
                }
                published += report.published;
            }
            ensure!(
                published == settings.events,
                "relay published {published} of {}",
                settings.events
            );
        }
        Role::Consumer => consume_all(&pool, topic, settings.events).await?,
        Role::Steady => consume_steady(&pool, topic, steady_config()).await?,
        Role::SteadyPerMessage => {
            consume_steady(&pool, topic, steady_config().max_batch_size(1)).await?;
        }
    }
    println!(
        "peak_rss_kib={}",
        crate::peak_rss_kib().context("no /proc/self/status")?
    );
    Ok(())
}

/// `dedup_consume` running in this process on `topic` with `config`, in a fresh group.
struct Running<H> {
    consumer: DedupConsumer<serde_json::Value, H>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>,
}

impl<H: Handler<serde_json::Value>> Running<H> {
    fn start(pool: &PgPool, topic: &str, config: ConsumerConfig, handler: H) -> Result<Self> {
        let consumer = DedupConsumer::new(pool.clone(), config, handler)?;
        let stream = stream_consumer(&consumer_config(&kafka_bootstrap(), &unique("mem")))?;
        stream.subscribe(&[topic])?;
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
            async move { consumer.run(stream, shutdown).await }
        });
        Ok(Self {
            consumer,
            shutdown,
            task,
        })
    }

    /// Waits until `events` messages were processed, then stops the consumer.
    async fn finish(self, events: u64) -> Result<()> {
        eventually("every event consumed", Duration::from_secs(300), || async {
            Ok(self.consumer.stats().processed >= events)
        })
        .await?;
        self.shutdown.cancel();
        self.task.await??;
        Ok(())
    }
}

async fn consume_all(pool: &PgPool, topic: &str, events: usize) -> Result<()> {
    Running::start(
        pool,
        topic,
        ConsumerConfig::new(unique("mem")),
        p4_consumer::effect,
    )?
    .finish(events as u64)
    .await
}

fn steady_config() -> ConsumerConfig {
    ConsumerConfig::new(unique("steady"))
}

/// Consumes `topic` with `config` while producing to it at P4's steady rate for its latency
/// run's length, until every record produced has its effect. The producer stands in for the
/// idle process's relay, which holds one too.
async fn consume_steady(pool: &PgPool, topic: &str, config: ConsumerConfig) -> Result<()> {
    let running = Running::start(pool, topic, config, p4_consumer::effect)?;
    let producer: FutureProducer = producer_config(&kafka_bootstrap()).create()?;
    let produced = p4_consumer::produce_steadily(&producer, topic, LATENCY_RUN, false).await?;
    running.finish(produced).await
}
