//! The `outbox` binary against the real Postgres.

use std::process::Command;

use anyhow::{Context, Result};
use outbox_producer::NewEvent;
use outbox_tests::TestDb;

/// The test database's URL with the test's schema as `search_path`.
fn schema_url(db: &TestDb) -> String {
    db.url()
}

fn outbox(db: &TestDb, args: &[&str]) -> Result<(bool, String, String)> {
    outbox_with(db, args, &[])
}

/// [`outbox`] with more environment variables (and no `KAFKA_BROKERS` from the test's).
fn outbox_with(db: &TestDb, args: &[&str], env: &[(&str, &str)]) -> Result<(bool, String, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", schema_url(db))
        .env("RUST_BACKTRACE", "0")
        .env_remove("KAFKA_BROKERS")
        .env_remove("OUTBOX_KAFKA_CONFIG")
        .envs(env.iter().copied())
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    ))
}

#[tokio::test]
async fn prune_dedup_from_cron_removes_only_old_rows() -> Result<()> {
    let db = TestDb::new().await?;
    // Ids with no time, handled 1..10 days ago (less 12 hours)...
    sqlx::query(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice, processed_at) \
         SELECT 'c', gen_random_uuid(), 0, now() - (g || ' days')::interval + interval '12 hours' \
         FROM generate_series(1, 10) AS g",
    )
    .execute(&db.pool)
    .await?;
    // ...and events decided 10, 9 and 1 day(s) ago, in their days' slices.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let mut conn = db.pool.acquire().await?;
    for days in [10, 9, 1] {
        let at = uuid::Timestamp::from_unix(uuid::NoContext, now.as_secs() - days * 86_400, 0);
        let id = uuid::Uuid::new_v7(at);
        let slice = outbox_consumer::dedup_slice(&id);
        outbox_consumer::ensure_dedup_slices(&mut conn, &Default::default(), [slice]).await?;
        sqlx::query(
            "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice) VALUES ('c', $1, $2)",
        )
        .bind(id)
        .bind(slice)
        .execute(&mut *conn)
        .await?;
    }
    let (ok, stdout, stderr) = outbox(
        &db,
        &["prune", "dedup", "--older-than", "7d", "--batch", "2"],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.trim(),
        "dropped 2 day slices, removed 3 timeless rows, made 8 day slices ahead",
        "the days of 10 and 9 days ago; ages 7.5, 8.5 and 9.5 days; today to a week ahead"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dedup")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 7 + 1);
    Ok(())
}

/// `outbox migrate` makes the dedup slices of the days around today, ahead of consumers.
#[tokio::test]
async fn migrate_makes_the_dedup_slices_around_today() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, stdout, stderr) = outbox(&db, &["migrate"])?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "migrations applied");
    let slices: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox_consumer_dedup'::regclass ORDER BY c.relname",
    )
    .fetch_all(&db.pool)
    .await?;
    let today = outbox_consumer::today();
    let mut expected: Vec<String> = (today - 1..=today + outbox_consumer::SLICES_AHEAD)
        .map(|d| format!("outbox_consumer_dedup_d{d}"))
        .collect();
    expected.push("outbox_consumer_dedup_timeless".to_owned());
    assert_eq!(slices, expected);
    Ok(())
}

/// A destination whose calls all fail shows as down in `outbox status`, with its actions
/// waiting out the outage uncharged and the reason; one that answers shows as up.
#[tokio::test]
async fn status_shows_a_dispatcher_destination_down_and_why() -> Result<()> {
    use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Outcome};
    let db = TestDb::new().await?;
    let mut tx = db.pool.begin().await?;
    for (destination, key) in [
        ("billing", "a"),
        ("billing", "b"),
        ("billing", "c"),
        ("mail", "a"),
    ] {
        let action = NewEvent::new("task", key, "Do", &serde_json::json!({}))?
            .for_dispatcher(destination)?;
        outbox_producer::enqueue(&mut tx, &action).await?;
    }
    tx.commit().await?;
    let refused = |_: Action| async { Outcome::retry("HTTP 503 Service Unavailable") };
    Dispatcher::new(db.pool.clone(), DispatcherConfig::new("billing"), refused)?
        .run_once()
        .await?;
    let (ok, stdout, stderr) = outbox(&db, &["status", "--json"])?;
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout)?;
    let destinations = status["destinations"].as_array().context("destinations")?;
    assert_eq!(destinations.len(), 2, "{destinations:?}");
    let billing = &destinations[0];
    assert_eq!(billing["destination"], "billing");
    assert_eq!(billing["up"], false);
    assert_eq!(billing["waiting_out_outage"], 3);
    assert!(
        billing["outage_reason"]
            .as_str()
            .is_some_and(|r| r.contains("HTTP 503")),
        "{billing}"
    );
    assert_eq!(destinations[1]["destination"], "mail");
    assert_eq!(destinations[1]["up"], true);
    let (ok, stdout, stderr) = outbox(&db, &["status"])?;
    assert!(ok, "{stderr}");
    assert!(stdout.contains("DOWN: 3 waiting out an outage"), "{stdout}");
    Ok(())
}

