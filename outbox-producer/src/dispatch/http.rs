//! The HTTP executor (feature `http`): performs each action as one HTTP request, with the
//! action's event id as `Idempotency-Key`, and turns the answer into an [`Outcome`].
//!
//! # Semantics
//! - **The same key on every attempt**: each request carries
//!   `Idempotency-Key: <Action::idempotency_key()>` (the event id), set after the request is
//!   built, so it replaces any the builder set. A retry after a 5xx, a timeout, a reset
//!   connection, a crash between the call and the record or a shutdown during the call sends
//!   the same key: an API that honours idempotency keys (payment APIs do) applies the action
//!   once and answers the repeat with the stored response. An API that ignores the header may
//!   apply it again.
//! - **Status codes**:
//!
//!   | answer | outcome |
//!   | --- | --- |
//!   | 2xx | [`Outcome::Done`] with the body as JSON; a body that is not JSON as `{"status": n, "body": "<text>"}`; an empty one as `{"status": n}` |
//!   | 408, 409, 425, 429, 5xx | [`Outcome::Retry`], after at least `Retry-After` (seconds or an HTTP date) when the answer has one |
//!   | any other 4xx; a 1xx or 3xx left after the client's redirects | [`Outcome::Rejected`], the body (as above) as the answer |
//!
//!   A 409 is retried because payment APIs answer it to a request whose key an earlier
//!   attempt is still processing (one the dispatcher stopped waiting for at `call_timeout`):
//!   the retry gets the first attempt's stored answer once it is done. An API that means
//!   something permanent by 409 sees it retried until `max_attempts`, then quarantined.
//! - **No answer**: an error before the request was sent (connection refused, DNS, a connect
//!   timeout, a TLS handshake refused) is [`Outcome::Unavailable`]: nothing is charged to the
//!   action, and when no call of a batch got an answer the dispatcher pauses as a whole. An
//!   error after it was sent (a timeout, a reset connection, a body that could not be read)
//!   is [`Outcome::Retry`]: the API may have applied it, so the same request is made again
//!   with the same key. Set the client's `connect_timeout` below the dispatcher's
//!   `call_timeout`, or an unreachable host counts as a call without an answer (a retry,
//!   charged to the action) rather than as an outage.
//! - **Bodies**: at most [`MAX_BODY`] (1 MiB) of a body is read, as it streams in; a longer
//!   one is stored as `{"status": n, "body": "<its first 1 MiB as text>", "truncated": true}`.
//! - **Reasons** (the row's `last_error`) are short: the status and the first 200 characters
//!   of the body, escaped ([`outbox_core::escape`]), or the error's chain without the URL.
//!   They never hold a header value, the request's or the answer's.
//! - **Redirects** follow the client's policy (reqwest follows 301, 302 and 303 as a `GET`
//!   without the body): a client for an API that must not be redirected wants
//!   `reqwest::redirect::Policy::none()`, so that a 3xx is rejected.
//!
//! ```no_run
//! # fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use outbox_producer::dispatch::{Dispatcher, DispatcherConfig, HttpExecutor};
//!
//! let client = reqwest::Client::builder()
//!     .connect_timeout(Duration::from_secs(5))
//!     .build()?;
//! let charges = HttpExecutor::post_json(client, "https://billing.example/charges".parse()?);
//! let dispatcher = Dispatcher::new(pool, DispatcherConfig::new("billing"), charges)?;
//! # Ok(()) }
//! ```

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Client, RequestBuilder, Response, StatusCode, Url};
use serde_json::{Value, json};

use super::{Action, Executor, Outcome};

/// Most bytes of an answer's body read and stored: 1 MiB.
pub const MAX_BODY: usize = 1 << 20;

/// Characters of a body quoted in a reason.
const SNIPPET_CHARS: usize = 200;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

type Build = dyn Fn(&Action) -> RequestBuilder + Send + Sync;

/// Performs actions as HTTP requests: see the [module](self) for what each answer becomes.
/// Cheap to clone.
#[derive(Clone)]
pub struct HttpExecutor {
    client: Client,
    build: Arc<Build>,
}

