//! Configuration the harness must refuse before it touches anything.

use std::process::Command;

#[test]
fn hostile_table_name_is_a_configuration_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(["run", "--profile", "ci", "--seed", "1"])
        .arg("--outbox-table=outbox; DROP TABLE users; --")
        // Nothing may be attempted: an unreachable server proves no connection was made.
        .arg("--database-url=postgres://nobody@127.0.0.1:1/none")
        .env_remove("DATABASE_URL")
        .output()
        .expect("the harness starts");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("invalid --outbox-table"),
        "a clear configuration error, got: {stderr}"
    );
    assert!(String::from_utf8_lossy(&output.stdout).trim().is_empty());
}
