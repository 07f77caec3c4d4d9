//! `outbox quarantine requeue|discard|audit` and `outbox prune quarantine`: checked, audited
//! and bounded, against the real Postgres.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::Result;
use outbox_tests::TestDb;

/// Runs `outbox` with `args` on the database at `url`, `stdin` fed to it (not a terminal).
fn run(url: &str, args: &[&str], stdin: &str) -> Result<(bool, String, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", url)
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

/// Runs `outbox` with `args` on the test's schema, with nothing on stdin.
fn outbox(db: &TestDb, args: &[&str]) -> Result<(bool, String, String)> {
    run(&db.url(), args, "")
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
        [
            "quarantine",
            "discard",
            "consumer",
            "1",
            "--quarantine-table",
            "invoices",
        ],
        [
            "quarantine",
            "discard",
            "relay",
            "2",
            "--outbox-table",
            "invoices",
        ],
        [
            "quarantine",
            "requeue",
            "relay",
            "3",
            "--outbox-table",
            "invoices",
        ],
        [
            "prune",
            "quarantine",
            "--older-than",
            "0s",
            "--quarantine-table",
            "invoices",
        ],
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
    // A quarantine of the other side is no quarantine of this one.
    let (ok, _, stderr) = outbox(
        &db,
        &[
            "quarantine",
            "discard",
            "relay",
            "1",
            "--outbox-table",
            "outbox_consumer_quarantine",
        ],
    )?;
    assert!(
        !ok && stderr.contains("not a quarantine table of the relay side"),
        "{stderr}"
    );
    // The library refuses with a typed error.
    let mut conn = db.pool.acquire().await?;
    let tables = outbox_core::TableNames::default()
        .with_consumer_tables("outbox_consumer_dedup", "invoices")?;
    let refused = outbox_consumer::quarantine::discard(
        &mut conn,
        &tables,
        &[1],
        &outbox_core::ActionNote::new(),
    )
    .await;
    assert!(
        matches!(
            refused,
            Err(outbox_consumer::ConsumerError::Core(outbox_core::CoreError::NotAQuarantineTable { ref table, .. })) if table == "invoices"
        ),
        "{refused:?}"
    );
    assert_eq!(count(&db, "invoices").await?, 3);
    assert_eq!(
        count(&db, "outbox_quarantine_audit").await?,
        0,
        "a refusal is no action"
    );
    Ok(())
}

/// Quarantines under custom names are registered by the migrations that make them.
#[tokio::test]
async fn custom_named_quarantines_are_registered_by_their_migrations() -> Result<()> {
    let db = TestDb::new().await?;
    let custom = [
        "--outbox-table",
        "cli_outbox",
        "--quarantine-table",
        "cli_quarantine",
        "--dedup-table",
        "cli_dedup",
    ];
    let (ok, _, stderr) = outbox(&db, &[&custom[..], &["migrate"]].concat())?;
    assert!(ok, "{stderr}");
    sqlx::query(
        "INSERT INTO cli_quarantine (consumer, topic, partition, \"offset\", reason, error) \
         VALUES ('billing', 't', 0, 1, 'invalid_json', 'e')",
    )
    .execute(&db.pool)
    .await?;
    let id: i64 = sqlx::query_scalar("SELECT id FROM cli_quarantine")
        .fetch_one(&db.pool)
        .await?;
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            &custom[..],
            &["quarantine", "discard", "consumer", &id.to_string()],
        ]
        .concat(),
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "discarded 1 messages");
    let table: String = sqlx::query_scalar("SELECT table_name FROM outbox_quarantine_audit")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(table, format!("{}.cli_quarantine", db.schema));
    // The same name made again by someone else is another table, not registered.
    sqlx::raw_sql(
        "DROP TABLE cli_quarantine; \
         CREATE TABLE cli_quarantine (id BIGINT PRIMARY KEY); INSERT INTO cli_quarantine VALUES (1)",
    )
    .execute(&db.pool)
    .await?;
    let (ok, _, stderr) = outbox(
        &db,
        &[&custom[..], &["quarantine", "discard", "consumer", "1"]].concat(),
    )?;
    assert!(!ok && stderr.contains("not a quarantine table"), "{stderr}");
    assert_eq!(count(&db, "cli_quarantine").await?, 1);
    Ok(())
}

