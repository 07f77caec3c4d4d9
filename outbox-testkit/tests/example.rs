//! The example of docs/src/testing.md, run (tests/guide.rs checks the page shows this file).

use std::time::Duration;

use outbox_consumer::{ConsumerConfig, Event, HandlerError, Outcome};
use outbox_core::{NewEvent, TableNames};
use outbox_testkit::{EnqueuedStatus, HandlerKit, enqueued};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

// The application's handler. It adds to a balance, so running it twice would credit twice:
// the consumer's dedup transaction is what makes its effect happen once.
#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    cents: i64,
}

async fn credit(event: &Event<Deposit>, conn: &mut PgConnection) -> Result<(), HandlerError> {
    if event.payload.cents <= 0 {
        return Err(HandlerError::quarantine("a deposit must be positive"));
    }
    sqlx::query("UPDATE accounts SET cents = cents + $2 WHERE id = $1")
        .bind(&event.payload.account)
        .bind(event.payload.cents)
        .execute(conn)
        .await?;
    Ok(())
}

fn deposit(account: &str, cents: i64) -> NewEvent {
    let payload = serde_json::json!({ "account": account, "cents": cents });
    NewEvent::new("account", account, "Deposited", &payload).expect("a valid event")
}

#[tokio::test]
async fn each_deposit_is_credited_once() -> anyhow::Result<()> {
    let pool = test_database().await?;
    // Short retries for tests; the rest as in production.
    let config =
        ConsumerConfig::new("ledger").backoff(Duration::from_millis(1), Duration::from_millis(10));
    let mut kit = HandlerKit::new(pool.clone(), config, credit)?;

    // Delivered, then delivered again: credited once.
    let first = deposit("alice", 100);
    assert_eq!(kit.deliver(&first).await?, Outcome::Processed);
    assert_eq!(kit.deliver_again(&first).await?, Outcome::DuplicateCached);
    assert_eq!(balance(&pool, "alice").await?, 100);

    // A batch with a failing message: the others are credited, once each.
    let batch = [
        deposit("alice", 10),
        deposit("alice", -5),
        deposit("alice", 1),
    ];
    let outcomes = kit.deliver_batch(&batch).await?;
    assert_eq!(
        outcomes,
        [
            Outcome::Processed,
            Outcome::Quarantined("handler_rejected"),
            Outcome::Processed,
        ]
    );
    assert_eq!(balance(&pool, "alice").await?, 111);
    let quarantined = kit.quarantined().await?;
    assert_eq!(quarantined.len(), 1);
    assert_eq!(quarantined[0].event_id, Some(*batch[1].id().as_uuid()));

    // A crash between the commit and the offset store: the restarted consumer gets the
    // record again, and the dedup table says it was handled.
    let last = deposit("alice", 1000);
    let crash = kit.crash_after_commit_then_redeliver(&last).await?;
    assert_eq!(crash.before_crash, Outcome::Processed);
    assert_eq!(crash.after_restart, Outcome::DuplicateStored);
    assert_eq!(balance(&pool, "alice").await?, 1111);
    Ok(())
}

// The producer side: what the transaction enqueued, read without a relay.
#[tokio::test]
async fn a_refund_enqueues_its_event_with_the_state_change() -> anyhow::Result<()> {
    let pool = test_database().await?;
    let tables = TableNames::default();
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE accounts SET cents = cents - 5 WHERE id = 'alice'")
        .execute(&mut *tx)
        .await?;
    outbox_producer::enqueue(&mut tx, &deposit("bob", 5)).await?;
    let rows = enqueued(&mut tx, &tables).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].aggregate_id, "bob");
    assert_eq!(rows[0].status, EnqueuedStatus::Pending);
    tx.rollback().await?;
    assert!(
        enqueued(&mut *pool.acquire().await?, &tables)
            .await?
            .is_empty()
    );
    Ok(())
}

async fn balance(pool: &PgPool, account: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT cents FROM accounts WHERE id = $1")
        .bind(account)
        .fetch_one(pool)
        .await
}

/// A schema of its own for each test, with the framework's tables and the application's.
async fn test_database() -> anyhow::Result<PgPool> {
    let url = std::env::var("OUTBOX_TEST_DATABASE_URL")?;
    let options: PgConnectOptions = url.parse()?;
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let admin = PgPool::connect_with(options.clone()).await?;
    sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await?;
    admin.close().await;
    let pool = PgPoolOptions::new()
        .connect_with(options.options([("search_path", schema.as_str())]))
        .await?;
    outbox_consumer::migrate(&pool).await?;
    sqlx::query("CREATE TABLE accounts (id TEXT PRIMARY KEY, cents BIGINT NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO accounts VALUES ('alice', 0), ('bob', 0)")
        .execute(&pool)
        .await?;
    Ok(pool)
}
