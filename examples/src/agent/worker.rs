//! One process of the agent service: the agent loop, the relay, the billing consumer and the
//! receipts consumer downstream of it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use outbox_consumer::{
    ConsumerConfig, ConsumerError, DedupConsumer, Event, Handler, HandlerError, consumer_config,
    dedup_consume, stream_consumer,
};
use outbox_producer::{NewEvent, ProducerError, Relay, RelayConfig, producer_config};
use rdkafka::consumer::Consumer;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use super::billing::Billing;
use super::crash::{CrashPoint, CrashSwitch, die};
use super::model::{InvoiceCharged, SendInvoice, decide_new_tasks};

/// Where the worker finds its services, and where it may crash.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// The topic decisions are published to.
    pub topic: String,
    /// The topic the billing handler's follow-up events (`InvoiceCharged`) go to.
    pub charged_topic: String,
    /// The billing consumer's group (and dedup name).
    pub group: String,
    /// How long to wait for every task to be charged.
    pub deadline: Duration,
}

/// Runs the agent until every task is charged and the outbox is drained, dying at `crash`.
pub async fn run(pool: PgPool, config: &WorkerConfig, crash: Option<CrashPoint>) -> Result<()> {
    let crash = Arc::new(CrashSwitch::new(crash));
    decide_new_tasks(
        &pool,
        |event| event.with_topic(&config.topic),
        || crash.reached(CrashPoint::BeforeCommit),
        || crash.reached(CrashPoint::AfterCommit),
    )
    .await?;

    let relay = Relay::new(
        pool.clone(),
        &producer_config(&config.brokers),
        RelayConfig::default(),
    )?;
    if crash.is_armed(CrashPoint::AfterPublish) {
        relay.crash_after_next_ack();
        match relay.run_once().await {
            Err(ProducerError::InjectedFault(_)) => die(CrashPoint::AfterPublish),
            other => bail!("the relay was meant to crash after publishing: {other:?}"),
        }
    }
    let consumer = billing_consumer(pool.clone(), &config.group, &config.charged_topic, &crash)?;
    if crash.is_armed(CrashPoint::AfterHandlerCommit) {
        consumer.crash_after_next_commit();
    }
    let stream = stream_consumer(
        consumer_config(&config.brokers, &config.group)
            // A crashed worker's membership must expire quickly for the restart to take over.
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "1000"),
    )?;
    stream.subscribe(&[config.topic.as_str()])?;
    let receipts = dedup_consume(
        consumer_config(&config.brokers, &format!("{}-receipts", config.group))
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "1000"),
        pool.clone(),
        record_receipt,
    )
    .topics([config.charged_topic.as_str()]);

    let shutdown = CancellationToken::new();
    let mut relaying = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });
    let mut consuming = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { consumer.run(stream, shutdown).await }
    });
    let mut receipting = tokio::spawn(receipts.run(shutdown.clone()));
    let done = tokio::select! {
        done = all_charged(&pool, config.deadline) => done,
        ended = &mut consuming => match ended? {
            Err(ConsumerError::InjectedFault(_)) => die(CrashPoint::AfterHandlerCommit),
            other => bail!("the billing consumer stopped early: {other:?}"),
        },
        ended = &mut relaying => bail!("the relay stopped early: {:?}", ended?),
        ended = &mut receipting => bail!("the receipts consumer stopped early: {:?}", ended?),
    };
    shutdown.cancel();
    relaying.await??;
    receipting.await??;
    match consuming.await? {
        // The crash fired on one partition while the other partitions' workers charged the
        // rest, so every task was charged before the consumer's run loop reported it.
        Err(ConsumerError::InjectedFault(_)) => die(CrashPoint::AfterHandlerCommit),
        ended => ended?,
    }
    done
}

/// The downstream consumer that performs the tool call, with the event id as the payment
/// API's idempotency key, and records the outcome in the agent's state.
fn billing_consumer(
    pool: PgPool,
    group: &str,
    charged_topic: &str,
    crash: &Arc<CrashSwitch>,
) -> Result<DedupConsumer<SendInvoice, Charger>> {
    let charger = Charger {
        billing: Billing::new(pool.clone()),
        crash: Arc::clone(crash),
        charged_topic: charged_topic.to_owned(),
    };
    // One partition at a time: a crash point then stops the only handler running, and the
    // demo's counts (a repeated billing request only for the handler that died) are exact.
    let config = ConsumerConfig::new(group).max_concurrent_partitions(1);
    DedupConsumer::new(pool, config, charger).context("creating the billing consumer")
}

/// The billing handler: what it needs to make the tool call and announce it.
struct Charger {
    billing: Billing,
    crash: Arc<CrashSwitch>,
    charged_topic: String,
}

impl Handler<SendInvoice> for Charger {
    /// Charge, then record the charge in the agent's state and enqueue `InvoiceCharged`, both
    /// on the handler's connection: the transaction the dedup row commits with. A redelivery
    /// is a duplicate, so the follow-up is enqueued once; a crash before the commit undoes
    /// both, and the retry enqueues it then. Consume → decide → enqueue, once.
    async fn handle(
        &self,
        event: &Event<SendInvoice>,
        conn: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let charge_id = self
            .billing
            .charge(&event.idempotency_key(), &event.payload)
            .await?;
        sqlx::query("UPDATE agent_tasks SET state = 'charged', charge_id = $2 WHERE id = $1")
            .bind(&event.payload.task)
            .bind(charge_id)
            .execute(&mut *conn)
            .await?;
        let charged = InvoiceCharged {
            task: event.payload.task.clone(),
            invoice: event.payload.invoice.clone(),
            charge_id,
            cents: event.payload.cents,
        };
        let follow_up = NewEvent::new("invoice", &charged.invoice, "InvoiceCharged", &charged)?
            .with_topic(&self.charged_topic)?;
        outbox_producer::enqueue(conn, &follow_up).await?;
        // Dying here, everything the handler wrote is undone with its transaction: the
        // follow-up too, which the retry enqueues again, once.
        self.crash.reached(CrashPoint::InHandler);
        Ok(())
    }
}

/// The receipts consumer, downstream of billing: a plain `async fn` handler.
async fn record_receipt(
    event: &Event<InvoiceCharged>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO agent_receipts (invoice, charge_id) VALUES ($1, $2)")
        .bind(&event.payload.invoice)
        .bind(event.payload.charge_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Waits until every task is charged and has its receipt, and nothing is left pending in the
/// outbox.
async fn all_charged(pool: &PgPool, deadline: Duration) -> Result<()> {
    let give_up = tokio::time::Instant::now() + deadline;
    loop {
        let (open, unreceipted): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM agent_tasks WHERE state <> 'charged'),
                    (SELECT count(*) FROM agent_tasks t WHERE NOT EXISTS
                       (SELECT 1 FROM agent_receipts r WHERE r.invoice = 'INV-' || t.id))",
        )
        .fetch_one(pool)
        .await?;
        let stats =
            outbox_producer::stats(&mut *pool.acquire().await?, &Default::default()).await?;
        if open == 0 && unreceipted == 0 && stats.pending == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() > give_up {
            bail!(
                "{open} tasks not charged, {unreceipted} without a receipt, {} events pending after {deadline:?}",
                stats.pending
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
