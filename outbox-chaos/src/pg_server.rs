//! The run's own PostgreSQL server, for the profiles that stop Postgres (the scripts' server
//! serves the rest of the test suite and is never stopped). `initdb` into the run's
//! directory (user `postgres`), a free port on 127.0.0.1, started and stopped with `pg_ctl`
//! on the same data directory, so a stop is a real server outage: every connection breaks and
//! none is accepted until the server is started again.
//!
//! Served as the scripts' server is: TCP over TLS only (the scripts' server certificate,
//! `.services/tls/`), a `scram-sha-256` password generated per run; `trust` on its unix
//! socket alone, in the run's directory (mode 700), where the password is set.
//!
//! Debian's binaries are under `/usr/lib/postgresql/<version>/bin` (`OUTBOX_PG_BIN`
//! overrides the directory). `initdb` refuses to run as root, so as root every command runs
//! as the `postgres` user (`runuser`), which then owns the data directory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, bail};
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection};
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
    /// The superuser's password (generated per run).
    password: Password,
    /// The authority that signed the server's certificate.
    ca: PathBuf,
}

async fn chown_postgres(path: &Path) -> Result<()> {
    let chown = Command::new("chown")
        .arg("postgres:postgres")
        .arg(path)
        .status()
        .await?;
    if !chown.success() {
        bail!("chown postgres {} failed", path.display());
    }
    Ok(())
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

/// The scripts' certificates (scripts/tls.sh): the server's, and the authority clients
/// verify it with.
fn tls_dir() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.services/tls");
    for file in ["ca.pem", "server.pem", "server.key"] {
        if !dir.join(file).is_file() {
            bail!(
                "{} is missing: scripts/tls.sh makes it (scripts/chaos and scripts/test run it)",
                dir.join(file).display()
            );
        }
    }
    Ok(dir.canonicalize()?)
}

/// A password that `Debug` does not show.
struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `pg_hba.conf`: TLS and a password on TCP, trust on the (private) socket.
const HBA: &str = "local all all trust\nhostssl all all 127.0.0.1/32 scram-sha-256\n";

impl LocalPg {
    /// Creates a cluster under `run_dir/pg` and starts it on a free port.
    pub(crate) async fn start_new(run_dir: &Path) -> Result<Self> {
        let tls = tls_dir()?;
        let dir = run_dir.join("pg");
        std::fs::create_dir_all(&dir)?;
        // The socket lives here, with `trust`: only its owner (and root) may reach it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let as_postgres = is_root().await;
        if as_postgres {
            chown_postgres(&dir).await?;
        }
        let port = crate::broker::free_ports(1)?[0];
        let mut pg = Self {
            bin: pg_bin(),
            dir,
            port,
            as_postgres,
            running: false,
            password: Password(uuid::Uuid::new_v4().simple().to_string()),
            ca: tls.join("ca.pem"),
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
        let data = Path::new(&data);
        pg.write_server_file(&data.join("pg_hba.conf"), HBA.as_bytes())
            .await?;
        for file in ["server.pem", "server.key"] {
            pg.write_server_file(&data.join(file), &std::fs::read(tls.join(file))?)
                .await?;
        }
        pg.start().await?;
        pg.set_password().await?;
        Ok(pg)
    }

    /// Writes `bytes` to `path` in the data directory, mode 600, owned by the server's user.
    async fn write_server_file(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        std::fs::write(path, bytes)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        if self.as_postgres {
            chown_postgres(path).await?;
        }
        Ok(())
    }

    /// Sets the superuser's password, over the socket (the one place `trust` holds).
    async fn set_password(&self) -> Result<()> {
        let options = PgConnectOptions::new_without_pgpass()
            .socket(&self.dir)
            .port(self.port)
            .username("postgres")
            .database("postgres");
        let mut conn = options
            .connect()
            .await
            .context("connecting to the run's Postgres over its socket")?;
        // A hex string: nothing to quote.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER ROLE postgres PASSWORD '{}'",
            self.password.0
        )))
        .execute(&mut conn)
        .await
        .context("setting the run's Postgres password")?;
        conn.close().await?;
        Ok(())
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The server's URL (its `postgres` maintenance database): TLS verified by name against
    /// the scripts' authority, the run's password.
    pub(crate) fn url(&self) -> String {
        format!(
            "postgres://postgres:{}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
            self.password.0,
            self.port,
            outbox_tests::url_escape(&self.ca.to_string_lossy())
        )
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
             -c max_connections=200 -c fsync=off -c ssl=on -c ssl_cert_file=server.pem \
             -c ssl_key_file=server.key -c password_encryption=scram-sha-256",
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
