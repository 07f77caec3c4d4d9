//! The HTTP executor against real servers on 127.0.0.1 (the billing API, a server answering
//! any status, servers that redirect and servers that record what reaches them, raw TCP
//! servers that cut the answer or stand in for a proxy), and a dispatcher with it against the
//! billing API on the real PostgreSQL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{self, any, get};
use outbox_examples::billing_api::{BillingApi, Charge};
use outbox_producer::dispatch::http::MAX_BODY;
use outbox_producer::dispatch::{
    self, Action, ActionState, Dispatcher, DispatcherConfig, Executor, HttpExecutor, Outcome,
};
use outbox_producer::{EventId, NewEvent, Outbox, ProducerError, TableNames};
use outbox_tests::{TestDb, eventually};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

/// The settings of the executors' clients.
fn builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(2))
}

/// A client for the tests' own requests.
fn client() -> reqwest::Client {
    builder().build().expect("a reqwest client")
}

fn url(s: &str) -> reqwest::Url {
    s.parse().expect("a URL")
}

async fn enqueue(db: &TestDb, key: &str, payload: &Value) -> Result<EventId> {
    let mut conn = db.pool.acquire().await?;
    let event = NewEvent::new("invoice", key, "charge", payload)?.for_dispatcher("billing")?;
    Ok(Outbox::default().enqueue(&mut conn, &event).await?)
}

async fn state(db: &TestDb, id: EventId) -> Result<Option<ActionState>> {
    let mut conn = db.pool.acquire().await?;
    Ok(dispatch::outcome(&mut conn, &TableNames::default(), id).await?)
}

/// A real action, as a dispatcher hands it to its executor (only the dispatcher makes them):
/// enqueued, claimed by a dispatcher whose executor keeps it and answers Retry.
async fn an_action(payload: Value) -> Result<Action> {
    let db = TestDb::new().await?;
    enqueue(&db, "INV-1", &payload).await?;
    claim_one(&db).await
}

/// An action whose stored payload is `json`, JSON that serde_json's `Value` cannot hold (a
/// number past `u64` and `f64`'s digits): written by SQL, as another writer would.
async fn an_action_stored(json: &str) -> Result<Action> {
    let db = TestDb::new().await?;
    let id = enqueue(&db, "INV-1", &json!({})).await?;
    sqlx::query("UPDATE outbox_events SET payload = $1::jsonb WHERE id = $2::uuid")
        .bind(json)
        .bind(id.to_string())
        .execute(&db.pool)
        .await?;
    claim_one(&db).await
}

async fn claim_one(db: &TestDb) -> Result<Action> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let keep = move |action: Action| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(action);
            Outcome::retry("kept for the test")
        }
    };
    let dispatcher = Dispatcher::new(db.pool.clone(), DispatcherConfig::new("billing"), keep)?;
    dispatcher.run_once().await?;
    rx.try_recv()
        .context("the dispatcher called the executor once")
}

// ---------------------------------------------------------------------------------------
// A server that answers any status: `/{code}/{kind}`, and records the keys it was sent.

#[derive(Debug, Default)]
struct Seen {
    /// Per request: every `Idempotency-Key` header it carried.
    keys: Mutex<Vec<Vec<String>>>,
}

impl Seen {
    fn keys(&self) -> Vec<Vec<String>> {
        self.keys.lock().expect("lock").clone()
    }
}

const SECRET_HEADER: &str = "s3cr3t-header-value";

async fn answer(
    Path((code, kind)): Path<(u16, String)>,
    State(seen): State<Arc<Seen>>,
    headers: HeaderMap,
) -> Response {
    seen.keys.lock().expect("lock").push(
        headers
            .get_all("idempotency-key")
            .iter()
            .map(|v| v.to_str().unwrap_or("<not text>").to_owned())
            .collect(),
    );
    let status = StatusCode::from_u16(code).expect("a status code");
    match kind.as_str() {
        "json" => (status, axum::Json(json!({ "code": code }))).into_response(),
        "text" => (status, format!("plain {code}")).into_response(),
        "empty" => status.into_response(),
        "control" => (status, "line one\nline two \u{1b}[31mred").into_response(),
        "seconds" => (
            status,
            [
                (header::RETRY_AFTER, "7".to_owned()),
                (header::WWW_AUTHENTICATE, SECRET_HEADER.to_owned()),
            ],
            "busy",
        )
            .into_response(),
        "date" => {
            let at = SystemTime::now() + Duration::from_secs(3600);
            (
                status,
                [(header::RETRY_AFTER, httpdate::fmt_http_date(at))],
                "busy",
            )
                .into_response()
        }
        "big" => (status, "x".repeat(MAX_BODY + 4096)).into_response(),
        // A server that quotes the credentials it refused.
        "echo" => (
            status,
            [(header::WWW_AUTHENTICATE, SECRET_HEADER.to_owned())],
            format!(
                "refused: {}",
                headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("no credentials")
            ),
        )
            .into_response(),
        "stall" => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            status.into_response()
        }
        _ => (StatusCode::NOT_FOUND, "no such kind").into_response(),
    }
}

/// The base URL of a server answering `/{code}/{kind}`, and what it saw.
async fn answer_server() -> Result<(String, Arc<Seen>)> {
    let seen = Arc::new(Seen::default());
    let router = Router::new()
        .route("/{code}/{kind}", any(answer))
        .with_state(Arc::clone(&seen));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok((base, seen))
}

async fn post(executor: &HttpExecutor, action: &Action) -> Outcome {
    executor.execute(action.clone()).await
}

fn post_to(base: &str, path: &str) -> HttpExecutor {
    HttpExecutor::post_json(builder(), url(&format!("{base}{path}"))).expect("an executor")
}

