//! The kit's producer side against the real PostgreSQL: what a transaction enqueued, read
//! without a relay, before it commits, after it rolls back, after it commits; under custom
//! table names; and handed on to a handler.

use anyhow::Result;
use outbox_consumer::{ConsumerConfig, Event, Outcome, boxed};
use outbox_core::{NewEvent, TableNames};
use outbox_producer::Outbox;
use outbox_testkit::{EnqueuedStatus, HandlerKit, RawRecord, enqueued};
use outbox_tests::TestDb;

fn invoice(id: &str, cents: i64) -> Result<NewEvent> {
    Ok(NewEvent::new(
        "invoice",
        id,
        "InvoiceRequested",
        &serde_json::json!({ "cents": cents }),
    )?)
}

#[tokio::test]
async fn a_transactions_rows_are_read_before_it_commits_and_none_after_it_rolls_back() -> Result<()>
{
    let db = TestDb::new().await?;
    let tables = TableNames::default();
    let first = invoice("inv-1", 1200)?.with_header("tenant", "acme")?;
    let second = invoice("inv-2", 5)?.with_topic("billing.requests")?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue_all(&mut tx, &[first.clone(), second.clone()]).await?;

    let rows = enqueued(&mut tx, &tables).await?;
    assert_eq!(rows.len(), 2);
    assert!(rows[0].seq < rows[1].seq, "in enqueue order");
    let (row, event) = (&rows[0], &first);
    assert_eq!(row.id, event.id());
    assert_eq!(row.aggregate_type, "invoice");
    assert_eq!(row.aggregate_id, "inv-1");
    assert_eq!(row.event_type, "InvoiceRequested");
    assert_eq!(row.payload, serde_json::json!({ "cents": 1200 }));
    assert_eq!(row.headers["tenant"], "acme");
    assert_eq!(row.topic, "outbox.event.invoice");
    assert_eq!(row.status, EnqueuedStatus::Pending);
    assert_eq!(rows[1].topic, "billing.requests");
    assert_eq!(rows[1].headers, serde_json::json!({}));

    // Another connection sees nothing before the commit.
    assert!(
        enqueued(&mut *db.pool.acquire().await?, &tables)
            .await?
            .is_empty()
    );
    tx.rollback().await?;
    assert!(
        enqueued(&mut *db.pool.acquire().await?, &tables)
            .await?
            .is_empty()
    );
    Ok(())
}

#[tokio::test]
async fn committed_rows_read_back_pending_and_feed_a_handler() -> Result<()> {
    let db = TestDb::new().await?;
    let tables = TableNames::default();
    sqlx::query("CREATE TABLE seen (id UUID NOT NULL, tenant TEXT)")
        .execute(&db.pool)
        .await?;
    let event = invoice("inv-1", 1200)?.with_header("tenant", "acme")?;
    let mut tx = db.pool.begin().await?;
    outbox_producer::enqueue(&mut tx, &event).await?;
    tx.commit().await?;

    let mut conn = db.pool.acquire().await?;
    let rows = enqueued(&mut conn, &tables).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].status, EnqueuedStatus::Pending);
    let read = rows[0].to_event()?;
    assert_eq!(read, event, "the row holds the event as enqueued");

    // Producer to handler, without Kafka.
    let handler = boxed(|event: &Event<serde_json::Value>, conn| {
        Box::pin(async move {
            sqlx::query("INSERT INTO seen (id, tenant) VALUES ($1, $2)")
                .bind(event.id)
                .bind(event.headers.get("tenant").cloned())
                .execute(conn)
                .await?;
            Ok(())
        })
    });
    let mut kit = HandlerKit::new(db.pool.clone(), ConsumerConfig::new("billing"), handler)?;
    assert_eq!(kit.deliver(&read).await?, Outcome::Processed);
    let seen: Vec<(uuid::Uuid, Option<String>)> = sqlx::query_as("SELECT id, tenant FROM seen")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(seen, [(*event.id().as_uuid(), Some("acme".to_owned()))]);

    // The status as the relay leaves it.
    sqlx::query("UPDATE outbox_events SET status = 'published'")
        .execute(&mut *conn)
        .await?;
    assert_eq!(
        enqueued(&mut conn, &tables).await?[0].status,
        EnqueuedStatus::Published
    );
    sqlx::query("UPDATE outbox_events SET status = 'quarantined', headers = '[1]'")
        .execute(&mut *conn)
        .await?;
    let rows = enqueued(&mut conn, &tables).await?;
    assert_eq!(rows[0].status, EnqueuedStatus::Quarantined);
    assert!(
        rows[0].to_event().is_err(),
        "headers that are not an object"
    );
    Ok(())
}

#[tokio::test]
async fn custom_table_names_are_read_where_the_application_writes() -> Result<()> {
    let db = TestDb::new().await?;
    let names = TableNames::default()
        .with_outbox("shop_outbox")?
        .with_consumer_tables("shop_dedup", "shop_quarantine")?;
    outbox_core::migrate_with(&db.pool, &names).await?;
    let event = invoice("inv-1", 1)?;
    let mut tx = db.pool.begin().await?;
    Outbox::new(&names).enqueue(&mut tx, &event).await?;
    assert_eq!(enqueued(&mut tx, &names).await?.len(), 1);
    assert!(enqueued(&mut tx, &TableNames::default()).await?.is_empty());
    tx.commit().await?;

    let handler = boxed(|_: &Event<serde_json::Value>, _| Box::pin(async { Ok(()) }));
    let mut kit = HandlerKit::new(
        db.pool.clone(),
        ConsumerConfig::new("shop").tables(names.clone()),
        handler,
    )?;
    assert_eq!(kit.deliver(&event).await?, Outcome::Processed);
    assert!(kit.is_recorded(event.id()).await?);
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM shop_dedup")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(recorded, 1);
    let poison = RawRecord::from(&invoice("inv-2", 2)?).with_payload("not json");
    assert_eq!(
        kit.deliver_raw(poison).await?,
        Outcome::Quarantined("invalid_json")
    );
    assert_eq!(kit.quarantined().await?.len(), 1);
    let default_rows: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox_consumer_dedup) \
         + (SELECT count(*) FROM outbox_consumer_quarantine)",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(default_rows, 0, "the default tables were not used");
    Ok(())
}
