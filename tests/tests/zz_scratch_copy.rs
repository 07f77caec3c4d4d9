use anyhow::Result;
use outbox_tests::TestDb;
use sqlx::{Connection, PgConnection};
use std::time::Instant;
use uuid::Uuid;

const N: usize = 32;

async fn one(conn: &mut PgConnection, variant: u8, day: i32, name: &str) -> Result<()> {
    let mut tx = conn.begin().await?;
    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::now_v7()).collect();
    let slices: Vec<i32> = vec![day; N];
    match variant {
        0 => {}
        1 => {
            sqlx::query("INSERT INTO outbox_consumer_dedup (consumer, event_id, slice) SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice)")
                .bind(name).bind(&ids).bind(&slices).execute(&mut *tx).await?;
        }
        2 => {
            let mut data = String::with_capacity(N * 60);
            for id in &ids {
                data.push_str(name);
                data.push('\t');
                data.push_str(&id.to_string());
                data.push('\t');
                data.push_str(&day.to_string());
                data.push('\n');
            }
            let mut copy = tx
                .copy_in_raw("COPY outbox_consumer_dedup (consumer, event_id, slice) FROM STDIN")
                .await?;
            copy.send(data.as_bytes()).await?;
            copy.finish().await?;
        }
        3 => {
            sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO outbox_consumer_dedup_d{day} (consumer, event_id, slice) SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice)")))
                .bind(name).bind(&ids).bind(&slices).execute(&mut *tx).await?;
        }
        _ => unreachable!(),
    }
    for id in &ids {
        sqlx::query("INSERT INTO effects (key) VALUES ($1)")
            .bind(id.to_string())
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scratch_copy() -> Result<()> {
    let db = TestDb::new().await?;
    sqlx::query("CREATE TABLE effects (id bigserial primary key, key text not null)")
        .execute(&db.pool)
        .await?;
    let day: i32 = sqlx::query_scalar("SELECT (extract(epoch from now()) / 86400)::int")
        .fetch_one(&db.pool)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE TABLE outbox_consumer_dedup_d{day} PARTITION OF outbox_consumer_dedup FOR VALUES FROM ({day}) TO ({})", day + 1))).execute(&db.pool).await?;
    let variants = [0u8, 1, 3];
    let mut totals = [0f64; 3];
    for round in 0..9 {
        for (i, &v) in variants.iter().enumerate() {
            let started = Instant::now();
            let mut tasks = Vec::new();
            for w in 0..4 {
                let pool = db.pool.clone();
                tasks.push(tokio::spawn(async move {
                    let mut conn = pool.acquire().await?;
                    for _ in 0..300 {
                        one(&mut conn, v, day, &format!("consumer-{w}")).await?;
                    }
                    anyhow::Ok(())
                }));
            }
            for t in tasks {
                t.await??;
            }
            let rate = (4 * 300 * N) as f64 / started.elapsed().as_secs_f64();
            if round > 0 {
                totals[i] += rate;
            }
            eprintln!("round {round} variant {v}: {rate:.0} msg/s");
        }
    }
    for (i, t) in totals.iter().enumerate() {
        eprintln!(
            "variant {i}: mean {:.0} msg/s, ratio to none {:.3}",
            t / 8.0,
            t / totals[0]
        );
    }
    Ok(())
}
