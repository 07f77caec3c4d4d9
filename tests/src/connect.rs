//! Kafka Connect's REST API and a Debezium Outbox Event Router connector per test.
//!
//! [`OutboxConnector::start`] creates a Debezium Postgres connector that reads one test
//! schema's `outbox_events` through its own replication slot and publication, routes each row
//! with the Outbox Event Router to the row's `topic` (as the relay does), and waits until its
//! task runs and its slot streams. [`OutboxConnector::stop`] deletes the connector, then drops
//! the slot and the publication; dropping an unstopped connector does the same on a thread of
//! its own, so a failing test does not leave a slot holding WAL.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value, json};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

use crate::{TestDb, create_topic, database_parts, database_url, unique};

/// Kafka Connect's REST address (`OUTBOX_TEST_CONNECT`).
pub fn connect_url() -> String {
    std::env::var("OUTBOX_TEST_CONNECT").unwrap_or_else(|_| "http://127.0.0.1:8083".into())
}

/// The database of [`database_url`], which the connector reads.
pub fn database_name() -> String {
    database_url()
        .parse::<PgConnectOptions>()
        .ok()
        .and_then(|o| o.get_database().map(str::to_owned))
        .unwrap_or_else(|| "outbox_test".into())
}

/// Bound on one REST call.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// One HTTP/1.1 request to the Connect REST API; returns the status and the body as JSON
/// (`Null` when empty, a JSON string when not JSON).
pub async fn connect_request(
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(StatusCode, Value)> {
    tokio::time::timeout(HTTP_TIMEOUT, request(method.clone(), path, body))
        .await
        .map_err(|_| anyhow!("{method} {path}: no answer within {HTTP_TIMEOUT:?}"))?
        .with_context(|| format!("{method} {} {path}", connect_url()))
}

async fn request(method: Method, path: &str, body: Option<&Value>) -> Result<(StatusCode, Value)> {
    let base = connect_url();
    let authority = base
        .strip_prefix("http://")
        .with_context(|| format!("OUTBOX_TEST_CONNECT must be http://host:port, not {base}"))?
        .trim_end_matches('/')
        .to_owned();
    let stream = tokio::net::TcpStream::connect(&authority).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let driver = tokio::spawn(connection);
    let bytes = match body {
        Some(v) => serde_json::to_vec(v)?,
        None => Vec::new(),
    };
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, &authority)
        .header(ACCEPT, "application/json")
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(bytes)))?;
    let response = sender.send_request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    drop(sender);
    // The connection ends once the sender is gone and the response is read.
    driver.await??;
    let value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
    };
    Ok((status, value))
}

/// How the connector turns the `payload` column (jsonb, a string in Debezium's record) into
/// the Kafka value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadMode {
    /// `value.converter=StringConverter`, no expansion: the value is the column's JSON text,
    /// byte for byte what the relay sends (`payload::text`).
    Text,
    /// `table.expand.json.payload=true` with `JsonConverter` (`schemas.enable=false`): the
    /// router infers a Connect schema from each payload and the converter writes it back as
    /// JSON. Object members whose value is `null` are dropped, and a payload it cannot type
    /// (an array mixing types, for one) is sent as a JSON *string* instead, with a
    /// `JSON expansion failed` warning in the worker's log.
    Expanded,
}

/// The Debezium connector configuration the tests run, as `(name, value)` pairs: the
/// Postgres connector on `schema.outbox_events` from now on (no snapshot), through `slot` and
/// `publication`, and the Outbox Event Router set up to produce the relay's wire contract,
/// with the payload written as `mode` says.
pub fn outbox_connector_config(
    name: &str,
    schema: &str,
    slot: &str,
    publication: &str,
    mode: PayloadMode,
) -> Vec<(String, String)> {
    // The connector reaches the test database as the tests do: same host (TLS verifies it),
    // user and password, `sslmode` and root certificate (pgjdbc takes libpq's names).
    let db =
        database_parts().unwrap_or_else(|e| panic!("the connector's database settings: {e:#}"));
    let port = db.port.to_string();
    let tls = [
        ("database.sslmode", db.sslmode.as_deref()),
        ("database.sslrootcert", db.sslrootcert.as_deref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v?)));
    [
        (
            "connector.class",
            "io.debezium.connector.postgresql.PostgresConnector",
        ),
        ("tasks.max", "1"),
        ("database.hostname", db.host.as_str()),
        ("database.port", port.as_str()),
        ("database.user", db.user.as_str()),
        ("database.password", db.password.as_str()),
        ("database.dbname", db.database.as_str()),
        ("topic.prefix", name),
        ("plugin.name", "pgoutput"),
        ("slot.name", slot),
        ("publication.name", publication),
        ("publication.autocreate.mode", "filtered"),
        ("table.include.list", &format!("{schema}.outbox_events")),
        // Debezium 3.6 rejects `never`; `no_data` streams from the slot's creation on.
        ("snapshot.mode", "no_data"),
        ("tombstones.on.delete", "false"),
        ("heartbeat.interval.ms", "1000"),
        // Debezium 3.x adds four `__debezium.context.*` headers to every record by default.
        ("extended.headers.enabled", "false"),
        (
            "key.converter",
            "org.apache.kafka.connect.storage.StringConverter",
        ),
        (
            "header.converter",
            "org.apache.kafka.connect.storage.SimpleHeaderConverter",
        ),
        ("transforms", "outbox"),
        (
            "transforms.outbox.type",
            "io.debezium.transforms.outbox.EventRouter",
        ),
        ("transforms.outbox.route.by.field", "topic"),
        (
            "transforms.outbox.route.topic.replacement",
            "${routedByValue}",
        ),
        (
            "transforms.outbox.table.fields.additional.placement",
            "type:header:type",
        ),
    ]
    .into_iter()
    .chain(tls)
    .chain(match mode {
        PayloadMode::Text => vec![
            (
                "value.converter",
                "org.apache.kafka.connect.storage.StringConverter",
            ),
            ("transforms.outbox.table.expand.json.payload", "false"),
        ],
        PayloadMode::Expanded => vec![
            (
                "value.converter",
                "org.apache.kafka.connect.json.JsonConverter",
            ),
            ("value.converter.schemas.enable", "false"),
            ("transforms.outbox.table.expand.json.payload", "true"),
        ],
    })
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// A running Debezium outbox connector of one test, with its slot and publication. `Debug`
/// leaves the database password out of the configuration.
pub struct OutboxConnector {
    /// Connector name (also its `topic.prefix`).
    pub name: String,
    /// Replication slot name.
    pub slot: String,
    /// Publication name.
    pub publication: String,
    /// The configuration it was created with.
    pub config: Vec<(String, String)>,
    cleaned: bool,
}

