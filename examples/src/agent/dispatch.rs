//! The agent without Kafka: decisions committed with their actions in the outbox, a
//! dispatcher calling the billing service over HTTP with the event id as `Idempotency-Key`,
//! and the agent's next turn reading the charge id from the stored outcome. The billing
//! service is a real local HTTP server ([`crate::billing_api`]) that lives in the demo's
//! process, so it outlives the worker processes the demo kills.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use outbox_producer::dispatch::{
    Action, ActionState, Dispatcher, DispatcherConfig, Executor, HttpExecutor, Outcome, outcome,
};
use outbox_producer::{EventId, TableNames};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::crash::CRASH_EXIT_CODE;
use super::model::decide_new_tasks;
use super::schema;
use crate::billing_api::BillingApi;

/// The destination the agent's actions are enqueued for.
pub const DESTINATION: &str = "billing";

/// Where a dispatch-mode worker dies (or, for [`DispatchCrash::LostResponse`], where the
/// billing service loses its answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DispatchCrash {
    /// State and the decided action are written, the transaction is not committed.
    BeforeCommit,
    /// The decision is committed; no call is made yet.
    AfterCommit,
    /// The billing service applied the charge; its answer has not reached the worker.
    DuringCall,
    /// The call answered; the dispatcher has not recorded the outcome.
    AfterCall,
    /// No crash: the billing service applies the charge and its answer never comes back
    /// (the call times out, its outcome unknown).
    LostResponse,
}

impl DispatchCrash {
    /// Every point, in the order the steps happen.
    pub const ALL: [DispatchCrash; 5] = [
        DispatchCrash::BeforeCommit,
        DispatchCrash::AfterCommit,
        DispatchCrash::DuringCall,
        DispatchCrash::AfterCall,
        DispatchCrash::LostResponse,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DispatchCrash::BeforeCommit => "before-commit",
            DispatchCrash::AfterCommit => "after-commit",
            DispatchCrash::DuringCall => "during-call",
            DispatchCrash::AfterCall => "after-call",
            DispatchCrash::LostResponse => "lost-response",
        }
    }

    /// What happens there.
    pub fn describe(self) -> &'static str {
        match self {
            DispatchCrash::BeforeCommit => "agent dies before committing state + decided action",
            DispatchCrash::AfterCommit => "agent dies right after committing, before any call",
            DispatchCrash::DuringCall => "dispatcher dies while the charge call is in flight",
            DispatchCrash::AfterCall => {
                "dispatcher dies after the call answered, before recording it"
            }
            DispatchCrash::LostResponse => {
                "the charge is applied, its answer lost: the call times out"
            }
        }
    }

    fn kills_the_worker(self) -> bool {
        self != DispatchCrash::LostResponse
    }
}

fn die(point: DispatchCrash) -> ! {
    eprintln!("   ** crash injected: {} **", point.describe());
    std::process::exit(CRASH_EXIT_CODE)
}

/// The agent's next turn: each decided task takes its charge id from its action's stored
/// outcome. Returns how many tasks are still waiting for theirs.
async fn take_outcomes(pool: &PgPool) -> Result<usize> {
    let decided: Vec<(String, uuid::Uuid)> =
        sqlx::query_as("SELECT id, event_id FROM agent_tasks WHERE state = 'decided'")
            .fetch_all(pool)
            .await?;
    let mut waiting = 0;
    for (task, event_id) in decided {
        let mut conn = pool.acquire().await?;
        match outcome(&mut conn, &TableNames::default(), EventId::from(event_id)).await? {
            Some(ActionState::Done(answer)) => {
                let charge = answer["charge_id"]
                    .as_str()
                    .context("the stored outcome has no charge_id")?;
                sqlx::query(
                    "UPDATE agent_tasks SET state = 'charged', charge_ref = $2 WHERE id = $1",
                )
                .bind(&task)
                .bind(charge)
                .execute(&mut *conn)
                .await?;
            }
            Some(ActionState::Pending { .. }) => waiting += 1,
            other => bail!("task {task}: its action ended {other:?}"),
        }
    }
    Ok(waiting)
}

/// The HTTP executor, with the crash points that need to see the call.
struct Calling {
    http: HttpExecutor,
    billing_url: String,
    crash: Option<DispatchCrash>,
}

