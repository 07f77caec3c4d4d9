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

/// A role of its own for the test, with what the guide ("Roles") grants an operator on the test's
/// schema (no SELECT on the audit); dropped when it goes out of scope.
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
             GRANT SELECT ON outbox_quarantine_tables TO {name}"
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
    // The outbox's entries are one per row.
    assert_eq!(audit.len(), 3, "{audit:?}");
    let discard = &audit[0];
    let mut requeues: Vec<&serde_json::Value> = audit[1..].iter().collect();
    requeues.sort_by_key(|entry| entry["row_ids"][0].as_i64());
    let superuser: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&db.pool)
        .await?;
    for (requeue, (seq, id)) in requeues.into_iter().zip(&events) {
        assert_eq!(requeue["action"], "requeue");
        assert_eq!(requeue["side"], "relay");
        assert_eq!(
            requeue["table_name"],
            format!("{}.outbox_events", db.schema)
        );
        assert_eq!(requeue["row_ids"], serde_json::json!([seq]));
        assert_eq!(requeue["event_ids"], serde_json::json!([id]));
        assert_eq!(requeue["db_user"], operator.name.as_str());
        assert_eq!(requeue["db_session_user"], superuser.as_str());
        assert_eq!(requeue["reason"], "topic fixed, INC-7");
    }
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
        ok && stdout.lines().count() == 3 && stdout.contains("topic fixed, INC-7"),
        "{stdout}"
    );
    // A reason is operator text, shown escaped like anything else from the database.
    sqlx::query(
        "UPDATE outbox_quarantine_audit SET reason = E'x\\n\\u001b[2J\\u202e\\u0085y' \
         WHERE action = 'discard'",
    )
    .execute(&db.pool)
    .await?;
    let (ok, stdout, _) = outbox(&db, &["quarantine", "audit"])?;
    assert!(ok && stdout.lines().count() == 3, "{stdout}");
    assert!(stdout.contains(r"x\n\u{1b}[2J\u{202e}\u{85}y"), "{stdout}");
    let (ok, stdout, _) = outbox(&db, &["quarantine", "audit", "--json"])?;
    assert!(
        ok && !stdout.contains(['\u{202e}', '\u{85}']) && stdout.contains(r"\u202e"),
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

    // The operator has no INSERT on the audit (the database writes it), and no way around
    // it: the same discard typed as a statement of its own is recorded all the same.
    let m1 = messages[0];
    let mut conn = db.pool.acquire().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("SET ROLE {}", operator.name)))
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM outbox_consumer_quarantine WHERE id = $1")
        .bind(m1)
        .execute(&mut *conn)
        .await?;
    sqlx::query("RESET ROLE").execute(&mut *conn).await?;
    let typed: (String, Vec<i64>, String) = sqlx::query_as(
        "SELECT action, row_ids, db_user FROM outbox_quarantine_audit ORDER BY at DESC, id DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await?;
    assert_eq!(typed, ("delete".into(), vec![m1], operator.name.clone()));
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 1);
    assert_eq!(count(&db, "outbox_quarantine_audit").await?, 4);
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
            "--reason",
            "retention",
        ],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "removed 5 quarantined messages");
    let left: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox_consumer_quarantine ORDER BY id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(left, recent);
    // (action, how many ids it lists, detail)
    let batches: Vec<(String, i32, serde_json::Value)> = sqlx::query_as(
        "SELECT action, cardinality(row_ids) + cardinality(event_ids), detail \
         FROM outbox_quarantine_audit ORDER BY at, id",
    )
    .fetch_all(&db.pool)
    .await?;
    // Counted, and listed up to a thousand rows a batch (past that, a flood of poison would
    // double in the audit).
    assert_eq!(
        batches
            .iter()
            .map(|b| b.2["rows"].as_i64())
            .collect::<Vec<_>>(),
        [Some(2), Some(2), Some(1)],
        "{batches:?}"
    );
    assert!(
        batches.iter().all(|b| b.0 == "prune"
            && Some(i64::from(b.1)) == b.2["rows"].as_i64().map(|rows| 2 * rows)
            && b.2["batch"] == 2
            && b.2["first_row_id"].as_i64() >= Some(old[0])
            && b.2["last_row_id"].as_i64() <= old.last().copied()),
        "{batches:?}"
    );
    let reasons: Vec<Option<String>> =
        sqlx::query_scalar("SELECT reason FROM outbox_quarantine_audit")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(reasons, vec![Some("retention".to_owned()); 3]);
    // Oldest first: the 10-day-old row went in the first batch.
    assert_eq!(batches[0].2["first_row_id"], ids[0], "{batches:?}");
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