impl std::fmt::Debug for HttpExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpExecutor")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl HttpExecutor {
    /// POSTs each action's payload as JSON (`Content-Type: application/json`) to `url`.
    pub fn post_json(client: Client, url: Url) -> Self {
        let builder = client.clone();
        Self::new(client, move |action: &Action| {
            builder.post(url.clone()).json(&action.payload)
        })
    }

    /// Sends the request `build` makes of each action (its method, URL, body and headers)
    /// with `client`; `build` usually starts from a clone of the same client
    /// (`client.post(...)`). The `Idempotency-Key` header is set after `build`, replacing any
    /// it set. A request `build` cannot make (a bad URL) is [`Outcome::Rejected`].
    pub fn new<F>(client: Client, build: F) -> Self
    where
        F: Fn(&Action) -> RequestBuilder + Send + Sync + 'static,
    {
        Self {
            client,
            build: Arc::new(build),
        }
    }

    async fn call(&self, action: Action) -> Outcome {
        let mut request = match (self.build)(&action).build() {
            Ok(request) => request,
            Err(e) => {
                return Outcome::rejected(
                    format!("the request could not be built: {}", chain(e)),
                    Value::Null,
                );
            }
        };
        match HeaderValue::try_from(action.idempotency_key()) {
            Ok(key) => {
                request.headers_mut().insert(IDEMPOTENCY_KEY, key);
            }
            // An event id is a UUID: always a valid header value.
            Err(_) => {
                return Outcome::rejected("the idempotency key is not a header value", Value::Null);
            }
        }
        let response = match self.client.execute(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => {
                return Outcome::unavailable(format!("no connection: {}", chain(e)));
            }
            Err(e) if e.is_builder() => {
                return Outcome::rejected(
                    format!("the request could not be built: {}", chain(e)),
                    Value::Null,
                );
            }
            Err(e) if e.is_redirect() => {
                return Outcome::rejected(format!("redirects: {}", chain(e)), Value::Null);
            }
            Err(e) => {
                return Outcome::retry(format!(
                    "sent, no answer (the outcome is unknown): {}",
                    chain(e)
                ));
            }
        };
        let status = response.status();
        let after = retry_after(response.headers(), SystemTime::now());
        match read_body(response).await {
            Ok(body) => classify(status, after, &body),
            Err(e) => Outcome::retry(format!(
                "HTTP {}, its body could not be read (the outcome is unknown): {}",
                status.as_u16(),
                chain(e)
            )),
        }
    }
}

impl Executor for HttpExecutor {
    fn execute(&self, action: Action) -> impl Future<Output = Outcome> + Send {
        self.call(action)
    }
}

/// An answer's body, at most [`MAX_BODY`] of it.
#[derive(Debug, Default, PartialEq)]
struct Body {
    bytes: Vec<u8>,
    /// The body went on past [`MAX_BODY`]; the rest was not read.
    truncated: bool,
}

async fn read_body(mut response: Response) -> Result<Body, reqwest::Error> {
    let mut body = Body::default();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_BODY - body.bytes.len();
        if chunk.len() > room {
            body.bytes.extend_from_slice(&chunk[..room]);
            body.truncated = true;
            break;
        }
        body.bytes.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// What an answer with `status` and `body` becomes.
fn classify(status: StatusCode, after: Option<Duration>, body: &Body) -> Outcome {
    let answer = answer(status, body);
    if status.is_success() {
        return Outcome::Done(answer);
    }
    let mut reason = format!("HTTP {status}");
    if status.is_informational() || status.is_redirection() {
        reason.push_str(" (not followed)");
    }
    reason.push_str(&snippet(body));
    match status.as_u16() {
        408 | 409 | 425 | 429 | 500..=599 => Outcome::Retry { reason, after },
        _ => Outcome::Rejected { reason, answer },
    }
}

/// The body as JSON, or as text in `{"status": n, "body": ...}`; `{"status": n}` when empty.
fn answer(status: StatusCode, body: &Body) -> Value {
    let status = status.as_u16();
    if body.truncated {
        return json!({
            "status": status,
            "body": String::from_utf8_lossy(&body.bytes),
            "truncated": true,
        });
    }
    if body.bytes.is_empty() {
        return json!({ "status": status });
    }
    serde_json::from_slice(&body.bytes).unwrap_or_else(
        |_| json!({ "status": status, "body": String::from_utf8_lossy(&body.bytes) }),
    )
}

/// `: <the body's first characters, escaped>` (nothing for an empty body).
fn snippet(body: &Body) -> String {
    if body.bytes.is_empty() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&body.bytes);
    let mut cut: String = text.chars().take(SNIPPET_CHARS).collect();
    let more = cut.len() < text.len() || body.truncated;
    cut = format!(": {}", outbox_core::escape(&cut));
    if more {
        cut.push_str(" ...");
    }
    if body.truncated {
        let _ = write!(cut, " (body cut at {} bytes)", MAX_BODY);
    }
    cut
}

