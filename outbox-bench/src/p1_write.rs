//! P1: what `enqueue` adds to a state-changing transaction.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use outbox_producer::{NewEvent, Outbox};
use outbox_tests::TestDb;
use serde_json::json;
use sqlx::PgPool;

use crate::Settings;
use crate::sample::{Figure, Sample};

const ACCOUNTS: i64 = 1_000;

/// What the library sends for one event, issued by hand: the baseline for library overhead.
const RAW_INSERT: &str = "WITH lock AS (SELECT pg_advisory_xact_lock(hashtext('outbox_events'), hashtext($3))), \
    ins AS (INSERT INTO outbox_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
    SELECT $1, $2, $3, $4, $5, $6, $7 FROM lock RETURNING 1) \
    SELECT pg_notify('outbox_' || 'outbox_events'::regclass::oid::text, '') FROM (SELECT 1 FROM ins LIMIT 1) AS written";

/// The floor: the same row into a table with no index, no lock and no NOTIFY. What any second
/// row in the transaction costs Postgres, whatever writes it.
const BARE_INSERT: &str = "INSERT INTO bare_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
    VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// The bare row with the one thing any outbox row needs: a generated, indexed sequence number
/// to publish in order by.
const KEYED_INSERT: &str = "INSERT INTO keyed_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
    VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// The floor of `enqueue` with its default wake-up: the keyed row plus a NOTIFY. Postgres
/// serializes the commits of notifying transactions on one global lock, whatever they write.
const KEYED_INSERT_NOTIFY: &str = "WITH ins AS (INSERT INTO keyed_events (id, aggregatetype, aggregateid, type, payload, headers, topic) \
    VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING 1) \
    SELECT pg_notify('outbox_bench_keyed', '') FROM (SELECT 1 FROM ins LIMIT 1) AS written";

/// The state update, alone or with an outbox write.
#[derive(Debug, Clone, Copy)]
enum Variant {
    Alone,
    WithEnqueue,
    WithQuietEnqueue,
    /// Neither NOTIFY nor the per-key lock.
    WithLeanEnqueue,
    WithRawSql,
    WithBareInsert,
    WithKeyedInsert,
    WithKeyedInsertNotify,
}

/// Every variant, in the order each round measures them.
const VARIANTS: [Variant; 8] = [
    Variant::Alone,
    Variant::WithEnqueue,
    Variant::WithQuietEnqueue,
    Variant::WithLeanEnqueue,
    Variant::WithRawSql,
    Variant::WithBareInsert,
    Variant::WithKeyedInsert,
    Variant::WithKeyedInsertNotify,
];