#[tokio::test]
async fn status_reports_json_and_bad_arguments_fail_clearly() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, stdout, stderr) = outbox(&db, &["status", "--json"])?;
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(status["pending"], 0);
    assert_eq!(status["consumer_quarantined"], 0);
    assert_eq!(status["topics"], serde_json::json!([]));

    let mut tx = db.pool.begin().await?;
    for topic in ["orders", "orders", "invoices"] {
        let event =
            NewEvent::new("agent", "a1", "Decided", &serde_json::json!({}))?.with_topic(topic)?;
        outbox_producer::enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;
    sqlx::query(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice) \
         SELECT c, gen_random_uuid(), 0 FROM unnest(ARRAY['billing', 'billing', 'audit']) AS c",
    )
    .execute(&db.pool)
    .await?;
    let (ok, stdout, stderr) = outbox(&db, &["status", "--json"])?;
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(status["pending"], 3);
    let per_topic: Vec<(String, i64)> = status["topics"]
        .as_array()
        .context("topics")?
        .iter()
        .map(|t| {
            (
                t["topic"].as_str().unwrap_or("").to_owned(),
                t["pending"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    assert_eq!(
        per_topic,
        [("invoices".to_owned(), 1), ("orders".to_owned(), 2)]
    );
    assert_eq!(status["dedup"]["rows"], 3);
    assert_eq!(
        status["dedup"]["consumers"],
        serde_json::json!([{"consumer": "audit", "rows": 1}, {"consumer": "billing", "rows": 2}])
    );
    assert!(status["dedup"]["bytes"].as_i64().unwrap_or(0) > 0);
    let (ok, stdout, stderr) = outbox(&db, &["status"])?;
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("orders") && stdout.contains("dedup rows           3"),
        "{stdout}"
    );

    // An unreachable database is named as such, not a panic or a raw driver error alone.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args([
            "status",
            "--database-url",
            "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()?;
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr)?;
    assert!(
        stderr.contains("cannot connect to the database"),
        "{stderr}"
    );

    let (ok, _, stderr) = outbox(&db, &["prune", "dedup", "--older-than", "seven days"])?;
    assert!(!ok);
    assert!(stderr.contains("--older-than"), "{stderr}");
    let (ok, _, stderr) = outbox(&db, &["--outbox-table", "x;drop", "status"])?;
    assert!(!ok);
    assert!(stderr.contains("invalid identifier"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn migrate_creates_the_tables_in_the_urls_schema() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "--outbox-table",
            "cli_outbox",
            "--dedup-table",
            "cli_dedup",
            "--quarantine-table",
            "cli_quarantine",
            "migrate",
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "migrations applied");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('cli_outbox') IS NOT NULL")
        .fetch_one(&db.pool)
        .await?;
    assert!(exists);
    Ok(())
}

async fn quarantine_two_outbox_rows(db: &TestDb) -> Result<Vec<i64>> {
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, status, attempts, last_error) \
         SELECT gen_random_uuid(), 'a', 'k', 't', '{}', 'topic', 'quarantined', 3, 'Permanent: too large' \
         FROM generate_series(1, 2)",
    )
    .execute(&db.pool)
    .await?;
    Ok(
        sqlx::query_scalar("SELECT seq FROM outbox_events ORDER BY seq")
            .fetch_all(&db.pool)
            .await?,
    )
}

