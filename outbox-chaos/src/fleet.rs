//! The child processes: spawning them from the harness's own executable, killing and
//! stopping them, and reaping them — telling planned deaths (kill -9, SIGTERM, an injected
//! crash's exit status) from unplanned ones, and respawning members that should keep running.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::ValueEnum;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::children::relay::Policy;
use crate::children::{
    EXIT_CONSUMER_AFTER_COMMIT, EXIT_DISPATCHER_AFTER_CALL, EXIT_PRODUCER_AFTER_COMMIT,
    EXIT_PRODUCER_BEFORE_COMMIT, EXIT_RELAY_AFTER_ACK,
};
use crate::summary::{Counts, Kind};

/// Sends SIGTERM (the `kill` command: this crate forbids `unsafe`, so no `libc::kill`).
pub(crate) fn send_sigterm(pid: u32) {
    let sent = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .stderr(Stdio::null())
        .status();
    if let Err(error) = sent {
        tracing::warn!(%error, pid, "cannot run kill -TERM");
    }
}

/// Largest batch size a relay is started with (each draws one from 10 to this).
pub(crate) const MAX_RELAY_BATCH: u32 = 80;

/// What a child process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Role {
    Producer,
    /// `crash_slot`: respawned in crash-after-ack mode while faults are on.
    Relay {
        crash_slot: bool,
    },
    Consumer {
        group: String,
    },
    /// The dispatcher fleet's writer of actions.
    ActionWriter,
    /// `crash_slot`: respawned in crash-after-call mode while faults are on.
    Dispatcher {
        crash_slot: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Killed,
    Stopped,
}

#[derive(Debug)]
struct Slot {
    label: String,
    role: Role,
    child: Option<Child>,
    /// Respawn when it exits.
    keep: bool,
    expect: Option<Expect>,
}

/// Everything the children are started with.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub(crate) exe: PathBuf,
    pub(crate) logs: PathBuf,
    pub(crate) database_url: String,
    pub(crate) database: String,
    pub(crate) brokers: String,
    pub(crate) topic: String,
    pub(crate) outbox_table: String,
    pub(crate) keys: u32,
    pub(crate) producer_pause_ms: (u64, u64),
    /// How relays retry a row that failed (see [`RelayRetry`]).
    pub(crate) relay_retry: RelayRetry,
    /// Whether a quarantined row holds back its key's later rows.
    pub(crate) relay_policy: Policy,
    /// The dispatcher fleet's settings, when it runs.
    pub(crate) dispatch: Option<DispatchLaunch>,
}

/// What the action writer and the dispatchers are started with.
#[derive(Debug, Clone)]
pub(crate) struct DispatchLaunch {
    /// The billing API's charges endpoint.
    pub(crate) api_url: String,
    pub(crate) keys: u32,
    pub(crate) writer_pause_ms: (u64, u64),
    pub(crate) max_in_flight: usize,
    pub(crate) call_timeout: Duration,
}

/// Largest batch size a dispatcher is started with (each draws one from 4 to this).
const MAX_DISPATCH_BATCH: u32 = 16;

/// The relays' retry settings, passed on their command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RelayRetry {
    /// `max_attempts`: transient failures before a row is quarantined.
    pub(crate) max_attempts: u32,
    /// Backoff of a failed row, first and longest delay, in milliseconds.
    pub(crate) backoff_ms: (u64, u64),
    /// librdkafka `message.timeout.ms`; `None`: the framework's default (30 s).
    pub(crate) message_timeout_ms: Option<u32>,
}

impl RelayRetry {
    /// Never quarantines for a broker fault: the CI, cluster and long profiles.
    pub(crate) const PATIENT: Self = Self {
        max_attempts: 1_000_000,
        backoff_ms: (50, 2000),
        message_timeout_ms: None,
    };
}

/// The children of one run.
#[derive(Debug)]
pub(crate) struct Fleet {
    launch: Launch,
    slots: Vec<Slot>,
    rng: StdRng,
    /// While on, new children may be started in an injected-crash mode.
    pub(crate) faults_on: bool,
    /// Faults seen so far, by kind.
    pub(crate) counts: Counts,
    /// Deaths nobody planned: each a description.
    pub(crate) unexpected: Vec<String>,
}

impl Fleet {
    pub(crate) fn new(launch: Launch, seed: u64) -> Self {
        Self {
            launch,
            slots: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            faults_on: true,
            counts: Counts::default(),
            unexpected: Vec::new(),
        }
    }

    /// Adds and starts a child; `keep`: respawn it whenever it exits.
    pub(crate) fn add(&mut self, label: &str, role: Role, keep: bool) -> Result<usize> {
        self.slots.push(Slot {
            label: label.to_owned(),
            role,
            child: None,
            keep,
            expect: None,
        });
        let index = self.slots.len() - 1;
        self.spawn(index)?;
        Ok(index)
    }

