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
//! - **Its own client, never redirected**: the executor builds its client from the
//!   [`ClientBuilder`] it is given, with [`reqwest::redirect::Policy::none()`] whatever the
//!   builder said. A redirect followed would send a `POST` again as a `GET` without its body
//!   (301, 302, 303), whose `2xx` (a list, a form) is not the answer to the request, or send
//!   the body, the key and the credentials to whatever host `Location` names (307, 308). A
//!   3xx is an answer: [`Outcome::Rejected`], with `Location` in the stored answer.
//! - **https only**, except `http://` to a loopback host (`127.0.0.0/8`, `::1`, `localhost`),
//!   unless the executor was made with [`HttpExecutor::allow_plain_http`] (or
//!   [`HttpExecutor::post_json_plain_http`]): the payload, the key and the credentials would
//!   cross the network in the clear. [`HttpExecutor::post_json`] refuses such a URL when it
//!   is made; a request built for one at call time is [`Outcome::NotSent`], nothing sent.
//! - **Status codes**:
//!
//!   | answer | outcome |
//!   | --- | --- |
//!   | 2xx | [`Outcome::Done`] with the body as JSON; a body that is not JSON as `{"status": n, "body": "<text>"}`; an empty one as `{"status": n}` |
//!   | 3xx | [`Outcome::Rejected`], not followed; the answer is `{"status": n, "location": "<Location as text, or null>", "body": <JSON or text, when not empty>}` |
//!   | 401, 403, 407 | [`Outcome::Unavailable`]: credentials refused, not applied; the destination's failure, not the action's |
//!   | 429 | [`Outcome::RateLimited`], after `Retry-After` (seconds or an HTTP date) when the answer has one |
//!   | 408, 409, 425, 5xx | [`Outcome::Retry`], after at least `Retry-After` when the answer has one |
//!   | any other 4xx, a 1xx | [`Outcome::Rejected`], the body (as for a 2xx) as the answer |
//!
//!   A 409 is retried because payment APIs answer it to a request whose key an earlier
//!   attempt is still processing (one the dispatcher stopped waiting for at `call_timeout`):
//!   the retry gets the first attempt's stored answer once it is done. An API that means
//!   something permanent by 409 sees it retried until `max_attempts`, then quarantined.
//!   Credentials refused are a destination's failure because every call gets them (a key
//!   rotated or revoked): the dispatcher finds the destination down and probes it, charging
//!   no action, until the credentials are fixed.
//! - **Nothing sent**: a request that cannot be built (a bad URL, a header that is not a
//!   header) or that would go over plain HTTP to another host is [`Outcome::NotSent`]: the
//!   action is quarantined at once as never sent.
//! - **No answer**: an error before the request was sent (connection refused, DNS, a connect
//!   timeout, a TLS handshake refused) is [`Outcome::Unavailable`]: nothing is charged to the
//!   action, and the dispatcher counts it against the destination's health. An error after
//!   it was sent (a timeout, a reset connection, a body that could not be read) is
//!   [`Outcome::Retry`]: the API may have applied it, so the same request is made again with
//!   the same key. Set the client's `connect_timeout` below the dispatcher's `call_timeout`,
//!   or an unreachable host counts as a call without an answer (a retry) rather than as an
//!   outage.
//! - **Bodies**: at most [`MAX_BODY`] (1 MiB) of a body is read, as it streams in; a longer
//!   one is stored as `{"status": n, "body": "<its first 1 MiB as text>", "truncated": true}`.
//!   [`HttpExecutor::post_json`] sends the payload as stored, byte for byte
//!   ([`Action::payload`]: every digit of a number kept).
//! - **Reasons** (the row's `last_error`) are short: the status and the first 200 characters
//!   of the body, escaped ([`outbox_core::escape`]), or the error's chain without the URL.
//!   They never hold a URL or a header value, the request's or the answer's: a redirect's
//!   reason leaves out its body (it usually repeats the location), a refusal of credentials
//!   leaves out its body (a server may quote the credentials it refused). The executor's
//!   `Debug` shows no part of the client (its default headers may hold a token).
//! - **Verification**: with [`HttpExecutor::verify_with`], [`Executor::verify`] sends the
//!   request it builds with the action's `Idempotency-Key`: a 2xx is
//!   `Some(Outcome::Done(<the body, as for a call>))`, a 404 or 410
//!   `Some(Outcome::NotSent { .. })`, anything else (or no answer) `None`. The dispatcher asks
//!   before it gives up on an action a call may have applied, and before it calls again one
//!   whose dispatcher stopped during its call: answer 404 only for a key the destination has
//!   not applied and is not applying.
//!
//! ```no_run
//! # fn doc(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use outbox_producer::dispatch::{Dispatcher, DispatcherConfig, HttpExecutor};
//!
//! let client = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
//! let charges = HttpExecutor::post_json(client, "https://billing.example/charges".parse()?)?
//!     .verify_with(|client, action| {
//!         let key = action.idempotency_key();
//!         client.get(format!("https://billing.example/charges/by-key/{key}"))
//!     });
//! let dispatcher = Dispatcher::new(pool, DispatcherConfig::new("billing"), charges)?;
//! # Ok(()) }
//! ```

