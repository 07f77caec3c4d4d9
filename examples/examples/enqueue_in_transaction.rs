//! Enqueue in your transaction: the state change and the decided event commit together, or
//! neither does. Run: `cargo run -p outbox-examples --example enqueue_in_transaction` (needs
//! `DATABASE_URL`; no Kafka).

use anyhow::Result;
use outbox_producer::{NewEvent, TableNames};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<()> {
    let pool = outbox_examples::setup::database("ex_enqueue").await?;
    sqlx::query("CREATE TABLE invoices (id TEXT PRIMARY KEY, state TEXT NOT NULL)")
        .execute(&pool)
        .await?;

    // Committed: the row and its event.
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO invoices VALUES ('inv-1', 'decided')")
        .execute(&mut *tx)
        .await?;
    let event = NewEvent::new(
        "invoice",
        "inv-1",
        "InvoiceDecided",
        &json!({ "cents": 1200 }),
    )?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;

    // Rolled back: neither the row nor its event.
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO invoices VALUES ('inv-2', 'decided')")
        .execute(&mut *tx)
        .await?;
    let event = NewEvent::new(
        "invoice",
        "inv-2",
        "InvoiceDecided",
        &json!({ "cents": 3400 }),
    )?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.rollback().await?;

    let mut conn = pool.acquire().await?;
    let stats = outbox_producer::stats(&mut conn, &TableNames::default()).await?;
    println!(
        "pending events: {} (inv-1's; inv-2's rolled back with it)",
        stats.pending
    );
    anyhow::ensure!(stats.pending == 1);
    Ok(())
}
