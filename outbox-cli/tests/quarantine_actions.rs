//! `outbox quarantine requeue|discard|audit` and `outbox prune quarantine`: checked, audited
//! and bounded, against the real Postgres.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::Result;
use outbox_tests::TestDb;

/// Runs `outbox` with `args` on the test's schema, `stdin` fed to it (not a terminal).
fn outbox_with_stdin(db: &TestDb, args: &[&str], stdin: &str) -> Result<(bool, String, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    Ok((
        out.status.success(),
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    ))
}

fn outbox(db: &TestDb, args: &[&str]) -> Result<(bool, String, String)> {
    outbox_with_stdin(db, args, "")
}

/// A user table that has every column the quarantine actions name (`id`, `seq`, `status`).
async fn invoices(db: &TestDb) -> Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE invoices (id BIGINT PRIMARY KEY, seq BIGINT NOT NULL, \
         status TEXT NOT NULL, amount INT NOT NULL); \
         INSERT INTO invoices SELECT g, g, 'quarantined', 100 * g FROM generate_series(1, 3) AS g",
    )
    .execute(&db.pool)
    .await?;
    Ok(())
}

async fn count(db: &TestDb, table: &str) -> Result<i64> {
    Ok(
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&db.pool)
            .await?,
    )
}

/// `--quarantine-table invoices` (or `--outbox-table invoices`) named a user's table, and
/// `discard` deleted its rows. Now the table must be registered as that side's quarantine.
#[tokio::test]
async fn discard_and_requeue_refuse_a_table_that_is_not_a_quarantine() -> Result<()> {
    let db = TestDb::new().await?;
    invoices(&db).await?;
    for args in [
        ["quarantine", "discard", "consumer", "1", "--quarantine-table", "invoices"],
        ["quarantine", "discard", "relay", "2", "--outbox-table", "invoices"],
        ["quarantine", "requeue", "relay", "3", "--outbox-table", "invoices"],
    ] {
        let (ok, stdout, stderr) = outbox(&db, &args)?;
        assert!(!ok, "{args:?} succeeded: {stdout}");
        assert!(
            stderr.contains("invoices") && stderr.contains("not a quarantine table"),
            "{args:?}: {stderr}"
        );
    }
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, status FROM invoices ORDER BY id")
        .fetch_all(&db.pool)
        .await?;
    assert_eq!(
        rows,
        [1, 2, 3].map(|id| (id, "quarantined".to_owned())),
        "nothing touched"
    );
    Ok(())
}
