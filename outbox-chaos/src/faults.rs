//! The fault loop: seeded random faults at random intervals, bounded in count and time.
//! Injected crashes inside the children (relay after ack, consumer after commit, producer
//! before/after commit) fire on their own; this loop adds the outside ones.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use outbox_examples::billing_api::BillingApi;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

use crate::broker::Down;
use crate::cluster::Cluster;
use crate::db::ChaosDb;
use crate::fleet::{Fleet, Role, lock};
use crate::pg_server::{LocalPg, StopMode};
use crate::profile::Profile;
use crate::summary::Kind;

/// What the loop works on.
#[derive(Debug)]
pub(crate) struct Chaos<'a> {
    pub(crate) fleet: &'a Mutex<Fleet>,
    pub(crate) broker: &'a mut Cluster,
    pub(crate) db: &'a ChaosDb,
    pub(crate) profile: &'a Profile,
    pub(crate) topic: &'a str,
    pub(crate) group_a: &'a str,
    /// The billing API of the dispatcher fleet, when it runs.
    pub(crate) api: Option<&'a BillingApi>,
    /// The run's own PostgreSQL server, when the loop restarts it.
    pg: Option<&'a mut LocalPg>,
    pub(crate) rng: StdRng,
    extras: u32,
    /// Broker faults so far (their kinds alternate).
    broker_faults: u32,
    /// Extra members of the first group and when they leave it again.
    leaving: Vec<(usize, Instant)>,
}

/// Faults the loop picks from, with weights, besides broker faults (weighted by the
/// profile). Consumers are killed at any moment, a member still joining its group included.
const MENU: [(Kind, u32); 5] = [
    (Kind::RelayKill, 6),
    (Kind::ConsumerKill, 6),
    (Kind::ProducerKill, 2),
    (Kind::PgTerminate, 3),
    (Kind::Rebalance, 3),
];

/// The dispatcher fleet's faults, when it runs.
/// (Each run has at least one API outage and one stall: see [`Chaos::run`].)
const DISPATCH_MENU: [(Kind, u32); 4] = [
    (Kind::DispatcherKill, 3),
    (Kind::ActionWriterKill, 1),
    (Kind::ApiOutage, 1),
    (Kind::ApiStall, 1),
];

impl<'a> Chaos<'a> {
    pub(crate) fn new(
        fleet: &'a Mutex<Fleet>,
        broker: &'a mut Cluster,
        db: &'a ChaosDb,
        profile: &'a Profile,
        topic: &'a str,
        group_a: &'a str,
        seed: u64,
    ) -> Self {
        Self {
            fleet,
            broker,
            db,
            profile,
            topic,
            group_a,
            api: None,
            pg: None,
            rng: StdRng::seed_from_u64(seed),
            extras: 0,
            broker_faults: 0,
            leaving: Vec::new(),
        }
    }

    /// Adds the dispatcher fleet's faults, with the billing API they take down or stall.
    pub(crate) fn with_api(mut self, api: Option<&'a BillingApi>) -> Self {
        self.api = api;
        self
    }

    /// Adds PostgreSQL restarts, on the run's own server.
    pub(crate) fn with_pg(mut self, pg: Option<&'a mut LocalPg>) -> Self {
        self.pg = pg;
        self
    }

