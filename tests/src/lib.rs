//! Helpers for the end-to-end tests: an isolated Postgres schema per test and random topics on
//! the real broker. The services come from `scripts/services.sh`; the addresses from
//! `OUTBOX_TEST_DATABASE_URL` and `OUTBOX_TEST_KAFKA`.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use outbox_core::{java_partition, murmur2};
pub mod dispatch;
mod java_producer;
mod raw_record;
mod roles;
mod secure_kafka;
pub use java_producer::{JavaRecord, java_produce};
pub use raw_record::{ByteHeader, produce_bytes};
pub use roles::{Login, Roles};
pub use secure_kafka::{SecureKafka, unsecured_token};

/// The Postgres database the tests use; each test gets its own schema in it.
/// `OUTBOX_TEST_DATABASE_URL`, else the scripts' own cluster ([`scripts_cluster_url`]);
/// panics with [`try_database_url`]'s error.
pub fn database_url() -> String {
    try_database_url().unwrap_or_else(|e| panic!("{e:#}"))
}

/// `OUTBOX_TEST_DATABASE_URL`, else the scripts' own cluster ([`scripts_cluster_url`]).
pub fn try_database_url() -> Result<String> {
    match std::env::var("OUTBOX_TEST_DATABASE_URL") {
        Ok(url) => Ok(url),
        Err(_) => scripts_cluster_url(),
    }
}

/// [`try_database_url`] with `database` in place of its database (the same server, user,
/// password and TLS settings).
pub fn database_url_for(database: &str) -> Result<String> {
    let mut url = url::Url::parse(&try_database_url()?)
        .map_err(|e| anyhow::anyhow!("OUTBOX_TEST_DATABASE_URL is not a URL: {e}"))?;
    url.set_path(database);
    Ok(url.into())
}

/// The URL `scripts/postgres.sh` exports for its cluster: user `OUTBOX_PG_USER` (default
/// `outbox`) with the password it generated into `.services/postgres/password`, `localhost`
/// port `OUTBOX_PG_PORT` (default 54329), TLS verified against the scripts' authority
/// (`sslmode=verify-full`). Fails, naming the file, when the cluster was never made.
pub fn scripts_cluster_url() -> Result<String> {
    let services = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.services");
    let password_file = services.join("postgres/password");
    let password = std::fs::read_to_string(&password_file).with_context(|| {
        format!(
            "OUTBOX_TEST_DATABASE_URL is not set and {} cannot be read: start the scripts' \
             PostgreSQL with scripts/test, or `source scripts/services.sh && ensure_postgres`",
            password_file.display()
        )
    })?;
    let ca = services.join("tls/ca.pem");
    let ca = ca.canonicalize().unwrap_or(ca);
    let user = std::env::var("OUTBOX_PG_USER").unwrap_or_else(|_| "outbox".into());
    let port = std::env::var("OUTBOX_PG_PORT").unwrap_or_else(|_| "54329".into());
    Ok(format!(
        "postgres://{}:{}@localhost:{port}/outbox_test?sslmode=verify-full&sslrootcert={}",
        url_escape(&user),
        url_escape(password.trim()),
        url_escape(&ca.to_string_lossy()),
    ))
}

/// The parts of [`database_url`] a client other than sqlx needs (Debezium's connector).
/// `Debug` leaves the password out.
#[derive(Clone)]
pub struct DatabaseParts {
    /// Host name as the URL gives it (`localhost`: TLS verifies it against the certificate).
    pub host: String,
    /// Port (5432 when the URL has none).
    pub port: u16,
    /// User name.
    pub user: String,
    /// Password (empty when the URL has none).
    pub password: String,
    /// Database name.
    pub database: String,
    /// `sslmode`, when the URL sets it.
    pub sslmode: Option<String>,
    /// `sslrootcert`, when the URL sets it.
    pub sslrootcert: Option<String>,
}

impl std::fmt::Debug for DatabaseParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseParts")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .field("database", &self.database)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .finish()
    }
}