#[tokio::test]
async fn relay_quarantine_can_be_listed_requeued_and_discarded() -> Result<()> {
    let db = TestDb::new().await?;
    let seqs = quarantine_two_outbox_rows(&db).await?;
    let (ok, stdout, stderr) = outbox(&db, &["quarantine", "list", "relay", "--json"])?;
    assert!(ok, "{stderr}");
    let listed: Vec<serde_json::Value> = serde_json::from_str(&stdout)?;
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["last_error"], "Permanent: too large");

    let (first, second) = (seqs[0].to_string(), seqs[1].to_string());
    let (ok, stdout, _) = outbox(&db, &["quarantine", "requeue", "relay", &first])?;
    assert!(ok && stdout.contains("requeued 1"), "{stdout}");
    let (ok, stdout, _) = outbox(&db, &["quarantine", "discard", "relay", &second])?;
    assert!(ok && stdout.contains("discarded 1"), "{stdout}");
    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT status, attempts FROM outbox_events")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(rows, [("pending".to_owned(), 0)]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_quarantine_requeue_publishes_the_message_as_received() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    sqlx::query(
        "INSERT INTO outbox_consumer_quarantine (consumer, topic, partition, \"offset\", message_key, payload, headers, reason, error, record_timestamp) \
         VALUES ('billing', $1, 0, 7, 'k'::bytea, '{broken'::bytea, '{\"id\": \"x\", \"type\": \"T\", \"outbox-requeue-for\": \"earlier\"}', 'invalid_id', 'not a uuid', '2026-01-02 03:04:05.678+00'), \
                ('billing', $1, 0, 8, NULL, NULL, '{}', 'missing_payload', 'no payload', NULL)",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await?;
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine ORDER BY id")
        .fetch_all(&db.pool)
        .await?;
    let (ok, stdout, _) = outbox(&db, &["quarantine", "list", "consumer"])?;
    assert!(
        ok && stdout.lines().count() == 2 && stdout.contains("invalid_id"),
        "{stdout}"
    );

    let first = ids[0].to_string();
    let brokers = outbox_tests::kafka_bootstrap();
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "quarantine",
            "requeue",
            "consumer",
            &first,
            "--brokers",
            &brokers,
            "--to-consumer",
            "billing-v2",
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "requeued 1 messages");
    let records = outbox_tests::read_all(&topic, 1, std::time::Duration::from_secs(30)).await?;
    assert_eq!(records.len(), 1);
    assert_eq!(
        (records[0].key.as_str(), records[0].payload.as_str()),
        ("k", "{broken")
    );
    assert_eq!(
        records[0].headers.get("type").map(String::as_str),
        Some("T")
    );
    // The original's time (2026-01-02 03:04:05.678 UTC), not the requeue's.
    assert_eq!(records[0].timestamp_ms, Some(1_767_323_045_678));
    // For the renamed consumer alone, in place of the earlier requeue's header (read last,
    // it would win).
    assert_eq!(
        records[0]
            .headers
            .get(outbox_core::wire::HEADER_REQUEUE_FOR)
            .map(String::as_str),
        Some("billing-v2")
    );
    // Recorded as a requeue of that row, with where its copy went.
    let (rows, detail): (Vec<i64>, serde_json::Value) = sqlx::query_as(
        "SELECT row_ids, detail FROM outbox_quarantine_audit WHERE action = 'requeue'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(rows, [ids[0]]);
    assert_eq!(
        detail,
        serde_json::json!({
            "to_consumer": "billing-v2",
            "copy": {"topic": topic, "partition": 0, "offset": records[0].offset},
        })
    );

    let (ok, stdout, _) = outbox(
        &db,
        &["quarantine", "discard", "consumer", &ids[1].to_string()],
    )?;
    assert!(ok && stdout.contains("discarded 1"), "{stdout}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_process_publishes_and_stops_cleanly_on_sigterm() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let metrics_addr = free_local_addr()?;
    let mut relay = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args([
                "relay",
                "--brokers",
                &outbox_tests::kafka_bootstrap(),
                "--poll-interval",
                "100ms",
            ])
            .args(["--metrics-addr", &metrics_addr])
            .env("DATABASE_URL", schema_url(&db))
            .spawn()?,
    );
    let event =
        outbox_core::NewEvent::new("a", "k", "t", &serde_json::json!({}))?.with_topic(&topic)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    outbox_tests::eventually(
        "the relay process publishes",
        std::time::Duration::from_secs(30),
        || async { Ok(outbox_tests::count_status(&db.pool, "published").await? == 1) },
    )
    .await?;
    let scraped = scrape(&metrics_addr)?;
    assert!(
        scraped
            .lines()
            .any(|l| l.starts_with("outbox_relay_published_total") && l.ends_with(" 1")),
        "{scraped}"
    );
    assert!(
        scraped.contains("outbox_relay_publish_latency_seconds"),
        "{scraped}"
    );
    let status = Command::new("kill")
        .args(["-TERM", &relay.0.id().to_string()])
        .status()?;
    assert!(status.success());
    let exit = relay.0.wait()?;
    assert!(exit.success(), "relay exited with {exit}");
    Ok(())
}

/// A child process that is killed if the test ends early, so no relay outlives its test.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_local_addr() -> Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.to_string())
}

/// A plain HTTP/1.0 GET of /metrics: no client library needed for one request.
fn scrape(addr: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}

#[tokio::test]
async fn relay_names_unreachable_brokers_instead_of_retrying_silently() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, _, stderr) = outbox(
        &db,
        &[
            "relay",
            "--brokers",
            "127.0.0.1:1",
            "--connect-timeout",
            "2s",
        ],
    )?;
    assert!(!ok);
    assert!(
        stderr.contains("cannot use the Kafka brokers at 127.0.0.1:1"),
        "{stderr}"
    );
    Ok(())
}