#[tokio::test]
async fn statuses_map_to_outcomes() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, seen) = answer_server().await?;

    for code in [200, 201, 202] {
        let outcome = post(&post_to(&base, &format!("/{code}/json")), &action).await;
        ensure!(
            outcome == Outcome::done(json!({ "code": code })),
            "{code}: {outcome:?}"
        );
    }
    for code in [408, 409, 425, 500, 502, 503, 504] {
        let outcome = post(&post_to(&base, &format!("/{code}/text")), &action).await;
        let Outcome::Retry { reason, after } = &outcome else {
            bail!("{code} is retried: {outcome:?}");
        };
        ensure!(
            after.is_none(),
            "{code}: no Retry-After, no wait: {after:?}"
        );
        ensure!(
            reason.starts_with(&format!("HTTP {code} "))
                && reason.ends_with(&format!(": plain {code}")),
            "{code}: the reason names the status and quotes the body: {reason}"
        );
    }
    let outcome = post(&post_to(&base, "/429/text"), &action).await;
    ensure!(
        outcome == Outcome::rate_limited("HTTP 429 Too Many Requests: plain 429", None),
        "{outcome:?}"
    );
    for code in [401, 403, 407] {
        let outcome = post(&post_to(&base, &format!("/{code}/json")), &action).await;
        ensure!(
            matches!(&outcome, Outcome::Unavailable { reason }
                if reason.starts_with(&format!("HTTP {code} "))),
            "{code}: {outcome:?}"
        );
    }
    for code in [400, 402, 404, 410, 422] {
        let outcome = post(&post_to(&base, &format!("/{code}/json")), &action).await;
        let Outcome::Rejected { reason, answer } = &outcome else {
            bail!("{code} is rejected: {outcome:?}");
        };
        ensure!(*answer == json!({ "code": code }), "{code}: {answer}");
        ensure!(reason.starts_with(&format!("HTTP {code} ")), "{reason}");
    }
    // A redirect is an answer retrying cannot change (not followed: see the redirect tests).
    for code in [301, 302, 307] {
        let outcome = post(&post_to(&base, &format!("/{code}/empty")), &action).await;
        ensure!(
            matches!(&outcome, Outcome::Rejected { answer, reason }
                if *answer == json!({ "status": code, "location": null })
                    && reason.contains("not followed")),
            "{code}: {outcome:?}"
        );
    }
    // Every request carried the action's key, once.
    let keys = seen.keys();
    ensure!(
        keys.len() == 3 + 7 + 1 + 3 + 5 + 3,
        "{} requests",
        keys.len()
    );
    ensure!(
        keys.iter().all(|k| *k == [action.idempotency_key()]),
        "keys sent: {keys:?}"
    );
    Ok(())
}

#[tokio::test]
async fn retry_after_in_seconds_or_as_a_date() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, _) = answer_server().await?;

    let outcome = post(&post_to(&base, "/503/seconds"), &action).await;
    let Outcome::Retry { reason, after } = &outcome else {
        bail!("a 503 is retried: {outcome:?}");
    };
    ensure!(*after == Some(Duration::from_secs(7)), "{after:?}");
    ensure!(reason == "HTTP 503 Service Unavailable: busy", "{reason}");
    ensure!(
        !reason.contains(SECRET_HEADER),
        "no header value in a reason"
    );

    let outcome = post(&post_to(&base, "/503/date"), &action).await;
    let Outcome::Retry { after, .. } = &outcome else {
        bail!("a 503 is retried: {outcome:?}");
    };
    // An HTTP date has whole seconds; the answer was made a moment ago.
    let after = after.context("Retry-After as a date gives a wait")?;
    ensure!(
        (Duration::from_secs(3590)..=Duration::from_secs(3600)).contains(&after),
        "an hour from the answer: {after:?}"
    );
    Ok(())
}

#[tokio::test]
async fn bodies_json_text_empty_and_cut_at_1_mib() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, _) = answer_server().await?;

    let outcome = post(&post_to(&base, "/201/text"), &action).await;
    ensure!(
        outcome == Outcome::done(json!({ "status": 201, "body": "plain 201" })),
        "{outcome:?}"
    );
    let outcome = post(&post_to(&base, "/204/empty"), &action).await;
    ensure!(
        outcome == Outcome::done(json!({ "status": 204 })),
        "{outcome:?}"
    );

    let outcome = post(&post_to(&base, "/200/big"), &action).await;
    let Outcome::Done(answer) = &outcome else {
        bail!("a 200 is done: {outcome:?}");
    };
    ensure!(
        answer["status"] == 200 && answer["truncated"] == true,
        "{:?}",
        answer.get("truncated")
    );
    let body = answer["body"].as_str().context("the body as text")?;
    ensure!(
        body.len() == MAX_BODY && body.bytes().all(|b| b == b'x'),
        "{} bytes",
        body.len()
    );

    let outcome = post(&post_to(&base, "/400/big"), &action).await;
    let Outcome::Rejected { reason, answer } = &outcome else {
        bail!("a 400 is rejected: {outcome:?}");
    };
    ensure!(answer["truncated"] == true, "the answer says it was cut");
    ensure!(
        reason.len() < 400 && reason.contains("cut at 1048576 bytes"),
        "a short reason that says the body was cut: {reason}"
    );

    // Control characters in a body are escaped in the reason, kept in the answer.
    let outcome = post(&post_to(&base, "/500/control"), &action).await;
    let Outcome::Retry { reason, .. } = &outcome else {
        bail!("a 500 is retried: {outcome:?}");
    };
    ensure!(
        reason == r"HTTP 500 Internal Server Error: line one\nline two \u{1b}[31mred",
        "{reason}"
    );
    Ok(())
}