/// Consumer messages quarantined `days_old` days ago each, by `billing` (the fourth by
/// `audit`), at offsets 0, 1, ...; their ids.
async fn quarantine_messages(db: &TestDb, days_old: &[i32]) -> Result<Vec<i64>> {
    let mut ids = Vec::new();
    for (i, days) in days_old.iter().enumerate() {
        let consumer = if i == 3 { "audit" } else { "billing" };
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO outbox_consumer_quarantine \
                (consumer, topic, partition, \"offset\", event_id, reason, error, quarantined_at) \
             VALUES ($1, 't', 0, $2, gen_random_uuid(), 'handler_failed', 'e', \
                     now() - $3 * interval '1 day') \
             RETURNING id",
        )
        .bind(consumer)
        .bind(i64::try_from(i)?)
        .bind(days)
        .fetch_one(&db.pool)
        .await?;
        ids.push(id);
    }
    Ok(ids)
}

/// Without a terminal to ask on, an action on more than one row needs `--yes`; one row does
/// not.
#[tokio::test]
async fn bulk_actions_need_yes_when_stdin_is_not_a_terminal() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = quarantine_messages(&db, &[1, 1, 1]).await?;
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let discard = [&["quarantine", "discard", "consumer"][..], &ids].concat();
    // A "y" on a pipe is no confirmation: it may be anything's output.
    let (ok, _, stderr) = run(&db.url(), &discard, "y\n")?;
    assert!(!ok);
    assert!(
        stderr.contains("refusing to discard 3 rows of")
            && stderr.contains("outbox_consumer_quarantine for consumer billing")
            && stderr.contains("pass --yes"),
        "{stderr}"
    );
    for args in [
        &["quarantine", "requeue", "relay", "1", "2"][..],
        &["quarantine", "discard", "relay", "1", "2"],
        &["prune", "quarantine", "--older-than", "0s"],
    ] {
        let (ok, _, stderr) = outbox(&db, args)?;
        assert!(!ok && stderr.contains("pass --yes"), "{args:?}: {stderr}");
    }
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 3);
    assert_eq!(count(&db, "outbox_quarantine_audit").await?, 0);

    let (ok, stdout, stderr) = outbox(&db, &discard[..4])?;
    assert!(ok, "one row needs no confirmation: {stderr}");
    assert_eq!(stdout.trim(), "discarded 1 messages");
    let (ok, stdout, stderr) = outbox(&db, &[&discard[..], &["--yes"]].concat())?;
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.trim(),
        "discarded 2 messages",
        "the first was gone already"
    );
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 0);
    Ok(())
}

/// A role of its own for the test, with what an operator needs on the test's schema; dropped
/// when it goes out of scope.
struct Operator {
    name: String,
}

impl Operator {
    async fn new(db: &TestDb) -> Result<Self> {
        let name = outbox_tests::unique("operator");
        let schema = &db.schema;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {name} NOLOGIN; \
             GRANT USAGE ON SCHEMA {schema} TO {name}; \
             GRANT SELECT, UPDATE, DELETE ON outbox_events, outbox_consumer_quarantine TO {name}; \
             GRANT SELECT ON outbox_quarantine_tables TO {name}; \
             GRANT SELECT, INSERT ON outbox_quarantine_audit TO {name}"
        )))
        .execute(&db.pool)
        .await?;
        Ok(Self { name })
    }

    /// `db`'s URL, its session (`session_user` the suite's superuser) acting as this role.
    fn url(&self, db: &TestDb) -> String {
        format!("{}%20-c%20role%3D{}", db.url(), self.name)
    }
}

impl Drop for Operator {
    /// Drops the role (a cluster's roles outlive the test's schema), whether the test passed
    /// or panicked: on a thread of its own, since a test's runtime cannot block.
    fn drop(&mut self) {
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || -> Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect(&outbox_tests::database_url()).await?;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "DROP OWNED BY {name}; DROP ROLE {name}"
                )))
                .execute(&mut conn)
                .await?;
                Ok(())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop role {}: {dropped:?}", self.name);
        }
    }
}