/// The audit's trigger stamps the server's time whatever the inserting session's
/// `search_path` puts before `pg_catalog`: an `evil.now()` there is not called.
#[tokio::test]
async fn the_audit_time_cannot_be_forged_through_the_search_path() -> Result<()> {
    let db = TestDb::new().await?;
    let evil = format!("{}_evil", db.schema);
    let schema = &db.schema;
    let mut conn = db.pool.acquire().await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {evil}; \
         CREATE FUNCTION {evil}.now() RETURNS timestamptz LANGUAGE sql \
             AS $$ SELECT '2000-01-01'::timestamptz $$; \
         SET search_path = {evil}, pg_catalog, {schema}"
    )))
    .execute(&mut *conn)
    .await?;
    let forged: bool = sqlx::query_scalar(
        "INSERT INTO outbox_quarantine_audit \
            (action, side, table_name, row_ids, event_ids, consumers) \
         VALUES ('discard', 'relay', 'x', '{}', '{}', '{}') \
         RETURNING at < pg_catalog.now() - interval '1 year'",
    )
    .fetch_one(&mut *conn)
    .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "RESET search_path; DROP SCHEMA {evil} CASCADE"
    )))
    .execute(&mut *conn)
    .await?;
    assert!(!forged, "the audit took the session's now()");
    Ok(())
}

/// A registry row outlives its table, and its oid can come back (oid wraparound, a dump that
/// writes a dangling regclass as a number): a user table that got the oid is no quarantine.
#[tokio::test]
async fn a_registered_oid_that_now_names_another_table_is_refused() -> Result<()> {
    let db = TestDb::new().await?;
    invoices(&db).await?;
    // As a restore leaves it: the quarantine's row, now with the oid of the user's table.
    sqlx::query(
        "UPDATE outbox_quarantine_tables SET table_oid = 'invoices'::regclass::oid \
         WHERE table_oid = 'outbox_consumer_quarantine'::regclass",
    )
    .execute(&db.pool)
    .await?;
    let (ok, stdout, stderr) = outbox(
        &db,
        &[
            "quarantine",
            "discard",
            "consumer",
            "1",
            "--quarantine-table",
            "invoices",
        ],
    )?;
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("not a quarantine table"), "{stderr}");
    assert_eq!(count(&db, "invoices").await?, 3);
    Ok(())
}

/// A role that may create in the schema makes the audit's stamp function before the owner's
/// first migration (on PostgreSQL 12-14 every role may create in `public`): the migration
/// refuses to reuse it, naming the object and its owner, instead of running that role's code
/// on every audited change. Fails before the fix: the function was reused.
#[tokio::test]
async fn a_shared_object_someone_else_made_first_is_not_reused() -> Result<()> {
    let db = TestDb::unmigrated(2).await?;
    let schema = &db.schema;
    let intruder = outbox_tests::unique("intruder");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {intruder} NOLOGIN; \
         GRANT USAGE, CREATE ON SCHEMA {schema} TO {intruder}; \
         SET ROLE {intruder}; \
         CREATE FUNCTION {schema}.outbox_quarantine_audit_stamp() RETURNS trigger \
             LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$; \
         RESET ROLE"
    )))
    .execute(&db.pool)
    .await?;
    let migrated = outbox_core::migrate(&db.pool).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA {schema} CASCADE; DROP OWNED BY {intruder}; DROP ROLE {intruder}"
    )))
    .execute(&db.pool)
    .await?;
    let error = migrated.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        error.contains("outbox_quarantine_audit_stamp()") && error.contains(&intruder),
        "{error}"
    );
    Ok(())
}

