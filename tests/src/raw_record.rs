//! Producing a record whose bytes no client library lets through: a header name that is not
//! UTF-8, or with a NUL inside. Go and C producers send such names; rdkafka and the Java client
//! take names as text. So the record batch is written here, byte for byte, and sent in a
//! Produce request (v3, the oldest Kafka 4 accepts) straight to the broker the tests use, the
//! partition's leader (a single broker).

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::kafka_bootstrap;

/// A header as bytes: its name, and its value (`None`: no value).
pub type ByteHeader<'a> = (&'a [u8], Option<&'a [u8]>);

/// Appends `record` (key, value, headers, any bytes) to `topic`/`partition` and returns its
/// offset, once the broker has written it (`acks=-1`).
pub async fn produce_bytes(
    topic: &str,
    partition: i32,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &[ByteHeader<'_>],
) -> Result<i64> {
    let batch = record_batch(key, value, headers)?;
    let mut body = Vec::new();
    body.extend_from_slice(&0_i16.to_be_bytes()); // api key: Produce
    body.extend_from_slice(&3_i16.to_be_bytes()); // api version
    body.extend_from_slice(&7_i32.to_be_bytes()); // correlation id
    string(&mut body, "outbox-tests-raw")?;
    body.extend_from_slice(&(-1_i16).to_be_bytes()); // no transactional id
    body.extend_from_slice(&(-1_i16).to_be_bytes()); // acks: all
    body.extend_from_slice(&10_000_i32.to_be_bytes()); // timeout ms
    body.extend_from_slice(&1_i32.to_be_bytes()); // one topic
    string(&mut body, topic)?;
    body.extend_from_slice(&1_i32.to_be_bytes()); // one partition
    body.extend_from_slice(&partition.to_be_bytes());
    body.extend_from_slice(&i32::try_from(batch.len())?.to_be_bytes());
    body.extend_from_slice(&batch);

    let mut stream = TcpStream::connect(kafka_bootstrap()).await?;
    stream
        .write_all(&i32::try_from(body.len())?.to_be_bytes())
        .await?;
    stream.write_all(&body).await?;
    let response = tokio::time::timeout(Duration::from_secs(30), async {
        let len = stream.read_i32().await?;
        let mut response = vec![0; usize::try_from(len)?];
        stream.read_exact(&mut response).await?;
        anyhow::Ok(response)
    })
    .await
    .context("no Produce response within 30 s")??;
    // correlation id, topics [name, partitions [index, error code, base offset, ...]]
    let mut r = Reader(&response);
    ensure!(r.i32()? == 7, "a response to another request");
    ensure!(r.i32()? == 1, "one topic answered");
    let name_len = usize::try_from(r.i16()?)?;
    r.take(name_len)?;
    ensure!(r.i32()? == 1, "one partition answered");
    r.i32()?;
    let error = r.i16()?;
    if error != 0 {
        bail!("the broker refused the record: error code {error}");
    }
    r.i64()
}

/// A record batch (magic 2) of one uncompressed record.
fn record_batch(
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &[ByteHeader<'_>],
) -> Result<Vec<u8>> {
    let mut record = Vec::new();
    record.push(0); // attributes
    varint(&mut record, 0); // timestamp delta
    varint(&mut record, 0); // offset delta
    bytes(&mut record, key)?;
    bytes(&mut record, value)?;
    varint(&mut record, i64::try_from(headers.len())?);
    for (name, value) in headers {
        bytes(&mut record, Some(name))?;
        bytes(&mut record, *value)?;
    }
    let mut records = Vec::new();
    varint(&mut records, i64::try_from(record.len())?);
    records.extend_from_slice(&record);

    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    // From the attributes to the end: what the CRC covers.
    let mut tail = Vec::new();
    tail.extend_from_slice(&0_i16.to_be_bytes()); // attributes: no codec, not transactional
    tail.extend_from_slice(&0_i32.to_be_bytes()); // last offset delta
    tail.extend_from_slice(&now.to_be_bytes()); // base timestamp
    tail.extend_from_slice(&now.to_be_bytes()); // max timestamp
    tail.extend_from_slice(&(-1_i64).to_be_bytes()); // producer id
    tail.extend_from_slice(&(-1_i16).to_be_bytes()); // producer epoch
    tail.extend_from_slice(&(-1_i32).to_be_bytes()); // base sequence
    tail.extend_from_slice(&1_i32.to_be_bytes()); // one record
    tail.extend_from_slice(&records);

    let mut batch = Vec::new();
    batch.extend_from_slice(&0_i64.to_be_bytes()); // base offset (the broker assigns it)
    // Batch length: from the partition leader epoch on.
    batch.extend_from_slice(&i32::try_from(4 + 1 + 4 + tail.len())?.to_be_bytes());
    batch.extend_from_slice(&(-1_i32).to_be_bytes()); // partition leader epoch
    batch.push(2); // magic
    batch.extend_from_slice(&crc32c(&tail).to_be_bytes());
    batch.extend_from_slice(&tail);
    Ok(batch)
}

fn string(out: &mut Vec<u8>, s: &str) -> Result<()> {
    out.extend_from_slice(&i16::try_from(s.len())?.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// A varint length (`-1` for none) and the bytes.
fn bytes(out: &mut Vec<u8>, b: Option<&[u8]>) -> Result<()> {
    match b {
        None => varint(out, -1),
        Some(b) => {
            varint(out, i64::try_from(b.len())?);
            out.extend_from_slice(b);
        }
    }
    Ok(())
}

/// Kafka's zig-zag varint.
fn varint(out: &mut Vec<u8>, n: i64) {
    let mut v = ((n << 1) ^ (n >> 63)) as u64;
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// CRC-32C (Castagnoli), as record batches carry it.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0_u32;
    for byte in data {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(self.0.len() >= n, "short Produce response");
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn i16(&mut self) -> Result<i16> {
        Ok(i16::from_be_bytes(self.take(2)?.try_into()?))
    }
    fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_be_bytes(self.take(4)?.try_into()?))
    }
    fn i64(&mut self) -> Result<i64> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