pub(crate) async fn run(settings: &Settings) -> Result<Vec<Figure>> {
    let db = TestDb::with_pool_size(settings.clients as u32 + 1).await?;
    sqlx::query("CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)")
        .execute(&db.pool)
        .await?;
    sqlx::query("INSERT INTO accounts SELECT g, 0 FROM generate_series(1, $1) g")
        .bind(ACCOUNTS)
        .execute(&db.pool)
        .await?;
    sqlx::query(
        "CREATE TABLE bare_events (id UUID, aggregatetype TEXT, aggregateid TEXT, type TEXT, \
         payload JSONB, headers JSONB, topic TEXT, created_at TIMESTAMPTZ DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    sqlx::query(
        "CREATE TABLE keyed_events (seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
         id UUID, aggregatetype TEXT, aggregateid TEXT, type TEXT, payload JSONB, headers JSONB, \
         topic TEXT, created_at TIMESTAMPTZ DEFAULT now())",
    )
    .execute(&db.pool)
    .await?;
    let mut samples: [Sample; 8] = Default::default();
    for round in 0..settings.rounds {
        // Interleaved, so drift (autovacuum, table growth, a busy core) hits every variant alike.
        for (variant, sample) in VARIANTS.iter().zip(&mut samples) {
            sample.push(rate(&db.pool, *variant, settings).await?);
        }
        let rates: Vec<String> = VARIANTS
            .iter()
            .zip(&samples)
            .map(|(variant, sample)| format!("{variant:?} {:.0}", sample.values[round]))
            .collect();
        eprintln!("P1 round {round} (tx/s): {}", rates.join(", "));
    }
    let [state, enqueue, quiet, lean, raw, bare, keyed, keyed_notify] = samples;
    Ok(vec![
        Figure::at_least(
            "P1",
            "state + enqueue",
            "tx/s",
            enqueue.clone(),
            "state alone",
            state.clone(),
            Some(0.8),
        ),
        Figure::at_least(
            "P1",
            "state + enqueue, notify(false)",
            "tx/s",
            quiet.clone(),
            "state alone",
            state.clone(),
            Some(0.8),
        ),
        Figure::at_least(
            "P1",
            "state + enqueue, no notify, no key lock",
            "tx/s",
            lean,
            "state alone",
            state.clone(),
            None,
        ),
        Figure::at_least(
            "P1",
            "state + bare row, no key/index/lock/notify",
            "tx/s",
            bare,
            "state alone",
            state.clone(),
            None,
        ),
        Figure::at_least(
            "P1",
            "state + keyed row (identity primary key)",
            "tx/s",
            keyed.clone(),
            "state alone",
            state.clone(),
            None,
        ),
        Figure::at_least(
            "P1",
            "state + enqueue, notify(false)",
            "tx/s",
            quiet.clone(),
            "state + keyed row (identity primary key)",
            keyed,
            None,
        ),
        Figure::at_least(
            "P1",
            "state + keyed row + NOTIFY",
            "tx/s",
            keyed_notify.clone(),
            "state alone",
            state,
            None,
        ),
        Figure::at_least(
            "P1",
            "state + enqueue",
            "tx/s",
            enqueue.clone(),
            "state + keyed row + NOTIFY (its floor)",
            keyed_notify,
            None,
        ),
        Figure::at_least(
            "P1",
            "state + enqueue",
            "tx/s",
            enqueue,
            "state + same SQL, raw",
            raw,
            Some(0.95),
        ),
    ])
}

/// Transactions per second of `variant` from `settings.clients` concurrent connections.
async fn rate(pool: &PgPool, variant: Variant, settings: &Settings) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + settings.duration;
    let clients: Vec<_> = (0..settings.clients)
        .map(|c| {
            let (pool, done) = (pool.clone(), Arc::clone(&done));
            tokio::spawn(async move {
                let quiet = matches!(
                    variant,
                    Variant::WithQuietEnqueue | Variant::WithLeanEnqueue
                );
                let outbox = Outbox::default()
                    .notify(!quiet)
                    .lock_per_key(!matches!(variant, Variant::WithLeanEnqueue));
                let mut i = c as i64;
                while Instant::now() < deadline {
                    one_transaction(&pool, &outbox, variant, i % ACCOUNTS + 1).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 7;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for c in clients {
        c.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64
        / started
            .elapsed()
            .max(Duration::from_millis(1))
            .as_secs_f64())
}

async fn one_transaction(
    pool: &PgPool,
    outbox: &Outbox,
    variant: Variant,
    account: i64,
) -> Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
        .bind(account)
        .execute(&mut *tx)
        .await?;
    let key = account.to_string();
    let payload = json!({ "account": account, "delta": 1 });
    match variant {
        Variant::Alone => {}
        Variant::WithEnqueue | Variant::WithQuietEnqueue | Variant::WithLeanEnqueue => {
            outbox
                .enqueue(
                    &mut tx,
                    &NewEvent::new("account", &key, "Credited", &payload)?,
                )
                .await?;
        }
        Variant::WithRawSql
        | Variant::WithBareInsert
        | Variant::WithKeyedInsert
        | Variant::WithKeyedInsertNotify => {
            let sql = match variant {
                Variant::WithRawSql => RAW_INSERT,
                Variant::WithBareInsert => BARE_INSERT,
                Variant::WithKeyedInsert => KEYED_INSERT,
                _ => KEYED_INSERT_NOTIFY,
            };
            sqlx::query(sql)
                .bind(uuid::Uuid::now_v7())
                .bind("account")
                .bind(&key)
                .bind("Credited")
                .bind(&payload)
                .bind(json!({}))
                .bind("outbox.event.account")
                .execute(&mut *tx)
                .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}
