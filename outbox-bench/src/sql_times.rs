//! Client-side time of each SQL statement, from sqlx's own statement log (target
//! `sqlx::query`: the statement's first words and `elapsed_secs`, from sending it to its last
//! row), for the benchmarks' breakdowns. [`install`] makes it part of the process's
//! subscriber (beside the usual log output, filtered by `RUST_LOG`); it records only between
//! [`start`] and [`stop`]: outside those, sqlx's check finds nothing enabled and logs nothing,
//! so timed runs pay an atomic load per statement.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Filter, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, fmt};

static RECORDING: AtomicBool = AtomicBool::new(false);
static TIMES: Mutex<BTreeMap<String, Statement>> = Mutex::new(BTreeMap::new());

/// One kind of statement (its first words, as sqlx logs them): how often it ran, its total
/// time, and the rows it returned.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Statement {
    pub(crate) count: u64,
    pub(crate) secs: f64,
    pub(crate) rows: u64,
}

/// The process's subscriber: log lines on stderr as `RUST_LOG` asks (errors by default), and
/// the statement timer. Call first thing: the test helpers' own (`outbox_tests`) then find a
/// subscriber in place and leave it.
pub(crate) fn install() {
    let _ = tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(EnvFilter::from_default_env()),
        )
        .with(Recorder.with_filter(WhileRecording))
        .try_init();
}

/// Clears what was recorded and records from now on.
pub(crate) fn start() {
    TIMES.lock().unwrap_or_else(PoisonError::into_inner).clear();
    RECORDING.store(true, Ordering::SeqCst);
}

/// Stops recording; returns what was recorded since [`start`], by statement.
pub(crate) fn stop() -> BTreeMap<String, Statement> {
    RECORDING.store(false, Ordering::SeqCst);
    std::mem::take(&mut *TIMES.lock().unwrap_or_else(PoisonError::into_inner))
}

fn is_statement(metadata: &Metadata<'_>) -> bool {
    metadata.target() == "sqlx::query"
}

/// Lets sqlx's statement events through while recording.
struct WhileRecording;

impl<S: Subscriber> Filter<S> for WhileRecording {
    fn enabled(&self, metadata: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        is_statement(metadata) && RECORDING.load(Ordering::Relaxed)
    }

    fn callsite_enabled(&self, metadata: &'static Metadata<'static>) -> Interest {
        if is_statement(metadata) {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }
}

/// Adds each statement event to [`TIMES`].
struct Recorder;

#[derive(Default)]
struct Fields {
    summary: Option<String>,
    secs: Option<f64>,
    rows: u64,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "summary" {
            self.summary = Some(value.trim_end_matches(" …").to_owned());
        }
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        if field.name() == "elapsed_secs" {
            self.secs = Some(value);
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "rows_returned" {
            self.rows = value;
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for Recorder {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if let (Some(summary), Some(secs)) = (fields.summary, fields.secs) {
            let mut times = TIMES.lock().unwrap_or_else(PoisonError::into_inner);
            let statement = times.entry(summary).or_default();
            statement.count += 1;
            statement.secs += secs;
            statement.rows += fields.rows;
        }
    }
}
