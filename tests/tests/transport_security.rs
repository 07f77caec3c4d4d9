//! The library refuses, when a relay, a dispatcher or a consumer is built, connection settings
//! that could hand a password to whoever answers on the network: a pool without
//! `sslmode=verify-full` to a host that is not this machine's (sqlx's default `prefer` sends
//! the password to a server that refuses TLS), and SASL credentials to Kafka without verified
//! TLS. `insecure_transport(true)` accepts them. (The CLI's refusal is tested against a fake
//! server in `outbox-cli/tests/transport_security.rs`.)

use anyhow::Result;
use outbox_consumer::{ConsumerConfig, DedupConsumer, Event};
use outbox_producer::dispatch::{Action, Dispatcher, DispatcherConfig, Outcome};
use outbox_producer::{Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, kafka_bootstrap};
use sqlx::PgConnection;
use sqlx::postgres::PgPoolOptions;

async fn handle(_: &Event<serde_json::Value>, _: &mut PgConnection) -> Result<(), sqlx::Error> {
    Ok(())
}

async fn call(_: Action) -> Outcome {
    Outcome::done(serde_json::Value::Null)
}

/// A pool that never connected, with `url`'s settings.
fn lazy(url: &str) -> Result<sqlx::PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy_with(url.parse()?))
}

/// Fails before the fix: each was built, and would have sent the password at its first
/// connection.
#[test]
fn a_pool_that_could_leak_its_password_is_refused_unless_accepted() -> Result<()> {
    let _runtime = tokio::runtime::Runtime::new()?.enter();
    let kafka = producer_config(&kafka_bootstrap());
    for url in [
        // `prefer` named: PGSSLMODE in the environment would otherwise decide.
        "postgres://u:hunter2@db.example:5432/app?sslmode=prefer",
        "postgres://u:hunter2@db.example:5432/app?sslmode=require",
        "postgres://u:hunter2@127.0.0.1:5432/app?sslmode=prefer",
    ] {
        let says =
            |error: String| error.contains("sslmode=verify-full") && !error.contains("hunter2");
        let relay = Relay::new(lazy(url)?, &kafka, RelayConfig::default());
        assert!(
            relay.as_ref().is_err_and(|e| says(e.to_string())),
            "{url}: relay built"
        );
        let dispatcher = Dispatcher::new(lazy(url)?, DispatcherConfig::new("billing"), call);
        assert!(
            dispatcher.as_ref().is_err_and(|e| says(e.to_string())),
            "{url}: dispatcher built"
        );
        let consumer = DedupConsumer::new(lazy(url)?, ConsumerConfig::new("billing"), handle);
        assert!(
            consumer.as_ref().is_err_and(|e| says(e.to_string())),
            "{url}: consumer built"
        );

        Relay::new(
            lazy(url)?,
            &kafka,
            RelayConfig::default().insecure_transport(true),
        )?;
        Dispatcher::new(
            lazy(url)?,
            DispatcherConfig::new("billing").insecure_transport(true),
            call,
        )?;
        DedupConsumer::new(
            lazy(url)?,
            ConsumerConfig::new("billing").insecure_transport(true),
            handle,
        )?;
    }
    Ok(())
}

/// A relay given SASL credentials over a listener without TLS is refused.
#[tokio::test]
async fn a_relay_with_sasl_credentials_without_tls_is_refused() -> Result<()> {
    let db = TestDb::new().await?;
    let mut kafka = producer_config(&kafka_bootstrap());
    kafka.set("security.protocol", "SASL_PLAINTEXT");
    kafka.set("sasl.mechanisms", "SCRAM-SHA-512");
    kafka.set("sasl.username", "relay");
    kafka.set("sasl.password", "hunter2");
    let relay = Relay::new(db.pool.clone(), &kafka, RelayConfig::default());
    let error = relay.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        error.contains("SASL_SSL") && !error.contains("hunter2"),
        "{error}"
    );
    Ok(())
}