/// A second migration set (custom names) in the same schema, owned by another role, migrates:
/// the shared trigger and function are the first set's, and are left alone.
#[tokio::test]
async fn a_second_migration_set_owned_by_another_role_migrates() -> Result<()> {
    let db = TestDb::new().await?;
    let owner = outbox_tests::unique("owner");
    let schema = &db.schema;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE {owner} NOLOGIN; \
         GRANT USAGE, CREATE ON SCHEMA {schema} TO {owner}; \
         GRANT SELECT, INSERT ON outbox_quarantine_tables TO {owner}"
    )))
    .execute(&db.pool)
    .await?;
    let url = format!("{}%20-c%20role%3D{owner}", db.url());
    let migrated = run(
        &url,
        &[
            "--outbox-table",
            "second_outbox",
            "--quarantine-table",
            "second_quarantine",
            "--dedup-table",
            "second_dedup",
            "migrate",
        ],
        "",
    );
    let registered: Vec<(String, String)> =
        sqlx::query_as("SELECT relname::text, side FROM outbox_quarantine_tables ORDER BY relname")
            .fetch_all(&db.pool)
            .await
            .unwrap_or_default();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP OWNED BY {owner}; DROP ROLE {owner}"
    )))
    .execute(&db.pool)
    .await?;
    let (ok, _, stderr) = migrated?;
    assert!(ok, "{stderr}");
    assert_eq!(
        registered,
        [
            ("outbox_consumer_quarantine", "consumer"),
            // Migration 0016's park, discarded from by `outbox parked skip`.
            ("outbox_consumer_quarantine_parked", "consumer"),
            ("outbox_events", "relay"),
            ("second_outbox", "relay"),
            ("second_quarantine", "consumer"),
            ("second_quarantine_parked", "consumer"),
        ]
        .map(|(t, s)| (t.to_owned(), s.to_owned()))
    );
    Ok(())
}

/// Two consumer messages quarantined by `billing`, to be requeued to `topic`; their ids.
async fn requeueable(db: &TestDb, topic: &str) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar(
        "INSERT INTO outbox_consumer_quarantine \
            (consumer, topic, partition, \"offset\", event_id, payload, reason, error) \
         SELECT 'billing', $1, 0, g, gen_random_uuid(), 'p'::bytea, 'handler_failed', 'e' \
         FROM generate_series(1, 2) AS g RETURNING id",
    )
    .bind(topic)
    .fetch_all(&db.pool)
    .await?)
}

/// Operator A asks to requeue two messages; while A's prompt waits, B discards one. A's "y"
/// must not publish the discarded message again, nor audit a requeue of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_discarded_while_a_requeue_asks_is_not_published() -> Result<()> {
    use std::io::Read;
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let ids = requeueable(&db, &topic).await?;
    let command = format!(
        "'{}' quarantine requeue consumer {} {} --to-consumer billing-v2 --brokers {}",
        env!("CARGO_BIN_EXE_outbox"),
        ids[0],
        ids[1],
        outbox_tests::kafka_bootstrap()
    );
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("DATABASE_URL", db.url())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut shown = Vec::new();
    while !String::from_utf8_lossy(&shown).contains("[y/N]") {
        let chunk = rx.recv_timeout(std::time::Duration::from_secs(30));
        assert!(
            chunk.is_ok(),
            "no prompt: {}",
            String::from_utf8_lossy(&shown)
        );
        shown.extend(chunk.unwrap_or_default());
    }
    assert!(
        String::from_utf8_lossy(&shown).contains("for consumer billing, to consumer billing-v2?"),
        "{}",
        String::from_utf8_lossy(&shown)
    );
    let (ok, _, stderr) = outbox(
        &db,
        &["quarantine", "discard", "consumer", &ids[1].to_string()],
    )?;
    assert!(ok, "{stderr}");
    child.stdin.take().expect("piped").write_all(b"y\n")?;
    let status = child.wait()?;
    reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    shown.extend(rx.try_iter().flatten());
    let shown = String::from_utf8_lossy(&shown);
    assert!(status.success(), "{shown}");
    assert!(shown.contains("requeued 1 messages"), "{shown}");
    assert!(
        shown.contains(&format!("already gone: {}", ids[1])),
        "{shown}"
    );

    let records = outbox_tests::read_all(&topic, 1, std::time::Duration::from_secs(30)).await?;
    assert_eq!(records.len(), 1, "only the message still quarantined");
    let audit: Vec<(String, Vec<i64>)> =
        sqlx::query_as("SELECT action, row_ids FROM outbox_quarantine_audit ORDER BY at, id")
            .fetch_all(&db.pool)
            .await?;
    assert_eq!(
        audit,
        [
            ("discard".to_owned(), vec![ids[1]]),
            ("requeue".to_owned(), vec![ids[0]])
        ]
    );
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 0);
    Ok(())
}

