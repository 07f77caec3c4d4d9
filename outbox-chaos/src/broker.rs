//! The run's own `tansu` broker, on a free port, with `sqlite://` storage in the run's
//! directory so that its data survives the restarts the harness inflicts on it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A tansu process that can be stopped and started again on the same port and storage.
#[derive(Debug)]
pub(crate) struct Broker {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    /// Length of `tansu.log` when the current process started: what it wrote since is after.
    log_start: u64,
}

/// The tansu binary: `TANSU_BIN`, else `$CARGO_HOME/bin/tansu`, else `~/.cargo/bin/tansu`,
/// else `tansu` on the `PATH`.
pub(crate) fn find_tansu() -> PathBuf {
    if let Some(bin) = std::env::var_os("TANSU_BIN") {
        return bin.into();
    }
    let candidates = [
        std::env::var_os("CARGO_HOME").map(|h| PathBuf::from(h).join("bin/tansu")),
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/tansu")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .unwrap_or_else(|| "tansu".into())
}

fn free_port() -> Result<u16> {
    // Port 9092 belongs to the test suite's shared broker; the OS never hands it out here.
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

fn port_open(port: u16) -> bool {
    std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

impl Broker {
    /// Starts tansu with its data in `dir` and waits until it accepts connections.
    pub(crate) async fn start(dir: &Path) -> Result<Self> {
        let mut broker = Self {
            bin: find_tansu(),
            dir: dir.to_owned(),
            port: free_port()?,
            child: None,
            log_start: 0,
        };
        broker.spawn().await?;
        Ok(broker)
    }

    /// The bootstrap address.
    pub(crate) fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) -> Result<()> {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))?;
        self.log_start = log.metadata()?.len();
        let child = Command::new(&self.bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            // tansu resolves sqlite://NAME against its working directory.
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (install tansu 0.6.0, or set TANSU_BIN)",
                    self.bin.display()
                )
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !port_open(self.port) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "tansu exited with {status} at start; see {}",
                    self.dir.join("tansu.log").display()
                );
            }
            if Instant::now() >= deadline {
                bail!("tansu did not listen on port {} within 60 s", self.port);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Stops the broker: SIGTERM, then SIGKILL if it has not exited within 10 s.
    pub(crate) async fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        crate::fleet::send_sigterm(child.id());
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                tracing::warn!("tansu ignored SIGTERM for 10 s; killing it");
                child.kill()?;
                child.wait()?;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Whether the running broker's storage has died: tansu 0.6.0's sqlite storage task can
    /// panic (`lite.rs`, an idempotent produce with an epoch it does not know, after
    /// librdkafka bumped the epoch of a producer whose request timed out), after which the
    /// process still accepts connections but answers every request with `UnableToSend`.
    pub(crate) fn storage_dead(&self) -> Result<bool> {
        use std::io::{Read, Seek, SeekFrom};
        let mut log = File::open(self.dir.join("tansu.log"))?;
        log.seek(SeekFrom::Start(self.log_start))?;
        let mut text = Vec::new();
        log.read_to_end(&mut text)?;
        let text = String::from_utf8_lossy(&text);
        Ok(text.contains("UnableToSend") || text.contains("tansu-storage-0.6.0/src/lite.rs"))
    }

    /// Kills the broker (`kill -9`: a crash, so no request is answered half shut down), keeps
    /// it down for `downtime`, and starts it again on the same port and storage.
    pub(crate) async fn restart(&mut self, downtime: Duration) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        tokio::time::sleep(downtime).await;
        self.spawn().await
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