#[tokio::test]
async fn the_idempotency_key_is_the_event_id_whatever_the_builder_set() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, seen) = answer_server().await?;
    let target = url(&format!("{base}/200/json"));
    let executor = HttpExecutor::new(
        builder(),
        move |client: &reqwest::Client, action: &Action| {
            client
                .put(target.clone())
                .header("Idempotency-Key", "set-by-the-builder")
                .header("Idempotency-Key", "and-another")
                .json(&action.payload)
        },
    )?;
    let outcome = post(&executor, &action).await;
    ensure!(
        outcome == Outcome::done(json!({ "code": 200 })),
        "{outcome:?}"
    );
    let outcome = post(&executor, &action).await;
    ensure!(
        outcome == Outcome::done(json!({ "code": 200 })),
        "{outcome:?}"
    );
    ensure!(
        seen.keys() == [[action.idempotency_key()], [action.idempotency_key()]],
        "{:?}",
        seen.keys()
    );
    ensure!(action.idempotency_key() == action.id.to_string());
    Ok(())
}

/// A server on a port of its own that reads each request whole, writes `reply` and closes.
async fn raw_server(reply: &'static [u8]) -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}/", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_request(&mut stream).await.is_ok() {
                    let _ = stream.write_all(reply).await;
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(base)
}

async fn read_request(stream: &mut tokio::net::TcpStream) -> std::io::Result<()> {
    let mut request = Vec::new();
    let mut chunk = [0; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        request.extend_from_slice(&chunk[..n]);
        if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&request[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if request.len() >= end + 4 + length {
                return Ok(());
            }
        }
    }
}

#[tokio::test]
async fn a_request_sent_without_an_answer_is_retried() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;

    // The connection closed after the request: the server may have applied it.
    let closed = raw_server(b"").await?;
    let outcome = post(&HttpExecutor::post_json(builder(), url(&closed))?, &action).await;
    ensure!(
        matches!(&outcome, Outcome::Retry { reason, after: None } if reason.starts_with("sent, no answer")),
        "{outcome:?}"
    );

    // The answer's head came, its body was cut.
    let cut = raw_server(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"charge_id\"").await?;
    let outcome = post(&HttpExecutor::post_json(builder(), url(&cut))?, &action).await;
    ensure!(
        matches!(&outcome, Outcome::Retry { reason, .. } if reason.starts_with("HTTP 200, its body could not be read")),
        "{outcome:?}"
    );

    // The client's timeout.
    let (base, seen) = answer_server().await?;
    let impatient = builder().timeout(Duration::from_millis(300));
    let executor = HttpExecutor::post_json(impatient, url(&format!("{base}/200/stall")))?;
    let outcome = post(&executor, &action).await;
    ensure!(
        matches!(&outcome, Outcome::Retry { reason, .. } if reason.starts_with("sent, no answer")),
        "{outcome:?}"
    );
    ensure!(seen.keys().len() == 1, "the request reached the server");
    Ok(())
}

#[tokio::test]
async fn connection_refused_is_unavailable() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    // A port nobody listens on (bound, then closed).
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let executor = post_to(
        &format!("http://127.0.0.1:{port}"),
        "/charges?token=hunter2",
    );
    let outcome = post(&executor, &action).await;
    let Outcome::Unavailable { reason } = &outcome else {
        bail!("connection refused is unavailable: {outcome:?}");
    };
    ensure!(
        reason.starts_with("no connection: ") && reason.contains("refused"),
        "{reason}"
    );
    ensure!(!reason.contains("hunter2"), "the URL is left out: {reason}");

    // The billing API stopped refuses connections on its port, and answers once restarted.
    let api = BillingApi::start().await?;
    let executor = HttpExecutor::post_json(builder(), url(&api.charges_url()))?;
    api.stop().await;
    let outcome = post(&executor, &action).await;
    ensure!(
        matches!(outcome, Outcome::Unavailable { .. }),
        "{outcome:?}"
    );
    api.restart().await?;
    let outcome = post(&executor, &action).await;
    ensure!(
        outcome == Outcome::done(json!({ "charge_id": "ch_1", "invoice": "INV-1", "cents": 500 })),
        "{outcome:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Redirects, plain HTTP, credentials, rate limits, payloads, Debug and verify.

/// Every request a recording server received.
#[derive(Debug, Default)]
struct Hits(Mutex<Vec<Hit>>);

#[derive(Debug, Clone)]
struct Hit {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Hits {
    fn all(&self) -> Vec<Hit> {
        self.0.lock().expect("lock").clone()
    }
}

/// Records the request and answers `200 []` (what a list endpoint answers).
async fn record(
    State(hits): State<Arc<Hits>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    hits.0.lock().expect("lock").push(Hit {
        method,
        path: uri.path().to_owned(),
        headers,
        body,
    });
    axum::Json(json!([])).into_response()
}

/// Serves `router` on a port of its own; its base URL.
async fn serve(router: Router) -> Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(base)
}

/// A server that records every request (any method, any path) and answers `200 []`.
async fn recording_server() -> Result<(String, Arc<Hits>)> {
    let hits = Arc::new(Hits::default());
    let base = serve(Router::new().fallback(record).with_state(Arc::clone(&hits))).await?;
    Ok((base, hits))
}

/// `code` with `Location: location` and a body that repeats it, as web servers write one.
fn redirect(code: u16, location: &str) -> Response {
    (
        StatusCode::from_u16(code).expect("a status code"),
        [(header::LOCATION, location.to_owned())],
        format!("Moved to {location}"),
    )
        .into_response()
}

#[tokio::test]
async fn a_redirect_to_a_list_endpoint_is_rejected_with_its_location_never_done() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    // `POST /charges` moved: `/v2/charges` lists charges (`GET` answers `[]`), so a client that
    // follows a 301, 302 or 303 as a GET records a list as the charge's answer.
    let listed = Arc::new(Hits::default());
    let router = Router::new()
        .route(
            "/charges",
            routing::post(|| async { redirect(301, "/v2/charges") }),
        )
        .route(
            "/charges/{code}",
            routing::post(|Path(code): Path<u16>| async move { redirect(code, "/v2/charges") }),
        )
        .route("/v2/charges", any(record))
        .with_state(Arc::clone(&listed));
    let base = serve(router).await?;

    let outcome = post(&post_to(&base, "/charges"), &action).await;
    let Outcome::Rejected { reason, answer } = &outcome else {
        bail!("a 301 is rejected, never done: {outcome:?}");
    };
    ensure!(
        *answer
            == json!({ "status": 301, "location": "/v2/charges", "body": "Moved to /v2/charges" }),
        "{answer}"
    );
    ensure!(
        reason
            == "HTTP 301 Moved Permanently: a redirect, not followed \
                   (its location is in the answer)",
        "{reason}"
    );
    for code in [302, 303, 307, 308] {
        let outcome = post(&post_to(&base, &format!("/charges/{code}")), &action).await;
        ensure!(
            matches!(&outcome, Outcome::Rejected { answer, reason }
                if answer["status"] == code && answer["location"] == "/v2/charges"
                    && reason.contains("not followed") && !reason.contains("/v2")),
            "{code}: {outcome:?}"
        );
    }
    // The executor has returned: a redirect followed would have reached it by now.
    let hits = listed.all();
    ensure!(hits.is_empty(), "the list endpoint saw {hits:?}");
    Ok(())
}

