//! One Apache Kafka node of the run's own cluster (KRaft, broker and controller in one
//! process), started through `scripts/kafka-node` on free ports with its data in the run's
//! directory, so that its log survives the restarts the harness inflicts on it.
//!
//! `scripts/kafka-node` `exec`s java, so the child's pid is the broker's: `kill -9` of it is
//! a broker crash and SIGTERM a clean (controlled) shutdown.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

/// How long a broker start (the JVM, log recovery after a crash, the KRaft quorum) may take
/// before the harness gives up. On 2 busy cores a start takes a few seconds; the first one
/// also formats the storage.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a SIGTERM'ed broker may take to shut down before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// How the broker goes down in a broker fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Down {
    /// SIGTERM: a controlled shutdown, awaited to the process's exit.
    Clean,
    /// `kill -9`: a crash; the next start recovers the log.
    Kill9,
}

/// A Kafka process that can be stopped and started again on the same ports and storage.
#[derive(Debug)]
pub(crate) struct Broker {
    node_id: u32,
    /// `controller.quorum.voters`, the same on every node of the cluster.
    voters: String,
    /// Replication factor of new and internal topics (`min.insync.replicas` 2 from 3 on).
    replication: usize,
    /// `scripts/kafka-node`.
    node_script: PathBuf,
    /// `scripts/kafka-ready`.
    ready_script: PathBuf,
    classpath_file: PathBuf,
    /// The node's directory: `server.properties`, `data/`, `broker.log`.
    dir: PathBuf,
    port: u16,
    controller_port: u16,
    cluster_id: String,
    child: Option<Child>,
    /// A restart's take-down and downtime, under way.
    going_down: Option<JoinHandle<Result<()>>>,
    /// Started but not yet seen ready.
    starting: bool,
    /// When the current process was started (for the readiness log line).
    started_at: Instant,
}

/// The repository's root: `OUTBOX_REPO_ROOT`, else this crate's parent directory as known at
/// compile time.
fn repo_root() -> PathBuf {
    std::env::var_os("OUTBOX_REPO_ROOT").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join(".."),
        PathBuf::from,
    )
}

/// `n` distinct free ports. Port 9092 belongs to the test suite's shared broker; the OS never
/// hands it out here. The listeners are held until all are bound, so no port repeats.
pub(crate) fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// A KRaft cluster id: a random UUID in unpadded base64url (22 characters), never starting
/// with `-`: `kafka-storage format -t -abc...` takes that for an option and fails the run's
/// broker start (one id in 64; it happened), which is why Kafka's own `Uuid.randomUuid()`
/// draws again in that case too.
pub(crate) fn new_cluster_id() -> String {
    loop {
        let id = base64url(&uuid::Uuid::new_v4().into_bytes());
        if !id.starts_with('-') {
            return id;
        }
    }
}

/// Unpadded base64url.
fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0_u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// Where and how one node of a cluster runs.
#[derive(Debug, Clone)]
pub(crate) struct NodeSpec {
    pub(crate) node_id: u32,
    pub(crate) port: u16,
    pub(crate) controller_port: u16,
    pub(crate) voters: String,
    pub(crate) cluster_id: String,
    pub(crate) replication: usize,
    /// The node's directory: `server.properties`, `data/`, `broker.log`.
    pub(crate) dir: PathBuf,
}

impl Broker {
    /// Starts a node; does not wait for it to be ready (the cluster does, once every node of
    /// the quorum is started).
    pub(crate) fn start(spec: NodeSpec) -> Result<Self> {
        let root = repo_root();
        let classpath_file = std::env::var_os("OUTBOX_TEST_KAFKA_CLASSPATH_FILE")
            .map_or_else(|| root.join(".services/kafka.classpath"), PathBuf::from);
        let has_classpath = std::fs::metadata(&classpath_file).is_ok_and(|m| m.len() > 0);
        if !has_classpath {
            bail!(
                "no Kafka classpath at {} (run `source scripts/services.sh && resolve_jars kafka` \
                 first, or set OUTBOX_TEST_KAFKA_CLASSPATH_FILE)",
                classpath_file.display()
            );
        }
        let node_script = root.join("scripts/kafka-node");
        if !node_script.is_file() {
            bail!(
                "{} not found (set OUTBOX_REPO_ROOT to the repository's root)",
                node_script.display()
            );
        }
        std::fs::create_dir_all(&spec.dir)?;
        let mut broker = Self {
            node_id: spec.node_id,
            voters: spec.voters,
            replication: spec.replication,
            node_script,
            ready_script: root.join("scripts/kafka-ready"),
            classpath_file,
            dir: spec.dir,
            port: spec.port,
            controller_port: spec.controller_port,
            cluster_id: spec.cluster_id,
            child: None,
            going_down: None,
            starting: false,
            started_at: Instant::now(),
        };
        broker.spawn()?;
        Ok(broker)
    }

