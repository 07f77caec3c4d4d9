//! Every runnable example (`examples/examples/*.rs`), run as its binary against the real
//! PostgreSQL and broker, must finish on its own and succeed: they are the documentation's
//! code, so they must keep working.

use anyhow::{Context, Result, ensure};
use outbox_tests::{database_url, kafka_bootstrap};

/// `target/<profile>/examples/<name>`: cargo builds the examples before the tests that need
/// them (`cargo test` builds every example), next to this test's own `deps` directory.
fn example(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .context("the test binary's directory")?;
    Ok(profile_dir.join("examples").join(name))
}

async fn run(name: &str) -> Result<()> {
    let path = example(name)?;
    let out = tokio::process::Command::new(&path)
        .env("DATABASE_URL", database_url())
        .env("KAFKA_BROKERS", kafka_bootstrap())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {} (built by `cargo test`)", path.display()))?;
    ensure!(
        out.status.success(),
        "{name} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test]
async fn enqueue_in_transaction() -> Result<()> {
    run("enqueue_in_transaction").await
}

#[tokio::test]
async fn relay_in_process() -> Result<()> {
    run("relay_in_process").await
}

#[tokio::test]
async fn minimal_consumer() -> Result<()> {
    run("minimal_consumer").await
}

#[tokio::test]
async fn stateful_handler() -> Result<()> {
    run("stateful_handler").await
}

#[tokio::test]
async fn chained_effects() -> Result<()> {
    run("chained_effects").await
}

#[tokio::test]
async fn consumer_statistics() -> Result<()> {
    run("consumer_statistics").await
}

#[tokio::test]
async fn dispatch_http() -> Result<()> {
    run("dispatch_http").await
}