#[tokio::test]
async fn a_307_to_another_server_sends_it_nothing() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (elsewhere, hits) = recording_server().await?;
    let location = format!("{elsewhere}/charges");
    let router = Router::new().route(
        "/charges/{code}",
        routing::post(
            |State(location): State<String>, Path(code): Path<u16>| async move {
                redirect(code, &location)
            },
        ),
    );
    let base = serve(router.with_state(location.clone())).await?;
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_static("Bearer s3cr3t"),
    );

    for code in [307, 308] {
        let executor = HttpExecutor::post_json(
            builder().default_headers(headers.clone()),
            url(&format!("{base}/charges/{code}")),
        )?;
        let outcome = post(&executor, &action).await;
        let Outcome::Rejected { reason, answer } = &outcome else {
            bail!("a {code} is rejected: {outcome:?}");
        };
        ensure!(
            answer["location"] == location.as_str(),
            "{code}: the location is in the answer: {answer}"
        );
        ensure!(
            !reason.contains(&elsewhere) && !reason.contains("127.0.0.1"),
            "{code}: no URL in the reason: {reason}"
        );
    }
    // The executor has returned: a redirect followed would have reached the other server.
    let hits = hits.all();
    ensure!(
        hits.is_empty(),
        "the body, key and credentials went elsewhere: {hits:?}"
    );
    Ok(())
}

/// A stand-in for a proxy on a port of its own: counts the connections made to it, and
/// answers each request `200 {}`. With the client's proxy set to it, a request the executor
/// sends to any host reaches it (the TEST-NET address is never dialled).
async fn proxy_trap() -> Result<(String, Arc<AtomicUsize>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxy = format!("http://{}", listener.local_addr()?);
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if read_request(&mut stream).await.is_ok() {
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok((proxy, connections))
}

#[tokio::test]
async fn plain_http_to_another_host_is_never_sent() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;

    for target in ["http://192.0.2.1/charges", "http://example.invalid/charges"] {
        let Err(ProducerError::Config(message)) = HttpExecutor::post_json(builder(), url(target))
        else {
            bail!("post_json refuses {target}");
        };
        ensure!(
            message.contains("plain http")
                && message.contains("use an https URL")
                && message.contains("post_json_plain_http"),
            "the error says what to do: {message}"
        );
    }
    // Loopback hosts take plain http.
    for target in [
        "http://localhost:1/charges",
        "http://[::1]:1/charges",
        "http://127.0.0.2:1/",
    ] {
        ensure!(
            HttpExecutor::post_json(builder(), url(target)).is_ok(),
            "{target}"
        );
    }

    // A request built at call time for such a URL is not sent (nothing reaches the proxy
    // every request of this client goes through), nor is a verify request.
    let (proxy, connections) = proxy_trap().await?;
    let through_trap = || -> Result<reqwest::ClientBuilder> {
        Ok(reqwest::Client::builder().proxy(reqwest::Proxy::all(&proxy)?))
    };
    let build = |client: &reqwest::Client, action: &Action| {
        client
            .post("http://192.0.2.1/charges?token=hunter2")
            .json(&action.payload)
    };
    let executor = HttpExecutor::new(through_trap()?, build)?.verify_with(build);
    let outcome = post(&executor, &action).await;
    let Outcome::NotSent { reason } = &outcome else {
        bail!("plain http elsewhere is not sent: {outcome:?}");
    };
    ensure!(
        reason.contains("plain http")
            && !reason.contains("192.0.2.1")
            && !reason.contains("hunter2"),
        "{reason}"
    );
    let verified = executor.verify(&action).await;
    ensure!(verified.is_none(), "{verified:?}");
    ensure!(
        connections.load(Ordering::SeqCst) == 0,
        "no connection was made"
    );

    // Opted in: sent (through the proxy), so the trap would have seen a request sent above.
    let allowed = HttpExecutor::new(through_trap()?, build)?.allow_plain_http();
    let outcome = post(&allowed, &action).await;
    ensure!(outcome == Outcome::done(json!({})), "{outcome:?}");
    ensure!(connections.load(Ordering::SeqCst) == 1);
    let plain = HttpExecutor::post_json_plain_http(through_trap()?, url("http://192.0.2.1/"))?;
    let outcome = post(&plain, &action).await;
    ensure!(outcome == Outcome::done(json!({})), "{outcome:?}");
    Ok(())
}