/// A consumer and its running task.
type Running<H> = (
    outbox_consumer::DedupConsumer<serde_json::Value, H>,
    tokio::task::JoinHandle<Result<(), outbox_consumer::ConsumerError>>,
);

/// A consumer named as `config` says, in a group of its own, recording each event's effect as
/// (its name, event id), or rejecting it (quarantine) while `reject` is set.
fn spawn_consumer(
    pool: &sqlx::PgPool,
    config: outbox_consumer::ConsumerConfig,
    topic: &str,
    reject: std::sync::Arc<std::sync::atomic::AtomicBool>,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<Running<impl outbox_consumer::Handler<serde_json::Value>>> {
    use outbox_consumer::{Event, HandlerError};
    use rdkafka::consumer::Consumer;
    let name = config.name.clone().context("a named consumer")?;
    let group = outbox_tests::unique(&name);
    let consumer = outbox_consumer::DedupConsumer::new(
        pool.clone(),
        config,
        outbox_consumer::boxed(move |event: &Event<serde_json::Value>, conn| {
            let (name, reject) = (name.clone(), reject.clone());
            Box::pin(async move {
                if reject.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(HandlerError::quarantine("rejected by the test"));
                }
                sqlx::query("INSERT INTO effects (consumer, event_id) VALUES ($1, $2)")
                    .bind(name)
                    .bind(event.id)
                    .execute(conn)
                    .await?;
                Ok(())
            })
        }),
    )?;
    let stream = outbox_consumer::stream_consumer(&outbox_consumer::consumer_config(
        &outbox_tests::kafka_bootstrap(),
        &group,
    ))?;
    stream.subscribe(&[topic])?;
    let (run, shutdown) = (consumer.clone(), shutdown.clone());
    Ok((
        consumer,
        tokio::spawn(async move { run.run(stream, shutdown).await }),
    ))
}

/// Effects of event `id` by consumer `name`.
async fn effects_of(pool: &sqlx::PgPool, name: &str, id: outbox_core::EventId) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE consumer = $1 AND event_id = $2")
            .bind(name)
            .bind(id)
            .fetch_one(pool)
            .await?,
    )
}

/// Produces an event with id `id` to partition 0 of `topic`, as the relay would.
async fn produce_event(topic: &str, id: outbox_core::EventId) -> Result<()> {
    let id = id.to_string();
    let headers: [(&str, &[u8]); 2] = [("id", id.as_bytes()), ("type", b"T")];
    outbox_tests::produce_raw(topic, Some(0), Some("k"), Some(b"{}"), &headers).await?;
    Ok(())
}

/// A message consumer `a` quarantined is requeued to the topic every group reads. Consumer `b`
/// handled it the first time, and its dedup row for it is gone (its TTL passed and the slice
/// was pruned, as happens to every row in time): the requeued copy must reach `a` alone, or
/// `b` makes the event's effect twice. `b`, which cannot tell the copy from one whose requeue
/// header was forged, quarantines it (`requeue_unseen`) instead of handling it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_requeue_reaches_only_the_consumer_that_quarantined_it() -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effects (consumer TEXT, event_id UUID)")
        .execute(&db.pool)
        .await?;
    let topic = outbox_tests::random_topic(1).await?;
    let event = outbox_core::EventId::new();
    produce_event(&topic, event).await?;

    let shutdown = tokio_util::sync::CancellationToken::new();
    let a_rejects = Arc::new(AtomicBool::new(true));
    let (a, a_run) = spawn_consumer(
        &db.pool,
        outbox_consumer::ConsumerConfig::new("a"),
        &topic,
        a_rejects.clone(),
        &shutdown,
    )?;
    // `b`'s cache forgets at once, so that only its dedup table could recognise the copy.
    let b_config =
        outbox_consumer::ConsumerConfig::new("b").cache(1_000, std::time::Duration::from_millis(1));
    let (b, b_run) = spawn_consumer(
        &db.pool,
        b_config,
        &topic,
        Arc::new(AtomicBool::new(false)),
        &shutdown,
    )?;
    outbox_tests::eventually("a quarantines the event and b handles it", WAIT, || async {
        Ok(a.stats().quarantined == 1 && effects_of(&db.pool, "b", event).await? == 1)
    })
    .await?;
    // What pruning b's slice of the event's day does once b's TTL has passed.
    sqlx::query("DELETE FROM outbox_consumer_dedup WHERE consumer = 'b'")
        .execute(&db.pool)
        .await?;

    a_rejects.store(false, Ordering::SeqCst);
    let id: i64 =
        sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine WHERE consumer = 'a'")
            .fetch_one(&db.pool)
            .await?;
    let brokers = outbox_tests::kafka_bootstrap();
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "quarantine",
            "requeue",
            "consumer",
            &id.to_string(),
            "--brokers",
            &brokers,
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "requeued 1 messages");
    // Behind the copy in the partition: once both have handled it, both have seen the copy.
    let later = outbox_core::EventId::new();
    produce_event(&topic, later).await?;
    outbox_tests::eventually("both consumers handle the later event", WAIT, || async {
        Ok(effects_of(&db.pool, "a", later).await? == 1
            && effects_of(&db.pool, "b", later).await? == 1)
    })
    .await?;
    shutdown.cancel();
    a_run.await??;
    b_run.await??;

    assert_eq!(
        effects_of(&db.pool, "a", event).await?,
        1,
        "a handles the copy"
    );
    assert_eq!(
        effects_of(&db.pool, "b", event).await?,
        1,
        "b handled the event once, and must not handle the copy meant for a"
    );
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT consumer, reason FROM outbox_consumer_quarantine")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        left,
        [("b".to_owned(), "requeue_unseen".to_owned())],
        "a handled its copy; b set it aside"
    );
    assert_eq!((a.stats().processed, b.stats().processed), (2, 2));
    assert_eq!((a.stats().not_for_us, b.stats().not_for_us), (0, 0));
    Ok(())
}