/// Each requeue and discard leaves one audit row: what, on which rows and events, when, by
/// which role (the one acting and the one logged in), and why; and none commits without it.
#[tokio::test]
async fn requeue_and_discard_are_audited_with_role_and_reason() -> Result<()> {
    let db = TestDb::new().await?;
    let operator = Operator::new(&db).await?;
    let url = operator.url(&db);
    let messages = quarantine_messages(&db, &[1, 1, 1, 1]).await?;
    let events: Vec<(i64, uuid::Uuid)> = sqlx::query_as(
        "WITH q AS (INSERT INTO outbox_events \
             (id, aggregatetype, aggregateid, type, payload, topic, status, last_error) \
           SELECT gen_random_uuid(), 'a', 'k', 't', '{}', 'topic', 'quarantined', 'Permanent' \
           FROM generate_series(1, 2) RETURNING seq, id) \
         SELECT seq, id FROM q ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await?;
    let (seq1, seq2) = (events[0].0.to_string(), events[1].0.to_string());
    let (ok, stdout, stderr) = run(
        &url,
        &[
            "quarantine",
            "requeue",
            "relay",
            &seq1,
            &seq2,
            "--yes",
            "--reason",
            "topic fixed, INC-7",
        ],
        "",
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "requeued 2 rows");
    let (m2, m4) = (messages[1].to_string(), messages[3].to_string());
    let (ok, stdout, stderr) = run(
        &url,
        &["quarantine", "discard", "consumer", &m2, &m4, "--yes"],
        "",
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "discarded 2 messages");

    let (ok, stdout, stderr) = outbox(&db, &["quarantine", "audit", "--json"])?;
    assert!(ok, "{stderr}");
    let audit: Vec<serde_json::Value> = serde_json::from_str(&stdout)?;
    assert_eq!(audit.len(), 2, "{audit:?}");
    let (discard, requeue) = (&audit[0], &audit[1]);
    let superuser: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&db.pool)
        .await?;
    assert_eq!(requeue["action"], "requeue");
    assert_eq!(requeue["side"], "relay");
    assert_eq!(
        requeue["table_name"],
        format!("{}.outbox_events", db.schema)
    );
    assert_eq!(
        requeue["row_ids"],
        serde_json::json!([events[0].0, events[1].0])
    );
    assert_eq!(
        requeue["event_ids"],
        serde_json::json!([events[0].1, events[1].1])
    );
    assert_eq!(requeue["db_user"], operator.name.as_str());
    assert_eq!(requeue["db_session_user"], superuser.as_str());
    assert_eq!(requeue["reason"], "topic fixed, INC-7");
    assert_eq!(discard["action"], "discard");
    assert_eq!(discard["side"], "consumer");
    assert_eq!(
        discard["row_ids"],
        serde_json::json!([messages[1], messages[3]])
    );
    assert_eq!(
        discard["consumers"],
        serde_json::json!(["audit", "billing"])
    );
    assert_eq!(discard["reason"], serde_json::Value::Null);
    let event_ids: Vec<Option<uuid::Uuid>> = sqlx::query_scalar(
        "SELECT event_ids FROM outbox_quarantine_audit WHERE action = 'discard'",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(event_ids.len(), 2);
    assert!(event_ids.iter().all(Option::is_some));
    let (ok, stdout, _) = outbox(&db, &["quarantine", "audit"])?;
    assert!(
        ok && stdout.lines().count() == 2 && stdout.contains("topic fixed, INC-7"),
        "{stdout}"
    );

    // The time and roles are the server's, whatever an insert says.
    let stamped: (String, bool) = sqlx::query_as(
        "INSERT INTO outbox_quarantine_audit \
            (at, action, side, table_name, row_ids, event_ids, consumers, db_user, db_session_user) \
         VALUES ('2000-01-01', 'discard', 'relay', 'x', '{}', '{}', '{}', 'mallory', 'mallory') \
         RETURNING db_user, at = now()",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(stamped, (superuser.clone(), true));
    sqlx::query("DELETE FROM outbox_quarantine_audit WHERE table_name = 'x'")
        .execute(&db.pool)
        .await?;

    // A role that cannot write the audit cannot act either: the action and its record are
    // one statement.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "REVOKE INSERT ON outbox_quarantine_audit FROM {}",
        operator.name
    )))
    .execute(&db.pool)
    .await?;
    let m1 = messages[0].to_string();
    let (ok, _, stderr) = run(&url, &["quarantine", "discard", "consumer", &m1], "")?;
    assert!(!ok && stderr.contains("permission denied"), "{stderr}");
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 2);
    assert_eq!(count(&db, "outbox_quarantine_audit").await?, 2);
    Ok(())
}