impl std::fmt::Debug for OutboxConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let config: Vec<(&str, &str)> = self
            .config
            .iter()
            .map(|(k, v)| match k.as_str() {
                "database.password" => (k.as_str(), "<redacted>"),
                _ => (k.as_str(), v.as_str()),
            })
            .collect();
        f.debug_struct("OutboxConnector")
            .field("name", &self.name)
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("config", &config)
            .field("cleaned", &self.cleaned)
            .finish()
    }
}

/// How long the connector's task and slot get to come up, and to go away.
const STARTUP: Duration = Duration::from_secs(90);
const SHUTDOWN: Duration = Duration::from_secs(30);

impl OutboxConnector {
    /// Creates a connector for `db`'s outbox and waits until its task is RUNNING and its
    /// replication slot is active: rows committed after this returns are streamed.
    pub async fn start(db: &TestDb, mode: PayloadMode) -> Result<Self> {
        let connector = Self::new(db, mode);
        connector.launch().await?;
        Ok(connector)
    }

    /// A connector for `db`'s outbox, not created yet: [`Self::create_slot`] may fix the
    /// point it streams from before [`Self::launch`] creates it. Dropping it cleans up
    /// whatever was created.
    pub fn new(db: &TestDb, mode: PayloadMode) -> Self {
        let name = unique("dbz");
        let slot = name.clone();
        let publication = format!("{name}_pub");
        let config = outbox_connector_config(&name, &db.schema, &slot, &publication, mode);
        Self {
            name,
            slot,
            publication,
            config,
            cleaned: false,
        }
    }

