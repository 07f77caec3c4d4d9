//! A real local HTTP billing service with the idempotency of payment APIs, for the
//! dispatcher's tests and demo. It listens on `127.0.0.1` (a port of its own) and keeps its
//! ledger in memory, for as long as its [`BillingApi`] handle lives (across
//! [`BillingApi::stop`] and [`BillingApi::restart`], as a real service's database would).
//!
//! # The API
//! - `POST /charges`, JSON body `{"invoice": "...", "cents": 500, ...}` (other fields are
//!   allowed and part of the body), header `Idempotency-Key` (missing: 400):
//!   - the first request with a key applies the charge (a ledger entry with the charge id,
//!     the key, the invoice, the cents and a sequence number) and stores its response:
//!     201 `{"charge_id": "ch_<n>", "invoice": ..., "cents": ...}`;
//!   - the same key with the same body: the stored response again, with
//!     `Idempotent-Replayed: true`, and no new charge;
//!   - the same key with a different body: 422;
//!   - the same key while the first request is still being processed: 409 (retry later);
//!   - a body that is not such JSON: 400;
//!   - beyond the rate limit ([`BillingApi::rate_limit`]), whatever the key: 429
//!     (`{"error": "rate_limited", ...}`, no `Retry-After`), nothing applied or stored.
//! - `GET /charges`: the ledger, as a JSON array of [`Charge`].
//!
//! # Test knobs
//! [`BillingApi::set_latency`] (a random wait per request, after the key is taken and before
//! the charge is applied), [`BillingApi::fail_rate`] (503 before applying),
//! [`BillingApi::apply_then_stall`] (apply, store the response, then hold it back),
//! [`BillingApi::reject_invoice`] (402), [`BillingApi::delay_invoice`],
//! [`BillingApi::rate_limit`] (429 beyond a number of charge requests per second),
//! [`BillingApi::stop`] / [`BillingApi::restart`] (the same port; connections are refused
//! while stopped). A 503, a 402 or a 429 is not stored: the key stays free, as if the request
//! had not come.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long [`BillingApi::apply_then_stall`] holds a response back: longer than any client's
/// timeout (the request is cut when its client gives up, or when the service stops).
pub const STALL: Duration = Duration::from_secs(3600);

/// The burst [`BillingApi::rate_limit`] lets through at once: this long's worth of requests
/// (at least one).
pub const BURST: Duration = Duration::from_millis(50);

/// One applied charge: a line of the ledger.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// `ch_<seq>`.
    pub charge_id: String,
    /// The `Idempotency-Key` of the request that applied it.
    pub idempotency_key: String,
    /// The invoice charged.
    pub invoice: String,
    /// The amount.
    pub cents: i64,
    /// 1, 2, ...: the order in which charges were applied.
    pub seq: u64,
}

/// The requests the service received (every `POST /charges`, answered or not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requests {
    /// All of them, with or without a key.
    pub total: u64,
    /// Per `Idempotency-Key`.
    pub by_key: HashMap<String, u64>,
    /// Those answered 429 by the rate limit ([`BillingApi::rate_limit`]).
    pub rate_limited: u64,
}

impl Requests {
    /// The requests that carried `key`.
    pub fn for_key(&self, key: &str) -> u64 {
        self.by_key.get(key).copied().unwrap_or(0)
    }
}

/// What a key stands for.
#[derive(Debug)]
enum Stored {
    /// A request with this key is being processed.
    InFlight,
    /// Applied: the first request's body and the response it got.
    Done { body: Value, response: Value },
}

#[derive(Debug, Default)]
struct Knobs {
    latency: Option<Range<Duration>>,
    fail_rate: f64,
    /// Answered 500 instead of 503 by a share of the failures.
    fail_500: bool,
    stall: u32,
    rejected: HashSet<String>,
    delays: HashMap<String, Duration>,
    rate_limit: Option<Bucket>,
}

/// The rate limit: a token bucket over every `POST /charges`.
#[derive(Debug)]
struct Bucket {
    per_second: f64,
    /// The most tokens it holds: the burst it lets through at once.
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_second: f64) -> Self {
        let burst = (per_second * BURST.as_secs_f64()).ceil().max(1.0);
        Self {
            per_second,
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    /// Takes a token if there is one.
    fn take(&mut self) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.per_second;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Debug, Default)]
struct Ledger {
    charges: Vec<Charge>,
    keys: HashMap<String, Stored>,
    requests: Requests,
    knobs: Knobs,
}

#[derive(Debug, Default)]
struct Service {
    ledger: Mutex<Ledger>,
}

