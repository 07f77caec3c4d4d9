//! The long-fault phase: after the fault loop, with the producer writing throughout, long
//! faults one after another, each injected, held, ended, and then timed: its **liveness
//! figure** is the time from the fault's end until everything committed by then has flowed —
//! no row of it pending, every group holding the effect of every one of its events (rows
//! quarantined are left out of the wait; the checker counts the unexpected ones).
//!
//! * **Broker outage**: the broker is killed (`kill -9`) and stays down for minutes, far
//!   longer than the relays' `max_attempts` × `message.timeout.ms`; then started again on the
//!   same storage. The fault ends when the broker serves Metadata again (its own start, 15-18 s
//!   after a crash, is Kafka's and not counted). Nothing may be quarantined for it.
//! * **Postgres stopped**: the run's own server is stopped (`pg_ctl stop -m immediate`) for
//!   tens of seconds and started again on the same data directory; the fault ends when it
//!   accepts connections.
//! * **Stuck key**, under either quarantine policy (`stuck_key.rs`): a row the broker rejects
//!   for good, then a backlog of its key. Under `SkipQuarantined` the backlog flows after the
//!   quarantined row; under `BlockKey` it waits for the operator, who discards the row.
//! * **Topic deleted and re-created**: deleting a topic drops what it holds, which is the
//!   operator's data loss, not the framework's. So the relays stop first (gracefully) and both
//!   groups consume everything published, then the consumers stop; the topic's events are
//!   recorded as verified by their effects (the checker cannot read them back any more); the
//!   topic is deleted; the relays start again while the producer keeps writing (every row of
//!   the topic now fails — its delivery times out while the broker answers Metadata — and is
//!   charged an attempt, under the fault's own retry settings, whose budget outlasts the
//!   absence); after the absence the topic is created again with the same partitions and the
//!   consumers start again (librdkafka does not follow a re-created topic, see below). The
//!   fault ends there.
//! * **Partial outage** (three nodes, `partial_outage.rs`): one node down while the topic
//!   still takes writes, then one node down while it refuses them (`min.insync.replicas`
//!   raised to 3). Metadata answers throughout; nothing may be quarantined for either.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use outbox_core::TableNames;
use outbox_producer::Outbox;
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::broker::Down;
use crate::children::producer::write_event;
use crate::cluster::Cluster;
use crate::db::ChaosDb;
use crate::fleet::{Fleet, Launch, Role, lock, wait_fleet};
use crate::kafka::TopicSpec;
use crate::pg_server::{LocalPg, StopMode};
use crate::profile::LongFaults;
use crate::summary::Kind;

mod partial_outage;
mod stuck_key;

use stuck_key::{BLOCKED_KEY, STUCK_KEY};

/// The key of the marker event the harness commits as soon as a fault has ended: the
/// figure waits for it too, so it measures that the pipeline moves again, not only that
/// what was committed before the fault had already gone through.
const MARKER_KEY: &str = "kmarker";

/// The topic's `max.message.bytes` in runs with the stuck-key fault: far above every good
/// event (under 1 KiB) and the malformed `too_large` record (20 KiB).
pub(crate) const TOPIC_MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// What the long-fault phase works on.
#[derive(Debug)]
pub(crate) struct LongFaultPhase<'a> {
    pub(crate) fleet: &'a Mutex<Fleet>,
    pub(crate) broker: &'a mut Cluster,
    pub(crate) db: &'a ChaosDb,
    pub(crate) pg: Option<&'a mut LocalPg>,
    pub(crate) tables: &'a TableNames,
    pub(crate) topic: &'a str,
    pub(crate) topic_spec: TopicSpec<'a>,
    pub(crate) groups: &'a [String],
    pub(crate) plan: &'a LongFaults,
}

/// One fault's liveness figure.
pub(crate) type Figure = (Kind, Duration);

