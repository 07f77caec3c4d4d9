//! `outbox-bench`: what users pick the framework for, each figure a ratio against a baseline
//! measured in the same invocation, variants interleaved (A B A B) so drift hits both.
//!
//! Needs PostgreSQL and Apache Kafka (`scripts/bench` starts them). Prints a table and writes JSON.

mod cpu;
mod memory;
mod p1_write;
mod p2_relay;
mod p3_latency;
mod p4_consumer;
mod p6_debezium;
mod p7_scale;
mod p8_dedup_store;
mod p9_dispatch;
mod p9_tail_and_limit;
mod sample;
mod sql_times;

use std::time::Duration;

use anyhow::Result;
use clap::Parser;

/// Benchmark settings.
#[derive(Debug, Clone, Parser)]
#[command(name = "outbox-bench")]
pub(crate) struct Settings {
    /// Which parts to run: p1 (write overhead), p2 (relay throughput and P5 growth),
    /// p3 (latency), p4 (consumer), mem (peak RSS of a relay and a consumer process),
    /// p6 (the relay vs Debezium's Outbox Event Router: backlog throughput, latency at 1k ev/s;
    /// needs Kafka Connect); not by default: p7 (stats, claim and prune at `--scale-rows`
    /// pending and published rows, ~15 min and ~8 GB of disk at 10M), p8 (the dedup store in
    /// day slices: inserts with `--dedup-rows` retained, pruning a day of `--slice-rows`, size
    /// per id; ~10 min and ~6 GB of disk); p9 (the dispatcher against a local HTTP billing
    /// API: vs a hand-written claim-call-mark loop, at 20 ms of API latency vs the bound 64 in
    /// flight allow, with 1 % of calls taking 2 s, and against an API limited to 200 calls/s;
    /// needs no Kafka).
    #[arg(long, value_delimiter = ',', default_values_t = ["p1".to_string(), "p2".into(), "p3".into(), "p4".into(), "mem".into(), "p6".into(), "p9".into()])]
    only: Vec<String>,
    /// Interleaved rounds per figure.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Length of each timed run (P1, P3).
    #[arg(long, value_parser = humantime_secs, default_value = "3")]
    pub(crate) duration: Duration,
    /// Concurrent writers in P1.
    #[arg(long, default_value_t = 4)]
    pub(crate) clients: usize,
    /// Events per relay run (P2, P5) and per consumer run (P4).
    #[arg(long, default_value_t = 40_000)]
    pub(crate) events: usize,
    /// Actions per dispatcher run (P9a, P9b; P9c runs twice as many, P9d 3,000).
    #[arg(long, default_value_t = 8_000)]
    pub(crate) actions: usize,
    /// Relay batch size.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) batch_size: u32,
    /// Pending rows, and published rows, of P7's large outbox.
    #[arg(long, default_value_t = 10_000_000)]
    pub(crate) scale_rows: i64,
    /// Dedup ids retained over the past week in P8's large store.
    #[arg(long, default_value_t = 20_000_000)]
    pub(crate) dedup_rows: i64,
    /// Ids of the day slice P8 prunes.
    #[arg(long, default_value_t = 5_000_000)]
    pub(crate) slice_rows: i64,
    /// Internal: run as a `mem` child process in this role.
    #[arg(long, value_enum, hide = true)]
    role: Option<memory::Role>,
    /// Internal: the `mem` child's schema.
    #[arg(long, hide = true)]
    pub(crate) schema: Option<String>,
    /// Internal: the `mem` child's topic.
    #[arg(long, hide = true)]
    pub(crate) topic: Option<String>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "target/bench/results.json")]
    pub(crate) json: std::path::PathBuf,
}

fn humantime_secs(s: &str) -> Result<Duration, std::num::ParseFloatError> {
    s.trim_end_matches('s')
        .parse::<f64>()
        .map(Duration::from_secs_f64)
}

#[tokio::main]
async fn main() -> Result<()> {
    let settings = Settings::parse();
    sql_times::install();
    if let Some(role) = settings.role {
        return memory::child(&settings, role).await;
    }
    let mut figures = Vec::new();
    let wants = |part: &str| settings.only.iter().any(|p| p == part);
    if wants("p1") {
        figures.extend(p1_write::run(&settings).await?);
    }
    if wants("p2") {
        figures.extend(p2_relay::run(&settings).await?);
    }
    if wants("p3") {
        figures.extend(p3_latency::run(&settings).await?);
    }
    if wants("p4") {
        figures.extend(p4_consumer::run(&settings).await?);
    }
    if wants("mem") {
        figures.extend(memory::run(&settings).await?);
    }
    if wants("p6") {
        figures.extend(p6_debezium::run(&settings).await?);
    }
    if wants("p7") {
        figures.extend(p7_scale::run(&settings).await?);
    }
    if wants("p8") {
        figures.extend(p8_dedup_store::run(&settings).await?);
    }
    if wants("p9") {
        figures.extend(p9_dispatch::run(&settings).await?);
        figures.extend(p9_tail_and_limit::run(&settings).await?);
    }
    let peak_rss_kib = peak_rss_kib();
    println!(
        "\nmedian [min..max] over {} interleaved rounds",
        settings.rounds
    );
    for f in &figures {
        println!("{}", f.row());
    }
    if let Some(kib) = peak_rss_kib {
        println!(
            "peak RSS of the bench process (relay + consumer + load generators): {:.1} MiB",
            kib as f64 / 1024.0
        );
    }
    if let Some(dir) = settings.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let json = serde_json::json!({ "settings": format!("{settings:?}"), "figures": figures, "peak_rss_kib": peak_rss_kib });
    std::fs::write(&settings.json, serde_json::to_string_pretty(&json)?)?;
    println!("results written to {}", settings.json.display());
    Ok(())
}

/// The process's peak resident set (VmHWM), from /proc.
pub(crate) fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
