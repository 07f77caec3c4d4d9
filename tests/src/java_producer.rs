//! Records written by Kafka's own Java producer (`tests/java/OutsideProducer.java`, run from
//! the Kafka jars the suite's broker runs from): what a client other than librdkafka puts on
//! the wire, such as record batches compressed with a codec of its choosing.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};

/// One record for [`java_produce`].
#[derive(Debug, Clone)]
pub struct JavaRecord {
    /// The producer's `compression.type` (`none`, `gzip`, `snappy`, `lz4`, `zstd`).
    pub compression: String,
    /// Topic (it must exist).
    pub topic: String,
    /// Key.
    pub key: String,
    /// Value of the `id` header.
    pub id: String,
    /// Value.
    pub value: String,
}

/// The Kafka jars' classpath file: `OUTBOX_TEST_KAFKA_CLASSPATH_FILE`, or the one
/// `scripts/services.sh` writes.
fn classpath() -> Result<String> {
    let file = std::env::var_os("OUTBOX_TEST_KAFKA_CLASSPATH_FILE").map_or_else(
        || {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../.services/kafka.classpath"
            ))
        },
        PathBuf::from,
    );
    let classpath = std::fs::read_to_string(&file).with_context(|| {
        format!(
            "reading the Kafka classpath {} (set OUTBOX_TEST_KAFKA_CLASSPATH_FILE)",
            file.display()
        )
    })?;
    Ok(classpath.trim().to_owned())
}

/// Sends `records` with Kafka's Java producer, in one JVM (one producer per compression type,
/// each batching its records), and returns once every one is acknowledged.
pub async fn java_produce(records: &[JavaRecord]) -> Result<()> {
    let mut input = String::new();
    for r in records {
        let fields = [&r.compression, &r.topic, &r.key, &r.id, &r.value];
        ensure!(
            fields.iter().all(|f| !f.contains(['\t', '\n'])),
            "a field of {r:?} has a tab or a newline"
        );
        input.push_str(&format!(
            "{}\t{}\t{}\t{}\t{}\n",
            r.compression, r.topic, r.key, r.id, r.value
        ));
    }
    let classpath = classpath()?;
    let expected = records.len();
    tokio::task::spawn_blocking(move || {
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/java/OutsideProducer.java");
        let mut child = Command::new("java")
            .arg("-cp")
            .arg(classpath)
            .arg(source)
            .arg(crate::kafka_bootstrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting java")?;
        child
            .stdin
            .take()
            .context("java's stdin")?
            .write_all(input.as_bytes())?;
        let output = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // Log lines may share stdout (log4j's default configuration prints errors there).
        let acknowledged = stdout
            .lines()
            .filter(|l| l.split('\t').count() == 3)
            .count();
        if !output.status.success() || acknowledged != expected {
            bail!(
                "the Java producer ({}) acknowledged {acknowledged} of {expected}: {stdout}{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    })
    .await?
}
