//! Runs the chaos harness's CI, cluster and liveness profiles as real processes against the real
//! Postgres and their own Apache Kafka nodes, and holds them to the issues' figures: each run
//! passes, with at least 50 kill cycles, both kinds of broker fault (clean restart and
//! `kill -9`), nothing lost, no double effect and no order violation. The CI profile also runs
//! the dispatcher fleet (issue 28) against a billing API that fails and lags at random: every
//! committed action charged exactly once, none lost, each key's charges in commit order. In the cluster profile
//! (three brokers, replication factor 3, `min.insync.replicas` 2) every broker fault takes
//! down the leader of a partition while the relays publish with `acks=all`. The liveness
//! profile (a short fault phase, then the broker down for over two minutes, Postgres stopped,
//! a key stuck behind a row the broker rejects under each quarantine policy, the topic deleted
//! and re-created) must drain within its bound after every one of those faults, quarantining
//! only the rows made to fail; under `BlockKey` the stuck key's backlog must wait for the
//! operator's discard.
//!
//! The harness isolates itself from the rest of the suite (which shares the broker on port
//! 9092 and the `outbox_test` database): it starts its own Kafka node on free ports and creates
//! its own database, so it can run in parallel with the other tests. It needs the Kafka jars
//! (`source scripts/services.sh && resolve_jars kafka`; `scripts/test` does that).

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Mutex;