/// `Retry-After` as a wait from `now`: delta seconds or an HTTP date (a date past is no wait).
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64: longer than any backoff (the dispatcher caps the wait at
        // its `backoff_max`).
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The error and its sources, without the URL (it may hold a secret), escaped.
fn chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let message = s.to_string();
        // Some errors repeat their source's message in their own.
        if !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        source = s.source();
    }
    outbox_core::escape(&text).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(bytes: &[u8]) -> Body {
        Body {
            bytes: bytes.to_vec(),
            truncated: false,
        }
    }

    fn headers(retry_after: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from_str(retry_after).expect("header value"),
        );
        headers
    }

    #[test]
    fn answers_become_json() {
        let ok = StatusCode::OK;
        assert_eq!(answer(ok, &body(br#"{"id": 1}"#)), json!({ "id": 1 }));
        assert_eq!(
            answer(ok, &body(b"fine")),
            json!({ "status": 200, "body": "fine" })
        );
        assert_eq!(
            answer(StatusCode::NO_CONTENT, &body(b"")),
            json!({ "status": 204 })
        );
        let cut = Body {
            bytes: b"{\"a\":".to_vec(),
            truncated: true,
        };
        assert_eq!(
            answer(ok, &cut),
            json!({ "status": 200, "body": "{\"a\":", "truncated": true })
        );
    }

    #[test]
    fn statuses_become_outcomes() {
        let retried = [408, 409, 425, 429, 500, 502, 503, 504, 599];
        for code in retried {
            let status = StatusCode::from_u16(code).expect("status");
            assert!(
                matches!(classify(status, None, &body(b"")), Outcome::Retry { .. }),
                "{code}"
            );
        }
        for code in [400, 401, 402, 403, 404, 410, 422, 451, 300, 304] {
            let status = StatusCode::from_u16(code).expect("status");
            assert!(
                matches!(
                    classify(status, None, &body(b"x")),
                    Outcome::Rejected { .. }
                ),
                "{code}"
            );
        }
        assert!(matches!(
            classify(StatusCode::CREATED, None, &body(b"")),
            Outcome::Done(_)
        ));
    }

    #[test]
    fn reasons_quote_the_body_escaped_and_short() {
        let long = format!("line\n\u{1b}[31m{}", "x".repeat(1000));
        let Outcome::Rejected { reason, .. } =
            classify(StatusCode::BAD_REQUEST, None, &body(long.as_bytes()))
        else {
            panic!("a 400 is rejected");
        };
        assert!(
            reason.starts_with("HTTP 400 Bad Request: line\\n\\u{1b}[31m"),
            "{reason}"
        );
        assert!(reason.len() < 300, "{reason}");
        assert!(!reason.contains('\n') && !reason.contains('\u{1b}'));
    }

    #[test]
    fn retry_after_as_seconds_or_a_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(
            retry_after(&headers("120"), now),
            Some(Duration::from_secs(120))
        );
        // 784111777 is Sun, 06 Nov 1994 08:49:37 GMT.
        assert_eq!(
            retry_after(&headers("Sun, 06 Nov 1994 08:50:07 GMT"), now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            retry_after(&headers("Sun, 06 Nov 1994 08:00:00 GMT"), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&headers("-5"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
        assert_eq!(
            retry_after(&headers("99999999999999999999999"), now),
            Some(Duration::from_secs(u64::MAX))
        );
    }
}