    /// Injects faults for `profile.fault_phase` or `profile.max_faults`, whichever ends
    /// first, with malformed records injected in rounds spread over the phase.
    pub(crate) async fn run(&mut self) -> Result<()> {
        let started = Instant::now();
        let end = started + self.profile.fault_phase;
        let rounds = self.profile.poison_rounds;
        let poison_due: Vec<Instant> = (1..=rounds)
            .map(|r| {
                started
                    + self
                        .profile
                        .fault_phase
                        .mul_f64(f64::from(r) / f64::from(rounds + 1))
            })
            .collect();
        let mut poison_done = 0_u32;
        let mut faults = 0_u32;
        while Instant::now() < end && faults < self.profile.max_faults {
            let (lo, hi) = self.profile.fault_gap_ms;
            let gap = Duration::from_millis(self.rng.random_range(lo..=hi));
            tokio::time::sleep(gap.min(end.saturating_duration_since(Instant::now()))).await;
            lock(self.fleet).reap()?;
            self.leave_due_extras(false);
            // A broker still starting from the last broker fault is not taken down again, and
            // malformed records wait for it: the loop goes on with the other faults meanwhile
            // (a broker start takes 6-18 s here, see docs/src/reliability.md).
            let broker_up = self.broker.poll_ready().await?;
            if broker_up
                && poison_done < rounds
                && Instant::now() >= poison_due[poison_done as usize]
            {
                match self.inject_poison(poison_done).await {
                    Ok(injected) => {
                        tracing::info!(
                            round = poison_done,
                            injected,
                            "fault: malformed records injected"
                        );
                        poison_done += 1;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "injecting malformed records failed; retrying")
                    }
                }
                continue;
            }
            // `BrokerRestart` stands for a broker fault of either kind: they alternate, clean
            // restart first, so every run with two broker faults has both.
            let broker_fault = (Kind::BrokerRestart, self.profile.broker_fault_weight);
            let dispatch = self.api.map(|_| DISPATCH_MENU).into_iter().flatten();
            let pg_restart = self.pg.is_some().then_some((Kind::PgRestart, 1));
            let menu: Vec<(Kind, u32)> = MENU
                .into_iter()
                .chain(broker_up.then_some(broker_fault))
                .chain(dispatch)
                .chain(pg_restart)
                .collect();
            let kind = menu
                .choose_weighted(&mut self.rng, |(_, w)| *w)
                .map(|(k, _)| *k)
                .unwrap_or(Kind::RelayKill);
            self.inject(kind).await?;
            faults += 1;
        }
        // Rounds the loop did not reach (a short phase): inject them now, so every run
        // checks every kind of malformed record.
        let mut attempts = 0;
        while poison_done < rounds {
            self.broker.wait_ready().await?;
            match self.inject_poison(poison_done).await {
                Ok(_) => poison_done += 1,
                Err(error) if attempts < 5 => {
                    attempts += 1;
                    tracing::warn!(%error, "injecting malformed records failed; retrying");
                }
                Err(error) => return Err(error),
            }
        }
        // Likewise every run takes the billing API down and makes it stall at least once,
        // and restarts PostgreSQL as often as the profile asks.
        for kind in [Kind::ApiOutage, Kind::ApiStall] {
            if self.api.is_some() && lock(self.fleet).counts.get(kind) == 0 {
                self.inject(kind).await?;
            }
        }
        let restarts = self.profile.dispatch.as_ref().map_or(0, |d| d.pg_restarts);
        while self.pg.is_some()
            && lock(self.fleet).counts.get(Kind::PgRestart) < u64::from(restarts)
        {
            self.inject(Kind::PgRestart).await?;
        }
        self.leave_due_extras(true);
        tracing::info!(faults, elapsed = ?started.elapsed(), "fault phase over");
        Ok(())
    }

    /// Stops the extra members whose stay is over (`all`: every one), gracefully.
    fn leave_due_extras(&mut self, all: bool) {
        let now = Instant::now();
        let mut fleet = lock(self.fleet);
        self.leaving.retain(|&(index, at)| {
            let due = all || at <= now;
            if due {
                tracing::info!(
                    label = fleet.label(index),
                    "fault: rebalance, member leaves"
                );
                fleet.stop(index, false);
            }
            !due
        });
    }

    async fn inject_poison(&self, round: u32) -> Result<usize> {
        crate::poison::inject(
            &self.db.pool,
            &self.broker.address(),
            self.topic,
            self.profile.partitions,
            round,
        )
        .await
    }

    fn pick(&mut self, filter: impl Fn(&Role) -> bool) -> Option<usize> {
        lock(self.fleet).live(filter).choose(&mut self.rng).copied()
    }

    async fn inject(&mut self, kind: Kind) -> Result<()> {
        match kind {
            Kind::RelayKill => {
                if let Some(i) = self.pick(|r| matches!(r, Role::Relay { .. })) {
                    lock(self.fleet).kill(i)?;
                }
            }
            Kind::ConsumerKill => {
                if let Some(i) = self.pick(|r| matches!(r, Role::Consumer { .. })) {
                    lock(self.fleet).kill(i)?;
                }
            }
            Kind::ProducerKill => {
                if let Some(i) = self.pick(|r| *r == Role::Producer) {
                    lock(self.fleet).kill(i)?;
                }
            }
            Kind::PgTerminate => {
                let terminated = self.db.terminate_connections().await?;
                tracing::info!(terminated, "fault: pg_terminate_backend");
                lock(self.fleet).counts.add(kind, 1);
            }
            Kind::BrokerRestart | Kind::BrokerKill => {
                let (how, kind) = if self.broker_faults % 2 == 1 {
                    (Down::Kill9, Kind::BrokerKill)
                } else {
                    (Down::Clean, Kind::BrokerRestart)
                };
                self.broker_faults += 1;
                let downtime = Duration::from_millis(self.rng.random_range(300..3000));
                let partition = self.rng.random_range(0..self.profile.partitions);
                match self
                    .broker
                    .restart_leader(self.topic, partition, how, downtime)
                    .await
                {
                    Ok(node) => {
                        tracing::info!(
                            ?how,
                            ?downtime,
                            partition,
                            node,
                            "fault: partition leader down"
                        );
                        lock(self.fleet).counts.add(kind, 1);
                    }
                    // A metadata request can fail while leadership moves; the loop goes on.
                    Err(error) => {
                        self.broker_faults -= 1;
                        tracing::warn!(%error, "no partition leader found; broker fault skipped");
                    }
                }
            }
            Kind::Rebalance => self.rebalance()?,
            Kind::DispatcherKill => {
                if let Some(i) = self.pick(|r| matches!(r, Role::Dispatcher { .. })) {
                    lock(self.fleet).kill(i)?;
                }
            }
            Kind::ActionWriterKill => {
                if let Some(i) = self.pick(|r| *r == Role::ActionWriter) {
                    lock(self.fleet).kill(i)?;
                }
            }
            Kind::ApiOutage => {
                if let Some(api) = self.api {
                    let downtime = Duration::from_millis(self.rng.random_range(300..3000));
                    api.stop().await;
                    tracing::info!(?downtime, "fault: billing API down");
                    tokio::time::sleep(downtime).await;
                    restart_api(api).await?;
                    lock(self.fleet).counts.add(kind, 1);
                }
            }
            Kind::PgRestart => {
                if let Some(pg) = self.pg.as_deref_mut() {
                    let downtime = Duration::from_millis(self.rng.random_range(300..2000));
                    pg.stop(StopMode::Immediate).await?;
                    tracing::info!(?downtime, "fault: Postgres stopped (immediate)");
                    tokio::time::sleep(downtime).await;
                    pg.start().await?;
                    lock(self.fleet).counts.add(kind, 1);
                }
            }
            Kind::ApiStall => {
                if let Some(api) = self.api {
                    let stalls = self.rng.random_range(1..=3);
                    tracing::info!(stalls, "fault: billing API applies, then stalls");
                    api.apply_then_stall(stalls);
                    lock(self.fleet).counts.add(kind, 1);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A member joins the first group and leaves again a little later, or an existing member
    /// leaves and rejoins: partitions move while messages are in flight.
    fn rebalance(&mut self) -> Result<()> {
        let group = self.group_a.to_owned();
        let in_group = move |r: &Role| matches!(r, Role::Consumer { group: g } if *g == group);
        if self.rng.random_bool(0.5) {
            self.extras += 1;
            let label = format!("consumer-a-extra{}", self.extras);
            let role = Role::Consumer {
                group: self.group_a.to_owned(),
            };
            tracing::info!(%label, "fault: rebalance, member joins");
            let index = lock(self.fleet).add(&label, role, false)?;
            let stay = Duration::from_millis(self.rng.random_range(1000..4000));
            self.leaving.push((index, Instant::now() + stay));
        } else if let Some(i) = self.pick(in_group) {
            let mut fleet = lock(self.fleet);
            tracing::info!(
                label = fleet.label(i),
                "fault: rebalance, member leaves and rejoins"
            );
            fleet.stop(i, true);
        }
        lock(self.fleet).counts.add(Kind::Rebalance, 1);
        Ok(())
    }
}

/// Listens again on the API's port, retrying while the port is not free yet.
async fn restart_api(api: &BillingApi) -> Result<()> {
    let mut tries = 0;
    loop {
        match api.restart().await {
            Ok(()) => return Ok(()),
            Err(error) if tries < 50 => {
                tries += 1;
                tracing::warn!(%error, "the billing API cannot listen again yet; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error).context("restarting the billing API"),
        }
    }
}