/// A message another session holds (another operator's requeue or discard in flight) is not
/// published: the requeue says so and leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_publishes_nothing_for_a_message_another_action_holds() -> Result<()> {
    let db = TestDb::new().await?;
    let topic = outbox_tests::random_topic(1).await?;
    let ids = requeueable(&db, &topic).await?;
    let mut other = db.pool.begin().await?;
    sqlx::query("SELECT id FROM outbox_consumer_quarantine WHERE id = $1 FOR UPDATE")
        .bind(ids[0])
        .execute(&mut *other)
        .await?;
    // Bounded, so that a requeue that waits for the lock fails rather than hangs.
    let url = format!("{}%20-c%20lock_timeout%3D3s", db.url());
    let (ok, stdout, stderr) = run(
        &url,
        &[
            "quarantine",
            "requeue",
            "consumer",
            &ids[0].to_string(),
            "--brokers",
            &outbox_tests::kafka_bootstrap(),
        ],
        "",
    )?;
    other.rollback().await?;
    let records = outbox_tests::read_all(&topic, 1, std::time::Duration::from_secs(30)).await?;
    assert_eq!(records.len(), 0, "nothing published: {stderr}");
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("another session"), "{stderr}");
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 2);
    Ok(())
}

/// An action that finds none of its rows changes nothing and is no action: no audit row. And
/// `audit` lists actions by the server's time, not by the row's id, which an insert can
/// choose.
#[tokio::test]
async fn an_action_that_changes_nothing_is_not_audited_and_audit_goes_by_time() -> Result<()> {
    let db = TestDb::new().await?;
    let ids = quarantine_messages(&db, &[1]).await?;
    for side in ["relay", "consumer"] {
        let (ok, stdout, stderr) = outbox(&db, &["quarantine", "discard", side, "999999"])?;
        assert!(ok, "{stderr}");
        assert!(stdout.contains("discarded 0"), "{stdout}");
    }
    let (ok, _, stderr) = outbox(&db, &["quarantine", "requeue", "relay", "999999"])?;
    assert!(ok, "{stderr}");
    assert_eq!(count(&db, "outbox_quarantine_audit").await?, 0);

    sqlx::query(
        "INSERT INTO outbox_quarantine_audit \
            (id, action, side, table_name, row_ids, event_ids, consumers) \
         OVERRIDING SYSTEM VALUE VALUES (1000000, 'discard', 'relay', 'forged', '{}', '{}', '{}')",
    )
    .execute(&db.pool)
    .await?;
    let (ok, _, stderr) = outbox(
        &db,
        &["quarantine", "discard", "consumer", &ids[0].to_string()],
    )?;
    assert!(ok, "{stderr}");
    let (ok, stdout, stderr) = outbox(&db, &["quarantine", "audit", "--limit", "1", "--json"])?;
    assert!(ok, "{stderr}");
    let newest: Vec<serde_json::Value> = serde_json::from_str(&stdout)?;
    assert_eq!(newest.len(), 1);
    assert_eq!(
        newest[0]["row_ids"],
        serde_json::json!([ids[0]]),
        "{newest:?}"
    );
    let (ok, _, stderr) = outbox(&db, &["quarantine", "audit", "--limit=-1"])?;
    assert!(!ok && stderr.contains("--limit"), "{stderr}");
    Ok(())
}

