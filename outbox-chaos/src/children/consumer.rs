//! One consumer process: a member of a consumer group whose handler records the event's
//! effect in `chaos_effects` on the handler's transaction. That table has no unique
//! constraint, so a second effect of one event in one group would show up as a second row.
//! In crash mode it arms the library's crash-after-commit fault after a delay and exits when
//! it fires (handler committed, offset not stored).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, ConsumerError, DedupConsumer, Event, HandlerFailurePolicy, boxed,
    consumer_config, stream_consumer,
};
use rand::Rng;
use rdkafka::consumer::Consumer;

use super::{ChaosPayload, Common, EVENT_TYPE, EXIT_CONSUMER_AFTER_COMMIT, crash};

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Consumer group; also the dedup scope (consumer name).
    #[arg(long)]
    pub(crate) group: String,
    /// Payloads larger than this are quarantined.
    #[arg(long, default_value_t = 16 * 1024)]
    pub(crate) max_payload_bytes: usize,
    /// Arm the crash-after-commit fault this many milliseconds after start.
    #[arg(long)]
    pub(crate) crash_after_commit_ms: Option<u64>,
}

pub(crate) async fn run(args: Args) -> Result<()> {
    let partitions = 3;
    let pool = args.common.pool(partitions as u32 + 1)?;
    let config = ConsumerConfig::new(args.group.as_str())
        .tables(args.common.tables()?)
        .max_payload_bytes(args.max_payload_bytes)
        .event_types([EVENT_TYPE])
        // The handler only fails when Postgres does: retry, never skip.
        .on_handler_failure(HandlerFailurePolicy::Block)
        .backoff(Duration::from_millis(20), Duration::from_secs(1))
        .max_concurrent_partitions(partitions);
    // Checking the checker: `CHAOS_SABOTAGE=double-effect` makes this handler write a second
    // effect for about one event in 256, a bug the run must then report as double effects.
    let sabotage = std::env::var("CHAOS_SABOTAGE").is_ok_and(|v| v == "double-effect");
    let group: Arc<str> = args.group.as_str().into();
    let member: Arc<str> = args.common.label.as_str().into();
    let consumer = DedupConsumer::new(
        pool,
        config,
        boxed(move |event: &Event<ChaosPayload>, conn| {
            let (group, member) = (Arc::clone(&group), Arc::clone(&member));
            Box::pin(async move {
                // A short random pause, so that kills land inside handlers.
                let pause = Duration::from_micros(rand::rng().random_range(0..=3000));
                tokio::time::sleep(pause).await;
                let times = if sabotage && event.id.as_uuid().as_bytes()[15] == 0 {
                    2
                } else {
                    1
                };
                for _ in 0..times {
                    sqlx::query(
                    "INSERT INTO chaos_effects (consumer, member, event_id, key, version, partition, kafka_offset) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(&*group)
                .bind(&*member)
                .bind(event.id.as_uuid())
                .bind(&event.key)
                .bind(event.payload.version)
                .bind(event.partition)
                .bind(event.offset)
                .execute(&mut *conn)
                .await?;
                }
                Ok(())
            })
        }),
    )?;
    let mut kafka = consumer_config(&args.common.brokers, &args.group);
    kafka
        .set("client.id", &args.common.label)
        // A killed member's partitions move within seconds.
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000");
    if let Ok(debug) = std::env::var("CHAOS_KAFKA_DEBUG") {
        // librdkafka debug contexts (`cgrp`, `consumer`, ...), for diagnosing a stuck group.
        kafka.set("debug", debug);
    }
    let stream = stream_consumer(&kafka)?;
    stream.subscribe(&[args.common.topic.as_str()])?;
    let shutdown = super::shutdown_token();
    if let Some(ms) = args.crash_after_commit_ms {
        let consumer = consumer.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            consumer.crash_after_next_commit();
        });
    }
    match consumer.run(stream, shutdown).await {
        Err(ConsumerError::InjectedFault(what)) => crash(EXIT_CONSUMER_AFTER_COMMIT, what),
        other => Ok(other?),
    }
}
