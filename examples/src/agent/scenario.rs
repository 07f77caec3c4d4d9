//! Runs the worker as real child processes, one crashing and one restarted, then checks that
//! every decision was made once and every invoice charged once.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use sqlx::PgPool;

use super::crash::{CRASH_EXIT_CODE, CrashPoint};
use super::schema;

/// Where one scenario runs.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// The Postgres server and database.
    pub database_url: String,
    /// The schema the scenario recreates and works in.
    pub schema: String,
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// The `agent` executable, started as `agent worker ...`.
    pub worker_exe: std::path::PathBuf,
}

/// The topic the billing handler's follow-up events go to, next to the decisions' `topic`.
pub fn charged_topic(topic: &str) -> String {
    format!("{topic}.charged")
}

/// What one task looks like at the end.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskReport {
    /// The task.
    pub id: String,
    /// Its state (`charged` when done).
    pub state: String,
    /// How often the model was asked about it.
    pub model_calls: i64,
    /// How many decisions (outbox events) were committed for it.
    pub decisions: i64,
    /// How many requests reached the billing service for it.
    pub billing_requests: i64,
    /// How many charges the billing service made for it.
    pub charges: i64,
    /// How many `InvoiceCharged` follow-ups the billing handler enqueued for it.
    pub follow_ups: i64,
    /// How many receipts the downstream consumer recorded for it.
    pub receipts: i64,
    /// Whether the task, its event and its charge point at each other.
    pub consistent: bool,
}

impl Scenario {
    /// Crashes a worker at `crash` (or runs it cleanly with `None`), restarts it, and checks
    /// the end state.
    pub async fn run(&self, crash: Option<CrashPoint>) -> Result<Vec<TaskReport>> {
        schema::reset(&self.database_url, &self.schema).await?;
        let run = uuid::Uuid::new_v4().simple().to_string();
        let topic = format!("agent.invoices.{run}");
        let group = format!("billing-{run}");
        create_topic(&self.brokers, &topic).await?;
        create_topic(&self.brokers, &charged_topic(&topic)).await?;

        if let Some(point) = crash {
            let status = self.worker(&topic, &group, Some(point)).await?;
            ensure!(
                status.code() == Some(CRASH_EXIT_CODE),
                "the worker should have crashed at {}, but ended with {status}",
                point.name()
            );
            println!("   restarting the worker");
        }
        let status = self.worker(&topic, &group, None).await?;
        ensure!(status.success(), "the restarted worker failed: {status}");

        let pool = schema::connect(&self.database_url, &self.schema, 1).await?;
        let report = task_reports(&pool).await;
        pool.close().await;
        let report = report?;
        check(&report, crash)?;
        Ok(report)
    }

    async fn worker(
        &self,
        topic: &str,
        group: &str,
        crash: Option<CrashPoint>,
    ) -> Result<std::process::ExitStatus> {
        let mut command = tokio::process::Command::new(&self.worker_exe);
        command
            .arg("worker")
            // The URL may carry a password: the environment, not the process list.
            .env("DATABASE_URL", &self.database_url)
            .args(["--schema", &self.schema])
            .args(["--brokers", &self.brokers])
            .args(["--topic", topic])
            .args(["--group", group])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(point) = crash {
            command.args(["--crash-at", point.name()]);
        }
        let mut child = command.spawn().context("starting the worker process")?;
        match tokio::time::timeout(Duration::from_secs(180), child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => bail!("the worker did not finish within 3 minutes"),
        }
    }
}

async fn task_reports(pool: &PgPool) -> Result<Vec<TaskReport>> {
    Ok(sqlx::query_as(
        "SELECT t.id, t.state,
            (SELECT count(*) FROM model_calls m WHERE m.task = t.id) AS model_calls,
            (SELECT count(*) FROM outbox_events o WHERE o.aggregateid = 'INV-' || t.id AND o.type = 'SendInvoice') AS decisions,
            (SELECT count(*) FROM billing_requests r WHERE r.invoice = 'INV-' || t.id) AS billing_requests,
            (SELECT count(*) FROM billing_charges c WHERE c.invoice = 'INV-' || t.id) AS charges,
            (SELECT count(*) FROM outbox_events o WHERE o.aggregateid = 'INV-' || t.id AND o.type = 'InvoiceCharged') AS follow_ups,
            (SELECT count(*) FROM agent_receipts r WHERE r.invoice = 'INV-' || t.id) AS receipts,
            EXISTS (SELECT 1 FROM outbox_events o JOIN billing_charges c
                      ON c.idempotency_key = o.id::text AND c.charge_id = t.charge_id
                    WHERE o.id = t.event_id) AS consistent
         FROM agent_tasks t ORDER BY t.id",
    )
    .fetch_all(pool)
    .await?)
}

/// What both demos promise of every task: charged, by one committed decision and one charge,
/// and the model asked again only about a decision the crash destroyed before its commit.
pub(super) fn charged_once(
    id: &str,
    state: &str,
    decisions: i64,
    charges: i64,
    model_calls: i64,
    lost_decisions: i64,
) -> Result<()> {
    ensure!(state == "charged", "{id} ended {state}");
    ensure!(decisions == 1, "{id} has {decisions} decisions");
    ensure!(charges == 1, "{id} was charged {charges}x");
    ensure!(
        model_calls == decisions + lost_decisions,
        "{id}: the model was asked {model_calls}x for {decisions} committed decision(s)"
    );
    Ok(())
}

/// The promises: one decision and one charge per task, state consistent, and the model asked
/// again only about a decision the crash destroyed before it committed.
fn check(report: &[TaskReport], crash: Option<CrashPoint>) -> Result<()> {
    ensure!(
        report.len() == schema::TASKS.len(),
        "tasks went missing: {report:?}"
    );
    for (i, task) in report.iter().enumerate() {
        // The first task's uncommitted decision died with the process, so it was decided anew.
        let lost_decisions = i64::from(i == 0 && crash == Some(CrashPoint::BeforeCommit));
        charged_once(
            &task.id,
            &task.state,
            task.decisions,
            task.charges,
            task.model_calls,
            lost_decisions,
        )?;
        ensure!(
            task.follow_ups == 1 && task.receipts == 1,
            "{}: {} InvoiceCharged follow-ups enqueued, {} receipts recorded (one each expected)",
            task.id,
            task.follow_ups,
            task.receipts
        );
        ensure!(
            task.consistent,
            "{}: task, event and charge disagree",
            task.id
        );
    }
    Ok(())
}

/// Prints the end state as a table.
pub fn print_report(report: &[TaskReport]) {
    println!(
        "   task  state    model calls  decisions  billing requests  charges  follow-ups  receipts"
    );
    for t in report {
        println!(
            "   {:<5} {:<8} {:>11}  {:>9}  {:>16}  {:>7}  {:>10}  {:>8}",
            t.id,
            t.state,
            t.model_calls,
            t.decisions,
            t.billing_requests,
            t.charges,
            t.follow_ups,
            t.receipts
        );
    }
}

async fn create_topic(brokers: &str, topic: &str) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, 2, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .context("creating the topic (is the broker up? scripts/demo starts it)")?;
    for result in results {
        result.map_err(|(name, code)| anyhow::anyhow!("creating topic {name}: {code}"))?;
    }
    Ok(())
}