/// A file of its own holding `text`, removed when dropped.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(text: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(outbox_tests::unique("outbox-cli"));
        std::fs::write(&path, text)?;
        Ok(Self(path))
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A random secret, so that no other text can contain it by chance.
fn secret() -> String {
    format!("s3cret-{}", uuid::Uuid::new_v4().simple())
}

/// The Kafka settings come from the config file, then `OUTBOX_KAFKA_*`, then `--brokers`,
/// then `-X`, each overriding the one before: the address the relay fails to reach (brokers
/// that do not exist) says which won.
#[tokio::test]
async fn relay_kafka_settings_apply_file_then_environment_then_brokers_then_x() -> Result<()> {
    let db = TestDb::new().await?;
    let file = TempFile::new("# the cluster\n\nbootstrap.servers = 127.0.0.1:1\n")?;
    let address_file = TempFile::new("127.0.0.1:4\n")?;
    let x = format!("bootstrap.servers=file:{}", address_file.path());
    let fails_at = |args: &[&str], env: &[(&str, &str)], address: &str| -> Result<()> {
        let mut all = vec!["relay", "--connect-timeout", "1s"];
        all.extend(args);
        let (ok, _, stderr) = outbox_with(&db, &all, env)?;
        assert!(!ok);
        assert!(
            stderr.contains(&format!("cannot use the Kafka brokers at {address}")),
            "{args:?} {env:?}: {stderr}"
        );
        Ok(())
    };
    fails_at(&["-F", file.path()], &[], "127.0.0.1:1")?;
    let env = [
        ("OUTBOX_KAFKA_CONFIG", file.path()),
        ("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:2"),
    ];
    fails_at(&[], &env, "127.0.0.1:2")?;
    fails_at(&["--brokers", "127.0.0.1:3"], &env, "127.0.0.1:3")?;
    fails_at(&["--brokers", "127.0.0.1:3", "-X", &x], &env, "127.0.0.1:4")?;

    let (ok, _, stderr) = outbox(&db, &["relay"])?;
    assert!(!ok);
    assert!(
        stderr.contains("no Kafka brokers: pass --brokers"),
        "{stderr}"
    );
    let bad = TempFile::new("bootstrap.servers=127.0.0.1:1\nhunter2\n")?;
    let (ok, _, stderr) = outbox(&db, &["relay", "-F", bad.path()])?;
    assert!(!ok);
    assert!(
        stderr.contains("line 2: expected key=value") && !stderr.contains("hunter2"),
        "{stderr}"
    );
    Ok(())
}