#[tokio::test]
async fn refused_credentials_make_the_destination_unavailable() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, seen) = answer_server().await?;
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        reqwest::header::HeaderValue::from_static("Bearer s3cr3t"),
    );
    for code in [401, 403, 407] {
        let executor = HttpExecutor::post_json(
            builder().default_headers(headers.clone()),
            url(&format!("{base}/{code}/echo")),
        )?;
        let outcome = post(&executor, &action).await;
        let Outcome::Unavailable { reason } = &outcome else {
            bail!("credentials refused make the destination unavailable: {outcome:?}");
        };
        ensure!(
            reason.starts_with(&format!("HTTP {code} ")) && reason.contains("credentials refused"),
            "{reason}"
        );
        ensure!(
            !reason.contains("s3cr3t") && !reason.contains(SECRET_HEADER),
            "no credentials quoted, no header value: {reason}"
        );
    }
    ensure!(seen.keys().len() == 3);
    Ok(())
}

#[tokio::test]
async fn a_429_rate_limits_for_its_retry_after() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let (base, _) = answer_server().await?;

    let outcome = post(&post_to(&base, "/429/seconds"), &action).await;
    ensure!(
        outcome
            == Outcome::rate_limited(
                "HTTP 429 Too Many Requests: busy",
                Some(Duration::from_secs(7))
            ),
        "{outcome:?}"
    );
    let outcome = post(&post_to(&base, "/429/date"), &action).await;
    let Outcome::RateLimited { after, .. } = &outcome else {
        bail!("a 429 rate-limits: {outcome:?}");
    };
    let after = after.context("Retry-After as a date gives a wait")?;
    ensure!(
        (Duration::from_secs(3590)..=Duration::from_secs(3600)).contains(&after),
        "an hour from the answer: {after:?}"
    );
    Ok(())
}

#[tokio::test]
async fn the_payload_reaches_the_server_as_stored_every_digit() -> Result<()> {
    let action = an_action_stored(r#"{"n":100000000000000000001}"#).await?;
    ensure!(
        action.payload.get().contains("100000000000000000001"),
        "stored as written: {}",
        action.payload.get()
    );
    let (base, hits) = recording_server().await?;
    let outcome = post(&post_to(&base, "/charges"), &action).await;
    ensure!(outcome == Outcome::done(json!([])), "{outcome:?}");
    let hits = hits.all();
    let [hit] = hits.as_slice() else {
        bail!("one request: {hits:?}");
    };
    ensure!(hit.method == Method::POST && hit.path == "/charges");
    ensure!(
        hit.body.as_ref() == action.payload.get().as_bytes(),
        "sent {:?}, stored {:?}",
        String::from_utf8_lossy(&hit.body),
        action.payload.get()
    );
    ensure!(
        hit.headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes())
            == Some(b"application/json".as_slice())
    );
    ensure!(
        hit.headers.get("idempotency-key").map(|v| v.as_bytes())
            == Some(action.idempotency_key().as_bytes())
    );
    Ok(())
}

#[tokio::test]
async fn debug_shows_nothing_of_the_client() -> Result<()> {
    let headers = || {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(
            reqwest::header::AUTHORIZATION,
            reqwest::header::HeaderValue::from_static("Bearer s3cr3t"),
        );
        headers
    };
    // The client itself prints its default headers.
    let client = builder().default_headers(headers()).build()?;
    ensure!(format!("{client:?}").contains("s3cr3t"));

    let executor = HttpExecutor::post_json(
        builder().default_headers(headers()),
        url("https://billing.example/charges?token=hunter2"),
    )?;
    let printed = format!("{executor:?} {executor:#?}");
    ensure!(
        !printed.contains("s3cr3t") && !printed.contains("hunter2"),
        "{printed}"
    );
    Ok(())
}

/// The charges a server knows, by idempotency key.
type Known = Arc<Mutex<HashMap<String, Value>>>;

/// `GET /charges/by-key` answers the charge made under the request's `Idempotency-Key`
/// (200), or 404.
async fn lookup(State((known, asked)): State<(Known, Arc<Seen>)>, headers: HeaderMap) -> Response {
    let keys: Vec<String> = headers
        .get_all("idempotency-key")
        .iter()
        .map(|v| v.to_str().unwrap_or("<not text>").to_owned())
        .collect();
    let found = keys
        .first()
        .and_then(|k| known.lock().expect("lock").get(k).cloned());
    asked.keys.lock().expect("lock").push(keys);
    match found {
        Some(charge) => axum::Json(charge).into_response(),
        None => (StatusCode::NOT_FOUND, "no such key").into_response(),
    }
}