/// [`database_url`] taken apart. Errors name the part that is wrong, never the URL.
pub fn database_parts() -> Result<DatabaseParts> {
    let url = url::Url::parse(&try_database_url()?)
        .map_err(|e| anyhow::anyhow!("OUTBOX_TEST_DATABASE_URL is not a URL: {e}"))?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(std::borrow::Cow::into_owned)
            .context("OUTBOX_TEST_DATABASE_URL: a part is not UTF-8 once decoded")
    };
    let query = |key: &str| {
        url.query_pairs()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.into_owned())
    };
    Ok(DatabaseParts {
        host: url
            .host_str()
            .context("OUTBOX_TEST_DATABASE_URL has no host")?
            .to_owned(),
        port: url.port().unwrap_or(5432),
        user: decode(url.username())?,
        password: decode(url.password().unwrap_or(""))?,
        database: decode(url.path().trim_start_matches('/'))?,
        sslmode: query("sslmode"),
        sslrootcert: query("sslrootcert"),
    })
}

/// Percent-encodes all but unreserved characters and `/` (a path in a URL's query).
pub fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' | b'/' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The broker's bootstrap address.
pub fn kafka_bootstrap() -> String {
    std::env::var("OUTBOX_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A short random suffix for schema and topic names.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// Installs a `tracing` subscriber once (`RUST_LOG` filters it).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A fresh schema with the framework's tables; its pool resolves tables there.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// Connections whose `search_path` is the test's schema.
    pub pool: PgPool,
    /// The schema's name.
    pub schema: String,
}

impl TestDb {
    /// The test database's URL with this schema as `search_path` (for processes: the CLI).
    pub fn url(&self) -> String {
        let url = database_url();
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}options=-c%20search_path%3D{}", self.schema)
    }

    /// A second pool on this schema whose connections carry `application_name`, so a test
    /// can tell its own backends (or a consumer's effect rows) apart.
    pub async fn pool_named(&self, name: &str) -> Result<PgPool> {
        let options = (*self.pool.connect_options())
            .clone()
            .application_name(name);
        Ok(sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?)
    }

    /// Creates the schema and runs the migrations in it.
    pub async fn new() -> Result<Self> {
        Self::with_pool_size(8).await
    }

    /// Same, with a pool of `size` connections.
    pub async fn with_pool_size(size: u32) -> Result<Self> {
        let db = Self::unmigrated(size).await?;
        outbox_core::migrate(&db.pool).await?;
        Ok(db)
    }

    /// A schema of its own with only the migrations before `version` run in it: the tables
    /// as an older release left them (for migration tests and benchmarks).
    pub async fn before_migration(version: i64) -> Result<Self> {
        let db = Self::unmigrated(4).await?;
        let all = outbox_core::migrator(&outbox_core::TableNames::default());
        let mut before = sqlx::migrate::Migrator::with_migrations(
            all.iter()
                .filter(|m| m.version < version)
                .cloned()
                .collect(),
        );
        before.dangerous_set_table_name(all.table_name.clone());
        before.run(&db.pool).await?;
        Ok(db)
    }

    /// A schema of its own with no migration run in it (for migration tests).
    pub async fn unmigrated(size: u32) -> Result<Self> {
        init_tracing();
        let schema = unique("t");
        let base = PgConnectOptions::from_str(&database_url())?;
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone())
            .await
            .context("connecting to the test database (run scripts/test, which starts it)")?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(size)
            .connect_with(base.options([("search_path", schema.as_str())]))
            .await?;
        Ok(Self { pool, schema })
    }
}

/// Creates `topic` with `partitions` partitions on the broker (the test broker does not
/// auto-create topics).
pub async fn create_topic(topic: &str, partitions: i32) -> Result<()> {
    create_topic_with(topic, partitions, &[]).await
}

/// Creates `topic` with `partitions` partitions and the topic `configs`
/// (`max.message.bytes`, `compression.type`, ...).
pub async fn create_topic_with(
    topic: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .create()?;
    let new = configs.iter().fold(
        NewTopic::new(topic, partitions, TopicReplication::Fixed(1)),
        |new, (key, value)| new.set(key, value),
    );
    let results = admin
        .create_topics(
            &[new],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => bail!("creating topic {name}: {code}"),
        }
    }
    Ok(())
}

/// A random topic name, created with `partitions` partitions.
pub async fn random_topic(partitions: i32) -> Result<String> {
    let topic = unique("outbox.test");
    create_topic(&topic, partitions).await?;
    Ok(topic)
}

