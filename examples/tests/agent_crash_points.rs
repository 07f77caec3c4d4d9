//! The agent demo crashed at every step: each scenario runs the real `agent` binary (a crashing
//! worker process, then a restarted one) against Postgres and the broker, and the test reads
//! the end state back itself.

use anyhow::{Result, ensure};
use outbox_tests::{database_url, kafka_bootstrap, unique};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// What one scenario must leave behind, besides one charge per task.
struct Expect {
    crash_at: &'static str,
    /// Model calls over all three tasks: one per decision, plus a decision lost uncommitted.
    model_calls: i64,
    /// Requests the billing service received: a repeat only when the handler died after
    /// charging, where the idempotency key makes the repeat harmless.
    billing_requests: i64,
}

async fn scenario(expect: Expect) -> Result<()> {
    let schema = unique("agent");
    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_agent"))
        .args(["--crash-at", expect.crash_at])
        .args(["--schema", &schema])
        .env("DATABASE_URL", database_url())
        .args(["--brokers", &kafka_bootstrap()])
        .status()
        .await?;
    ensure!(
        status.success(),
        "agent --crash-at {} failed: {status}",
        expect.crash_at
    );

    let options: PgConnectOptions = database_url().parse()?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    let charges: Vec<(String, i64)> = sqlx::query_as(
        "SELECT invoice, count(*) FROM billing_charges GROUP BY invoice ORDER BY invoice",
    )
    .fetch_all(&pool)
    .await?;
    ensure!(
        charges
            == [
                ("INV-t1".into(), 1),
                ("INV-t2".into(), 1),
                ("INV-t3".into(), 1)
            ],
        "charges: {charges:?}"
    );
    let (uncharged, model_calls, requests, decisions, pending): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM agent_tasks WHERE state <> 'charged'),
                    (SELECT count(*) FROM model_calls),
                    (SELECT count(*) FROM billing_requests),
                    (SELECT count(*) FROM outbox_events WHERE type = 'SendInvoice'),
                    (SELECT count(*) FROM outbox_events WHERE status <> 'published')",
        )
        .fetch_one(&pool)
        .await?;
    ensure!(uncharged == 0, "{uncharged} tasks not charged");
    ensure!(
        decisions == 3 && pending == 0,
        "{decisions} decisions, {pending} not published"
    );
    // The billing handler's follow-up, enqueued on its dedup transaction: once per charge in
    // the outbox, whatever was redelivered or crashed, and handled once downstream.
    let chained: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT c.invoice,
                (SELECT count(*) FROM outbox_events o
                  WHERE o.type = 'InvoiceCharged' AND o.aggregateid = c.invoice),
                (SELECT count(*) FROM agent_receipts r WHERE r.invoice = c.invoice)
           FROM billing_charges c ORDER BY c.invoice",
    )
    .fetch_all(&pool)
    .await?;
    ensure!(
        chained
            == [
                ("INV-t1".into(), 1, 1),
                ("INV-t2".into(), 1, 1),
                ("INV-t3".into(), 1, 1)
            ],
        "follow-ups and receipts per invoice: {chained:?}"
    );
    ensure!(
        model_calls == expect.model_calls,
        "model called {model_calls}x, expected {}",
        expect.model_calls
    );
    ensure!(
        requests == expect.billing_requests,
        "billing saw {requests} requests, expected {}",
        expect.billing_requests
    );
    Ok(())
}

#[tokio::test]
async fn no_crash() -> Result<()> {
    scenario(Expect {
        crash_at: "none",
        model_calls: 3,
        billing_requests: 3,
    })
    .await
}

#[tokio::test]
async fn crash_before_commit_loses_only_the_uncommitted_decision() -> Result<()> {
    scenario(Expect {
        crash_at: "before-commit",
        model_calls: 4,
        billing_requests: 3,
    })
    .await
}

#[tokio::test]
async fn crash_after_commit_publishes_the_stored_decision_without_asking_again() -> Result<()> {
    scenario(Expect {
        crash_at: "after-commit",
        model_calls: 3,
        billing_requests: 3,
    })
    .await
}

#[tokio::test]
async fn crash_after_publish_before_mark_republishes_and_dedups() -> Result<()> {
    scenario(Expect {
        crash_at: "after-publish",
        model_calls: 3,
        billing_requests: 3,
    })
    .await
}

#[tokio::test]
async fn crash_in_handler_repeats_the_call_under_the_same_idempotency_key() -> Result<()> {
    scenario(Expect {
        crash_at: "in-handler",
        model_calls: 3,
        billing_requests: 4,
    })
    .await
}

#[tokio::test]
async fn crash_after_handler_commit_skips_the_redelivery() -> Result<()> {
    scenario(Expect {
        crash_at: "after-handler-commit",
        model_calls: 3,
        billing_requests: 3,
    })
    .await
}