#[tokio::test]
async fn verify_asks_the_destination_for_the_key() -> Result<()> {
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let known = Known::default();
    let asked = Arc::new(Seen::default());
    let router = Router::new()
        .route("/charges/by-key", get(lookup))
        .route(
            "/broken",
            any(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "down") }),
        )
        .with_state((Arc::clone(&known), Arc::clone(&asked)));
    let base = serve(router).await?;
    let charges = url(&format!("{base}/charges"));

    // Without a verify request: it cannot tell.
    let executor = HttpExecutor::post_json(builder(), charges.clone())?;
    ensure!(executor.verify(&action).await.is_none());

    let by_key = format!("{base}/charges/by-key");
    let executor = HttpExecutor::post_json(builder(), charges.clone())?
        .verify_with(move |client: &reqwest::Client, _: &Action| client.get(&by_key));
    let verified = executor.verify(&action).await;
    ensure!(
        matches!(&verified, Some(Outcome::NotSent { reason }) if reason.starts_with("HTTP 404 ")),
        "an unknown key was not applied: {verified:?}"
    );
    let charge = json!({ "charge_id": "ch_1", "cents": 500 });
    known
        .lock()
        .expect("lock")
        .insert(action.idempotency_key(), charge.clone());
    let verified = executor.verify(&action).await;
    ensure!(verified == Some(Outcome::Done(charge)), "{verified:?}");
    ensure!(
        asked.keys() == [[action.idempotency_key()], [action.idempotency_key()]],
        "the verify requests carried the key: {:?}",
        asked.keys()
    );

    // A 500, or no connection: it cannot tell.
    let broken = format!("{base}/broken");
    let executor = HttpExecutor::post_json(builder(), charges.clone())?
        .verify_with(move |client: &reqwest::Client, _: &Action| client.get(&broken));
    ensure!(executor.verify(&action).await.is_none());
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let executor = HttpExecutor::post_json(builder(), charges)?.verify_with(
        move |client: &reqwest::Client, _: &Action| {
            client.get(format!("http://127.0.0.1:{port}/charges/by-key"))
        },
    );
    ensure!(executor.verify(&action).await.is_none());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The billing API itself.

struct Answer {
    status: u16,
    replayed: bool,
    /// Its `Retry-After` header, if any.
    retry_after: Option<String>,
    body: Value,
}

async fn charge(api: &BillingApi, key: Option<&str>, body: &Value) -> Result<Answer> {
    let mut request = client().post(api.charges_url()).json(body);
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap_or("<not text>").to_owned());
    let body = response.json().await?;
    Ok(Answer {
        status,
        replayed,
        retry_after,
        body,
    })
}

#[tokio::test]
async fn billing_api_applies_a_key_once() -> Result<()> {
    let api = BillingApi::start().await?;
    let body = json!({ "invoice": "INV-1", "cents": 500, "memo": "first" });

    let first = charge(&api, Some("k1"), &body).await?;
    ensure!(first.status == 201 && !first.replayed, "{}", first.status);
    ensure!(
        first.body == json!({ "charge_id": "ch_1", "invoice": "INV-1", "cents": 500 }),
        "{}",
        first.body
    );
    // The same key and body: the stored response, no new charge.
    let again = charge(&api, Some("k1"), &body).await?;
    ensure!(again.status == 201 && again.replayed && again.body == first.body);
    // The same key, another body: 422, nothing applied.
    let other = json!({ "invoice": "INV-1", "cents": 501, "memo": "first" });
    let reused = charge(&api, Some("k1"), &other).await?;
    ensure!(reused.status == 422 && reused.body["error"] == "idempotency_key_reused");
    // No key: 400.
    let missing = charge(&api, None, &body).await?;
    ensure!(missing.status == 400, "{}", missing.status);
    // Another key: another charge.
    let second = charge(&api, Some("k2"), &body).await?;
    ensure!(second.status == 201 && second.body["charge_id"] == "ch_2");

    let charges = api.charges();
    ensure!(
        charges
            == [
                Charge {
                    charge_id: "ch_1".into(),
                    idempotency_key: "k1".into(),
                    invoice: "INV-1".into(),
                    cents: 500,
                    seq: 1
                },
                Charge {
                    charge_id: "ch_2".into(),
                    idempotency_key: "k2".into(),
                    invoice: "INV-1".into(),
                    cents: 500,
                    seq: 2
                },
            ],
        "{charges:?}"
    );
    let listed: Vec<Charge> = client().get(api.charges_url()).send().await?.json().await?;
    ensure!(listed == charges, "GET /charges lists the ledger");
    let requests = api.requests();
    ensure!(requests.total == 5 && requests.for_key("k1") == 3 && requests.for_key("k2") == 1);
    Ok(())
}

#[tokio::test]
async fn billing_api_in_flight_key_402_503_and_restart() -> Result<()> {
    let api = Arc::new(BillingApi::start().await?);
    let slow = json!({ "invoice": "INV-slow", "cents": 100 });

    // A key whose first request is still being processed: 409.
    api.delay_invoice("INV-slow", Duration::from_secs(3));
    let first = tokio::spawn({
        let (api, slow) = (Arc::clone(&api), slow.clone());
        async move { charge(&api, Some("slow"), &slow).await }
    });
    eventually("the first request arrives", WAIT, || {
        let api = Arc::clone(&api);
        async move { Ok(api.requests().for_key("slow") == 1) }
    })
    .await?;
    let busy = charge(&api, Some("slow"), &slow).await?;
    ensure!(busy.status == 409, "{}", busy.status);
    let first = first.await??;
    ensure!(first.status == 201 && first.body["charge_id"] == "ch_1");

    // 402 for a rejected invoice, 503 at a fail rate of 1: neither applies nor stores.
    api.reject_invoice("INV-bad");
    let declined = charge(
        &api,
        Some("bad"),
        &json!({ "invoice": "INV-bad", "cents": 1 }),
    )
    .await?;
    ensure!(declined.status == 402 && declined.body["error"] == "card_declined");
    api.fail_rate(1.0);
    let down = json!({ "invoice": "INV-2", "cents": 2 });
    ensure!(charge(&api, Some("k2"), &down).await?.status == 503);
    api.fail_rate(0.0);
    let applied = charge(&api, Some("k2"), &down).await?;
    ensure!(applied.status == 201 && !applied.replayed && applied.body["charge_id"] == "ch_2");

    // Stopped: connections refused on its port; restarted there with its ledger.
    let before = api.url();
    api.stop().await;
    let refused = client().get(api.charges_url()).send().await;
    ensure!(
        refused.as_ref().is_err_and(reqwest::Error::is_connect),
        "connection refused while stopped: {refused:?}"
    );
    api.restart().await?;
    ensure!(api.url() == before);
    let replay = charge(&api, Some("k2"), &down).await?;
    ensure!(replay.status == 201 && replay.replayed && replay.body == applied.body);
    ensure!(api.charges().len() == 2, "{:?}", api.charges());
    Ok(())
}