impl Service {
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The server task and what stops it.
#[derive(Debug)]
struct Running {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// A running (or stopped) billing service; dropping it stops the service.
#[derive(Debug)]
pub struct BillingApi {
    service: Arc<Service>,
    addr: SocketAddr,
    running: Mutex<Option<Running>>,
}

impl BillingApi {
    /// Starts the service on `127.0.0.1` with a port of its own, without latency or faults.
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let api = Self {
            service: Arc::default(),
            addr,
            running: Mutex::new(None),
        };
        api.serve(listener);
        Ok(api)
    }

    /// The base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The charges endpoint, `http://127.0.0.1:<port>/charges`.
    pub fn charges_url(&self) -> String {
        format!("{}/charges", self.url())
    }

    /// The address it listens on (the same after a restart).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Each request then waits a random time in `range` (an empty range: none) after its key
    /// is taken and before the charge is applied: a request with the same key gets 409 in
    /// that time.
    pub fn set_latency(&self, range: Range<Duration>) {
        self.service.ledger().knobs.latency = (!range.is_empty()).then_some(range);
    }

    /// Each request then fails with 503 with probability `p` (0 to 1), before the charge is
    /// applied (after its latency); the key is not stored.
    pub fn fail_rate(&self, p: f64) {
        self.service.ledger().knobs.fail_rate = if p.is_nan() { 0.0 } else { p.clamp(0.0, 1.0) };
    }

    /// Half of the failures of [`Self::fail_rate`] are then 500 instead of 503 (still before
    /// the charge is applied).
    pub fn fail_some_with_500(&self, on: bool) {
        self.service.ledger().knobs.fail_500 = on;
    }

    /// The next `n` requests that apply a charge apply it, store the response, and then hold
    /// the response back for [`STALL`], longer than any client timeout: the client learns
    /// nothing, and its retry with the same key gets the stored response.
    pub fn apply_then_stall(&self, n: u32) {
        self.service.ledger().knobs.stall = n;
    }

    /// Requests for `invoice` are then answered 402 (`{"error": "card_declined", ...}`),
    /// nothing applied or stored.
    pub fn reject_invoice(&self, invoice: impl Into<String>) {
        self.service.ledger().knobs.rejected.insert(invoice.into());
    }

    /// Requests for `invoice` then wait `delay` more (added to the latency) before the charge
    /// is applied. `Duration::ZERO` removes the delay.
    pub fn delay_invoice(&self, invoice: impl Into<String>, delay: Duration) {
        let mut ledger = self.service.ledger();
        if delay.is_zero() {
            ledger.knobs.delays.remove(&invoice.into());
        } else {
            ledger.knobs.delays.insert(invoice.into(), delay);
        }
    }

    /// Limits the `POST /charges` requests the service takes to `per_second` (a token bucket
    /// over all of them, whatever their key, with a burst of [`BURST`]'s worth, at least one;
    /// `GET /charges` is not limited); each request beyond it is answered at once
    /// `429 Too Many Requests`
    /// (`{"error": "rate_limited", ...}`, no `Retry-After`), nothing applied or stored, its
    /// key left free. `None` (or a rate that is not a positive number) lifts the limit; a new
    /// limit starts with a full burst.
    pub fn rate_limit(&self, per_second: Option<f64>) {
        self.service.ledger().knobs.rate_limit = per_second
            .filter(|rate| rate.is_finite() && *rate > 0.0)
            .map(Bucket::new);
    }

    /// Stops the service as a crash would: the listener is closed (connections are refused
    /// until [`Self::restart`]) and every open connection is cut, requests in flight
    /// unanswered (a charge already applied stays applied). Returns once all of that is done.
    pub async fn stop(&self) {
        let running = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(running) = running {
            running.stop.cancel();
            // The task closes every connection before it ends; a panic there is the test's
            // to see in the ledger, not here.
            let _ = running.task.await;
        }
    }

    /// Listens again on the same address, with the same ledger, keys and knobs. Nothing
    /// happens when it is running.
    pub async fn restart(&self) -> std::io::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let listener = TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }

    /// Whether it listens now.
    pub fn is_running(&self) -> bool {
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// The ledger: every charge applied, in order.
    pub fn charges(&self) -> Vec<Charge> {
        self.service.ledger().charges.clone()
    }

    /// The requests received so far.
    pub fn requests(&self) -> Requests {
        self.service.ledger().requests.clone()
    }

    fn serve(&self, listener: TcpListener) {
        let stop = CancellationToken::new();
        let router = Router::new()
            .route("/charges", post(charge).get(list))
            .with_state(Arc::clone(&self.service));
        let task = tokio::spawn(accept(listener, router, stop.clone()));
        let previous = self
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(Running { stop, task });
        if let Some(previous) = previous {
            previous.stop.cancel();
        }
    }
}

impl Drop for BillingApi {
    fn drop(&mut self) {
        if let Some(running) = self
            .running
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            running.stop.cancel();
            running.task.abort();
        }
    }
}