impl LongFaultPhase<'_> {
    /// Runs the planned long faults in turn; returns each one's liveness figure.
    pub(crate) async fn run(&mut self) -> Result<Vec<Figure>> {
        lock(self.fleet).faults_on = false;
        if let Some(retry) = self.plan.relay_retry {
            self.restart_relays(|launch| launch.relay_retry = retry)
                .await?;
        }
        for key in [STUCK_KEY, BLOCKED_KEY, MARKER_KEY] {
            sqlx::query("INSERT INTO chaos_state (key) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(key)
                .execute(&self.db.pool)
                .await?;
        }
        // The fault loop's backlog first, so that each figure is its own fault's.
        let began = Instant::now();
        let watermark = self.mark().await?;
        let settled = self.time_drain(watermark, None, began).await?;
        tracing::info!(took = ?settled, "long-fault phase: the fault loop's backlog drained");
        let mut figures = Vec::new();
        if let Some(outage) = self.plan.broker_outage {
            figures.push((Kind::BrokerOutage, self.broker_outage(outage).await?));
        }
        if let Some(downtime) = self.plan.partial_outage {
            figures.extend(self.partial_outage(downtime).await?);
        }
        if let Some(outage) = self.plan.pg_outage {
            figures.push((Kind::PgStop, self.pg_stop(outage).await?));
        }
        if self.plan.stuck_key {
            figures.push((Kind::StuckKey, self.stuck_key().await?));
        }
        if self.plan.blocked_key {
            figures.extend(self.blocked_key().await?);
        }
        if let Some(absence) = self.plan.topic_absence {
            figures.push((Kind::TopicRecreate, self.topic_recreate(absence).await?));
        }
        for (kind, took) in &figures {
            tracing::info!(
                fault = kind.name(),
                seconds = took.as_secs_f64(),
                "liveness"
            );
        }
        Ok(figures)
    }

    async fn broker_outage(&mut self, outage: Duration) -> Result<Duration> {
        let node = self
            .broker
            .restart_leader(self.topic, 0, Down::Kill9, outage)
            .await?;
        lock(self.fleet).counts.add(Kind::BrokerOutage, 1);
        tracing::info!(node, ?outage, "long fault: broker killed, stays down");
        // The take-down and the downtime run in the background; this starts the broker after
        // them and returns once it serves.
        self.broker.wait_ready().await?;
        let back = Instant::now();
        tracing::info!(
            quarantined = self.quarantined().await?,
            "long fault: broker serves again"
        );
        let watermark = self.mark().await?;
        let took = self.time_drain(watermark, None, back).await?;
        tracing::info!(
            quarantined = self.quarantined().await?,
            "after the broker outage"
        );
        Ok(took)
    }

    async fn pg_stop(&mut self, outage: Duration) -> Result<Duration> {
        let Some(pg) = self.pg.as_deref_mut() else {
            bail!("a Postgres fault needs the run's own server");
        };
        pg.stop(StopMode::Immediate).await?;
        lock(self.fleet).counts.add(Kind::PgStop, 1);
        tracing::info!(?outage, "long fault: Postgres stopped (immediate)");
        tokio::time::sleep(outage).await;
        pg.start().await?;
        let back = Instant::now();
        tracing::info!("long fault: Postgres accepts connections again");
        let watermark = self.mark().await?;
        self.time_drain(watermark, None, back).await
    }

    async fn topic_recreate(&mut self, absence: Duration) -> Result<Duration> {
        let relays = self.stop_relays().await?;
        // Quiesced: everything published was applied by every group, and every malformed
        // record quarantined by every group, before the topic and what it holds go.
        let began = Instant::now();
        while !self.consumed_everything_published().await? {
            if began.elapsed() >= self.plan.drain_wait {
                bail!("the groups did not consume the topic before its deletion");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // The consumers stop too, and start again once the topic is back: librdkafka (2.12)
        // does not follow a subscribed topic that is deleted and created again. In the first
        // run of this fault the groups stood still from the re-creation to the end of the
        // run, 6 minutes later (confluentinc/librdkafka#3255, and "Yes, this is a bug" in
        // confluentinc/confluent-kafka-javascript#274). Restarting them is the operator's
        // step of the procedure, as stopping the relays is.
        let consumers = lock(self.fleet).live(|r| matches!(r, Role::Consumer { .. }));
        self.stop_and_wait(&consumers, "consumers").await?;
        let pool = &self.db.pool;
        let mut tx = pool.begin().await?;
        let epoch: i32 = sqlx::query_scalar(
            "INSERT INTO chaos_topic_deletions (epoch) \
             SELECT count(*) + 1 FROM chaos_topic_deletions RETURNING epoch",
        )
        .fetch_one(&mut *tx)
        .await?;
        let recorded = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO chaos_deleted_with_topic (event_id, epoch) \
             SELECT id, $1 FROM {} WHERE status = 'published' ON CONFLICT DO NOTHING",
            self.tables.outbox
        )))
        .bind(epoch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        let brokers = self.broker.address();
        crate::kafka::delete_topic(&brokers, self.topic).await?;
        lock(self.fleet).counts.add(Kind::TopicRecreate, 1);
        tracing::info!(
            epoch,
            events = recorded,
            ?absence,
            "long fault: topic deleted (its events verified by their effects from now on)"
        );
        let retry = self.plan.topic_fault_retry;
        self.resume_relays(&relays, |launch| launch.relay_retry = retry)?;
        tokio::time::sleep(absence).await;
        crate::kafka::create_topic(&brokers, self.topic, self.topic_spec, true).await?;
        let back = Instant::now();
        {
            let mut fleet = lock(self.fleet);
            for &i in &consumers {
                fleet.resume(i)?;
            }
        }
        tracing::info!(
            quarantined = self.quarantined().await?,
            "long fault: topic created again"
        );
        let watermark = self.mark().await?;
        self.time_drain(watermark, None, back).await
    }

    /// Stops every relay gracefully and waits until they have exited; returns their slots.
    async fn stop_relays(&self) -> Result<Vec<usize>> {
        let relays = lock(self.fleet).slots_where(|r| matches!(r, Role::Relay { .. }));
        self.stop_and_wait(&relays, "relays").await?;
        Ok(relays)
    }

    /// Stops the children in `slots` gracefully and waits up to 30 s until they have exited.
    async fn stop_and_wait(&self, slots: &[usize], what: &str) -> Result<()> {
        {
            let mut fleet = lock(self.fleet);
            for &i in slots {
                fleet.stop(i, false);
            }
        }
        if !wait_fleet(self.fleet, Duration::from_secs(30), |f| {
            slots.iter().all(|&i| f.exited(i))
        })
        .await?
        {
            bail!("the {what} did not stop within 30 s");
        }
        Ok(())
    }

    /// Starts the stopped `relays` again, with what they are started with changed first.
    fn resume_relays(&self, relays: &[usize], change: impl FnOnce(&mut Launch)) -> Result<()> {
        let mut fleet = lock(self.fleet);
        change(fleet.launch_mut());
        for &i in relays {
            fleet.resume(i)?;
        }
        Ok(())
    }

    /// Restarts every relay with new settings. Stopped first, all of them: a relay still
    /// running with the old settings would act on rows the new ones are meant to handle.
    async fn restart_relays(&self, change: impl FnOnce(&mut Launch)) -> Result<()> {
        let relays = self.stop_relays().await?;
        self.resume_relays(&relays, change)?;
        tracing::info!(relays = relays.len(), "relays restarted with new settings");
        Ok(())
    }

    /// Whether every published row has an effect in every group and every malformed record
    /// was quarantined by every group.
    async fn consumed_everything_published(&self) -> Result<bool> {
        let outbox = &self.tables.outbox;
        let quarantine = &self.tables.consumer_quarantine;
        for group in self.groups {
            let (published, applied, poison, quarantined): (i64, i64, i64, i64) =
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT (SELECT count(*) FROM {outbox} WHERE status = 'published'), \
                            (SELECT count(DISTINCT e.event_id) FROM chaos_effects e \
                               JOIN {outbox} o ON o.id = e.event_id \
                             WHERE e.consumer = $1 AND o.status = 'published'), \
                            (SELECT count(*) FROM chaos_poison), \
                            (SELECT count(*) FROM {quarantine} q JOIN chaos_poison p \
                               ON q.partition = p.partition AND q.\"offset\" = p.kafka_offset \
                             WHERE q.consumer = $1 AND q.topic = $2)"
                )))
                .bind(group)
                .bind(self.topic)
                .fetch_one(&self.db.pool)
                .await?;
            if applied < published || quarantined < poison {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Commits a marker event (retried while the database is not back yet) and returns its
    /// `seq`: the watermark a figure waits for.
    async fn mark(&self) -> Result<i64> {
        let outbox = Outbox::new(self.tables);
        let seq_of = format!("SELECT seq FROM {} WHERE id = $1", self.tables.outbox);
        let began = Instant::now();
        loop {
            let id = Uuid::new_v4();
            let attempt = async {
                write_batch(
                    &self.db.pool,
                    &outbox,
                    self.topic,
                    MARKER_KEY,
                    &[id],
                    String::new(),
                )
                .await?;
                let seq: i64 = sqlx::query_scalar(AssertSqlSafe(seq_of.clone()))
                    .bind(id)
                    .fetch_one(&self.db.pool)
                    .await?;
                Ok::<_, anyhow::Error>(seq)
            };
            match attempt.await {
                Ok(seq) => return Ok(seq),
                Err(error) if began.elapsed() < Duration::from_secs(60) => {
                    tracing::warn!(%error, "writing the marker event failed; retrying");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(error) => return Err(error).context("writing the marker event"),
            }
        }
    }

    /// Outbox rows quarantined so far.
    async fn quarantined(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE status = 'quarantined'",
            self.tables.outbox
        )))
        .fetch_one(&self.db.pool)
        .await?)
    }

    /// Waits until every row up to `watermark` (but those of `except_key`, and quarantined
    /// ones) is published and applied by every group; returns the time since `since`. Gives
    /// up after the plan's `drain_wait` and returns the time so far (over the bound).
    async fn time_drain(
        &mut self,
        watermark: i64,
        except_key: Option<&str>,
        since: Instant,
    ) -> Result<Duration> {
        let outbox = &self.tables.outbox;
        let sql = format!(
            "WITH due AS (SELECT id, status FROM {outbox} \
                          WHERE seq <= $1 AND status <> 'quarantined' AND aggregateid <> $2) \
             SELECT (SELECT count(*) FROM due WHERE status = 'pending'), \
                    (SELECT count(*) FROM due), \
                    (SELECT count(DISTINCT e.event_id) FROM chaos_effects e \
                       JOIN due ON due.id = e.event_id WHERE e.consumer = $3)"
        );
        let except = except_key.unwrap_or("");
        let started = Instant::now();
        let mut last_log = started;
        // When no row up to the watermark was pending any more: the relays' part.
        let mut published: Option<Duration> = None;
        loop {
            self.broker.check_alive().await?;
            let mut behind = Vec::new();
            let mut pending = 0;
            let mut failed = None;
            for group in self.groups {
                let row: Result<(i64, i64, i64), sqlx::Error> =
                    sqlx::query_as(AssertSqlSafe(sql.clone()))
                        .bind(watermark)
                        .bind(except)
                        .bind(group)
                        .fetch_one(&self.db.pool)
                        .await;
                match row {
                    Ok((p, due, applied)) => {
                        pending = p;
                        if applied < due {
                            behind.push(format!("{group}: {applied}/{due}"));
                        }
                    }
                    Err(error) => failed = Some(error),
                }
            }
            if failed.is_none() && pending == 0 && published.is_none() {
                published = Some(since.elapsed());
            }
            match failed {
                None if pending == 0 && behind.is_empty() => {
                    let applied = since.elapsed();
                    tracing::info!(watermark, ?published, ?applied, "long fault: drained");
                    return Ok(applied);
                }
                None => {
                    if last_log.elapsed() >= Duration::from_secs(5) {
                        tracing::info!(watermark, pending, ?behind, "long fault: draining");
                        last_log = Instant::now();
                    }
                }
                Some(error) => tracing::warn!(%error, "drain check failed; retrying"),
            }
            if started.elapsed() >= self.plan.drain_wait {
                tracing::error!(
                    watermark,
                    pending,
                    ?behind,
                    "long fault: not drained within {:?}",
                    self.plan.drain_wait
                );
                return Ok(since.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Writes one event per id for `key` in one transaction (each id recorded as attempted
/// first, as the producer does).
async fn write_batch(
    pool: &PgPool,
    outbox: &Outbox,
    topic: &str,
    key: &str,
    ids: &[Uuid],
    pad: String,
) -> Result<()> {
    let keys: Vec<&str> = ids.iter().map(|_| key).collect();
    sqlx::query(
        "INSERT INTO chaos_attempts (event_id, key) SELECT * FROM UNNEST($1::uuid[], $2::text[])",
    )
    .bind(ids)
    .bind(&keys)
    .execute(pool)
    .await?;
    let mut tx = pool.begin().await?;
    for id in ids {
        write_event(&mut tx, outbox, topic, *id, key, pad.clone()).await?;
    }
    tx.commit().await?;
    Ok(())
}