/// `outbox prune quarantine` deletes only what is older than the age, a batch at a time, one
/// audit row per batch; a batch in the caller's transaction goes with it.
#[tokio::test]
async fn prune_quarantine_deletes_only_older_rows_in_batches() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = quarantine_messages(&db, &[10, 9, 8, 8, 9, 1, 0]).await?;
    let (old, recent) = ids.split_at(5);

    let mut tx = db.pool.begin().await?;
    let (n, _) = outbox_consumer::prune_quarantine_batch(
        &mut tx,
        &Default::default(),
        std::time::Duration::from_secs(7 * 86_400),
        2,
        None,
    )
    .await?;
    assert_eq!(n, 2);
    tx.rollback().await?;
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 7);
    assert_eq!(
        count(&db, "outbox_quarantine_audit").await?,
        0,
        "rolled back with its batch"
    );

    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "prune",
            "quarantine",
            "--older-than",
            "7d",
            "--batch",
            "2",
            "--yes",
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "removed 5 quarantined messages");
    let left: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine ORDER BY id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(left, recent);
    let batches: Vec<(String, Vec<i64>, serde_json::Value)> =
        sqlx::query_as("SELECT action, row_ids, detail FROM outbox_quarantine_audit ORDER BY id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        batches.iter().map(|b| b.1.len()).collect::<Vec<_>>(),
        [2, 2, 1],
        "{batches:?}"
    );
    assert!(
        batches.iter().all(|b| b.0 == "prune" && b.2["batch"] == 2),
        "{batches:?}"
    );
    let mut pruned: Vec<i64> = batches.into_iter().flat_map(|b| b.1).collect();
    pruned.sort_unstable();
    assert_eq!(pruned, old);
    // Oldest first: the 10-day-old row went in the first batch.
    let first: Vec<i64> =
        sqlx::query_scalar("SELECT row_ids FROM outbox_quarantine_audit ORDER BY id LIMIT 1")
            .fetch_one(&db.pool)
            .await?;
    assert!(first.contains(&ids[0]), "{first:?}");
    Ok(())
}

/// On a terminal (util-linux `script` gives the command one), a bulk action asks, and only a
/// "y" goes on.
#[tokio::test]
async fn a_terminal_is_asked_before_a_bulk_discard() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = quarantine_messages(&db, &[1, 1]).await?;
    let command = format!(
        "'{}' quarantine discard consumer {} {}",
        env!("CARGO_BIN_EXE_outbox"),
        ids[0],
        ids[1]
    );
    let on_a_terminal = |answer: &str| -> Result<(bool, String)> {
        let mut child = Command::new("script")
            .args(["-qec", &command, "/dev/null"])
            .env("DATABASE_URL", db.url())
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let Some(mut input) = child.stdin.take() {
            input.write_all(answer.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ))
    };
    let (ok, shown) = on_a_terminal("n\n")?;
    assert!(!ok, "{shown}");
    assert!(
        shown.contains("discard 2 rows of")
            && shown.contains("outbox_consumer_quarantine for consumer billing? [y/N]")
            && shown.contains("not confirmed; nothing was changed"),
        "{shown}"
    );
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 2);
    let (ok, shown) = on_a_terminal("y\n")?;
    assert!(ok, "{shown}");
    assert!(shown.contains("discarded 2 messages"), "{shown}");
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 0);
    Ok(())
}