    /// Creates the publication and then the replication slot the connector will use: the
    /// connector streams what commits after this returns, whenever it is launched.
    pub async fn create_slot(&self, schema: &str) -> Result<()> {
        let mut conn = PgConnection::connect(&database_url()).await?;
        // The publication must predate the changes the slot decodes.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE PUBLICATION {} FOR TABLE {schema}.outbox_events",
            self.publication
        )))
        .execute(&mut conn)
        .await?;
        sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&self.slot)
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        Ok(())
    }

    /// Creates the connector (on its existing slot, if [`Self::create_slot`] made one) and
    /// waits until its task is RUNNING and a walsender streams its slot.
    pub async fn launch(&self) -> Result<()> {
        // Heartbeats go to `__debezium-heartbeat.<topic.prefix>`; the broker does not
        // auto-create topics.
        create_topic(&format!("__debezium-heartbeat.{}", self.name), 1).await?;
        let body = json!({
            "name": self.name,
            "config": self.config.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect::<Map<_, _>>(),
        });
        let (status, answer) = connect_request(Method::POST, "/connectors", Some(&body)).await?;
        if !status.is_success() {
            bail!("creating connector {}: {status} {answer}", self.name);
        }
        self.await_streaming(None).await
    }

    /// The connector's status document.
    pub async fn status(&self) -> Result<Value> {
        let (status, answer) = connect_request(
            Method::GET,
            &format!("/connectors/{}/status", self.name),
            None,
        )
        .await?;
        if !status.is_success() {
            bail!("status of {}: {status} {answer}", self.name);
        }
        Ok(answer)
    }

    /// Whether the connector and its one task are RUNNING; fails when either FAILED.
    async fn running(&self) -> Result<bool> {
        let status = self.status().await?;
        let connector = status["connector"]["state"].as_str().unwrap_or_default();
        let tasks = status["tasks"].as_array().cloned().unwrap_or_default();
        for task in &tasks {
            if task["state"] == "FAILED" {
                bail!("connector {} task failed: {}", self.name, task["trace"]);
            }
        }
        if connector == "FAILED" {
            bail!("connector {} failed: {status}", self.name);
        }
        Ok(connector == "RUNNING"
            && !tasks.is_empty()
            && tasks.iter().all(|t| t["state"] == "RUNNING"))
    }

    /// The pid of the walsender streaming this connector's slot, if it is active.
    pub async fn slot_pid(&self) -> Result<Option<i32>> {
        let mut conn = PgConnection::connect(&database_url()).await?;
        let pid: Option<Option<i32>> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&self.slot)
                .fetch_optional(&mut conn)
                .await?;
        conn.close().await?;
        Ok(pid.flatten())
    }

    /// Waits until the task is RUNNING and a walsender other than `not_pid` streams the slot.
    async fn await_streaming(&self, not_pid: Option<i32>) -> Result<()> {
        let deadline = Instant::now() + STARTUP;
        loop {
            if self.running().await?
                && let Some(pid) = self.slot_pid().await?
                && Some(pid) != not_pid
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "connector {} not streaming after {STARTUP:?}: {}",
                    self.name,
                    self.status().await.unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Restarts the connector and its task (a graceful stop, offsets committed, then a
    /// start from them), and waits until a new walsender streams the slot.
    pub async fn restart(&self) -> Result<()> {
        let before = self.slot_pid().await?;
        let (status, answer) = connect_request(
            Method::POST,
            &format!(
                "/connectors/{}/restart?includeTasks=true&onlyFailed=false",
                self.name
            ),
            None,
        )
        .await?;
        if !status.is_success() {
            bail!("restarting {}: {status} {answer}", self.name);
        }
        self.await_streaming(before).await
    }

    /// Pauses the connector (`PUT /connectors/{name}/pause`) and waits until it and its task
    /// report PAUSED: the task no longer hands records to Kafka Connect's producer (Debezium
    /// keeps reading the slot into its queue until `max.queue.size` is reached).
    pub async fn pause(&self) -> Result<()> {
        self.put_state("pause").await?;
        let deadline = Instant::now() + STARTUP;
        loop {
            let status = self.status().await?;
            let tasks = status["tasks"].as_array().cloned().unwrap_or_default();
            if status["connector"]["state"] == "PAUSED"
                && !tasks.is_empty()
                && tasks.iter().all(|t| t["state"] == "PAUSED")
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "connector {} not paused after {STARTUP:?}: {status}",
                    self.name
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Resumes a paused connector (`PUT /connectors/{name}/resume`); returns once the worker
    /// accepted the request.
    pub async fn resume(&self) -> Result<()> {
        self.put_state("resume").await
    }

    async fn put_state(&self, verb: &str) -> Result<()> {
        let (status, answer) = connect_request(
            Method::PUT,
            &format!("/connectors/{}/{verb}", self.name),
            None,
        )
        .await?;
        if !status.is_success() {
            bail!("{verb} {}: {status} {answer}", self.name);
        }
        Ok(())
    }

    /// Deletes the connector, then drops its slot and publication (once; later calls do
    /// nothing).
    pub async fn stop(&mut self) -> Result<()> {
        if self.cleaned {
            return Ok(());
        }
        self.cleaned = true;
        cleanup(&self.name, &self.slot, &self.publication).await
    }
}

impl Drop for OutboxConnector {
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let (name, slot, publication) = (
            self.name.clone(),
            self.slot.clone(),
            self.publication.clone(),
        );
        // Drop may run inside a runtime (a failing test): clean up on a runtime of its own.
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(cleanup(&name, &slot, &publication))
        })
        .join();
        match done {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("cleaning up connector {}: {error:#}", self.name),
            Err(_) => eprintln!("cleaning up connector {}: the cleanup panicked", self.name),
        }
    }
}

/// Deletes connector `name` (if present), waits for its walsender to leave `slot` (ending it
/// if it lingers), drops the slot and `publication`.
async fn cleanup(name: &str, slot: &str, publication: &str) -> Result<()> {
    let (status, answer) =
        connect_request(Method::DELETE, &format!("/connectors/{name}"), None).await?;
    if !status.is_success() && status != StatusCode::NOT_FOUND {
        bail!("deleting connector {name}: {status} {answer}");
    }
    let mut conn = PgConnection::connect(&database_url()).await?;
    let deadline = Instant::now() + SHUTDOWN;
    loop {
        let pid: Option<Option<i32>> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_optional(&mut conn)
                .await?;
        match pid {
            None => break, // never created
            Some(None) => {
                sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(slot)
                    .execute(&mut conn)
                    .await?;
                break;
            }
            Some(Some(pid)) if Instant::now() >= deadline => {
                sqlx::query("SELECT pg_terminate_backend($1)")
                    .bind(pid)
                    .execute(&mut conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(Some(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP PUBLICATION IF EXISTS {publication}"
    )))
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    Ok(())
}
