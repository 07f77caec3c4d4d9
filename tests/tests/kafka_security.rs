//! The relay and the consumer over the test broker's secured listeners (scripts/kafka-node):
//! SASL_SSL with SCRAM-SHA-512, SASL_SSL with OAUTHBEARER tokens from the application's
//! context, and TLS with a client certificate (mTLS); and `check_connection` naming what
//! failed (a wrong password, an untrusted broker, a missing client certificate) without a
//! secret in its words.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use outbox_consumer::{
    ConsumerConfig, DedupConsumer, Event, consumer_config, dedup_consume, stream_consumer,
};
use outbox_core::{CoreError, KafkaCheckFailure, check_connection, check_connection_with_context};
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{SecureKafka, TestDb, eventually, random_topic, unique, unsecured_token};
use rdkafka::ClientConfig;
use rdkafka::client::{ClientContext, DefaultClientContext, OAuthToken};
use rdkafka::consumer::Consumer;
use serde_json::json;
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// `base` with every setting of `security` on top.
fn with(mut base: ClientConfig, security: &ClientConfig) -> ClientConfig {
    // `config_map` hides secrets' values; `get` gives them.
    for key in security.config_map().into_keys() {
        if let Some(value) = security.get(key) {
            base.set(key, value);
        }
    }
    base
}

async fn record(
    event: &Event<serde_json::Value>,
    conn: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO effects (event_id) VALUES ($1)")
        .bind(event.id)
        .execute(conn)
        .await?;
    Ok(())
}

/// One event through a relay and a dedup consumer with `security` settings, each with its
/// context: published, then handled once; both kept running until `also` holds.
async fn round_trip<P, C>(
    security: &ClientConfig,
    producer_context: P,
    consumer_context: C,
    also: impl Fn() -> bool,
) -> Result<()>
where
    P: ClientContext + 'static,
    C: ClientContext + 'static,
{
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effects (event_id UUID PRIMARY KEY)")
        .execute(&db.pool)
        .await?;
    let topic = random_topic(1).await?;
    let event =
        NewEvent::new("invoice", "42", "InvoiceSent", &json!({"n": 1}))?.with_topic(&topic)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;

    // The bootstrap address comes from `security`.
    let relay = Relay::with_context(
        db.pool.clone(),
        &with(producer_config("unused:1"), security),
        producer_context,
        RelayConfig::default(),
    )?;
    let report = relay.run_once().await?;
    assert_eq!(report.published, 1, "{report:?}");

    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let kafka = with(consumer_config("unused:1", &unique("g")), security);
        let (pool, shutdown, topic) = (db.pool.clone(), shutdown.clone(), topic.clone());
        async move {
            dedup_consume(&kafka, pool, record)
                .topics([topic])
                .config(ConsumerConfig::default())
                .context(consumer_context)
                .run(shutdown)
                .await
        }
    });
    let outcome = eventually(
        "the event has its effect",
        Duration::from_secs(60),
        || async {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
                .fetch_one(&db.pool)
                .await?;
            Ok(n == 1 && also())
        },
    )
    .await;
    drop(relay);
    shutdown.cancel();
    consuming.await??;
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_the_consumer_work_over_sasl_ssl_with_scram() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    round_trip(
        &kafka.scram(),
        DefaultClientContext,
        DefaultClientContext,
        || true,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_and_the_consumer_work_over_mutual_tls() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    round_trip(
        &kafka.mtls()?,
        DefaultClientContext,
        DefaultClientContext,
        || true,
    )
    .await
}

/// Issues unsecured OAUTHBEARER tokens of a short life, counting them.
#[derive(Clone)]
struct Tokens {
    issued: Arc<AtomicUsize>,
    lifetime: Duration,
}

impl ClientContext for Tokens {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        _oauthbearer_config: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn Error>> {
        self.issued.fetch_add(1, Ordering::SeqCst);
        let (token, lifetime_ms) = unsecured_token("outbox-test", self.lifetime);
        Ok(OAuthToken {
            token,
            principal_name: "outbox-test".to_owned(),
            lifetime_ms,
        })
    }
}

/// librdkafka asks for a new token at 80 % of the last one's life: with tokens of 3 s, the
/// relay's and the consumer's contexts are asked again while they run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauthbearer_tokens_come_from_the_applications_context_and_are_refreshed() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    let tokens = || Tokens {
        issued: Arc::new(AtomicUsize::new(0)),
        lifetime: Duration::from_secs(3),
    };
    // The connection check serves the token too (librdkafka connects only once it has one).
    let (config, checking) = (kafka.oauthbearer(), tokens());
    let issued = checking.issued.clone();
    let brokers = tokio::task::spawn_blocking(move || {
        check_connection_with_context(&config, checking, CHECK_TIMEOUT)
    })
    .await??;
    assert!(brokers >= 1 && issued.load(Ordering::SeqCst) >= 1);

    let (relay_tokens, consumer_tokens) = (tokens(), tokens());
    let (relay_issued, consumer_issued) =
        (relay_tokens.issued.clone(), consumer_tokens.issued.clone());
    round_trip(&kafka.oauthbearer(), relay_tokens, consumer_tokens, || {
        relay_issued.load(Ordering::SeqCst) >= 2 && consumer_issued.load(Ordering::SeqCst) >= 2
    })
    .await
}