/// Serves connections until `stop`; then drops the listener and cuts every connection.
async fn accept(listener: TcpListener, router: Router, stop: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let service = TowerToHyperService::new(router.clone());
                    connections.spawn(async move {
                        // A connection's end (the client's or an error) is no concern here.
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                // Out of descriptors or the like: a pause, not a busy loop (and not a test's
                // failure to report here).
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

#[derive(Deserialize)]
struct ChargeRequest {
    invoice: String,
    cents: i64,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({ "error": code, "message": message })),
    )
        .into_response()
}

/// Frees the key of a request that ends without applying its charge (an error answer, or the
/// request dropped: its client went away, or the service stopped).
struct KeyTaken {
    service: Arc<Service>,
    key: String,
}

impl Drop for KeyTaken {
    fn drop(&mut self) {
        let mut ledger = self.service.ledger();
        if matches!(ledger.keys.get(&self.key), Some(Stored::InFlight)) {
            ledger.keys.remove(&self.key);
        }
    }
}

async fn charge(State(service): State<Arc<Service>>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_owned);
    let wait = {
        let mut ledger = service.ledger();
        ledger.requests.total += 1;
        if let Some(key) = &key {
            *ledger.requests.by_key.entry(key.clone()).or_default() += 1;
        }
        if ledger
            .knobs
            .rate_limit
            .as_mut()
            .is_some_and(|bucket| !bucket.take())
        {
            ledger.requests.rate_limited += 1;
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "too many requests; nothing was charged",
            );
        }
        let Some(key) = &key else {
            return error(
                StatusCode::BAD_REQUEST,
                "idempotency_key_missing",
                "an Idempotency-Key header is required",
            );
        };
        let Ok(body) = serde_json::from_slice::<Value>(&body) else {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                "the body is not JSON",
            );
        };
        let Ok(request) = ChargeRequest::deserialize(&body) else {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                "the body needs \"invoice\" (a string) and \"cents\" (an integer)",
            );
        };
        match ledger.keys.get(key) {
            Some(Stored::Done {
                body: first,
                response,
            }) => {
                if *first != body {
                    return error(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "idempotency_key_reused",
                        "this Idempotency-Key was used with another body",
                    );
                }
                let mut replay =
                    (StatusCode::CREATED, axum::Json(response.clone())).into_response();
                replay
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
                return replay;
            }
            Some(Stored::InFlight) => {
                return error(
                    StatusCode::CONFLICT,
                    "idempotency_key_in_use",
                    "a request with this Idempotency-Key is being processed; retry later",
                );
            }
            None => {
                ledger.keys.insert(key.clone(), Stored::InFlight);
            }
        }
        let latency = match &ledger.knobs.latency {
            Some(range) => rand::rng().random_range(range.clone()),
            None => Duration::ZERO,
        };
        let delay = ledger
            .knobs
            .delays
            .get(&request.invoice)
            .copied()
            .unwrap_or_default();
        (latency + delay, body, request, key.clone())
    };
    let (wait, body, request, key) = wait;
    let taken = KeyTaken {
        service: Arc::clone(&service),
        key,
    };
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    let (response, stall) = {
        let mut ledger = service.ledger();
        let fail_rate = ledger.knobs.fail_rate;
        if fail_rate > 0.0 && rand::rng().random_bool(fail_rate) {
            let status = if ledger.knobs.fail_500 && rand::rng().random_bool(0.5) {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            drop(ledger);
            drop(taken);
            return error(
                status,
                "unavailable",
                "the service is unavailable; nothing was charged",
            );
        }
        if ledger.knobs.rejected.contains(&request.invoice) {
            drop(ledger);
            drop(taken);
            return error(
                StatusCode::PAYMENT_REQUIRED,
                "card_declined",
                "the card was declined; nothing was charged",
            );
        }
        let seq = ledger.charges.len() as u64 + 1;
        let charge = Charge {
            charge_id: format!("ch_{seq}"),
            idempotency_key: taken.key.clone(),
            invoice: request.invoice,
            cents: request.cents,
            seq,
        };
        let response = json!({
            "charge_id": charge.charge_id,
            "invoice": charge.invoice,
            "cents": charge.cents,
        });
        ledger.charges.push(charge);
        ledger.keys.insert(
            taken.key.clone(),
            Stored::Done {
                body,
                response: response.clone(),
            },
        );
        let stall = ledger.knobs.stall > 0;
        if stall {
            ledger.knobs.stall -= 1;
        }
        (response, stall)
    };
    drop(taken);
    if stall {
        tokio::time::sleep(STALL).await;
    }
    (StatusCode::CREATED, axum::Json(response)).into_response()
}

async fn list(State(service): State<Arc<Service>>) -> axum::Json<Vec<Charge>> {
    axum::Json(service.ledger().charges.clone())
}
