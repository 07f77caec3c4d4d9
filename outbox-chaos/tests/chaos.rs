//! Runs the chaos harness's CI profile as a real process against the real Postgres and its own
//! Apache Kafka broker, and holds it to the figures: the run passes, with at least 50
//! kill cycles, both kinds of broker fault (clean restart and `kill -9`), nothing lost, no
//! double effect and no order violation.
//!
//! The harness isolates itself from the rest of the suite (which shares the broker on port
//! 9092 and the `outbox_test` database): it starts its own Kafka node on free ports and creates
//! its own database, so it can run in parallel with the other tests. It needs the Kafka jars
//! (`source scripts/services.sh && resolve_jars kafka`; `scripts/test` does that).

use std::collections::BTreeMap;
use std::process::Command;

/// The Postgres server the suite uses, pointed at its `postgres` maintenance database: the
/// harness creates (and drops) a database of its own there.
fn server_url() -> String {
    let url = std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/outbox_test".into());
    match url.rsplit_once('/') {
        Some((server, _database)) => format!("{server}/postgres"),
        None => url,
    }
}

/// The `key=value` fields of the harness's `chaos:` summary line.
fn summary(stdout: &str) -> BTreeMap<String, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("chaos: "))
        .unwrap_or_else(|| panic!("no `chaos:` summary line in the output:\n{stdout}"));
    line.trim_start_matches("chaos: ")
        .split_whitespace()
        .filter_map(|field| field.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn number(fields: &BTreeMap<String, String>, key: &str) -> u64 {
    let value = fields
        .get(key)
        .unwrap_or_else(|| panic!("summary has no `{key}`: {fields:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("summary `{key}` is not a number: {value}"))
}

#[test]
fn ci_profile_keeps_every_guarantee_under_fifty_kill_cycles() {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(["run", "--profile", "ci", "--seed", "1"])
        .arg(format!("--database-url={}", server_url()))
        .env_remove("DATABASE_URL")
        .output()
        .expect("the harness starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: String = {
        let lines: Vec<&str> = stderr.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    };
    let fields = summary(&stdout);
    println!("{}", stdout.trim());
    assert!(
        output.status.success(),
        "harness failed ({}); summary: {fields:?}\nlast log lines:\n{tail}",
        output.status
    );
    assert_eq!(fields.get("result").map(String::as_str), Some("PASS"));
    for zero in ["lost", "double_effects", "order_violations"] {
        assert_eq!(number(&fields, zero), 0, "{zero} must be 0: {fields:?}");
    }
    let kills = number(&fields, "kill_cycles");
    assert!(kills >= 50, "only {kills} kill cycles: {fields:?}");
    for broker_fault in ["broker_restart", "broker_kill9"] {
        assert!(
            number(&fields, broker_fault) >= 1,
            "no {broker_fault} in the run: {fields:?}"
        );
    }
    assert!(number(&fields, "events_committed") > 0);
}