    /// The node's id (`node.id`, the leader id in metadata).
    pub(crate) fn node_id(&self) -> u32 {
        self.node_id
    }

    /// The bootstrap address.
    pub(crate) fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("broker.log")
    }

    /// Starts the process; does not wait for it to be ready (see [`Self::wait_ready`]).
    fn spawn(&mut self) -> Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = Command::new(&self.node_script)
            .arg(&self.dir)
            .args([
                &self.node_id.to_string(),
                &self.port.to_string(),
                &self.controller_port.to_string(),
                &self.voters,
                &self.cluster_id,
                &self.replication.to_string(),
            ])
            .env("OUTBOX_TEST_KAFKA_CLASSPATH_FILE", &self.classpath_file)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Whatever drops it (a failed run, an interrupted harness, a take-down task cut
            // short by the runtime's shutdown) kills the broker: no stray JVM.
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.node_script.display()))?;
        tracing::debug!(pid = ?child.id(), node = self.node_id, port = self.port, "broker process started");
        self.child = Some(child);
        self.starting = true;
        self.started_at = Instant::now();
        Ok(())
    }

    /// Waits for a take-down begun by [`Self::restart`] and its downtime, then starts the
    /// broker again; at once when none is under way.
    pub(crate) async fn finish_restart(&mut self) -> Result<()> {
        if let Some(task) = self.going_down.take() {
            task.await.context("broker take-down task")??;
            self.spawn()?;
        }
        Ok(())
    }

    /// Starts the broker again once a take-down begun by [`Self::restart`] has finished.
    async fn advance(&mut self) -> Result<()> {
        if self
            .going_down
            .as_ref()
            .is_some_and(JoinHandle::is_finished)
        {
            if let Some(task) = self.going_down.take() {
                task.await.context("broker take-down task")??;
            }
            self.spawn()?;
        }
        Ok(())
    }

    /// Fails if the broker process has exited without being asked to (it crashed, or could
    /// not start). Also starts it again when a restart's downtime is over.
    pub(crate) async fn check_alive(&mut self) -> Result<()> {
        self.advance().await?;
        if self.going_down.is_some() {
            return Ok(());
        }
        let Some(child) = self.child.as_mut() else {
            bail!("the broker is not running");
        };
        if let Some(status) = child.try_wait()? {
            self.child = None;
            bail!(
                "broker {} exited by itself ({status}); see {}",
                self.node_id,
                self.log_path().display()
            );
        }
        Ok(())
    }

    /// Whether the broker serves requests: one Metadata request (`scripts/kafka-ready`) must
    /// list it; an open port alone is a broker still recovering its log or joining its quorum.
    /// `true` at once when it was seen ready since its last start; `false` while a restart is
    /// under way.
    pub(crate) async fn poll_ready(&mut self) -> Result<bool> {
        self.check_alive().await?;
        if self.going_down.is_some() {
            return Ok(false);
        }
        if !self.starting {
            return Ok(true);
        }
        // Every node's replication is the cluster's size: a node is ready when its metadata
        // lists all of them, so the next broker fault waits for a whole cluster.
        let ready = tokio::process::Command::new(&self.ready_script)
            .arg(self.address())
            .arg(self.replication.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .with_context(|| format!("running {}", self.ready_script.display()))?;
        if ready.success() {
            self.starting = false;
            tracing::info!(node = self.node_id, took = ?self.started_at.elapsed(), "broker ready");
        }
        Ok(ready.success())
    }

    /// Waits until [`Self::poll_ready`] holds: a restart's take-down and downtime, then
    /// [`START_TIMEOUT`] for the start.
    pub(crate) async fn wait_ready(&mut self) -> Result<()> {
        self.finish_restart().await?;
        // From this wait's start at the earliest: a node that could not be ready while
        // another node was down gets its whole start time once that node is back.
        let deadline = self.started_at.max(Instant::now()) + START_TIMEOUT;
        while !self.poll_ready().await? {
            if Instant::now() >= deadline {
                bail!(
                    "broker {} (port {}) was not ready within {START_TIMEOUT:?}; see {}",
                    self.node_id,
                    self.port,
                    self.log_path().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Stops the broker cleanly and for good (a restart under way is finished first, without
    /// starting it again).
    pub(crate) async fn stop(&mut self) -> Result<()> {
        if let Some(task) = self.going_down.take() {
            task.await.context("broker take-down task")??;
        }
        match self.child.take() {
            Some(child) => take_down(child, Down::Clean, &self.log_path()).await,
            None => Ok(()),
        }
    }

    /// Kills the broker for good (`kill -9`), a restart under way included.
    pub(crate) async fn kill(&mut self) -> Result<()> {
        if let Some(task) = self.going_down.take() {
            task.abort();
        }
        match self.child.take() {
            Some(child) => take_down(child, Down::Kill9, &self.log_path()).await,
            None => Ok(()),
        }
    }

    /// Takes the broker down (`how`) and, after `downtime`, starts it again on the same ports
    /// and log. Returns at once: the take-down and the downtime run in the background and the
    /// start happens at the next [`Self::check_alive`], [`Self::poll_ready`] or
    /// [`Self::wait_ready`] after them, so the run goes on meanwhile, as clients of a
    /// restarting broker do.
    pub(crate) fn restart(&mut self, how: Down, downtime: Duration) {
        let Some(child) = self.child.take() else {
            return;
        };
        let log = self.log_path();
        self.going_down = Some(tokio::spawn(async move {
            take_down(child, how, &log).await?;
            tokio::time::sleep(downtime).await;
            Ok(())
        }));
    }
}

/// Takes a broker process down: SIGTERM awaited to its exit (`kill -9` after [`STOP_TIMEOUT`],
/// which is an error: a clean stop that needs a kill is not one), or `kill -9`.
async fn take_down(mut child: Child, how: Down, log: &Path) -> Result<()> {
    let began = Instant::now();
    match how {
        Down::Kill9 => {
            child.kill().await?;
        }
        Down::Clean => {
            let Some(pid) = child.id() else {
                return Ok(()); // already exited and reaped
            };
            crate::fleet::send_sigterm(pid);
            if tokio::time::timeout(STOP_TIMEOUT, child.wait())
                .await
                .is_err()
            {
                child.kill().await?;
                bail!(
                    "the broker ignored SIGTERM for {STOP_TIMEOUT:?} and was killed; see {}",
                    log.display()
                );
            }
        }
    }
    tracing::info!(?how, took = ?began.elapsed(), "broker down");
    Ok(())
}

impl Drop for Broker {
    fn drop(&mut self) {
        // The running process dies with its `Child` (`kill_on_drop`); one being taken down
        // dies with the aborted task that holds it.
        if let Some(task) = self.going_down.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_the_standard_encoding() {
        // Python: base64.urlsafe_b64encode(bytes(range(250, 256)) + bytes(range(10))), '=' cut.
        let bytes: Vec<u8> = (250..=255).chain(0..10).collect();
        assert_eq!(base64url(&bytes), "-vv8_f7_AAECAwQFBgcICQ");
        assert_eq!(base64url(&[0; 16]), "AAAAAAAAAAAAAAAAAAAAAA");
    }

    #[test]
    fn no_cluster_id_reads_as_an_option() {
        // Without the redraw, about 30 of 2,000 would start with '-'.
        assert!((0..2000).all(|_| !new_cluster_id().starts_with('-')));
    }

    #[test]
    fn cluster_ids_are_22_base64url_characters_and_differ() {
        let a = new_cluster_id();
        let b = new_cluster_id();
        assert_eq!(a.len(), 22, "{a}");
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
            "{a}"
        );
        assert_ne!(a, b);
    }

    #[test]
    fn free_ports_are_distinct() {
        let ports = free_ports(6).expect("six free ports");
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), 6, "{ports:?}");
        assert!(!distinct.contains(&0));
    }
}