/// A role that may not take the message out of the quarantine publishes nothing: the
/// privileges are checked before the copy is sent, not found missing after it. (The audit
/// needs none: the database writes it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_that_could_not_be_recorded_publishes_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let operator = Operator::new(&db).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "REVOKE DELETE ON outbox_consumer_quarantine FROM {}",
        operator.name
    )))
    .execute(&db.pool)
    .await?;
    let topic = outbox_tests::random_topic(1).await?;
    let ids = requeueable(&db, &topic).await?;
    let (ok, stdout, stderr) = run(
        &operator.url(&db),
        &[
            "quarantine",
            "requeue",
            "consumer",
            &ids[0].to_string(),
            "--brokers",
            &outbox_tests::kafka_bootstrap(),
        ],
        "",
    )?;
    let records = outbox_tests::read_all(&topic, 1, std::time::Duration::from_secs(30)).await?;
    assert_eq!(records.len(), 0, "nothing published: {stderr}");
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("lacks DELETE on") && stderr.contains("outbox_consumer_quarantine"),
        "{stderr}"
    );
    assert_eq!(count(&db, "outbox_consumer_quarantine").await?, 2);
    Ok(())
}

/// The registry and the audit are those of the table's schema: a schema earlier on the
/// `search_path` with a registry of its own cannot register a user's table.
#[tokio::test]
async fn a_registry_earlier_on_the_search_path_registers_nothing() -> Result<()> {
    let db = TestDb::new().await?;
    let schema = &db.schema;
    let shadow = format!("{schema}_shadow");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE payments (id BIGINT PRIMARY KEY, event_id UUID, consumer TEXT); \
         INSERT INTO payments VALUES (1, NULL, NULL); \
         CREATE SCHEMA {shadow}; \
         CREATE TABLE {shadow}.outbox_quarantine_tables \
             (LIKE {schema}.outbox_quarantine_tables INCLUDING ALL); \
         CREATE TABLE {shadow}.outbox_quarantine_audit \
             (LIKE {schema}.outbox_quarantine_audit INCLUDING ALL)"
    )))
    .execute(&db.pool)
    .await?;
    // Written so that it reads as a registration in the old layout and in the new.
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'outbox_quarantine_tables'",
    )
    .bind(&shadow)
    .fetch_all(&db.pool)
    .await?;
    let insert = if columns.iter().any(|c| c == "relname") {
        format!(
            "INSERT INTO {shadow}.outbox_quarantine_tables (table_oid, side, nspname, relname) \
             VALUES ('payments'::regclass, 'consumer', '{schema}', 'payments')"
        )
    } else {
        format!(
            "INSERT INTO {shadow}.outbox_quarantine_tables (table_oid, side) \
             VALUES ('payments'::regclass, 'consumer')"
        )
    };
    sqlx::query(sqlx::AssertSqlSafe(insert))
        .execute(&db.pool)
        .await?;
    let base = outbox_tests::database_url();
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{separator}options=-c%20search_path%3D{shadow}%2C{schema}");
    let (ok, stdout, stderr) = run(
        &url,
        &[
            "quarantine",
            "discard",
            "consumer",
            "1",
            "--quarantine-table",
            "payments",
        ],
        "",
    )?;
    let left = count(&db, "payments").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {shadow} CASCADE")))
        .execute(&db.pool)
        .await?;
    assert_eq!(left?, 1, "the user's row deleted: {stdout}");
    assert!(!ok && stderr.contains("not a quarantine table"), "{stderr}");
    Ok(())
}
