//! W3C trace context: captured at enqueue, carried in the Kafka headers, and made the parent
//! of the consumer's span. Spans are exported with OpenTelemetry's in-memory exporter, so the
//! test checks the parent links a tracing backend would see.
//!
//! Its own test binary: it installs a global `tracing` subscriber.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_consumer::{Event, boxed, consumer_config, dedup_consume};
use outbox_core::trace::TraceParent;
use outbox_producer::{NewEvent, Relay, RelayConfig, producer_config};
use outbox_tests::{TestDb, eventually, kafka_bootstrap, random_topic, read_all, unique};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const EXPLICIT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// What the handler saw: the trace its own span belongs to, per aggregate id.
type Seen = Arc<Mutex<BTreeMap<String, TraceId>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_span_continues_the_trace_that_decided_the_event() -> Result<()> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test")));
    tracing::subscriber::set_global_default(subscriber)?;

    let db = TestDb::new().await?;
    let topic = random_topic(1).await?;
    let event = |key: &str| -> Result<NewEvent> {
        Ok(NewEvent::new("invoice", key, "InvoiceDecided", &json!({}))?.with_topic(&topic)?)
    };

    // "traced": decided inside an agent span, which enqueue captures by itself.
    let decide = tracing::info_span!("agent.decide");
    let decided_in = decide.context().span().span_context().clone();
    assert!(decided_in.is_valid(), "the OpenTelemetry layer is active");
    async {
        let mut tx = db.pool.begin().await?;
        outbox_producer::enqueue(&mut tx, &event("traced")?).await?;
        tx.commit().await?;
        anyhow::Ok(())
    }
    .instrument(decide)
    .await?;
    // "explicit": a context received from elsewhere wins over the ambient one.
    // "untraced": no span, no header.
    let mut tx = db.pool.begin().await?;
    let explicit: TraceParent = EXPLICIT.parse()?;
    outbox_producer::enqueue(
        &mut tx,
        &event("explicit")?.with_trace_context(explicit, Some("vendor=7")),
    )
    .await?;
    outbox_producer::enqueue(&mut tx, &event("untraced")?).await?;
    tx.commit().await?;

    let relay = Relay::new(
        db.pool.clone(),
        &producer_config(&kafka_bootstrap()),
        RelayConfig::default(),
    )?;
    relay.run_once().await?;

    // On the wire, for any client: the W3C headers.
    let records = read_all(&topic, 1, Duration::from_secs(30)).await?;
    let header = |key: &str, name: &str| {
        records
            .iter()
            .find(|r| r.key == key)
            .and_then(|r| r.headers.get(name).cloned())
    };
    let traced_header = format!(
        "00-{}-{}-{:02x}",
        decided_in.trace_id(),
        decided_in.span_id(),
        decided_in.trace_flags().to_u8()
    );
    assert_eq!(header("traced", "traceparent"), Some(traced_header));
    assert_eq!(header("explicit", "traceparent").as_deref(), Some(EXPLICIT));
    assert_eq!(
        header("explicit", "tracestate").as_deref(),
        Some("vendor=7")
    );
    assert_eq!(header("untraced", "traceparent"), None);

    let seen: Seen = Arc::default();
    let shutdown = CancellationToken::new();
    let consuming = tokio::spawn({
        let (pool, shutdown, topic, seen) = (
            db.pool.clone(),
            shutdown.clone(),
            topic.clone(),
            Arc::clone(&seen),
        );
        async move {
            let handler = boxed(move |event: &Event<serde_json::Value>, _conn| {
                let trace = tracing::Span::current()
                    .context()
                    .span()
                    .span_context()
                    .trace_id();
                let seen = Arc::clone(&seen);
                let key = event.key.clone();
                Box::pin(async move {
                    seen.lock().expect("not poisoned").insert(key, trace);
                    Ok(())
                })
            });
            dedup_consume(
                &consumer_config(&kafka_bootstrap(), &unique("g")),
                pool,
                handler,
            )
            .topics([topic])
            .run(shutdown)
            .await
        }
    });
    eventually("all three handled", Duration::from_secs(60), || async {
        Ok(seen.lock().expect("not poisoned").len() == 3)
    })
    .await?;
    shutdown.cancel();
    consuming.await??;
    provider.force_flush()?;

    let spans = exporter.get_finished_spans()?;
    let consume_span = |trace: TraceId| -> Result<&SpanData> {
        spans
            .iter()
            .find(|s| s.name == "outbox.consume" && s.span_context.trace_id() == trace)
            .with_context(|| format!("no outbox.consume span in trace {trace}"))
    };
    let seen = seen.lock().expect("not poisoned").clone();

    // The consumer's span is a child of the agent's span, across the outbox and Kafka.
    assert_eq!(seen["traced"], decided_in.trace_id());
    let traced = consume_span(decided_in.trace_id())?;
    assert_eq!(traced.parent_span_id, decided_in.span_id());
    assert!(traced.parent_span_is_remote);

    let explicit_trace = TraceId::from_bytes(explicit.trace_id().to_be_bytes());
    assert_eq!(seen["explicit"], explicit_trace);
    let from_header = consume_span(explicit_trace)?;
    assert_eq!(
        from_header.parent_span_id,
        SpanId::from_bytes(explicit.parent_id().to_be_bytes())
    );
    assert_eq!(from_header.span_context.trace_state().header(), "vendor=7");

    // Without a context the consumer starts a trace of its own.
    let untraced = seen["untraced"];
    assert!(untraced != decided_in.trace_id() && untraced != explicit_trace);
    assert_eq!(consume_span(untraced)?.parent_span_id, SpanId::INVALID);
    Ok(())
}
