//! `outbox status`: what an operator checks first — depth and lag per topic, quarantines on
//! both sides, and how big the dedup store has grown. Counts stop at `STATS_COUNT_CAP`
//! (shown as `N+`), so the command costs the same on a 10M-row backlog as on a small one.

use std::time::Duration;

use anyhow::Result;
use outbox_core::TableNames;
use outbox_producer::STATS_COUNT_CAP;
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection};

#[derive(Debug, Serialize)]
struct Status {
    /// Where every count below stops.
    count_cap: i64,
    pending: i64,
    oldest_pending_age_ms: Option<i64>,
    quarantined: i64,
    consumer_quarantined: i64,
    /// Keys parked by `ParkKey` consumers, the records parked behind them, and the most
    /// records one key holds (past the consumer's `max_parked_per_key`, it warns).
    parked_keys: i64,
    parked_records: i64,
    largest_park: i64,
    topics: Vec<TopicLag>,
    destinations: Vec<Destination>,
    dedup: DedupSize,
}

/// A dispatcher destination, as its pending actions tell it: how many are called right now,
/// and how many wait out an outage of the destination uncharged (it is down, or was a moment
/// ago), with the latest reason.
#[derive(Debug, Serialize, sqlx::FromRow)]
struct Destination {
    destination: String,
    pending: i64,
    in_flight: i64,
    waiting_out_outage: i64,
    up: bool,
    outage_reason: Option<String>,
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
        println!("{}", crate::print::json(&status, false)?);
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
    // Every count stops at the cap, so `status` reads at most that many index entries per
    // count however large the backlog or the dedup store: the oldest pending rows by seq for
    // the topics, and a loose index scan of the dedup key for its consumers.
    let cap = STATS_COUNT_CAP;
    let topics = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT topic, count(*) AS pending, \
                (extract(epoch FROM now() - min(created_at)) * 1000)::bigint AS oldest_pending_age_ms \
           FROM (SELECT topic, created_at FROM {t} WHERE status = 'pending' ORDER BY seq LIMIT $1) oldest \
          GROUP BY topic ORDER BY topic"
    )))
    .bind(cap)
    .fetch_all(&mut *conn)
    .await?;
    // From the dispatch pending index (topic, seq), at most `cap` rows per look.
    let destinations = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT substr(topic, length('dispatch:') + 1) AS destination, count(*) AS pending, \
                count(*) FILTER (WHERE lease IS NOT NULL AND next_attempt_at > now()) AS in_flight, \
                count(*) FILTER (WHERE lease IS NULL AND last_error LIKE 'Outage (not charged)%') \
                  AS waiting_out_outage, \
                count(*) FILTER (WHERE lease IS NULL AND last_error LIKE 'Outage (not charged)%') = 0 AS up, \
                (array_agg(last_error ORDER BY next_attempt_at DESC) \
                   FILTER (WHERE lease IS NULL AND last_error LIKE 'Outage (not charged)%'))[1] \
                  AS outage_reason \
           FROM (SELECT topic, lease, next_attempt_at, last_error FROM {t} \
                  WHERE status = 'pending' AND topic LIKE 'dispatch:%' ORDER BY topic, seq LIMIT $1) oldest \
          GROUP BY topic ORDER BY topic"
    )))
    .bind(cap)
    .fetch_all(&mut *conn)
    .await?;
    let consumer_quarantined = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT 1 FROM {q} LIMIT $1) capped"
    )))
    .bind(cap)
    .fetch_one(&mut *conn)
    .await?;
    let (keys, parked) = (q.suffixed("_parked_keys"), q.suffixed("_parked"));
    let (parked_keys, parked_records, largest_park): (i64, i64, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM (SELECT 1 FROM {keys} LIMIT $1) k),                     (SELECT count(*) FROM (SELECT 1 FROM {parked} LIMIT $1) p),                     coalesce((SELECT max(n) FROM (SELECT count(*) AS n FROM                         (SELECT consumer, topic, partition, message_key FROM {parked} LIMIT $1) c                         GROUP BY consumer, topic, partition, message_key) per_key), 0)"
        )))
        .bind(cap)
        .fetch_one(&mut *conn)
        .await?;
    let consumers: Vec<ConsumerRows> = sqlx::query_as(AssertSqlSafe(format!(
        "WITH RECURSIVE names(consumer) AS ( \
             (SELECT consumer FROM {d} ORDER BY consumer LIMIT 1) \
             UNION ALL \
             SELECT (SELECT d.consumer FROM {d} d WHERE d.consumer > names.consumer \
                      ORDER BY d.consumer LIMIT 1) \
               FROM names WHERE names.consumer IS NOT NULL) \
         SELECT consumer, \
                (SELECT count(*) FROM (SELECT 1 FROM {d} d WHERE d.consumer = names.consumer LIMIT $1) capped) AS rows \
           FROM names WHERE consumer IS NOT NULL ORDER BY consumer"
    )))
    .bind(cap)
    .fetch_all(&mut *conn)
    .await?;
    // A partitioned table holds nothing itself: its size is its slices'.
    let bytes = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint \
         FROM pg_partition_tree('{d}'::regclass)"
    )))
    .fetch_one(&mut *conn)
    .await?;
    Ok(Status {
        count_cap: cap,
        pending: outbox.pending,
        oldest_pending_age_ms: outbox.oldest_pending_age_ms,
        quarantined: outbox.quarantined,
        consumer_quarantined,
        parked_keys,
        parked_records,
        largest_park,
        topics,
        destinations,
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
    let capped = |n: i64| {
        if n >= s.count_cap {
            format!("{n}+")
        } else {
            n.to_string()
        }
    };
    println!("pending              {}", capped(s.pending));
    println!("oldest pending age   {}", age(s.oldest_pending_age_ms));
    for topic in &s.topics {
        println!(
            "  {:<40} {:>8} pending, oldest {}",
            outbox_core::escape(&topic.topic).to_string(),
            capped(topic.pending),
            age(topic.oldest_pending_age_ms)
        );
    }
    for d in &s.destinations {
        println!(
            "  destination {:<28} {:>8} pending, {} in flight, {}",
            outbox_core::escape(&d.destination).to_string(),
            capped(d.pending),
            d.in_flight,
            match &d.outage_reason {
                Some(reason) if !d.up => format!(
                    "DOWN: {} waiting out an outage uncharged ({})",
                    d.waiting_out_outage,
                    outbox_core::escape(reason)
                ),
                _ => "up".to_owned(),
            }
        );
    }
    println!("relay quarantined    {}", capped(s.quarantined));
    println!("consumer quarantined {}", capped(s.consumer_quarantined));
    println!(
        "parked keys          {} ({} records, at most {} under one key)",
        capped(s.parked_keys),
        capped(s.parked_records),
        capped(s.largest_park)
    );
    let any_capped = s.dedup.consumers.iter().any(|c| c.rows >= s.count_cap);
    println!(
        "dedup rows           {}{} ({} KiB)",
        s.dedup.rows,
        if any_capped { "+" } else { "" },
        s.dedup.bytes / 1024
    );
    for consumer in &s.dedup.consumers {
        println!(
            "  {:<40} {:>8} rows",
            outbox_core::escape(&consumer.consumer).to_string(),
            capped(consumer.rows)
        );
    }
}