/// A secret in the Kafka settings never reaches the terminal: not in librdkafka's refusal of
/// a misspelt key or of a value, not in the warning about a secret on the command line.
#[tokio::test]
async fn kafka_secrets_never_reach_the_cli_output() -> Result<()> {
    let db = TestDb::new().await?;
    let brokers = outbox_tests::kafka_bootstrap();
    let (misspelt, valued, literal, from_file) = (secret(), secret(), secret(), secret());
    let file = TempFile::new(&format!(
        "bootstrap.servers={brokers}\nsasl.pasword={misspelt}\n"
    ))?;
    let secret_file = TempFile::new(&format!("{from_file}\n"))?;
    let literal_x = format!("ssl.key.password={literal}");
    let file_x = format!("sasl.password=file:{}", secret_file.path());
    let hidden = |stderr: &str, key: &str| {
        for secret in [&misspelt, &valued, &literal, &from_file] {
            assert!(
                !stderr.contains(secret.as_str()),
                "a secret is shown: {stderr}"
            );
        }
        assert!(stderr.contains(key), "{key} is not named: {stderr}");
    };

    // Past the refusal of SASL credentials without TLS, to librdkafka's own refusals.
    let (ok, _, stderr) = outbox(
        &db,
        &[
            "--insecure-transport",
            "relay",
            "-F",
            file.path(),
            "-X",
            &literal_x,
            "-X",
            &file_x,
        ],
    )?;
    assert!(!ok);
    hidden(&stderr, "sasl.pasword");
    assert!(
        stderr.contains("warning: -X ssl.key.password=... puts a secret")
            && stderr.contains("OUTBOX_KAFKA_SSL_KEY_PASSWORD")
            && !stderr.contains("-X sasl.password"),
        "only the literal secret draws the warning: {stderr}"
    );

    let env = [("OUTBOX_KAFKA_SECURITY_PROTOCOL", valued.as_str())];
    let (ok, _, stderr) = outbox_with(&db, &["relay", "--brokers", &brokers], &env)?;
    assert!(!ok);
    hidden(&stderr, "security.protocol");

    let (ok, _, stderr) = outbox(
        &db,
        &["quarantine", "requeue", "consumer", "1", "-F", file.path()],
    )?;
    assert!(!ok);
    hidden(&stderr, "sasl.pasword");
    Ok(())
}

/// Settings from a file and the environment reach the relay's producer: it publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_publishes_with_kafka_settings_from_a_file_and_the_environment() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let file = TempFile::new(&format!(
        "# as in production, with the brokers in the file\nbootstrap.servers={}\nclient.id=outbox-relay\n",
        outbox_tests::kafka_bootstrap()
    ))?;
    let relay = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(["relay", "--poll-interval", "100ms", "-X", "linger.ms=5"])
            .env("DATABASE_URL", schema_url(&db))
            .env_remove("KAFKA_BROKERS")
            .env("OUTBOX_KAFKA_CONFIG", file.path())
            .env("OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS", "20000")
            .spawn()?,
    );
    publishes_one_event_then_stops(&db, &topic, relay).await
}

/// Enqueues one event for `topic`, awaits the relay process publishing it, then stops the
/// process with SIGTERM and expects a clean exit.
async fn publishes_one_event_then_stops(
    db: &TestDb,
    topic: &str,
    mut relay: KillOnDrop,
) -> Result<()> {
    let event =
        outbox_core::NewEvent::new("a", "k", "t", &serde_json::json!({}))?.with_topic(topic)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    outbox_tests::eventually(
        "the relay process publishes",
        std::time::Duration::from_secs(30),
        || async { Ok(outbox_tests::count_status(&db.pool, "published").await? == 1) },
    )
    .await?;
    let status = Command::new("kill")
        .args(["-TERM", &relay.0.id().to_string()])
        .status()?;
    assert!(status.success());
    assert!(relay.0.wait()?.success());
    Ok(())
}

