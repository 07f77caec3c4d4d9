//! A deterministic stand-in for the language model.

use outbox_producer::{NewEvent, Outbox};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// A task the agent was given.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Task {
    /// The task's id.
    pub id: String,
    /// Who to invoice.
    pub customer: String,
    /// How much, in cents.
    pub cents: i64,
}

/// The tool call the model decides on: the intent the outbox stores and replays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInvoice {
    /// The task the decision belongs to.
    pub task: String,
    /// The invoice number.
    pub invoice: String,
    /// Who to charge.
    pub customer: String,
    /// How much, in cents.
    pub cents: i64,
}

/// What the billing handler decides once it has charged: a follow-up event, enqueued on the
/// handler's transaction, so it exists exactly when the charge is recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvoiceCharged {
    /// The task the charge belongs to.
    pub task: String,
    /// The invoice number.
    pub invoice: String,
    /// The billing service's charge id.
    pub charge_id: i64,
    /// How much, in cents.
    pub cents: i64,
}

/// The model. Every invocation is recorded outside any transaction, like the bill of a real
/// model API, so a crash cannot hide a call.
#[derive(Debug, Clone)]
pub struct Model {
    pool: PgPool,
}

impl Model {
    /// A model that records its calls in `model_calls`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Decides what to do about `task`.
    pub async fn decide(&self, task: &Task) -> sqlx::Result<SendInvoice> {
        sqlx::query("INSERT INTO model_calls (task) VALUES ($1)")
            .bind(&task.id)
            .execute(&self.pool)
            .await?;
        Ok(SendInvoice {
            task: task.id.clone(),
            invoice: format!("INV-{}", task.id),
            customer: task.customer.clone(),
            cents: task.cents,
        })
    }
}

/// The agent's turn: decides each new task (one model call each, recorded before the
/// transaction) and commits the task's state with the decided action, which `route` points at
/// its destination (a Kafka topic, or a dispatcher). `before_commit` and `after_commit` run
/// around the commit: the crash points there.
pub async fn decide_new_tasks(
    pool: &PgPool,
    route: impl Fn(NewEvent) -> Result<NewEvent, outbox_core::CoreError>,
    before_commit: impl Fn(),
    after_commit: impl Fn(),
) -> anyhow::Result<()> {
    let model = Model::new(pool.clone());
    let tasks: Vec<Task> = sqlx::query_as(
        "SELECT id, customer, cents FROM agent_tasks WHERE state = 'new' ORDER BY id",
    )
    .fetch_all(pool)
    .await?;
    for task in tasks {
        let decision = model.decide(&task).await?;
        let action = route(NewEvent::new(
            "invoice",
            &decision.invoice,
            "SendInvoice",
            &decision,
        )?)?;
        let mut tx = pool.begin().await?;
        sqlx::query("UPDATE agent_tasks SET state = 'decided', event_id = $2 WHERE id = $1")
            .bind(&task.id)
            .bind(action.id().as_uuid())
            .execute(&mut *tx)
            .await?;
        Outbox::default().enqueue(&mut tx, &action).await?;
        before_commit();
        tx.commit().await?;
        after_commit();
    }
    Ok(())
}
