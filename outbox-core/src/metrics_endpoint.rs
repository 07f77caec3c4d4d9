//! An opt-in Prometheus endpoint for the metrics the relay and the consumer record.
//!
//! The framework records through the `metrics` facade, so any recorder works; this is the
//! one-line way to expose them when the service has none of its own.

use std::net::SocketAddr;

use crate::CoreError;

/// Installs a Prometheus recorder for this process and serves it on `http://<addr>/metrics`
/// (from a task on the current Tokio runtime). Call it once, at startup, inside the runtime.
///
/// Series (each labelled with `table` for the relay, `consumer` for a consumer):
/// `outbox_pending`, `outbox_oldest_pending_age_seconds`, `outbox_quarantined`,
/// `outbox_relay_{published,failed,quarantined,unconfirmed,waiting}_total`,
/// `outbox_relay_partitions_out`, `outbox_relay_publish_latency_seconds`;
/// `outbox_consumer_{processed,duplicates,handler_errors,quarantined}_total` (duplicates by
/// `via` = `cache` | `table`), `outbox_consumer_message_seconds`.
///
/// ```no_run
/// # async fn doc() -> Result<(), outbox_core::CoreError> {
/// outbox_core::serve_metrics("127.0.0.1:9464".parse().expect("address"))?;
/// # Ok(()) }
/// ```
pub fn serve_metrics(addr: SocketAddr) -> Result<(), CoreError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| CoreError::Metrics(format!("cannot serve metrics on {addr}: {e}")))?;
    describe();
    Ok(())
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!("outbox_pending", "Outbox rows waiting to be published");
    describe_gauge!(
        "outbox_oldest_pending_age_seconds",
        Unit::Seconds,
        "Age of the oldest pending outbox row (relay lag)"
    );
    describe_gauge!("outbox_quarantined", "Outbox rows the relay quarantined");
    describe_counter!(
        "outbox_relay_published_total",
        "Events published and acknowledged"
    );
    describe_counter!("outbox_relay_failed_total", "Publish attempts that failed");
    describe_counter!(
        "outbox_relay_quarantined_total",
        "Events the relay quarantined"
    );
    describe_counter!(
        "outbox_relay_unconfirmed_total",
        "Rows left pending as they were, no broker having answered for them (the relay's failure)"
    );
    describe_counter!(
        "outbox_relay_waiting_total",
        "Rows left pending, charged nothing, because their partition could not take writes"
    );
    describe_gauge!(
        "outbox_relay_partitions_out",
        "Partitions this relay knows cannot take writes: their rows wait unsent until a probe is acknowledged"
    );
    describe_histogram!(
        "outbox_relay_publish_latency_seconds",
        Unit::Seconds,
        "Time from enqueue to Kafka's acknowledgement, per published event"
    );
    describe_counter!(
        "outbox_consumer_processed_total",
        "Events whose handler committed"
    );
    describe_counter!(
        "outbox_consumer_duplicates_total",
        "Redelivered events skipped, by where the duplicate was found"
    );
    describe_counter!("outbox_consumer_handler_errors_total", "Handler failures");
    describe_counter!(
        "outbox_consumer_quarantined_total",
        "Messages the consumer quarantined"
    );
    describe_counter!(
        "outbox_consumer_revoked_skipped_total",
        "Queued messages dropped because a rebalance revoked their partition"
    );
    describe_counter!(
        "outbox_consumer_not_for_us_total",
        "Requeued copies skipped because they name another consumer"
    );
    describe_histogram!(
        "outbox_consumer_message_seconds",
        Unit::Seconds,
        "Time to handle one message, dedup and commit included"
    );
}