#[tokio::test]
async fn billing_api_rate_limit_answers_429_and_applies_nothing() -> Result<()> {
    let api = BillingApi::start().await?;
    // 2 a second: a burst of one, then one every 500 ms.
    api.rate_limit(Some(2.0));
    let body = |n: usize| json!({ "invoice": format!("INV-{n}"), "cents": 100 });
    let mut answers = Vec::new();
    for n in 0..5 {
        answers.push(charge(&api, Some(&format!("k{n}")), &body(n)).await?);
    }
    let limited: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    ensure!(
        answers[0].status == 201 && limited.len() >= 3,
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    for answer in &limited {
        ensure!(answer.body["error"] == "rate_limited", "{}", answer.body);
        ensure!(answer.retry_after.is_none(), "{:?}", answer.retry_after);
    }
    let applied = answers.iter().filter(|a| a.status == 201).count();
    ensure!(api.charges().len() == applied, "{:?}", api.charges());
    let requests = api.requests();
    ensure!(requests.total == 5 && requests.rate_limited == limited.len() as u64);
    // The keys of the requests refused stay free: once lifted, each applies, not replayed.
    api.rate_limit(None);
    for (n, answer) in answers.iter().enumerate() {
        if answer.status == 429 {
            let again = charge(&api, Some(&format!("k{n}")), &body(n)).await?;
            ensure!(again.status == 201 && !again.replayed, "{}", again.status);
        }
    }
    ensure!(api.charges().len() == 5, "{:?}", api.charges());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A dispatcher with the HTTP executor against the billing API, on the real PostgreSQL.

struct Running {
    dispatcher: Dispatcher<HttpExecutor>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), outbox_producer::ProducerError>>,
}

impl Running {
    async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        Ok(self.task.await??)
    }
}

fn run_dispatcher(db: &TestDb, api: &BillingApi, call_timeout: Duration) -> Result<Running> {
    let config = DispatcherConfig::new("billing")
        .max_in_flight(4)
        .batch_size(4)
        .call_timeout(call_timeout)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .poll_interval(Duration::from_millis(50));
    let executor = HttpExecutor::post_json(builder(), url(&api.charges_url()))?;
    let dispatcher = Dispatcher::new(db.pool.clone(), config, executor)?;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    Ok(Running {
        dispatcher,
        shutdown,
        task,
    })
}

async fn await_done(db: &TestDb, id: EventId) -> Result<Value> {
    eventually("the action is done", WAIT, || async move {
        Ok(matches!(state(db, id).await?, Some(ActionState::Done(_))))
    })
    .await?;
    match state(db, id).await? {
        Some(ActionState::Done(answer)) => Ok(answer),
        other => bail!("{other:?}"),
    }
}

#[tokio::test]
async fn a_dispatched_action_is_charged_once_and_its_outcome_stored() -> Result<()> {
    let db = TestDb::new().await?;
    let api = BillingApi::start().await?;
    let running = run_dispatcher(&db, &api, Duration::from_secs(10))?;
    let id = enqueue(&db, "INV-7", &json!({ "invoice": "INV-7", "cents": 700 })).await?;

    let answer = await_done(&db, id).await?;
    ensure!(
        answer == json!({ "charge_id": "ch_1", "invoice": "INV-7", "cents": 700 }),
        "{answer}"
    );
    running.stop().await?;
    let charges = api.charges();
    ensure!(
        charges.len() == 1 && charges[0].idempotency_key == id.to_string(),
        "{charges:?}"
    );
    ensure!(api.requests().total == 1);
    Ok(())
}