/// The runs take turns: each alone keeps 2 cores busy (several child processes and one
/// or three JVMs), and two at once would measure the machine rather than the framework.
static ONE_RUN_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The Postgres server the suite uses, pointed at its `postgres` maintenance database: the
/// harness creates (and drops) a database of its own there.
fn server_url() -> String {
    outbox_tests::database_url_for("postgres").unwrap_or_else(|e| panic!("{e:#}"))
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

/// Runs the harness with `profile` (seed 1), checks that it passed with nothing lost, doubled
/// or reordered, and returns the summary's fields.
fn run_profile(profile: &str) -> BTreeMap<String, String> {
    let _turn = ONE_RUN_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(["run", "--profile", profile, "--seed", "1"])
        // The URL carries a password: the environment, not the process list.
        .env("DATABASE_URL", server_url())
        .output()
        .expect("the harness starts");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail: String = {
        let lines: Vec<&str> = stderr.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    };
    println!("{}", stdout.trim());
    assert!(
        stdout.lines().any(|l| l.starts_with("chaos: ")),
        "the harness ended without its summary ({}); last log lines:\n{tail}",
        output.status
    );
    let fields = summary(&stdout);
    assert!(
        output.status.success(),
        "harness failed ({}); summary: {fields:?}\nlast log lines:\n{tail}",
        output.status
    );
    assert_eq!(fields.get("result").map(String::as_str), Some("PASS"));
    for zero in ["lost", "double_effects", "order_violations"] {
        assert_eq!(number(&fields, zero), 0, "{zero} must be 0: {fields:?}");
    }
    assert!(number(&fields, "events_committed") > 0);
    fields
}

/// Runs the harness with `profile` (seed 1), checks what every fault-loop profile must hold,
/// and returns the summary's fields.
fn run_harness(profile: &str) -> BTreeMap<String, String> {
    let fields = run_profile(profile);
    let kills = number(&fields, "kill_cycles");
    assert!(kills >= 50, "only {kills} kill cycles: {fields:?}");
    for broker_fault in ["broker_restart", "broker_kill9"] {
        assert!(
            number(&fields, broker_fault) >= 1,
            "no {broker_fault} in the run: {fields:?}"
        );
    }
    fields
}

fn seconds(fields: &BTreeMap<String, String>, key: &str) -> f64 {
    let value = fields
        .get(key)
        .unwrap_or_else(|| panic!("summary has no `{key}`: {fields:?}"));
    value
        .parse()
        .unwrap_or_else(|_| panic!("summary `{key}` is not a number of seconds: {value}"))
}

/// The profiles, in a module of their own: `scripts/test` runs them beside the rest of the
/// suite and skips `chaos_profiles::` in the main run.
mod chaos_profiles {
    use super::{number, run_harness, run_profile, seconds};

    #[test]
    fn ci_profile_keeps_every_guarantee_under_fifty_kill_cycles() {
        let fields = run_harness("ci");
        assert_eq!(fields.get("profile").map(String::as_str), Some("ci"));
        // The dispatcher fleet beside it: killed at random and after its calls, against a
        // billing API that fails, lags, stalls after applying and goes away; every committed
        // action charged once, in its key's order, with the charge's answer as its outcome.
        for zero in [
            "actions_lost",
            "actions_double_applied",
            "actions_out_of_order",
            "actions_phantom",
            "actions_bad_outcome",
        ] {
            assert_eq!(number(&fields, zero), 0, "{zero} must be 0: {fields:?}");
        }
        let actions = number(&fields, "actions_committed");
        assert!(
            actions >= 500,
            "only {actions} actions committed: {fields:?}"
        );
        assert_eq!(number(&fields, "charges"), actions, "{fields:?}");
        for fault in [
            "dispatcher_kill9",
            "dispatcher_after_call",
            "api_outage",
            "api_stall",
            "dispatcher_pg_terminate",
            "api_rate_limited",
            "pg_restart",
        ] {
            assert!(
                number(&fields, fault) >= 1,
                "no {fault} in the run: {fields:?}"
            );
        }
        // Retries and replays reached the API: more requests than charges.
        assert!(number(&fields, "api_requests") > actions, "{fields:?}");
    }

    #[test]
    fn cluster_profile_keeps_every_guarantee_when_partition_leaders_die() {
        let fields = run_harness("cluster");
        assert_eq!(fields.get("profile").map(String::as_str), Some("cluster"));
        let leader_faults = number(&fields, "broker_restart") + number(&fields, "broker_kill9");
        assert!(
            leader_faults >= 3,
            "only {leader_faults} partition leaders taken down: {fields:?}"
        );
        // Then one node of three down, with the topic taking writes and with it refusing them
        // (min.insync.replicas 3): Metadata answers throughout, and no row is charged for it.
        for fault in ["partial_outage", "isr_outage"] {
            assert_eq!(
                number(&fields, fault),
                1,
                "no {fault} in the run: {fields:?}"
            );
            seconds(&fields, &format!("liveness_{fault}_s"));
        }
        assert_eq!(number(&fields, "liveness_exceeded"), 0, "{fields:?}");
        assert_eq!(number(&fields, "outbox_quarantined"), 0, "{fields:?}");
    }

    #[test]
    fn liveness_profile_drains_within_the_bound_after_each_long_fault() {
        let fields = run_profile("liveness");
        assert_eq!(fields.get("profile").map(String::as_str), Some("liveness"));
        for fault in [
            "broker_outage",
            "pg_stop",
            "stuck_key",
            "blocked_key",
            "topic_recreate",
        ] {
            assert_eq!(
                number(&fields, fault),
                1,
                "no {fault} in the run: {fields:?}"
            );
            // Every long fault has its own figure.
            seconds(&fields, &format!("liveness_{fault}_s"));
        }
        let worst = seconds(&fields, "liveness_worst_s");
        let bound = seconds(&fields, "liveness_bound_s");
        assert!(
            worst <= bound,
            "liveness {worst} s over the bound {bound} s: {fields:?}"
        );
        assert_eq!(number(&fields, "liveness_exceeded"), 0);
        // A broker outage far longer than max_attempts x message.timeout.ms quarantines nothing;
        // the two rows made to fail for good (one per quarantine policy) are quarantined with
        // their reason, and under BlockKey nothing of the key went out before the discard.
        assert_eq!(number(&fields, "outbox_quarantined"), 0, "{fields:?}");
        assert_eq!(
            fields.get("expected_quarantined").map(String::as_str),
            Some("2/2"),
            "{fields:?}"
        );
        assert_eq!(number(&fields, "published_past_block"), 0, "{fields:?}");
    }
}