impl Executor for Calling {
    async fn execute(&self, action: Action) -> Outcome {
        if self.crash != Some(DispatchCrash::DuringCall) {
            return self.http.execute(action).await;
        }
        // The service applies the charge and holds its answer back (the demo told it to):
        // die once the charge is in its ledger, the answer still on its way.
        let key = action.idempotency_key();
        let call = self.http.execute(action);
        let applied = async {
            loop {
                if charged_keys(&self.billing_url)
                    .await
                    .is_ok_and(|k| k.contains(&key))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            outcome = call => outcome,
            () = applied => die(DispatchCrash::DuringCall),
        }
    }
}

async fn charged_keys(billing_url: &str) -> Result<Vec<String>> {
    let charges: Vec<serde_json::Value> = reqwest::get(format!("{billing_url}/charges"))
        .await?
        .json()
        .await?;
    Ok(charges
        .iter()
        .filter_map(|c| c["idempotency_key"].as_str().map(str::to_owned))
        .collect())
}

/// One worker process: decide, dispatch, take the outcomes, until every task is charged.
pub async fn worker(pool: PgPool, billing_url: &str, crash: Option<DispatchCrash>) -> Result<()> {
    let die_at = |point| {
        if crash == Some(point) {
            die(point);
        }
    };
    decide_new_tasks(
        &pool,
        |action| action.for_dispatcher(DESTINATION),
        || die_at(DispatchCrash::BeforeCommit),
        || die_at(DispatchCrash::AfterCommit),
    )
    .await?;
    let executor = Calling {
        http: HttpExecutor::post_json(
            reqwest::Client::builder(),
            reqwest::Url::parse(&format!("{billing_url}/charges")).context("the billing URL")?,
        )?,
        billing_url: billing_url.to_owned(),
        crash,
    };
    let config = DispatcherConfig::new(DESTINATION)
        .max_in_flight(4)
        .batch_size(4)
        .call_timeout(Duration::from_secs(2))
        .backoff(Duration::from_millis(100), Duration::from_secs(1));
    let dispatcher = Dispatcher::new(pool.clone(), config, executor)?;
    if crash == Some(DispatchCrash::AfterCall) {
        dispatcher.crash_after_next_call();
        if dispatcher.run_once().await.is_err() {
            die(DispatchCrash::AfterCall);
        }
        bail!("the dispatcher was meant to crash after its call");
    }
    let shutdown = CancellationToken::new();
    let running = tokio::spawn({
        let (dispatcher, shutdown) = (dispatcher.clone(), shutdown.clone());
        async move { dispatcher.run(shutdown).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while take_outcomes(&pool).await? > 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "tasks still waiting for their charge after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await??;
    Ok(())
}

/// What one task looks like at the end.
#[derive(Debug, Clone)]
pub struct DispatchReport {
    /// The task.
    pub id: String,
    /// Its state (`charged` when done).
    pub state: String,
    /// How often the model was asked about it.
    pub model_calls: i64,
    /// Decided actions committed for it.
    pub decisions: i64,
    /// Requests the billing service received for its action.
    pub requests: u64,
    /// Charges the billing service applied for it.
    pub charges: usize,
    /// Whether the task holds the charge id of the one charge its action made.
    pub consistent: bool,
}

/// A task as the agent's tables hold it.
#[derive(Debug, sqlx::FromRow)]
struct TaskRow {
    id: String,
    state: String,
    event_id: Option<uuid::Uuid>,
    charge_ref: Option<String>,
    model_calls: i64,
    decisions: i64,
}

/// Runs the dispatch-mode scenarios in child processes against a billing service of its own.
#[derive(Debug, Clone)]
pub struct DispatchScenario {
    /// The Postgres server and database.
    pub database_url: String,
    /// The schema the scenario recreates and works in.
    pub schema: String,
    /// The `agent` executable, started as `agent dispatch-worker ...`.
    pub worker_exe: std::path::PathBuf,
}

impl DispatchScenario {
    /// Crashes a worker at `crash` (or runs cleanly), restarts it, and checks the end state.
    pub async fn run(&self, crash: Option<DispatchCrash>) -> Result<Vec<DispatchReport>> {
        schema::reset(&self.database_url, &self.schema).await?;
        let pool = schema::connect(&self.database_url, &self.schema, 1).await?;
        sqlx::query("ALTER TABLE agent_tasks ADD COLUMN charge_ref TEXT")
            .execute(&pool)
            .await?;
        let billing = BillingApi::start().await?;
        if matches!(
            crash,
            Some(DispatchCrash::DuringCall | DispatchCrash::LostResponse)
        ) {
            billing.apply_then_stall(1);
        }
        match crash {
            Some(point) if point.kills_the_worker() => {
                let status = self.worker(&billing.url(), Some(point)).await?;
                ensure!(
                    status.code() == Some(CRASH_EXIT_CODE),
                    "the worker should have crashed at {}, but ended with {status}",
                    point.name()
                );
                println!("   restarting the worker");
            }
            _ => {}
        }
        let status = self.worker(&billing.url(), None).await?;
        ensure!(status.success(), "the worker failed: {status}");
        let report = self.report(&pool, &billing).await;
        pool.close().await;
        let report = report?;
        check(&report, crash)?;
        Ok(report)
    }

    async fn worker(
        &self,
        billing_url: &str,
        crash: Option<DispatchCrash>,
    ) -> Result<std::process::ExitStatus> {
        let mut command = tokio::process::Command::new(&self.worker_exe);
        command
            .arg("dispatch-worker")
            .env("DATABASE_URL", &self.database_url)
            .args(["--schema", &self.schema])
            .args(["--billing-url", billing_url])
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(point) = crash {
            command.args(["--crash-at", point.name()]);
        }
        let mut child = command.spawn().context("starting the worker process")?;
        match tokio::time::timeout(Duration::from_secs(120), child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => bail!("the worker did not finish within 2 minutes"),
        }
    }

    async fn report(&self, pool: &PgPool, billing: &BillingApi) -> Result<Vec<DispatchReport>> {
        let rows: Vec<TaskRow> = sqlx::query_as(
            "SELECT t.id, t.state, t.event_id, t.charge_ref,
                (SELECT count(*) FROM model_calls m WHERE m.task = t.id) AS model_calls,
                (SELECT count(*) FROM outbox_events o WHERE o.aggregateid = 'INV-' || t.id) AS decisions
             FROM agent_tasks t ORDER BY t.id",
        )
        .fetch_all(pool)
        .await?;
        let (charges, requests) = (billing.charges(), billing.requests());
        Ok(rows
            .into_iter()
            .map(|row| {
                let TaskRow {
                    id,
                    state,
                    event_id,
                    charge_ref,
                    model_calls,
                    decisions,
                } = row;
                let key = event_id.map(|e| e.to_string()).unwrap_or_default();
                let mine: Vec<_> = charges
                    .iter()
                    .filter(|c| c.idempotency_key == key)
                    .collect();
                let consistent =
                    mine.len() == 1 && charge_ref.as_deref() == Some(&mine[0].charge_id);
                DispatchReport {
                    charges: charges
                        .iter()
                        .filter(|c| c.invoice == format!("INV-{id}"))
                        .count(),
                    requests: requests.for_key(&key),
                    id,
                    state,
                    model_calls,
                    decisions,
                    consistent,
                }
            })
            .collect())
    }
}

fn check(report: &[DispatchReport], crash: Option<DispatchCrash>) -> Result<()> {
    ensure!(
        report.len() == schema::TASKS.len(),
        "tasks went missing: {report:?}"
    );
    for (i, task) in report.iter().enumerate() {
        let lost_decisions = i64::from(i == 0 && crash == Some(DispatchCrash::BeforeCommit));
        super::scenario::charged_once(
            &task.id,
            &task.state,
            task.decisions,
            i64::try_from(task.charges)?,
            task.model_calls,
            lost_decisions,
        )?;
        ensure!(
            task.consistent,
            "{}: task, action and charge disagree",
            task.id
        );
    }
    Ok(())
}

/// Prints the end state as a table.
pub fn print_dispatch_report(report: &[DispatchReport]) {
    println!("   task  state    model calls  decisions  billing requests  charges");
    for t in report {
        println!(
            "   {:<5} {:<8} {:>11}  {:>9}  {:>16}  {:>7}",
            t.id, t.state, t.model_calls, t.decisions, t.requests, t.charges
        );
    }
}