    fn spawn(&mut self, index: usize) -> Result<()> {
        let l = &self.launch;
        let slot = &self.slots[index];
        let seed: u64 = self.rng.random();
        let mut cmd = Command::new(&l.exe);
        let role_args: Vec<String> = match &slot.role {
            Role::Producer => {
                let mut a = vec![
                    "producer".into(),
                    format!("--keys={}", l.keys),
                    format!("--pause-min-ms={}", l.producer_pause_ms.0),
                    format!("--pause-max-ms={}", l.producer_pause_ms.1),
                ];
                if self.faults_on && self.rng.random_bool(0.6) {
                    a.push(format!("--crash-at-txn={}", self.rng.random_range(10..150)));
                    let point = if self.rng.random_bool(0.5) {
                        "before-commit"
                    } else {
                        "after-commit"
                    };
                    a.push(format!("--crash-point={point}"));
                }
                a
            }
            Role::Relay { crash_slot } => {
                let retry = l.relay_retry;
                let mut a = vec![
                    "relay".into(),
                    format!(
                        "--batch-size={}",
                        self.rng.random_range(10..=MAX_RELAY_BATCH)
                    ),
                    format!("--max-attempts={}", retry.max_attempts),
                    format!("--backoff-min-ms={}", retry.backoff_ms.0),
                    format!("--backoff-max-ms={}", retry.backoff_ms.1),
                ];
                if let Some(ms) = retry.message_timeout_ms {
                    a.push(format!("--message-timeout-ms={ms}"));
                }
                if let Some(policy) = l.relay_policy.to_possible_value() {
                    a.push(format!("--quarantine-policy={}", policy.get_name()));
                }
                if self.faults_on && *crash_slot {
                    a.push(format!(
                        "--crash-after-ack-batches={}",
                        self.rng.random_range(0..5)
                    ));
                }
                a
            }
            Role::Consumer { group } => {
                let mut a = vec!["consumer".into(), format!("--group={group}")];
                if self.faults_on && self.rng.random_bool(0.4) {
                    a.push(format!(
                        "--crash-after-commit-ms={}",
                        self.rng.random_range(500..4000)
                    ));
                }
                a
            }
            Role::ActionWriter => {
                let d = l
                    .dispatch
                    .as_ref()
                    .context("an action writer without the dispatcher fleet's settings")?;
                vec![
                    "action-writer".into(),
                    format!("--keys={}", d.keys),
                    format!("--pause-min-ms={}", d.writer_pause_ms.0),
                    format!("--pause-max-ms={}", d.writer_pause_ms.1),
                ]
            }
            Role::Dispatcher { crash_slot } => {
                let d = l
                    .dispatch
                    .as_ref()
                    .context("a dispatcher without the dispatcher fleet's settings")?;
                let mut a = vec![
                    "dispatcher".into(),
                    format!("--api-url={}", d.api_url),
                    format!("--max-in-flight={}", d.max_in_flight),
                    format!(
                        "--batch-size={}",
                        self.rng.random_range(4..=MAX_DISPATCH_BATCH)
                    ),
                    format!("--call-timeout-ms={}", d.call_timeout.as_millis()),
                ];
                if self.faults_on && *crash_slot {
                    a.push(format!(
                        "--crash-after-call-batches={}",
                        self.rng.random_range(0..5)
                    ));
                }
                a
            }
        };
        cmd.args(&role_args)
            // The URL may carry a password: the environment, not the process list.
            .env("DATABASE_URL", &l.database_url)
            .arg(format!("--database={}", l.database))
            .arg(format!("--brokers={}", l.brokers))
            .arg(format!("--topic={}", l.topic))
            .arg(format!("--outbox-table={}", l.outbox_table))
            .arg(format!("--label={}", slot.label))
            .arg(format!("--seed={seed}"))
            .env("RUST_BACKTRACE", "0")
            .env(
                "RUST_LOG",
                std::env::var("CHAOS_CHILD_LOG").unwrap_or_else(|_| "info".into()),
            );
        let log = File::options()
            .create(true)
            .append(true)
            .open(l.logs.join(format!("{}.log", slot.label)))?;
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", slot.label))?;
        tracing::debug!(label = %slot.label, pid = child.id(), args = ?role_args, "started");
        let slot = &mut self.slots[index];
        slot.child = Some(child);
        slot.expect = None;
        Ok(())
    }