#[tokio::test]
async fn a_charge_whose_answer_stalls_past_the_call_timeout_is_applied_once() -> Result<()> {
    let db = TestDb::new().await?;
    let api = BillingApi::start().await?;
    api.apply_then_stall(1);
    let running = run_dispatcher(&db, &api, Duration::from_secs(1))?;
    let id = enqueue(&db, "INV-8", &json!({ "invoice": "INV-8", "cents": 800 })).await?;

    // The first call applies the charge and gets no answer within call_timeout; the retry
    // (same key) gets the stored response.
    let answer = await_done(&db, id).await?;
    ensure!(
        answer == json!({ "charge_id": "ch_1", "invoice": "INV-8", "cents": 800 }),
        "{answer}"
    );
    running.stop().await?;
    let key = id.to_string();
    ensure!(
        api.charges()
            == [Charge {
                charge_id: "ch_1".into(),
                idempotency_key: key.clone(),
                invoice: "INV-8".into(),
                cents: 800,
                seq: 1
            }],
        "one charge: {:?}",
        api.charges()
    );
    // The stalled request and its retry (one more if a retry itself outlived call_timeout
    // on a loaded machine), all with the action's key.
    let requests = api.requests();
    ensure!(
        requests.for_key(&key) >= 2 && requests.total == requests.for_key(&key),
        "{requests:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_declined_charge_is_rejected_with_the_answer_and_an_outage_charges_nothing() -> Result<()>
{
    let db = TestDb::new().await?;
    let api = BillingApi::start().await?;
    api.reject_invoice("INV-bad");
    let running = run_dispatcher(&db, &api, Duration::from_secs(10))?;

    let bad = enqueue(&db, "INV-bad", &json!({ "invoice": "INV-bad", "cents": 1 })).await?;
    eventually("the action is rejected", WAIT, || {
        let db = &db;
        async move {
            Ok(matches!(
                state(db, bad).await?,
                Some(ActionState::Rejected { .. })
            ))
        }
    })
    .await?;
    let Some(ActionState::Rejected { answer, reason }) = state(&db, bad).await? else {
        bail!("rejected");
    };
    ensure!(answer["error"] == "card_declined", "{answer}");
    ensure!(reason.contains("HTTP 402 Payment Required: "), "{reason}");

    // The API down: the dispatcher pauses, charges the action nothing, and performs it once
    // the API is back.
    api.stop().await;
    let id = enqueue(&db, "INV-9", &json!({ "invoice": "INV-9", "cents": 900 })).await?;
    eventually("the dispatcher finds the API down", WAIT, || {
        let dispatcher = running.dispatcher.clone();
        async move { Ok(dispatcher.last_error().is_some()) }
    })
    .await?;
    let pending = state(&db, id).await?;
    ensure!(
        matches!(pending, Some(ActionState::Pending { attempts: 0, .. })),
        "no attempt charged: {pending:?}"
    );
    api.restart().await?;
    let answer = await_done(&db, id).await?;
    ensure!(answer["charge_id"] == "ch_1", "{answer}");
    running.stop().await?;
    ensure!(api.charges().len() == 1, "{:?}", api.charges());
    Ok(())
}

/// An API key refused for a while (a rotation not yet propagated), then accepted: with
/// `max_attempts(2)`, every action of the time was rejected within seconds before. Now the
/// destination is down while every call gets 401, nothing is charged or rejected, and every
/// action is done once the key is accepted.
#[tokio::test]
async fn credentials_refused_for_a_while_reject_nothing() -> Result<()> {
    /// Answers 401 to the first `REFUSALS` requests, then 200 with the request's key.
    const REFUSALS: usize = 8;
    async fn until_accepted(
        State(refused): State<Arc<AtomicUsize>>,
        headers: HeaderMap,
    ) -> Response {
        if refused.fetch_add(1, Ordering::SeqCst) < REFUSALS {
            return (StatusCode::UNAUTHORIZED, "invalid api key").into_response();
        }
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        axum::Json(json!({ "charged": key })).into_response()
    }
    let refused = Arc::new(AtomicUsize::new(0));
    let base = serve(
        Router::new()
            .route("/charges", routing::post(until_accepted))
            .with_state(Arc::clone(&refused)),
    )
    .await?;
    let db = TestDb::new().await?;
    let mut ids = Vec::new();
    for n in 0..6 {
        ids.push(enqueue(&db, &format!("INV-{n}"), &json!({ "invoice": n })).await?);
    }
    let config = DispatcherConfig::new("billing")
        .max_attempts(2)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .poll_interval(Duration::from_millis(50));
    let executor = HttpExecutor::post_json(builder(), url(&format!("{base}/charges")))?;
    let dispatcher = Dispatcher::new(db.pool.clone(), config, executor)?;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    for id in &ids {
        let answer = await_done(&db, *id).await?;
        ensure!(answer == json!({ "charged": id.to_string() }), "{answer}");
    }
    shutdown.cancel();
    task.await??;
    ensure!(
        refused.load(Ordering::SeqCst) > REFUSALS,
        "the key was refused, then accepted"
    );
    let quarantined: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE status = 'quarantined'")
            .fetch_one(&db.pool)
            .await?;
    ensure!(
        quarantined == 0,
        "{quarantined} actions rejected or given up"
    );
    Ok(())
}

/// A payment API answers with a `client_secret`, an OAuth token and a card's `cvc`: the answer
/// stored for the agent (done, or rejected) has them as `"[redacted]"`, whatever their depth
/// and case, and everything else as answered; `keep_answer_secrets` stores them whole.
#[tokio::test]
async fn secrets_in_an_answer_are_stored_redacted() -> Result<()> {
    let answered = json!({
        "id": "pi_1",
        "client_secret": "pi_1_secret_abc",
        "auth": {"Access_Token": "eyJ", "expires_in": 3600},
        "card": {"cvc": "123", "last4": "4242"}
    });
    let body = answered.to_string();
    let rejected = body.clone();
    let router = Router::new()
        .route("/ok", any(move || async move { (StatusCode::OK, body) }))
        .route(
            "/declined",
            any(move || async move { (StatusCode::PAYMENT_REQUIRED, rejected) }),
        );
    let base = serve(router).await?;
    let action = an_action(json!({ "invoice": "INV-1", "cents": 500 })).await?;
    let redacted = json!({
        "id": "pi_1",
        "client_secret": "[redacted]",
        "auth": {"Access_Token": "[redacted]", "expires_in": 3600},
        "card": {"cvc": "[redacted]", "last4": "4242"}
    });
    assert_eq!(
        post(&post_to(&base, "/ok"), &action).await,
        Outcome::Done(redacted.clone())
    );
    match post(&post_to(&base, "/declined"), &action).await {
        Outcome::Rejected { answer, .. } => assert_eq!(answer, redacted),
        other => bail!("not rejected: {other:?}"),
    }
    assert_eq!(
        post(&post_to(&base, "/ok").keep_answer_secrets(), &action).await,
        Outcome::Done(answered)
    );
    Ok(())
}