use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};
use reqwest::redirect::Policy;
use reqwest::{Client, ClientBuilder, Request, RequestBuilder, Response, StatusCode, Url};
use serde_json::{Value, json};

use super::{Action, Executor, Outcome};
use crate::ProducerError;

/// Most bytes of an answer's body read and stored: 1 MiB.
pub const MAX_BODY: usize = 1 << 20;

/// Characters of a body quoted in a reason.
const SNIPPET_CHARS: usize = 200;

const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

type Build = dyn Fn(&Client, &Action) -> RequestBuilder + Send + Sync;

/// Performs actions as HTTP requests: see the [module](self) for what each answer becomes.
/// Cheap to clone (clones share the client and its connections).
#[derive(Clone)]
pub struct HttpExecutor {
    client: Client,
    build: Arc<Build>,
    verify: Option<Arc<Build>>,
    plain_http: bool,
    keep_secrets: bool,
}

/// Leaves the client out: its `Debug` prints its default headers (an `Authorization` token).
impl std::fmt::Debug for HttpExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpExecutor")
            .field("verifies", &self.verify.is_some())
            .field("plain_http", &self.plain_http)
            .finish_non_exhaustive()
    }
}

impl HttpExecutor {
    /// POSTs each action's payload, as stored ([`Action::payload`], byte for byte), with
    /// `Content-Type: application/json`, to `url`, with a client built from `builder` (see
    /// [`Self::new`]).
    ///
    /// Fails with [`ProducerError::Config`] if the client cannot be built, or if `url` is
    /// not `https://` (`http://` is taken to a loopback host only): use an https URL, or
    /// [`Self::post_json_plain_http`] on a network you trust.
    pub fn post_json(builder: ClientBuilder, url: Url) -> Result<Self, ProducerError> {
        if let Some(refusal) = refusal(&url, false) {
            return Err(ProducerError::Config(format!(
                "HttpExecutor::post_json to {}: {refusal}; use an https URL, or \
                 HttpExecutor::post_json_plain_http if the network to it is trusted",
                url.host_str().unwrap_or("a URL without a host"),
            )));
        }
        Self::post_json_plain_http(builder, url)
    }

    /// [`Self::post_json`] that also takes a plain `http://` URL to any host
    /// ([`Self::allow_plain_http`]): the payload, the key and any credentials cross the
    /// network unencrypted.
    pub fn post_json_plain_http(builder: ClientBuilder, url: Url) -> Result<Self, ProducerError> {
        let executor = Self::new(builder, move |client: &Client, action: &Action| {
            client
                .post(url.clone())
                .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
                .body(action.payload.get().to_owned())
        })?;
        Ok(executor.allow_plain_http())
    }