/// One record read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Partition it landed in.
    pub partition: i32,
    /// Offset in that partition.
    pub offset: i64,
    /// Key as UTF-8.
    pub key: String,
    /// Value as UTF-8.
    pub payload: String,
    /// Headers as UTF-8.
    pub headers: BTreeMap<String, String>,
    /// The record's timestamp, in milliseconds since the epoch.
    pub timestamp_ms: Option<i64>,
}

impl Record {
    /// The `id` header.
    pub fn id(&self) -> &str {
        self.headers.get("id").map_or("", String::as_str)
    }
}

fn reader(brokers: &str, topic: &str, partitions: i32) -> Result<BaseConsumer> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()?;
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment.add_partition_offset(topic, p, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    Ok(consumer)
}

impl Record {
    fn from_message(message: &impl Message) -> Self {
        let text = |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
        Self {
            partition: message.partition(),
            offset: message.offset(),
            key: text(message.key()),
            payload: text(message.payload()),
            headers: message
                .headers()
                .map(|hs| {
                    hs.iter()
                        .map(|h| (h.key.to_owned(), text(h.value)))
                        .collect()
                })
                .unwrap_or_default(),
            timestamp_ms: message.timestamp().to_millis(),
        }
    }
}

/// Header marking the end-of-read markers [`read_all`] writes; such records are never
/// returned.
const SENTINEL_HEADER: &str = "outbox-test-sentinel";

/// Reads everything in `topic` as of now, duplicates included, in offset order per partition.
///
/// It first appends a marker record to every partition, then reads until it has met each
/// marker, so it neither waits for a fixed time nor relies on watermarks.
pub async fn read_all(topic: &str, partitions: i32, timeout: Duration) -> Result<Vec<Record>> {
    read_all_from(&kafka_bootstrap(), topic, partitions, timeout).await
}

/// [`read_all`] from the broker at `brokers` rather than the suite's.
pub async fn read_all_from(
    brokers: &str,
    topic: &str,
    partitions: i32,
    timeout: Duration,
) -> Result<Vec<Record>> {
    let token = uuid::Uuid::new_v4().to_string();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for p in 0..partitions {
        let headers = OwnedHeaders::new().insert(Header {
            key: SENTINEL_HEADER,
            value: Some(&token),
        });
        producer
            .send(
                FutureRecord::<(), ()>::to(topic)
                    .partition(p)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer = reader(&brokers, &topic, partitions)?;
        let deadline = Instant::now() + timeout;
        let mut open: HashSet<i32> = (0..partitions).collect();
        let mut records = Vec::new();
        while !open.is_empty() {
            if Instant::now() >= deadline {
                bail!("timed out reading {topic}: partitions {open:?} not read to the end");
            }
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let record = Record::from_message(&message?);
            match record.headers.get(SENTINEL_HEADER) {
                Some(t) if *t == token => {
                    open.remove(&record.partition);
                }
                Some(_) => {}
                None => records.push(record),
            }
        }
        Ok(records)
    })
    .await?
}

/// Awaits `condition` (checked every 20 ms) for up to `timeout`; fails with `what` if it never
/// holds.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Blocks of `index` (on `table`, in `schema`) that `run` read or found in shared buffers on
/// `conn`. `table` is analyzed first, as autovacuum keeps it: with a histogram, a plan made
/// for a key bound probes the index for the key's actual least value.
pub async fn index_blocks_read_by<T>(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    table: &str,
    index: &str,
    run: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T>,
) -> Result<(T, i64)> {
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
        .execute(&mut *conn)
        .await?;
    let query = "SELECT idx_blks_read + idx_blks_hit FROM pg_statio_user_indexes \
                 WHERE schemaname = $1 AND indexrelname = $2";
    let before = blocks_accessed(conn, query, schema, index).await?;
    let value = run(&mut *conn).await?;
    let after = blocks_accessed(conn, query, schema, index).await?;
    Ok((value, after - before))
}

/// Heap and index blocks of `table` (in `schema`) read or found in shared buffers so far: run
/// what to count on the same connection, between two calls.
pub async fn table_blocks_accessed(
    conn: &mut sqlx::PgConnection,
    schema: &str,
    table: &str,
) -> Result<i64> {
    let query = "SELECT coalesce(heap_blks_read + heap_blks_hit, 0) \
                      + coalesce(idx_blks_read + idx_blks_hit, 0) \
                 FROM pg_statio_user_tables WHERE schemaname = $1 AND relname = $2";
    blocks_accessed(conn, query, schema, table).await
}

