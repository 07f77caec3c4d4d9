//! `outbox status`: what an operator checks first — depth and lag per topic, quarantines on
//! both sides, and how big the dedup store has grown.

use std::time::Duration;

use anyhow::Result;
use outbox_core::TableNames;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection};

#[derive(Debug, Serialize)]
struct Status {
    pending: i64,
    oldest_pending_age_ms: Option<i64>,
    quarantined: i64,
    consumer_quarantined: i64,
    topics: Vec<TopicLag>,
    dedup: DedupSize,
}

/// Pending rows of one topic and the age of its oldest.
#[derive(Debug, Serialize, sqlx::FromRow)]
struct TopicLag {
    topic: String,
    pending: i64,
    oldest_pending_age_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
struct DedupSize {
    rows: i64,
    bytes: i64,
    consumers: Vec<ConsumerRows>,
}

#[derive(Debug, Serialize, sqlx::FromRow)]
struct ConsumerRows {
    consumer: String,
    rows: i64,
}

pub(crate) async fn run(conn: &mut PgConnection, tables: &TableNames, json: bool) -> Result<()> {
    let status = read(conn, tables).await?;
    if json {
        println!("{}", serde_json::to_string(&status)?);
    } else {
        print_text(&status);
    }
    Ok(())
}

async fn read(conn: &mut PgConnection, tables: &TableNames) -> Result<Status> {
    let outbox = outbox_producer::stats(&mut *conn, tables).await?;
    let (t, d, q) = (
        &tables.outbox,
        &tables.consumer_dedup,
        &tables.consumer_quarantine,
    );
    let topics = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT topic, count(*) AS pending, \
                (extract(epoch FROM now() - min(created_at)) * 1000)::bigint AS oldest_pending_age_ms \
           FROM {t} WHERE status = 'pending' GROUP BY topic ORDER BY topic"
    )))
    .fetch_all(&mut *conn)
    .await?;
    let consumer_quarantined =
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {q}")))
            .fetch_one(&mut *conn)
            .await?;
    let consumers: Vec<ConsumerRows> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT consumer, count(*) AS rows FROM {d} GROUP BY consumer ORDER BY consumer"
    )))
    .fetch_all(&mut *conn)
    .await?;
    let bytes = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_total_relation_size('{d}'::regclass)"
    )))
    .fetch_one(&mut *conn)
    .await?;
    Ok(Status {
        pending: outbox.pending,
        oldest_pending_age_ms: outbox.oldest_pending_age_ms,
        quarantined: outbox.quarantined,
        consumer_quarantined,
        topics,
        dedup: DedupSize {
            rows: consumers.iter().map(|c| c.rows).sum(),
            bytes,
            consumers,
        },
    })
}

fn print_text(s: &Status) {
    let age = |ms: Option<i64>| {
        ms.map_or_else(
            || "-".to_owned(),
            |ms| humantime::format_duration(Duration::from_millis(ms.unsigned_abs())).to_string(),
        )
    };
    println!("pending              {}", s.pending);
    println!("oldest pending age   {}", age(s.oldest_pending_age_ms));
    for topic in &s.topics {
        println!(
            "  {:<40} {:>8} pending, oldest {}",
            topic.topic,
            topic.pending,
            age(topic.oldest_pending_age_ms)
        );
    }
    println!("relay quarantined    {}", s.quarantined);
    println!("consumer quarantined {}", s.consumer_quarantined);
    println!(
        "dedup rows           {} ({} KiB)",
        s.dedup.rows,
        s.dedup.bytes / 1024
    );
    for consumer in &s.dedup.consumers {
        println!("  {:<40} {:>8} rows", consumer.consumer, consumer.rows);
    }
}
