//! A secret in a Kafka client configuration never reaches an error or a log line: rdkafka's
//! configuration error shows the value it refused, and librdkafka's description can quote it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use outbox_consumer::{ConsumerConfig, consumer_config, dedup_consume, stream_consumer};
use outbox_producer::{Relay, RelayConfig, producer_config};
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

/// A random secret, so that no other text in an error can contain it by chance.
fn secret() -> String {
    format!("s3cret-{}", uuid::Uuid::new_v4().simple())
}

/// Configurations `base` plus one that librdkafka refuses, each carrying `secret` where the
/// error could show it: under a misspelt key (rdkafka's error shows the value), and as the
/// value of an enumerated property (librdkafka's description quotes it).
fn refused_configs(base: &ClientConfig, secret: &str) -> Vec<(&'static str, ClientConfig)> {
    ["sasl.pasword", "security.protocol"]
        .into_iter()
        .map(|key| {
            let mut config = base.clone();
            config.set("ssl.key.password", secret).set(key, secret);
            (key, config)
        })
        .collect()
}

fn assert_hidden(error: &dyn std::fmt::Debug, shown: &str, secret: &str, key: &str) {
    let debug = format!("{error:?}");
    for text in [shown, debug.as_str()] {
        assert!(!text.contains(secret), "the secret is echoed: {text}");
        assert!(text.contains(key), "the key is not named: {text}");
    }
}

/// A pool that never connects: building a client needs none.
fn lazy_pool() -> Result<PgPool> {
    Ok(PgPoolOptions::new().connect_lazy(&outbox_tests::database_url())?)
}

#[tokio::test]
async fn relay_new_never_echoes_a_config_value() -> Result<()> {
    let secret = secret();
    let base = producer_config(&outbox_tests::kafka_bootstrap());
    for (key, config) in refused_configs(&base, &secret) {
        let Err(error) = Relay::new(lazy_pool()?, &config, RelayConfig::default()) else {
            bail!("{key}={secret} accepted");
        };
        assert_hidden(&error, &error.to_string(), &secret, key);
        assert!(
            matches!(error, outbox_producer::ProducerError::Kafka(_)),
            "{error:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn consumer_constructors_never_echo_a_config_value() -> Result<()> {
    let secret = secret();
    let base = consumer_config(&outbox_tests::kafka_bootstrap(), "g");
    for (key, config) in refused_configs(&base, &secret) {
        let Err(error) = stream_consumer(&config) else {
            bail!("{key}={secret} accepted");
        };
        assert_hidden(&error, &error.to_string(), &secret, key);
        let run = dedup_consume::<serde_json::Value, _>(&config, lazy_pool()?, nothing)
            .topics(["t"])
            .config(ConsumerConfig::new("c"))
            .run(CancellationToken::new())
            .await;
        let Err(error) = run else {
            bail!("{key}={secret} accepted by dedup_consume");
        };
        assert_hidden(&error, &error.to_string(), &secret, key);
        assert!(
            matches!(error, outbox_consumer::ConsumerError::Kafka(_)),
            "{error:?}"
        );
    }
    Ok(())
}

async fn nothing(
    _: &outbox_consumer::Event<serde_json::Value>,
    _: &mut sqlx::PgConnection,
) -> Result<(), sqlx::Error> {
    Ok(())
}

/// Keeps every line librdkafka logs.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl ClientContext for Lines {
    fn log(&self, _: RDKafkaLogLevel, fac: &str, line: &str) {
        if let Ok(mut lines) = self.0.lock() {
            lines.push(format!("{fac} {line}"));
        }
    }
}

impl ConsumerContext for Lines {}

/// librdkafka's own log is the other way a value could leave: its configuration dump
/// (`debug=conf`) lists every property set. It must show the secret ones as redacted.
#[tokio::test]
async fn librdkafka_config_dump_redacts_secrets() -> Result<()> {
    let secret = secret();
    let lines = Lines::default();
    let mut config = ClientConfig::new();
    config
        .set("debug", "conf")
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "relay")
        .set("sasl.password", &secret)
        .set("ssl.key.password", &secret)
        .set_log_level(RDKafkaLogLevel::Debug);
    let consumer: BaseConsumer<_> =
        outbox_core::kafka_secrets::create_with_context(&config, lines.clone())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let dumped = |lines: &[String]| lines.iter().any(|l| l.contains("ssl.key.password"));
    while !dumped(&lines.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?) {
        if Instant::now() > deadline {
            bail!("librdkafka logged no configuration dump");
        }
        let _ = consumer.poll(Duration::from_millis(100));
    }
    let lines = lines.0.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let all = lines.join("\n");
    assert!(
        !all.contains(&secret),
        "a secret in librdkafka's log:\n{all}"
    );
    for key in ["sasl.password", "ssl.key.password"] {
        assert!(
            lines
                .iter()
                .any(|l| l.contains(key) && l.contains("[redacted]")),
            "{key} is not shown redacted:\n{all}"
        );
    }
    Ok(())
}
