//! The agent without Kafka, crashed at every step between its decision and the charge: each
//! scenario runs the real `agent` binary as worker processes (a crashing one, then a
//! restarted one) against the real PostgreSQL and a real local HTTP billing service, and
//! checks one model call per committed decision, one charge per invoice, and the task holding
//! the charge id its action's stored outcome gave it.

use anyhow::{Result, ensure};
use outbox_examples::agent::dispatch::{DispatchCrash, DispatchScenario};
use outbox_tests::{database_url, unique};

/// Runs `crash` and returns the billing requests each task's action made.
async fn requests(crash: Option<DispatchCrash>) -> Result<Vec<u64>> {
    let scenario = DispatchScenario {
        database_url: database_url(),
        schema: unique("dagent"),
        worker_exe: env!("CARGO_BIN_EXE_agent").into(),
    };
    let report = scenario.run(crash).await?;
    for task in &report {
        ensure!(task.charges == 1 && task.consistent, "{task:?}");
    }
    Ok(report.iter().map(|t| t.requests).collect())
}

#[tokio::test]
async fn a_crash_before_or_after_the_commit_makes_one_request_per_action() -> Result<()> {
    for crash in [
        None,
        Some(DispatchCrash::BeforeCommit),
        Some(DispatchCrash::AfterCommit),
    ] {
        assert_eq!(requests(crash).await?, [1, 1, 1], "{crash:?}");
    }
    Ok(())
}

#[tokio::test]
async fn a_crash_after_the_call_repeats_it_with_the_same_key_and_charges_once() -> Result<()> {
    // The batch's three calls were answered; none was recorded.
    assert_eq!(requests(Some(DispatchCrash::AfterCall)).await?, [2, 2, 2]);
    Ok(())
}

#[tokio::test]
async fn a_crash_during_the_call_repeats_it_with_the_same_key_and_charges_once() -> Result<()> {
    // The call in flight is made again; the batch's other calls too when they had gone out.
    let requests = requests(Some(DispatchCrash::DuringCall)).await?;
    ensure!(
        requests.contains(&2) && requests.iter().all(|&n| (1..=2).contains(&n)),
        "{requests:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_lost_response_is_retried_with_the_same_key_and_charges_once() -> Result<()> {
    let mut requests = requests(Some(DispatchCrash::LostResponse)).await?;
    requests.sort_unstable();
    assert_eq!(requests, [1, 1, 2]);
    Ok(())
}
