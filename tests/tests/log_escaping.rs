//! Text from Kafka (an `id` header, a `type` header, payload text a serde error quotes) never
//! reaches a log line raw: a CR, LF or ESC in it would forge log lines or drive the terminal
//! of whoever reads the log. Its own test binary: it installs a global `tracing` subscriber
//! (the consumer's partition workers are tasks of their own) that writes into a buffer.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use outbox_consumer::{ConsumerConfig, DedupConsumer, Event, HandlerError, consumer_config};
use outbox_core::EventId;
use outbox_tests::{ByteHeader, TestDb, kafka_bootstrap, produce_bytes, random_topic, unique};
use rdkafka::consumer::Consumer;
use serde::Deserialize;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tracing::instrument::WithSubscriber;

/// What every hostile string carries: a line break that would start a forged line, a CR that
/// would overwrite the start of the line on a terminal, and an ANSI colour sequence.
const HOSTILE: &str = "\r\nFORGED line\x1b[31m red";

/// Everything logged, as the `fmt` subscriber formats it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut buffer) = self.0.lock() {
            buffer.extend_from_slice(bytes);
        }
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// A `fmt` subscriber (as an application would install, without colours) writing here.
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + use<> {
        let writer = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish()
    }

    fn text(&self) -> Result<String> {
        let buffer = self.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok(String::from_utf8_lossy(&buffer).into_owned())
    }
}

/// The global subscriber's capture: the consumer's partition workers are tasks of their own.
fn captured() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        tracing::subscriber::set_global_default(captured.subscriber()).ok();
        captured
    })
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Known,
}

#[derive(Debug, Deserialize)]
struct Payload {
    #[expect(dead_code, reason = "only decoded")]
    kind: Kind,
}

/// Refuses every event, quoting its `type` header, as handlers' errors often quote their input.
async fn refuse(event: &Event<Payload>, _: &mut PgConnection) -> Result<(), HandlerError> {
    Err(HandlerError::quarantine(format!(
        "no handler for type {}",
        event.event_type.as_deref().unwrap_or("")
    )))
}

/// A quarantine row's `id` and `type` headers and its payload.
type StoredRow = (Option<String>, Option<String>, Option<Vec<u8>>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_text_reaches_log_lines_escaped_and_the_quarantine_as_received() -> Result<()> {
    let logs = captured();
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let bad_id = format!("not-a-uuid{HOSTILE}");
    let hostile_type = format!("T{HOSTILE}");
    // serde quotes an unknown variant: the JSON escapes decode to the raw characters.
    let bad_payload = format!(
        r#"{{"kind":{}}}"#,
        serde_json::to_string(&format!("unknown{HOSTILE}"))?
    );
    let (id_a, id_b) = (EventId::new().to_string(), EventId::new().to_string());
    let records: [(&[u8], &[ByteHeader<'_>]); 3] = [
        (br#"{"kind":"known"}"#, &[(b"id", Some(bad_id.as_bytes()))]),
        (
            bad_payload.as_bytes(),
            &[(b"id", Some(id_a.as_bytes())), (b"type", Some(b"T"))],
        ),
        (
            br#"{"kind":"known"}"#,
            &[
                (b"id", Some(id_b.as_bytes())),
                (b"type", Some(hostile_type.as_bytes())),
            ],
        ),
    ];
    for (payload, headers) in records {
        produce_bytes(&topic, 0, Some(b"k"), Some(payload), headers).await?;
    }

    let consumer = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c"), refuse)?;
    let mut config = consumer_config(&kafka_bootstrap(), &unique("g"));
    config.set("session.timeout.ms", "6000");
    let stream = outbox_consumer::stream_consumer(&config)?;
    stream.subscribe(&[topic.as_str()])?;
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let (consumer, shutdown) = (consumer.clone(), shutdown.clone());
        async move { consumer.run(stream, shutdown).await }
    });
    outbox_tests::eventually(
        "the three records are quarantined",
        Duration::from_secs(30),
        || async { Ok(consumer.stats().quarantined == 3) },
    )
    .await?;
    shutdown.cancel();
    run.await??;

    let text = logs.text()?;
    // Each record's hostile text is logged, escaped: the `id` header, the payload text serde
    // quotes, the `type` header a handler's error quotes.
    let escaped = outbox_core::escape(HOSTILE).to_string();
    for quoted in ["not-a-uuid", "unknown", "no handler for type T"] {
        assert!(
            text.contains(&format!("{quoted}{escaped}")),
            "{quoted}{escaped} is not logged:\n{text}"
        );
    }
    let raw = raw_lines(&text);
    assert!(
        raw.is_empty(),
        "log lines with raw control characters or forged by one:\n{}",
        raw.join("\n")
    );

    // The quarantine keeps what was received, unescaped.
    let stored: Vec<StoredRow> = sqlx::query_as(
        "SELECT headers->>'id', headers->>'type', payload \
         FROM outbox_consumer_quarantine ORDER BY \"offset\"",
    )
    .fetch_all(&db.pool)
    .await?;
    let [first, second, third] = stored.as_slice() else {
        anyhow::bail!("{stored:?}");
    };
    assert_eq!(first.0.as_deref(), Some(bad_id.as_str()));
    assert_eq!(second.2.as_deref(), Some(bad_payload.as_bytes()));
    assert_eq!(third.1.as_deref(), Some(hostile_type.as_str()));
    let error: String =
        sqlx::query_scalar("SELECT error FROM outbox_consumer_quarantine WHERE event_id = $1")
            .bind(uuid::Uuid::parse_str(&id_b).context("id")?)
            .fetch_one(&db.pool)
            .await?;
    assert!(error.contains(&hostile_type), "{error}");
    Ok(())
}

/// Lines of the captured log with a raw control character (other than the line end) or
/// starting with forged text.
fn raw_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|line| line.contains(|c: char| c.is_control()) || line.starts_with("FORGED"))
        .collect()
}

/// The relay logs a row's topic, which is whatever was written to the table (not only
/// through `NewEvent`, which validates it): one Kafka refuses is quarantined and logged,
/// escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_logs_a_rows_topic_escaped() -> Result<()> {
    // Its own capture, apart from the other test's global one (installed first all the same,
    // before `TestDb` would install another): `run_once` logs on this task.
    captured();
    let logs = Captured::default();
    let db = TestDb::new().await?;
    let topic = format!("{}{HOSTILE}", unique("t"));
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, topic) \
         VALUES (gen_random_uuid(), 'a', 'k', 't', '{}', $1)",
    )
    .bind(&topic)
    .execute(&db.pool)
    .await?;
    let relay = outbox_producer::Relay::new(
        db.pool.clone(),
        &outbox_producer::producer_config(&kafka_bootstrap()),
        outbox_producer::RelayConfig::default(),
    )?;
    let report = relay.run_once().with_subscriber(logs.subscriber()).await?;
    assert_eq!(report.quarantined, 1, "{report:?}");
    let text = logs.text()?;
    let escaped = outbox_core::escape(&topic).to_string();
    assert!(text.contains(&escaped), "{escaped} is not logged:\n{text}");
    let raw = raw_lines(&text);
    assert!(raw.is_empty(), "{}", raw.join("\n"));
    Ok(())
}