/// A password in the database URL is never shown: not in `--help` (which shows other
/// variables' values), not in an error about the database.
#[tokio::test]
async fn a_database_password_is_never_shown() -> Result<()> {
    let db = TestDb::new().await?;
    let password = secret();
    let with_password = format!("postgres://postgres:{password}@127.0.0.1:1/nowhere");
    for args in [&["--help"][..], &["relay", "--help"], &["status", "--help"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
            .args(args)
            .env("DATABASE_URL", &with_password)
            .output()?;
        let help = String::from_utf8(out.stdout)?;
        assert!(
            out.status.success() && help.contains("DATABASE_URL"),
            "{help}"
        );
        assert!(!help.contains(&password), "{help}");
    }
    let bad_port = format!("postgres://postgres:{password}@127.0.0.1:notaport/x");
    for url in [&with_password, &bad_port] {
        let (ok, stdout, stderr) = outbox(&db, &["status", "--database-url", url])?;
        assert!(!ok);
        assert!(
            !stderr.contains(&password) && !stdout.contains(&password),
            "{stderr}"
        );
        assert!(!stderr.is_empty());
    }

    // From a file, which wins over DATABASE_URL.
    let file = TempFile::new(&format!("{}\n", schema_url(&db)))?;
    let (ok, stdout, stderr) = outbox_with(
        &db,
        &["status", "--json", "--database-url-file", file.path()],
        &[("DATABASE_URL", &with_password)],
    )?;
    assert!(ok, "{stderr}");
    assert!(stdout.contains("\"pending\":0"), "{stdout}");
    let (ok, _, stderr) = outbox(&db, &["status", "--database-url-file", "/nonexistent/url"])?;
    assert!(!ok && stderr.contains("/nonexistent/url"), "{stderr}");
    Ok(())
}

/// Text from a record (an `id` header, payload text an error quotes), from a broker's error
/// and a consumer's name reaches the terminal escaped: no line forged, no colour changed. The
/// rows keep it.
#[tokio::test]
async fn quarantine_listings_escape_what_records_carry() -> Result<()> {
    let db = TestDb::new().await?;
    let hostile = "\r\nFORGED line\x1b[31m red\u{9b}2J\u{202e}";
    sqlx::query(
        "INSERT INTO outbox_consumer_quarantine (consumer, topic, partition, \"offset\", message_key, payload, headers, reason, error) \
         VALUES ('billing', 't', 0, 7, 'k'::bytea, convert_to($1, 'UTF8'), jsonb_build_object('id', $1), 'invalid_id', 'not a uuid: ' || $1)",
    )
    .bind(hostile)
    .execute(&db.pool)
    .await?;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic, status, attempts, last_error) \
         VALUES (gen_random_uuid(), 'a', $1, 't', '{}', 'topic', 'quarantined', 3, 'broker said ' || $1)",
    )
    .bind(hostile)
    .execute(&db.pool)
    .await?;
    // A consumer's name is the application's, and `status` shows it.
    sqlx::query(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, slice) \
         VALUES ('c' || $1, gen_random_uuid(), 0)",
    )
    .bind(hostile)
    .execute(&db.pool)
    .await?;
    let id: i64 = sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine")
        .fetch_one(&db.pool)
        .await?;
    let seq: i64 = sqlx::query_scalar("SELECT seq FROM outbox_events")
        .fetch_one(&db.pool)
        .await?;
    let (id, seq) = (id.to_string(), seq.to_string());
    let runs: [&[&str]; 8] = [
        &["status"],
        &["status", "--json"],
        &["quarantine", "list", "consumer"],
        &["quarantine", "list", "relay"],
        &["quarantine", "list", "consumer", "--json"],
        &["quarantine", "list", "relay", "--json"],
        &["quarantine", "show", "consumer", &id],
        &["quarantine", "show", "relay", &seq],
    ];
    for args in runs {
        let (ok, stdout, stderr) = outbox(&db, args)?;
        assert!(ok, "{stderr}");
        assert!(stdout.contains("FORGED"), "{args:?}: {stdout}");
        let raw: Vec<&str> = stdout
            .lines()
            .filter(|line| {
                // Tabs separate the columns.
                line.contains(|c: char| (c.is_control() && c != '\t') || c == '\u{202e}')
                    || line.starts_with("FORGED")
            })
            .collect();
        assert!(raw.is_empty(), "{args:?}: {raw:?}");
        if args.contains(&"--json") || args.contains(&"show") {
            // Escaped for the terminal, the same values for a program.
            let value: serde_json::Value = serde_json::from_str(&stdout)?;
            let text = serde_json::to_string(&value)?;
            let quoted = serde_json::to_string(hostile)?;
            assert!(text.contains(quoted.trim_matches('"')), "{text}");
        }
    }
    let stored: (Vec<u8>, String) =
        sqlx::query_as("SELECT payload, error FROM outbox_consumer_quarantine")
            .fetch_one(&db.pool)
            .await?;
    assert_eq!(stored.0, hostile.as_bytes());
    assert_eq!(stored.1, format!("not a uuid: {hostile}"));
    Ok(())
}

/// A properties file for the test broker's SASL_SSL (SCRAM-SHA-512) or mTLS listener, its
/// secrets read from files (`file:`), as a production file would hold them.
fn secure_properties(kafka: &outbox_tests::SecureKafka, mtls: bool) -> Result<TempFile> {
    let ca = kafka.tls_file("ca.pem");
    let text = if mtls {
        format!(
            "bootstrap.servers={}\nsecurity.protocol=SSL\nssl.ca.location={ca}\n\
             ssl.certificate.location={}\nssl.key.location={}\nssl.key.password=file:{}\n",
            kafka.mtls,
            kafka.tls_file("client.pem"),
            kafka.tls_file("client.key"),
            kafka.tls_file("client.key.password"),
        )
    } else {
        format!(
            "bootstrap.servers={}\nsecurity.protocol=SASL_SSL\nsasl.mechanisms=SCRAM-SHA-512\n\
             sasl.username={}\nsasl.password=file:{}\nssl.ca.location={ca}\n",
            kafka.sasl_ssl,
            kafka.user,
            std::env::var("OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE")?,
        )
    };
    TempFile::new(&text)
}