/// `check_connection`'s failure, asserting its words hold no secret.
fn refused(
    result: Result<usize, CoreError>,
    secrets: &[&str],
) -> Result<(KafkaCheckFailure, String)> {
    match result {
        Ok(brokers) => anyhow::bail!("connected to {brokers} broker(s)"),
        Err(error @ CoreError::KafkaCheck { failure, .. }) => {
            let text = error.to_string();
            for secret in secrets {
                assert!(!text.contains(secret), "the error quotes a secret: {text}");
            }
            Ok((failure, text))
        }
        Err(other) => anyhow::bail!("not a connection check failure: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_named_and_no_password_is_quoted() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    let config = kafka.scram();
    let brokers =
        tokio::task::spawn_blocking(move || check_connection(&config, CHECK_TIMEOUT)).await??;
    assert!(brokers >= 1);
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let config = kafka.scram_with(&wrong, "ca.pem");
    let result =
        tokio::task::spawn_blocking(move || check_connection(&config, CHECK_TIMEOUT)).await?;
    let (failure, text) = refused(result, &[&wrong, &kafka.password])?;
    assert_eq!(failure, KafkaCheckFailure::Authentication, "{text}");
    assert!(failure.needs_a_change());
    assert!(
        text.contains("SCRAM-SHA-512") && text.contains("invalid credentials"),
        "names the mechanism and the cause: {text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_broker_certificate_is_named() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    // The client trusts another authority than the one that signed the broker's certificate.
    let config = kafka.scram_with(&kafka.password, "rogue-ca.pem");
    let result =
        tokio::task::spawn_blocking(move || check_connection(&config, CHECK_TIMEOUT)).await?;
    let (failure, text) = refused(result, &[&kafka.password])?;
    assert_eq!(failure, KafkaCheckFailure::Tls, "{text}");
    assert!(text.contains("certificate verify failed"), "{text}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_client_certificate_is_named_and_the_key_password_is_not_quoted() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    let with_certificate = kafka.mtls()?;
    let key_password = with_certificate
        .get("ssl.key.password")
        .unwrap_or_default()
        .to_owned();
    let config = with_certificate.clone();
    let brokers = tokio::task::spawn_blocking(move || {
        check_connection_with_context(&config, DefaultClientContext, CHECK_TIMEOUT)
    })
    .await??;
    assert!(brokers >= 1);

    let config = kafka.mtls_without_certificate();
    let result =
        tokio::task::spawn_blocking(move || check_connection(&config, CHECK_TIMEOUT)).await?;
    let (failure, text) = refused(result, &[])?;
    assert_eq!(failure, KafkaCheckFailure::Tls, "{text}");
    assert!(text.contains("certificate"), "{text}");

    // A key password that does not decrypt the key: refused by the client itself, and the
    // password is not in the words.
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let mut config = kafka.mtls()?;
    config.set("ssl.key.password", &wrong);
    let result =
        tokio::task::spawn_blocking(move || check_connection(&config, CHECK_TIMEOUT)).await?;
    let (failure, text) = refused(result, &[&wrong, &key_password])?;
    assert!(failure.needs_a_change(), "{failure:?}: {text}");
    Ok(())
}

/// A relay given a wrong password waits as for an outage (its row is not charged) and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_with_a_wrong_password_charges_nothing_and_says_why() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let event = NewEvent::new("invoice", "42", "InvoiceSent", &json!({}))?.with_topic(&topic)?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let mut config = with(
        producer_config("unused:1"),
        &kafka.scram_with(&wrong, "ca.pem"),
    );
    config.set("message.timeout.ms", "3000");
    let relay = Relay::new(db.pool.clone(), &config, RelayConfig::default())?;
    let report = relay.run_once().await?;
    assert!(report.broker_unreachable, "{report:?}");
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM outbox_events")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(
        attempts, 0,
        "an authentication failure is no failure of the row"
    );
    let cause = relay.last_client_error().unwrap_or_default();
    assert!(cause.contains("SASL authentication error"), "{cause:?}");
    assert!(
        !cause.contains(&wrong) && !cause.contains(&kafka.password),
        "{cause}"
    );
    Ok(())
}

/// A consumer given a wrong password keeps running (the password may be fixed on the broker's
/// side) and says why it receives nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_a_wrong_password_says_why() -> Result<()> {
    let kafka = SecureKafka::from_env()?;
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effects (event_id UUID PRIMARY KEY)")
        .execute(&db.pool)
        .await?;
    let topic = random_topic(1).await?;
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let config = with(
        consumer_config("unused:1", &unique("g")),
        &kafka.scram_with(&wrong, "ca.pem"),
    );
    let consumer = stream_consumer(&config)?;
    consumer.subscribe(&[topic.as_str()])?;
    let cause = consumer.context().last_client_error();
    let dedup = DedupConsumer::new(db.pool.clone(), ConsumerConfig::new("c1"), record)?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { dedup.run(consumer, shutdown).await }
    });
    let seen = eventually("the cause is recorded", Duration::from_secs(30), || async {
        Ok(cause
            .get()
            .is_some_and(|c| c.contains("SASL authentication error")))
    })
    .await;
    shutdown.cancel();
    running.await??;
    seen?;
    let text = cause.get().unwrap_or_default();
    assert!(
        !text.contains(&wrong) && !text.contains(&kafka.password),
        "{text}"
    );
    Ok(())
}
