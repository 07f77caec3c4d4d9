//! [`dedup_consume`]: a whole consumer from a Kafka configuration, a pool and a handler.

use rdkafka::ClientConfig;
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::Consumer;
use serde::de::DeserializeOwned;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::{ConsumerConfig, ConsumerError, DedupConsumer, Handler, stream_consumer_with_context};

/// Runs `handler` once per event id on what `kafka`'s consumer reads, once the topics are
/// given:
///
/// ```no_run
/// # async fn doc(pool: sqlx::PgPool) -> Result<(), outbox_consumer::ConsumerError> {
/// use outbox_consumer::{ConsumerConfig, Event, consumer_config, dedup_consume};
/// use sqlx::PgConnection;
/// use tokio_util::sync::CancellationToken;
///
/// async fn record(event: &Event<serde_json::Value>, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO seen (id) VALUES ($1)").bind(event.id).execute(conn).await?;
///     Ok(())
/// }
///
/// let kafka = consumer_config("127.0.0.1:9092", "billing");
/// dedup_consume(&kafka, pool, record)
///     .topics(["outbox.event.invoice"])
///     .config(ConsumerConfig::default().max_concurrent_partitions(4))
///     .run(CancellationToken::new())
///     .await
/// # }
/// ```
///
/// The settings the consumer's guarantees rest on are enforced over `kafka`'s (see
/// [`consumer_config`](crate::consumer_config)); the consumer name defaults to the `group.id`.
pub fn dedup_consume<P, H>(kafka: &ClientConfig, pool: PgPool, handler: H) -> DedupConsume<P, H>
where
    H: Handler<P>,
{
    DedupConsume {
        kafka: kafka.clone(),
        pool,
        handler,
        topics: Vec::new(),
        config: ConsumerConfig::default(),
        context: DefaultClientContext,
        _payload: std::marker::PhantomData,
    }
}

/// A consumer being set up; made by [`dedup_consume`], started by [`Self::run`].
#[must_use = "a consumer does nothing until it runs"]
pub struct DedupConsume<P, H, C = DefaultClientContext> {
    kafka: ClientConfig,
    pool: PgPool,
    handler: H,
    topics: Vec<String>,
    config: ConsumerConfig,
    context: C,
    _payload: std::marker::PhantomData<fn() -> P>,
}

impl<P, H, C> std::fmt::Debug for DedupConsume<P, H, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupConsume")
            .field("topics", &self.topics)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<P, H, C> DedupConsume<P, H, C> {
    /// The topics to subscribe to (at least one).
    pub fn topics<I, S>(mut self, topics: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topics.extend(topics.into_iter().map(Into::into));
        self
    }

    /// The consumer's settings (default: [`ConsumerConfig::default`], named after the
    /// `group.id`).
    pub fn config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }

    /// The application's own client context (statistics, logging, OAUTHBEARER token refresh),
    /// wrapped by the consumer's [`DedupContext`](crate::DedupContext).
    pub fn context<D: ClientContext>(self, context: D) -> DedupConsume<P, H, D> {
        DedupConsume {
            kafka: self.kafka,
            pool: self.pool,
            handler: self.handler,
            topics: self.topics,
            config: self.config,
            context,
            _payload: self._payload,
        }
    }
}

impl<P, H, C> DedupConsume<P, H, C>
where
    P: DeserializeOwned + Send + Sync + 'static,
    H: Handler<P>,
    C: ClientContext + 'static,
{
    /// Builds the Kafka consumer, subscribes it and consumes until `shutdown` is cancelled
    /// (see [`DedupConsumer::run`]).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let Self {
            kafka,
            pool,
            handler,
            topics,
            mut config,
            context,
            ..
        } = self;
        if topics.is_empty() {
            return Err(ConsumerError::Config(
                "dedup_consume needs at least one topic".to_owned(),
            ));
        }
        if config.name.is_none() {
            config.name = kafka.get("group.id").map(str::to_owned);
        }
        if !config.insecure_transport {
            outbox_core::check_kafka_tls_with(&kafka, C::ENABLE_REFRESH_OAUTH_TOKEN)?;
        }
        let consumer = DedupConsumer::new(pool, config, handler)?;
        let stream = stream_consumer_with_context(&kafka, context)?;
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        stream.subscribe(&topics)?;
        consumer.run(stream, shutdown).await
    }
}