/// `outbox relay` and `outbox quarantine requeue` publish through SASL_SSL with SCRAM and
/// through mTLS, configured by a file whose secrets come from files.
#[tokio::test]
async fn relay_and_requeue_work_over_sasl_ssl_and_mutual_tls() -> Result<()> {
    let kafka = outbox_tests::SecureKafka::from_env()?;
    for mtls in [false, true] {
        let db = TestDb::new().await?;
        let topic = outbox_tests::random_topic(1).await?;
        let file = secure_properties(&kafka, mtls)?;
        let relay = KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_outbox"))
                .args(["relay", "--poll-interval", "100ms", "-F", file.path()])
                .env("DATABASE_URL", schema_url(&db))
                .env_remove("KAFKA_BROKERS")
                .spawn()?,
        );
        publishes_one_event_then_stops(&db, &topic, relay).await?;

        let id: i64 = sqlx::query_scalar(
            "INSERT INTO outbox_consumer_quarantine (consumer, topic, partition, \"offset\", message_key, payload, headers, reason, error) \
             VALUES ('billing', $1, 0, 7, 'k2'::bytea, '{broken'::bytea, '{}', 'invalid_id', 'not a uuid') RETURNING id",
        )
        .bind(&topic)
        .fetch_one(&db.pool)
        .await?;
        let (ok, stdout, stderr) = outbox(
            &db,
            &[
                "quarantine",
                "requeue",
                "consumer",
                &id.to_string(),
                "-F",
                file.path(),
            ],
        )?;
        assert!(ok, "mtls {mtls}: {stderr}");
        assert_eq!(stdout.trim(), "requeued 1 messages");
        let records = outbox_tests::read_all(&topic, 1, std::time::Duration::from_secs(30)).await?;
        let keys: Vec<&str> = records.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, ["k", "k2"], "mtls {mtls}");
    }
    Ok(())
}

/// A wrong password or an untrusted broker certificate stops `outbox relay` at once, naming
/// what failed, with no secret in its words.
#[tokio::test]
async fn relay_names_a_wrong_password_and_an_untrusted_certificate() -> Result<()> {
    let kafka = outbox_tests::SecureKafka::from_env()?;
    let db = TestDb::new().await?;
    let wrong = secret();
    let wrong_password = TempFile::new(&format!(
        "bootstrap.servers={}\nsecurity.protocol=SASL_SSL\nsasl.mechanisms=SCRAM-SHA-512\n\
         sasl.username={}\nsasl.password={wrong}\nssl.ca.location={}\n",
        kafka.sasl_ssl,
        kafka.user,
        kafka.tls_file("ca.pem"),
    ))?;
    let untrusted = TempFile::new(&format!(
        "bootstrap.servers={}\nsecurity.protocol=SASL_SSL\nsasl.mechanisms=SCRAM-SHA-512\n\
         sasl.username={}\nsasl.password=file:{}\nssl.ca.location={}\n",
        kafka.sasl_ssl,
        kafka.user,
        std::env::var("OUTBOX_TEST_KAFKA_SCRAM_PASSWORD_FILE")?,
        kafka.tls_file("rogue-ca.pem"),
    ))?;
    for (file, expected) in [
        (
            &wrong_password,
            "the cluster refused the client's credentials",
        ),
        (&untrusted, "certificate verify failed"),
    ] {
        let (ok, stdout, stderr) = outbox(
            &db,
            &["relay", "-F", file.path(), "--connect-timeout", "5s"],
        )?;
        assert!(!ok, "{stdout}");
        assert!(
            stderr.contains("cannot use the Kafka brokers at") && stderr.contains(expected),
            "{stderr}"
        );
        assert!(
            !stderr.contains(&wrong) && !stderr.contains(&kafka.password),
            "{stderr}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_slow_status_prints_its_answer_and_no_warning_or_colour() -> Result<()> {
    let db = TestDb::new().await?;
    // The status waits for the table a transaction locked, for longer than sqlx's default
    // slow-statement threshold (1 s).
    let mut lock = db.pool.begin().await?;
    sqlx::query("LOCK TABLE outbox_events IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await?;
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .arg("status")
        .env("DATABASE_URL", schema_url(&db))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    outbox_tests::eventually("the status waits for the lock", std::time::Duration::from_secs(30), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE relation = 'outbox_events'::regclass AND NOT granted",
        )
        .fetch_one(&db.pool)
        .await?;
        Ok(waiting > 0)
    })
    .await?;
    // Not synchronization: the statement must take longer than the threshold.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    lock.commit().await?;
    let out = tokio::task::spawn_blocking(move || status.wait_with_output()).await??;
    let (stdout, stderr) = (
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("pending"), "{stdout}");
    assert!(!stderr.contains("slow statement"), "{stderr}");
    assert!(
        !stdout.contains('\u{1b}') && !stderr.contains('\u{1b}'),
        "colour codes: {stderr:?}"
    );
    Ok(())
}