    /// Sends the request `build` makes of each action (its method, URL, body and headers)
    /// with the client `builder` makes, which `build` is given (`client.post(...)`).
    /// Redirects are never followed, whatever `builder` says (a 3xx is
    /// [`Outcome::Rejected`]). The `Idempotency-Key` header is set after `build`, replacing
    /// any it set. A request `build` cannot make (a bad URL), or one to a plain `http://` URL
    /// of a host that is not loopback (unless [`Self::allow_plain_http`]), is
    /// [`Outcome::NotSent`].
    ///
    /// Fails with [`ProducerError::Config`] if `builder` cannot build a client (a TLS
    /// backend that does not load, a bad certificate).
    pub fn new<F>(builder: ClientBuilder, build: F) -> Result<Self, ProducerError>
    where
        F: Fn(&Client, &Action) -> RequestBuilder + Send + Sync + 'static,
    {
        let client = builder.redirect(Policy::none()).build().map_err(|e| {
            ProducerError::Config(format!(
                "the HTTP executor's client could not be built: {}",
                chain(e)
            ))
        })?;
        Ok(Self {
            client,
            build: Arc::new(build),
            verify: None,
            plain_http: false,
            keep_secrets: false,
        })
    }

    /// Sends requests to plain `http://` URLs of any host, not only loopback ones: for a
    /// network you trust (the payload, the key and any credentials go unencrypted).
    #[must_use]
    pub fn allow_plain_http(mut self) -> Self {
        self.plain_http = true;
        self
    }

    /// Stores answers whole. By default, the values of an answer's JSON fields named like a
    /// secret (`client_secret`, `password`, `access_token`, `api_key`, `private_key`,
    /// `authorization`, `cookie`, `cvc`, and any name ending in `secret`, `token`,
    /// `password` or `key` after one of those words; `-` and `_` and case ignored) are
    /// stored as `"[redacted]"`: an answer is read by the agent, the status role and
    /// whatever replicates the outbox, and a payment API's `client_secret` or an OAuth
    /// token is no business of theirs.
    #[must_use]
    pub fn keep_answer_secrets(mut self) -> Self {
        self.keep_secrets = true;
        self
    }

    /// Makes [`Executor::verify`] send the request `build` makes of an action (a `GET` of
    /// the charge made under its key), with the action's `Idempotency-Key`: a 2xx is
    /// `Some(Outcome::Done(<its body>))`, a 404 or a 410 `Some(Outcome::NotSent { .. })`,
    /// anything else `None`. Answer 404 only for a key that was not applied and is not
    /// being applied: the dispatcher then quarantines the action as never sent.
    #[must_use]
    pub fn verify_with<F>(mut self, build: F) -> Self
    where
        F: Fn(&Client, &Action) -> RequestBuilder + Send + Sync + 'static,
    {
        self.verify = Some(Arc::new(build));
        self
    }

    /// The request `build` makes of `action`, with its key; the reason when it is not sent.
    fn request(&self, build: &Build, action: &Action) -> Result<Request, String> {
        let mut request = build(&self.client, action)
            .build()
            .map_err(|e| format!("the request could not be built: {}", chain(e)))?;
        if let Some(refusal) = refusal(request.url(), self.plain_http) {
            return Err(format!("not sent: {refusal}"));
        }
        // An event id is a UUID: always a valid header value.
        let key = HeaderValue::try_from(action.idempotency_key())
            .map_err(|_| "the idempotency key is not a header value".to_owned())?;
        request.headers_mut().insert(IDEMPOTENCY_KEY, key);
        Ok(request)
    }

