//! Every TCP connection the project opens sends small writes at once: sqlx 0.9.0 stopped
//! setting `TCP_NODELAY` (sqlx #4335), and each `enqueue_all` of 128 rows over TCP then waited
//! ~48 ms on Nagle's algorithm; librdkafka leaves Nagle on unless told. Checked on the live
//! sockets of this process (`tests/fixtures/tcp_nodelay.py` reads them with pidfd_getfd).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use futures::future::try_join_all;
use outbox_consumer::consumer_config;
use outbox_producer::producer_config;
use outbox_tests::{TestDb, database_url, kafka_bootstrap};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, Producer};

/// `TCP_NODELAY` of this process's connections to each of `ports`.
fn nodelay_by_port(ports: &[u16]) -> Result<BTreeMap<u16, Vec<bool>>> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tcp_nodelay.py");
    let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
    let out = Command::new("python3")
        .arg(script)
        .arg(std::process::id().to_string())
        .arg(ports.join(","))
        .output()
        .context("running python3")?;
    ensure!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut found: BTreeMap<u16, Vec<bool>> = BTreeMap::new();
    for line in String::from_utf8(out.stdout)?.lines() {
        let (port, on) = line.split_once(' ').context("a line")?;
        found
            .entry(port.parse()?)
            .or_default()
            .push(on.trim() != "0");
    }
    Ok(found)
}

#[tokio::test]
async fn every_connection_to_postgres_and_kafka_has_tcp_nodelay() -> Result<()> {
    let db = TestDb::with_pool_size(4).await?;
    // Held open while the sockets are read.
    let connections = try_join_all((0..3).map(|_| db.pool.acquire())).await?;
    let pg_port = url::Url::parse(&database_url())?
        .port()
        .context("the test database's port")?;
    let bootstrap = kafka_bootstrap();
    let kafka_port: u16 = bootstrap.rsplit_once(':').context("host:port")?.1.parse()?;
    let producer: BaseProducer = producer_config(&bootstrap).create()?;
    let consumer: BaseConsumer = consumer_config(&bootstrap, "tcp-nodelay").create()?;
    let clients = tokio::task::spawn_blocking(move || -> Result<_> {
        producer
            .client()
            .fetch_metadata(None, Duration::from_secs(10))?;
        consumer.fetch_metadata(None, Duration::from_secs(10))?;
        Ok((producer, consumer))
    })
    .await??;
    let found = nodelay_by_port(&[pg_port, kafka_port])?;
    drop(connections);
    drop(clients);
    for port in [pg_port, kafka_port] {
        let sockets = found.get(&port).cloned().unwrap_or_default();
        ensure!(
            !sockets.is_empty(),
            "no connection to port {port} found: {found:?}"
        );
        ensure!(
            sockets.iter().all(|&on| on),
            "connections to port {port} without TCP_NODELAY: {found:?}"
        );
    }
    Ok(())
}