    /// Reaps exited children, classifies each death, and respawns those to keep.
    pub(crate) fn reap(&mut self) -> Result<()> {
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            let Some(status) = child.try_wait()? else {
                continue;
            };
            slot.child = None;
            let expect = slot.expect.take();
            let label = slot.label.clone();
            let role = slot.role.clone();
            self.classify(&label, &role, status, expect);
            if self.slots[index].keep {
                self.spawn(index)?;
            }
        }
        Ok(())
    }

    fn classify(&mut self, label: &str, role: &Role, status: ExitStatus, expect: Option<Expect>) {
        let crash = match (role, status.code()) {
            (Role::Relay { .. }, Some(EXIT_RELAY_AFTER_ACK)) => Some(Kind::RelayAfterAck),
            (Role::Consumer { .. }, Some(EXIT_CONSUMER_AFTER_COMMIT)) => {
                Some(Kind::ConsumerAfterCommit)
            }
            (Role::Producer, Some(EXIT_PRODUCER_BEFORE_COMMIT)) => Some(Kind::ProducerBeforeCommit),
            (Role::Producer, Some(EXIT_PRODUCER_AFTER_COMMIT)) => Some(Kind::ProducerAfterCommit),
            (Role::Dispatcher { .. }, Some(EXIT_DISPATCHER_AFTER_CALL)) => {
                Some(Kind::DispatcherAfterCall)
            }
            _ => None,
        };
        if let Some(kind) = crash {
            tracing::info!(label, kind = kind.name(), "fault: injected crash fired");
            self.counts.add(kind, 1);
            return;
        }
        match (expect, status.signal(), status.success()) {
            (Some(Expect::Killed), Some(9), _) => {
                let kind = match role {
                    Role::Producer => Kind::ProducerKill,
                    Role::Relay { .. } => Kind::RelayKill,
                    Role::Consumer { .. } => Kind::ConsumerKill,
                    Role::ActionWriter => Kind::ActionWriterKill,
                    Role::Dispatcher { .. } => Kind::DispatcherKill,
                };
                self.counts.add(kind, 1);
            }
            // Asked to stop: a clean exit, or SIGTERM's default action when it arrived before
            // the freshly started process had installed its handler.
            (Some(Expect::Stopped), _, true) | (Some(Expect::Stopped), Some(15), _) => {}
            _ => {
                let what = format!(
                    "{label} exited unexpectedly ({status}); see {}",
                    self.launch.logs.join(format!("{label}.log")).display()
                );
                tracing::error!("{what}");
                self.unexpected.push(what);
            }
        }
    }

    /// Live children matching `filter`.
    pub(crate) fn live(&self, filter: impl Fn(&Role) -> bool) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| {
                let slot = &self.slots[i];
                slot.child.is_some() && filter(&slot.role)
            })
            .collect()
    }

    pub(crate) fn label(&self, index: usize) -> &str {
        &self.slots[index].label
    }

    /// `kill -9`.
    pub(crate) fn kill(&mut self, index: usize) -> Result<()> {
        let slot = &mut self.slots[index];
        if let Some(child) = slot.child.as_mut() {
            tracing::info!(label = %slot.label, pid = child.id(), "fault: kill -9");
            slot.expect = Some(Expect::Killed);
            child.kill()?;
        }
        Ok(())
    }

    /// SIGTERM: a graceful stop; `keep` says whether to start it again once it has exited.
    pub(crate) fn stop(&mut self, index: usize, keep: bool) {
        let slot = &mut self.slots[index];
        slot.keep = keep;
        if let Some(child) = slot.child.as_ref() {
            // A child already being killed stays expected to die of that.
            if slot.expect.is_none() {
                slot.expect = Some(Expect::Stopped);
            }
            send_sigterm(child.id());
        }
    }

    /// What the children are started with; changes apply to the next (re)spawns.
    pub(crate) fn launch_mut(&mut self) -> &mut Launch {
        &mut self.launch
    }

    /// Children whose role matches `filter`, live or not.
    pub(crate) fn slots_where(&self, filter: impl Fn(&Role) -> bool) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| filter(&self.slots[i].role))
            .collect()
    }

    /// Starts a stopped child again and keeps it running (respawned when it exits).
    pub(crate) fn resume(&mut self, index: usize) -> Result<()> {
        self.slots[index].keep = true;
        if self.slots[index].child.is_none() {
            self.spawn(index)?;
        }
        Ok(())
    }

    /// Whether the child in `index` has exited (and been reaped).
    pub(crate) fn exited(&self, index: usize) -> bool {
        self.slots[index].child.is_none()
    }

    /// Stops every child gracefully, without respawning.
    pub(crate) fn stop_all(&mut self) {
        for index in 0..self.slots.len() {
            self.stop(index, false);
        }
    }

    /// Whether every child has exited.
    pub(crate) fn all_exited(&self) -> bool {
        self.slots.iter().all(|s| s.child.is_none())
    }

    /// Kills whatever is still running (after a graceful stop timed out).
    pub(crate) fn kill_remaining(&mut self) {
        for slot in &mut self.slots {
            if let Some(mut child) = slot.child.take() {
                let what = format!("{} did not stop on SIGTERM; killed", slot.label);
                tracing::error!("{what}");
                self.unexpected.push(what);
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for slot in &mut self.slots {
            if let Some(mut child) = slot.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Polls `done` on the fleet (reaping meanwhile) until it holds or `timeout` passes.
pub(crate) async fn wait_fleet(
    fleet: &std::sync::Mutex<Fleet>,
    timeout: Duration,
    done: impl Fn(&Fleet) -> bool,
) -> Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        {
            let mut f = lock(fleet);
            f.reap()?;
            if done(&f) {
                return Ok(true);
            }
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Locks the fleet; a poisoned lock (a panic elsewhere) still gives the data.
pub(crate) fn lock(fleet: &std::sync::Mutex<Fleet>) -> std::sync::MutexGuard<'_, Fleet> {
    fleet
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
