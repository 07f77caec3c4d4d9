//! What a handler is: a plain `async fn` of the event and the connection its effect is written
//! on (the dedup transaction's), or a type implementing [`Handler`] with an `async fn`, and what
//! it may fail with.

use std::fmt;
use std::future::Future;

use futures::future::BoxFuture;
use sqlx::PgConnection;

use crate::Event;

/// Any error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a handler did not finish, and what the consumer should do about it.
///
/// `?` on any error type gives [`HandlerError::Retry`]; say
/// [`HandlerError::quarantine`] when retrying cannot help (the event asks for something that
/// can never be done).
#[derive(Debug)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later, with backoff, up to `max_attempts`; then the failure policy applies.
    /// (A database that cannot be reached is never counted as an attempt.)
    Retry(BoxError),
    /// Retrying cannot help: the message is quarantined at once (reason `handler_rejected`),
    /// under either failure policy, and the partition moves on.
    Quarantine(BoxError),
}

impl HandlerError {
    /// Try again later.
    pub fn retry(error: impl Into<BoxError>) -> Self {
        Self::Retry(error.into())
    }

    /// Quarantine now: retrying cannot help.
    pub fn quarantine(error: impl Into<BoxError>) -> Self {
        Self::Quarantine(error.into())
    }

    pub(crate) fn into_parts(self) -> (bool, BoxError) {
        match self {
            Self::Retry(error) => (true, error),
            Self::Quarantine(error) => (false, error),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Retry(error) => write!(f, "{error}"),
            Self::Quarantine(error) => write!(f, "rejected: {error}"),
        }
    }
}

// Not `std::error::Error` itself, so that every error type converts with `?` (as
// `anyhow::Error` does it).
impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(error: E) -> Self {
        Self::Retry(Box::new(error))
    }
}

/// A message handler. Write it as a plain function and pass the function:
///
/// ```no_run
/// use outbox_consumer::{Event, HandlerError};
/// use sqlx::PgConnection;
///
/// #[derive(serde::Deserialize)]
/// struct Invoice { cents: i64 }
///
/// async fn charge(event: &Event<Invoice>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO charges (idempotency_key, cents) VALUES ($1, $2)")
///         .bind(event.idempotency_key())
///         .bind(event.payload.cents)
///         .execute(conn)
///         .await?;
///     Ok(())
/// }
/// # fn check() -> impl outbox_consumer::Handler<Invoice> { charge }
/// ```
///
/// or implement the trait on a type that carries what the handler needs, with `async fn`:
///
/// ```no_run
/// use outbox_consumer::{Event, Handler, HandlerError};
/// use sqlx::PgConnection;
///
/// struct Billing { currency: String }
///
/// impl Handler<serde_json::Value> for Billing {
///     async fn handle(&self, event: &Event<serde_json::Value>, conn: &mut PgConnection)
///         -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO charges (idempotency_key, currency) VALUES ($1, $2)")
///             .bind(event.idempotency_key())
///             .bind(&self.currency)
///             .execute(conn)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
///
/// `conn` is the dedup transaction's connection: what the handler writes there commits with the
/// event's dedup row, or not at all. That includes follow-up events: `outbox_producer::enqueue`
/// on `conn` makes consume → decide → enqueue happen once. Closures are wrapped in [`boxed`].
pub trait Handler<P>: Send + Sync + 'static {
    /// Writes the effect of `event` on `conn`.
    fn handle(
        &self,
        event: &Event<P>,
        conn: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// The functions [`Handler`] is implemented for: `async fn(&Event<P>, &mut PgConnection) ->
/// Result<(), E>` with any `E` that converts into [`HandlerError`] (every error type does).
/// Named so that the future's lifetime can be tied to its arguments'; not to be implemented.
pub trait HandlerFn<'a, P: 'a>: Fn(&'a Event<P>, &'a mut PgConnection) -> Self::Fut {
    /// The function's future.
    type Fut: Future<Output = Result<(), Self::Error>> + Send + 'a;
    /// The function's error.
    type Error: Into<HandlerError>;
}

impl<'a, P: 'a, F, Fut, E> HandlerFn<'a, P> for F
where
    F: Fn(&'a Event<P>, &'a mut PgConnection) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'a,
    E: Into<HandlerError>,
{
    type Fut = Fut;
    type Error = E;
}

impl<P: Sync + 'static, F> Handler<P> for F
where
    F: for<'a> HandlerFn<'a, P> + Send + Sync + 'static,
{
    // An `async fn`, so that the call is inside the future: it borrows both arguments for
    // one lifetime, which only the future's own type can name.
    async fn handle(&self, event: &Event<P>, conn: &mut PgConnection) -> Result<(), HandlerError> {
        self(event, conn).await.map_err(Into::into)
    }
}

/// The future a [`boxed`] closure returns.
pub type HandlerFuture<'a> = BoxFuture<'a, Result<(), HandlerError>>;

/// A closure as a [`Handler`]. Closures cannot name the lifetime their future borrows with
/// (and async closures cannot promise a `Send` future on stable Rust), so they return a
/// boxed one:
///
/// ```no_run
/// use outbox_consumer::{Event, boxed};
///
/// let table = "seen";
/// let handler = boxed(move |event: &Event<serde_json::Value>, conn| Box::pin(async move {
///     sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} (id) VALUES ($1)")))
///         .bind(event.id)
///         .execute(conn)
///         .await?;
///     Ok(())
/// }));
/// # fn check(_: impl outbox_consumer::Handler<serde_json::Value>) {}
/// # check(handler);
/// ```
pub fn boxed<P, F>(f: F) -> Boxed<F>
where
    F: for<'a> Fn(&'a Event<P>, &'a mut PgConnection) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    Boxed(f)
}

/// A closure returning [`HandlerFuture`], as a [`Handler`]; made by [`boxed`].
#[derive(Clone, Copy)]
pub struct Boxed<F>(F);

impl<F> fmt::Debug for Boxed<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Boxed(..)")
    }
}

impl<P: Sync + 'static, F> Handler<P> for Boxed<F>
where
    F: for<'a> Fn(&'a Event<P>, &'a mut PgConnection) -> HandlerFuture<'a> + Send + Sync + 'static,
{
    async fn handle(&self, event: &Event<P>, conn: &mut PgConnection) -> Result<(), HandlerError> {
        (self.0)(event, conn).await
    }
}
