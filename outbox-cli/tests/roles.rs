//! The `outbox` binary as the least-privileged roles of the guide's "Roles" section:
//! `outbox status` as the read-only role, `outbox prune dedup` as the tables' owner (the only
//! role that may drop and make day slices). Each fails without its documented grants.

use std::process::Command;

use anyhow::Result;
use outbox_tests::{Login, Roles};

/// Runs `outbox args` as `login`; the URL, with its password, goes through the environment.
fn outbox(roles: &Roles, login: &Login, args: &[&str]) -> Result<(bool, String, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(args)
        .env("DATABASE_URL", roles.url(login)?)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    Ok((
        out.status.success(),
        String::from_utf8(out.stdout)?,
        String::from_utf8(out.stderr)?,
    ))
}

#[tokio::test]
async fn status_and_prune_run_as_their_documented_roles() -> Result<()> {
    let roles = Roles::new().await?;

    let (ok, stdout, stderr) = outbox(&roles, &roles.status, &["status", "--json"])?;
    assert!(ok, "{stderr}");
    let status: serde_json::Value = serde_json::from_str(&stdout)?;
    assert_eq!(status["pending"], 0);

    // The pruner is the owner: it drops and makes day slices.
    let (ok, stdout, stderr) = outbox(
        &roles,
        &roles.owner,
        &["prune", "dedup", "--older-than", "7d"],
    )?;
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.trim(),
        "dropped 0 day slices, removed 0 timeless rows, made 9 day slices ahead"
    );
    // Not the consumer, nor the status role: making a slice needs the table's owner.
    for login in [&roles.consumer, &roles.status] {
        let (ok, _, stderr) = outbox(&roles, login, &["prune", "dedup", "--older-than", "7d"])?;
        assert!(!ok, "{} pruned", login.name);
        assert!(
            stderr.contains("permission denied") || stderr.contains("must be owner"),
            "{stderr}"
        );
    }

    // The documented grants less one: status reads the quarantine.
    roles
        .as_admin(&format!(
            "REVOKE SELECT ON {}.outbox_consumer_quarantine FROM {}",
            roles.schema, roles.status.name
        ))
        .await?;
    let (ok, _, stderr) = outbox(&roles, &roles.status, &["status"])?;
    assert!(!ok, "status ran without SELECT on the quarantine");
    assert!(stderr.contains("permission denied"), "{stderr}");
    roles.drop_all().await
}
