//! A stand-in for an external payment API: its own storage, its own transactions, and
//! idempotency keys honoured the way payment APIs honour them.

use sqlx::PgPool;

use super::model::SendInvoice;

/// The billing service's client.
#[derive(Debug, Clone)]
pub struct Billing {
    pool: PgPool,
}

impl Billing {
    /// A client of the service whose tables live behind `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    /// Charges `invoice` and returns the charge id. A request repeating an idempotency key
    /// gets the first charge back instead of a second charge. Every request is logged, so the
    /// demo can show which requests were repeats.
    pub async fn charge(&self, idempotency_key: &str, invoice: &SendInvoice) -> sqlx::Result<i64> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT INTO billing_requests (idempotency_key, invoice) VALUES ($1, $2)")
            .bind(idempotency_key)
            .bind(&invoice.invoice)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO billing_charges (idempotency_key, invoice, cents) VALUES ($1, $2, $3)
             ON CONFLICT (idempotency_key) DO NOTHING",
        )
        .bind(idempotency_key)
        .bind(&invoice.invoice)
        .bind(invoice.cents)
        .execute(&mut *tx)
        .await?;
        let charge_id =
            sqlx::query_scalar("SELECT charge_id FROM billing_charges WHERE idempotency_key = $1")
                .bind(idempotency_key)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(charge_id)
    }
}