/// `query`'s count (bound to `schema` and `name`) as the statistics have it once this
/// connection's own counters are flushed.
async fn blocks_accessed(
    conn: &mut sqlx::PgConnection,
    query: &'static str,
    schema: &str,
    name: &str,
) -> Result<i64> {
    // The backend flushes its counters when it goes idle after this statement, so the next
    // one (a new transaction, a new statistics snapshot) reads them.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await?;
    Ok(sqlx::query_scalar(query)
        .bind(schema)
        .bind(name)
        .fetch_one(conn)
        .await?)
}

/// Rows of the test's outbox with `status`.
pub async fn count_status(pool: &PgPool, status: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE status = $1")
            .bind(status)
            .fetch_one(pool)
            .await?,
    )
}

/// Produces one raw record with any client settings a test wants, as an outside producer
/// (not the relay) would.
pub async fn produce_raw(
    topic: &str,
    partition: Option<i32>,
    key: Option<&str>,
    payload: Option<&[u8]>,
    headers: &[(&str, &[u8])],
) -> Result<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap())
        .create()?;
    let mut owned = OwnedHeaders::new();
    for (k, v) in headers {
        owned = owned.insert(Header {
            key: k,
            value: Some(*v),
        });
    }
    let mut record = FutureRecord::<str, [u8]>::to(topic).headers(owned);
    if let Some(p) = partition {
        record = record.partition(p);
    }
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(p) = payload {
        record = record.payload(p);
    }
    let delivery = producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)?;
    Ok((delivery.partition, delivery.offset))
}

pub mod connect;
pub use connect::{
    OutboxConnector, PayloadMode, connect_request, connect_url, outbox_connector_config,
};

/// A record as the relay writes it, for feeding a consumer directly: key `k`, partition 0,
/// an `id` header and `payload`.
pub fn event_message(
    topic: &str,
    offset: i64,
    id: outbox_core::EventId,
    payload: &str,
) -> rdkafka::message::OwnedMessage {
    let id = id.to_string();
    let headers = OwnedHeaders::new().insert(Header {
        key: "id",
        value: Some(&id),
    });
    rdkafka::message::OwnedMessage::new(
        Some(payload.as_bytes().to_vec()),
        Some(b"k".to_vec()),
        topic.to_owned(),
        rdkafka::Timestamp::NotAvailable,
        0,
        offset,
        Some(headers),
    )
}

/// A tracing subscriber that keeps the statements sqlx ran while it was the current one (sqlx
/// logs each statement's text: target `sqlx::query`, field `db.statement`, prepared or not),
/// and the notices and warnings Postgres sent, as `notice: <message>`.
/// Use it with `tracing::instrument::WithSubscriber::with_subscriber`.
#[derive(Debug, Clone, Default)]
pub struct Statements(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Statements {
    /// The first statement that contains `marker`.
    pub fn containing(&self, marker: &str) -> Result<String> {
        let statements = self.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        statements
            .iter()
            .find(|s| s.contains(marker))
            .cloned()
            .with_context(|| format!("no statement containing {marker:?} ran"))
    }

    /// Every statement, in the order sqlx ran them.
    pub fn all(&self) -> Vec<String> {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

struct StatementField<'a>(&'a mut Option<String>);

impl tracing::field::Visit for StatementField<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "db.statement" {
            *self.0 = Some(value.trim().to_owned());
        }
    }

    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

struct NoticeField<'a>(&'a mut Option<String>);

impl tracing::field::Visit for NoticeField<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            *self.0 = Some(format!("notice: {value:?}"));
        }
    }
}

impl tracing::Subscriber for Statements {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        matches!(metadata.target(), "sqlx::query" | "sqlx::postgres::notice")
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut statement = None;
        if event.metadata().target() == "sqlx::query" {
            event.record(&mut StatementField(&mut statement));
        } else {
            event.record(&mut NoticeField(&mut statement));
        }
        if let (Some(s), Ok(mut all)) = (statement, self.0.lock()) {
            all.push(s);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}
