//! A producer that hits a fatal error must not walk healthy rows to quarantine. librdkafka's
//! mock cluster injects the fault (a head-of-line sequence desynchronization, fatal for an
//! idempotent producer); the rows live in the real Postgres.

use anyhow::Result;
use outbox_producer::{NewEvent, Outbox, ProducerError, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, count_status, unique};
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_stops_the_relay_and_leaves_rows_untouched() -> Result<()> {
    let db = TestDb::new().await?;
    let mock = MockCluster::new(1)?;
    let topic = unique("fatal");
    mock.create_topic(&topic, 1, 1)?;
    let outbox = Outbox::default();
    let mut tx = db.pool.begin().await?;
    for n in 0..3 {
        let event =
            NewEvent::new("order", "k", "OrderChanged", &json!({ "n": n }))?.with_topic(&topic)?;
        outbox.enqueue(&mut tx, &event).await?;
    }
    tx.commit().await?;

    let config = RelayConfig::default().max_attempts(1);
    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&mock.bootstrap_servers()),
        config.clone(),
    )?;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
    );
    let failed = relay.run_once().await;
    assert!(
        matches!(failed, Err(ProducerError::FatalProducer { .. })),
        "{failed:?}"
    );
    // With max_attempts(1) a recorded failure would have quarantined every row.
    assert_eq!(count_status(&db.pool, "pending").await?, 3);
    let attempts: i64 = sqlx::query_scalar("SELECT sum(attempts) FROM outbox_events")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(
        attempts, 0,
        "a fatal producer error is not the rows' failure"
    );

    // `run` stops on it too, rather than retrying on a dead producer forever.
    let stopped = relay.run(tokio_util::sync::CancellationToken::new()).await;
    assert!(
        matches!(stopped, Err(ProducerError::FatalProducer { .. })),
        "{stopped:?}"
    );

    // A new relay (a new producer) publishes the same rows.
    let fresh = Relay::new(
        db.pool.clone(),
        &producer_config(&mock.bootstrap_servers()),
        config,
    )?;
    let report = fresh.run_once().await?;
    assert_eq!(report.published, 3, "{report:?}");
    assert_eq!(count_status(&db.pool, "published").await?, 3);
    Ok(())
}