    async fn call(&self, action: Action) -> Outcome {
        let request = match self.request(&*self.build, &action) {
            Ok(request) => request,
            Err(reason) => return Outcome::not_sent(reason),
        };
        let response = match self.client.execute(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => {
                return Outcome::unavailable(format!("no connection: {}", chain(e)));
            }
            Err(e) if e.is_builder() => {
                return Outcome::not_sent(format!("the request could not be built: {}", chain(e)));
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
        let location = response
            .headers()
            .get(LOCATION)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        match read_body(response).await {
            Ok(body) => classify(status, after, location, &body),
            Err(e) => Outcome::retry(format!(
                "HTTP {}, its body could not be read (the outcome is unknown): {}",
                status.as_u16(),
                chain(e)
            )),
        }
    }

    async fn ask(&self, action: &Action) -> Option<Outcome> {
        let build = self.verify.as_deref()?;
        let request = self.request(build, action).ok()?;
        let response = self.client.execute(request).await.ok()?;
        let status = response.status();
        if status.is_success() {
            let body = read_body(response).await.ok()?;
            return Some(Outcome::Done(answer(status, &body)));
        }
        match status {
            StatusCode::NOT_FOUND | StatusCode::GONE => Some(Outcome::not_sent(format!(
                "HTTP {status} when asked for the key: the destination has not applied it"
            ))),
            _ => None,
        }
    }
}

impl Executor for HttpExecutor {
    async fn execute(&self, action: Action) -> Outcome {
        self.stored(self.call(action).await)
    }

    async fn verify(&self, action: &Action) -> Option<Outcome> {
        self.ask(action).await.map(|outcome| self.stored(outcome))
    }
}

impl HttpExecutor {
    /// `outcome` with its answer as stored: secrets redacted unless kept.
    fn stored(&self, outcome: Outcome) -> Outcome {
        if self.keep_secrets {
            return outcome;
        }
        match outcome {
            Outcome::Done(mut answer) => {
                redact(&mut answer);
                Outcome::Done(answer)
            }
            Outcome::Rejected { reason, mut answer } => {
                redact(&mut answer);
                Outcome::Rejected { reason, answer }
            }
            other => other,
        }
    }
}

/// Replaces, at any depth, the values of fields named like a secret with `"[redacted]"`.
fn redact(value: &mut Value) {
    match value {
        Value::Object(fields) => {
            for (name, field) in fields.iter_mut() {
                if is_secret_name(name) {
                    *field = Value::String("[redacted]".to_owned());
                } else {
                    redact(field);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

fn is_secret_name(name: &str) -> bool {
    let name: String = name
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect();
    const EXACT: [&str; 8] = [
        "password",
        "passwd",
        "authorization",
        "cookie",
        "setcookie",
        "cvc",
        "cvv",
        "pin",
    ];
    const ENDINGS: [&str; 5] = ["secret", "token", "password", "apikey", "privatekey"];
    EXACT.contains(&name.as_str()) || ENDINGS.iter().any(|end| name.ends_with(end))
}

/// Why a request to `url` must not be sent, if it must not: a scheme other than https, or
/// plain http to a host that is not loopback (unless `plain_http`). Names no part of the URL.
fn refusal(url: &Url, plain_http: bool) -> Option<&'static str> {
    match url.scheme() {
        "https" => None,
        "http" if plain_http || is_loopback(url) => None,
        "http" => Some(
            "plain http to a host that is not loopback (the payload, the idempotency key and \
             any credentials would cross the network unencrypted)",
        ),
        _ => Some("not an http or https URL"),
    }
}

/// `127.0.0.0/8`, `::1` or `localhost`: a plain-http request to it never leaves the machine.
fn is_loopback(url: &Url) -> bool {
    // `Url` writes an IPv4 host in dotted form (`http://2130706433/` is 127.0.0.1) and an
    // IPv6 one in brackets.
    let Some(host) = url.host_str() else {
        return false;
    };
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host
            .strip_suffix('.')
            .unwrap_or(host)
            .eq_ignore_ascii_case("localhost"),
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

/// What an answer with `status`, `Retry-After` (as `after`), `Location` and `body` becomes.
fn classify(
    status: StatusCode,
    after: Option<Duration>,
    location: Option<String>,
    body: &Body,
) -> Outcome {
    if status.is_success() {
        return Outcome::Done(answer(status, body));
    }
    if status.is_redirection() {
        // The body is left out of the reason: it usually repeats the location, which may
        // hold a token.
        return Outcome::Rejected {
            reason: format!(
                "HTTP {status}: a redirect, not followed (its location is in the answer)"
            ),
            answer: redirect_answer(status, location, body),
        };
    }
    let code = status.as_u16();
    if matches!(code, 401 | 403 | 407) {
        // Every call gets it until the credentials are fixed: the destination's failure.
        // The body is left out: a server may quote the credentials it refused.
        return Outcome::unavailable(format!("HTTP {status}: credentials refused, not applied"));
    }
    let mut reason = format!("HTTP {status}");
    if status.is_informational() {
        reason.push_str(" (an interim answer, not the request's outcome)");
    }
    reason.push_str(&snippet(body));
    match code {
        429 => Outcome::RateLimited { reason, after },
        408 | 409 | 425 | 500..=599 => Outcome::Retry { reason, after },
        _ => Outcome::Rejected {
            reason,
            answer: answer(status, body),
        },
    }
}

/// The body as JSON, or as text in `{"status": n, "body": ...}`; `{"status": n}` when empty.
fn answer(status: StatusCode, body: &Body) -> Value {
    let status = status.as_u16();
    if body.bytes.is_empty() {
        return json!({ "status": status });
    }
    if let Some(json) = parsed(body) {
        return json;
    }
    let mut answer = json!({ "status": status, "body": text(body) });
    if body.truncated {
        answer["truncated"] = Value::Bool(true);
    }
    answer
}

/// `{"status": n, "location": <text or null>, "body": <JSON or text>}`, without `body` when
/// it is empty, with `"truncated": true` when it was cut.
fn redirect_answer(status: StatusCode, location: Option<String>, body: &Body) -> Value {
    let mut answer = json!({ "status": status.as_u16(), "location": location });
    if !body.bytes.is_empty() {
        answer["body"] = parsed(body).unwrap_or_else(|| Value::String(text(body)));
    }
    if body.truncated {
        answer["truncated"] = Value::Bool(true);
    }
    answer
}

/// The body as JSON, if it is whole and JSON.
fn parsed(body: &Body) -> Option<Value> {
    if body.truncated {
        return None;
    }
    serde_json::from_slice(&body.bytes).ok()
}

fn text(body: &Body) -> String {
    String::from_utf8_lossy(&body.bytes).into_owned()
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
        // Too many digits for a u64: longer than any wait (the dispatcher cuts what it is asked
        // to wait to its `max_age`).
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
    fn secrets_in_answers_are_redacted_unless_kept() {
        let mut answer = json!({
            "id": "pi_1",
            "client_secret": "pi_1_secret_x",
            "next": {"Access-Token": "t", "tokens_left": 3, "keys": ["a"]},
            "list": [{"password": "p", "api_key": "k", "amount": 5}],
            "card": {"cvc": "123", "last4": "4242"}
        });
        redact(&mut answer);
        assert_eq!(
            answer,
            json!({
                "id": "pi_1",
                "client_secret": "[redacted]",
                "next": {"Access-Token": "[redacted]", "tokens_left": 3, "keys": ["a"]},
                "list": [{"password": "[redacted]", "api_key": "[redacted]", "amount": 5}],
                "card": {"cvc": "[redacted]", "last4": "4242"}
            })
        );
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

    fn outcome(code: u16, location: Option<&str>, body_text: &[u8]) -> Outcome {
        let status = StatusCode::from_u16(code).expect("status");
        classify(
            status,
            Some(Duration::from_secs(7)),
            location.map(str::to_owned),
            &body(body_text),
        )
    }

    #[test]
    fn statuses_become_outcomes() {
        for code in [200, 201, 202, 204, 299] {
            assert!(
                matches!(outcome(code, None, b""), Outcome::Done(_)),
                "{code}"
            );
        }
        for code in [408, 409, 425, 500, 502, 503, 504, 599] {
            assert!(
                matches!(
                    outcome(code, None, b""),
                    Outcome::Retry { after: Some(after), .. } if after == Duration::from_secs(7)
                ),
                "{code}"
            );
        }
        assert!(matches!(
            outcome(429, None, b"slow down"),
            Outcome::RateLimited { after: Some(after), .. } if after == Duration::from_secs(7)
        ));
        for code in [401, 403, 407] {
            assert!(
                matches!(outcome(code, None, b"x"), Outcome::Unavailable { .. }),
                "{code}"
            );
        }
        for code in [400, 402, 404, 405, 410, 422, 451, 499, 100, 101, 103] {
            assert!(
                matches!(outcome(code, None, b"x"), Outcome::Rejected { .. }),
                "{code}"
            );
        }
        for code in [300, 301, 302, 303, 304, 307, 308] {
            let rejected = outcome(code, Some("/v2/charges"), b"");
            assert!(
                matches!(&rejected, Outcome::Rejected { answer, reason }
                    if *answer == json!({ "status": code, "location": "/v2/charges" })
                        && reason.contains("not followed")),
                "{code}: {rejected:?}"
            );
        }
    }

    #[test]
    fn a_redirect_keeps_its_location_and_body_in_the_answer_not_in_the_reason() {
        let location = "https://elsewhere.example/charges?token=t0k3n";
        let page = format!("<a href=\"{location}\">moved</a>");
        let Outcome::Rejected { reason, answer } = outcome(308, Some(location), page.as_bytes())
        else {
            panic!("a 308 is rejected");
        };
        assert_eq!(
            reason,
            "HTTP 308 Permanent Redirect: a redirect, not followed (its location is in the answer)"
        );
        assert_eq!(
            answer,
            json!({ "status": 308, "location": location, "body": page })
        );
        let Outcome::Rejected { answer, .. } = outcome(301, None, br#"{"moved": true}"#) else {
            panic!("a 301 is rejected");
        };
        assert_eq!(
            answer,
            json!({ "status": 301, "location": null, "body": { "moved": true } })
        );
    }

    #[test]
    fn refused_credentials_quote_nothing_of_the_answer() {
        let Outcome::Unavailable { reason } = outcome(401, None, b"bad token: Bearer s3cr3t")
        else {
            panic!("a 401 is unavailable");
        };
        assert_eq!(
            reason,
            "HTTP 401 Unauthorized: credentials refused, not applied"
        );
    }

    #[test]
    fn plain_http_goes_to_loopback_hosts_only() {
        let refused = |u: &str, plain_http: bool| {
            refusal(&u.parse::<Url>().expect("a URL"), plain_http).is_some()
        };
        for sent in [
            "https://billing.example/charges",
            "https://192.0.2.1/",
            "http://127.0.0.1:8080/charges",
            "http://127.255.255.254/",
            "http://2130706433/",
            "http://[::1]:9000/",
            "http://localhost/",
            "http://LocalHost.:80/",
        ] {
            assert!(!refused(sent, false), "{sent}");
        }
        for not_sent in [
            "http://billing.example/charges",
            "http://192.0.2.1/",
            "http://128.0.0.1/",
            "http://[::2]/",
            "http://[::ffff:127.0.0.1]/",
            "http://localhost.example/",
            "http://127.0.0.1.example/",
            "ftp://127.0.0.1/",
            "file:///etc/passwd",
        ] {
            assert!(refused(not_sent, false), "{not_sent}");
        }
        assert!(!refused("http://billing.example/charges", true));
        assert!(refused("ftp://billing.example/", true));
    }

    #[test]
    fn reasons_quote_the_body_escaped_and_short() {
        let long = format!("line\n\u{1b}[31m{}", "x".repeat(1000));
        let Outcome::Rejected { reason, .. } =
            classify(StatusCode::BAD_REQUEST, None, None, &body(long.as_bytes()))
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
