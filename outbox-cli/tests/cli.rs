//! The `outbox` binary against the real Postgres.

use std::process::Command;

use anyhow::Result;
use outbox_tests::{TestDb, database_url};

fn outbox(db: &TestDb, args: &[&str]) -> Result<(bool, String, String)> {
    let url = format!(
        "{}?options=-c%20search_path%3D{}",
        database_url(),
        db.schema
    );
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    ))
}

#[tokio::test]
async fn prune_dedup_from_cron_removes_only_old_rows() -> Result<()> {
    let db = TestDb::new().await?;
    sqlx::query(
        "INSERT INTO outbox_consumer_dedup (consumer, event_id, processed_at) \
         SELECT 'c', gen_random_uuid(), now() - (g || ' days')::interval + interval '12 hours' \
         FROM generate_series(1, 10) AS g",
    )
    .execute(&db.pool)
    .await?;
    let (ok, stdout, stderr) = outbox(
        &db,
        &["prune", "dedup", "--older-than", "7d", "--batch", "2"],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.trim(),
        "removed 3 rows",
        "ages 7.5, 8.5 and 9.5 days"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dedup")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(left, 7);
    Ok(())
}

#[tokio::test]
async fn status_reports_json_and_bad_arguments_fail_clearly() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, stdout, stderr) = outbox(&db, &["status", "--json"])?;
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(status["pending"], 0);
    assert_eq!(status["consumer_quarantined"], 0);

    let (ok, _, stderr) = outbox(&db, &["prune", "dedup", "--older-than", "seven days"])?;
    assert!(!ok);
    assert!(stderr.contains("--older-than"), "{stderr}");
    let (ok, _, stderr) = outbox(&db, &["--outbox-table", "x;drop", "status"])?;
    assert!(!ok);
    assert!(stderr.contains("invalid identifier"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn migrate_creates_the_tables_in_the_urls_schema() -> Result<()> {
    let db = TestDb::new().await?;
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "--outbox-table",
            "cli_outbox",
            "--dedup-table",
            "cli_dedup",
            "--quarantine-table",
            "cli_quarantine",
            "migrate",
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "migrations applied");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('cli_outbox') IS NOT NULL")
        .fetch_one(&db.pool)
        .await?;
    assert!(exists);
    Ok(())
}
