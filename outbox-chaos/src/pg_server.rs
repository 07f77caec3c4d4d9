//! The run's own PostgreSQL server, for the profiles that stop Postgres (the shared server
//! on 5432 serves the rest of the test suite and is never stopped). `initdb` into the run's
//! directory (trust authentication, user `postgres`), a free port on 127.0.0.1, started and
//! stopped with `pg_ctl` on the same data directory, so a stop is a real server outage: every
//! connection breaks and none is accepted until the server is started again.
//!
//! Debian's binaries are under `/usr/lib/postgresql/<version>/bin` (`OUTBOX_PG_BIN`
//! overrides the directory). `initdb` refuses to run as root, so as root every command runs
//! as the `postgres` user (`runuser`), which then owns the data directory.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use tokio::process::Command;

/// How long `pg_ctl` waits for a start or a stop.
const PG_CTL_WAIT_S: u32 = 60;

/// How the server is stopped in a Postgres fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopMode {
    /// `pg_ctl stop -m immediate`: every backend dies at once, as in a crash; the next start
    /// recovers from the WAL.
    Immediate,
    /// `pg_ctl stop -m fast`: open transactions are rolled back, the server shuts down cleanly.
    Fast,
}

/// A PostgreSQL server of the run's own.
#[derive(Debug)]
pub(crate) struct LocalPg {
    bin: PathBuf,
    /// `<run dir>/pg`: `data/` and `postgres.log`.
    dir: PathBuf,
    port: u16,
    /// Run every command as `postgres` (the harness runs as root).
    as_postgres: bool,
    running: bool,
}

fn pg_bin() -> PathBuf {
    std::env::var_os("OUTBOX_PG_BIN").map_or_else(
        || {
            // The newest Debian version installed, else whatever `initdb` is on PATH.
            let base = Path::new("/usr/lib/postgresql");
            let mut versions: Vec<u32> = std::fs::read_dir(base)
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect();
            versions.sort_unstable();
            versions
                .last()
                .map_or_else(PathBuf::new, |v| base.join(v.to_string()).join("bin"))
        },
        PathBuf::from,
    )
}

async fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().await;
    out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl LocalPg {
    /// Creates a cluster under `run_dir/pg` and starts it on a free port.
    pub(crate) async fn start_new(run_dir: &Path) -> Result<Self> {
        let dir = run_dir.join("pg");
        std::fs::create_dir_all(&dir)?;
        let as_postgres = is_root().await;
        if as_postgres {
            let chown = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&dir)
                .status()
                .await?;
            if !chown.success() {
                bail!("chown postgres {} failed", dir.display());
            }
        }
        let port = crate::broker::free_ports(1)?[0];
        let mut pg = Self {
            bin: pg_bin(),
            dir,
            port,
            as_postgres,
            running: false,
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )
        .await
        .context("initdb of the run's own Postgres")?;
        pg.start().await?;
        Ok(pg)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The server's URL (its `postgres` maintenance database).
    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn command(&self, program: &str) -> Command {
        let path = if self.bin.as_os_str().is_empty() {
            PathBuf::from(program)
        } else {
            self.bin.join(program)
        };
        if self.as_postgres {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(path);
            cmd
        } else {
            Command::new(path)
        }
    }

    async fn run(&self, program: &str, args: &[&str]) -> Result<()> {
        let out = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .with_context(|| format!("running {program}"))?;
        if !out.status.success() {
            bail!(
                "{program} {args:?} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Starts the server (on the same data directory and port) and waits until it accepts
    /// connections.
    pub(crate) async fn start(&mut self) -> Result<()> {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} \
             -c max_connections=200 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let data = self.data();
        let log = self.dir.join("postgres.log").display().to_string();
        let wait = PG_CTL_WAIT_S.to_string();
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-o", &options, "-w", "-t", &wait, "start",
            ],
        )
        .await
        .with_context(|| format!("starting the run's Postgres (log: {log})"))?;
        self.running = true;
        Ok(())
    }

    /// Stops the server (`mode`) and waits until it is gone.
    pub(crate) async fn stop(&mut self, mode: StopMode) -> Result<()> {
        let mode = match mode {
            StopMode::Immediate => "immediate",
            StopMode::Fast => "fast",
        };
        let data = self.data();
        let wait = PG_CTL_WAIT_S.to_string();
        self.run(
            "pg_ctl",
            &["-D", &data, "-m", mode, "-w", "-t", &wait, "stop"],
        )
        .await?;
        self.running = false;
        Ok(())
    }
}

impl Drop for LocalPg {
    fn drop(&mut self) {
        if self.running {
            // A failed or interrupted run: no stray postmaster.
            let data = self.data();
            let mut cmd = if self.as_postgres {
                let mut c = std::process::Command::new("runuser");
                c.args(["-u", "postgres", "--"])
                    .arg(self.bin.join("pg_ctl"));
                c
            } else {
                std::process::Command::new(self.bin.join("pg_ctl"))
            };
            let _ = cmd
                .args(["-D", &data, "-m", "immediate", "-w", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}
