//! Every runnable example (`examples/examples/*.rs`), run as its binary against the real
//! PostgreSQL and broker, must finish on its own and succeed: they are the documentation's
//! code, so they must keep working.

use anyhow::{Context, Result, ensure};
use outbox_tests::{database_url, kafka_bootstrap};

/// The example `name`, built as a program. `cargo test` alone builds the examples so, but
/// `cargo test --all-targets` (what `scripts/test` runs) builds them only as test harnesses
/// (`<name>-<hash>`, which never call `main`): so the examples are built here once, by the
/// cargo that runs this test, with the workspace's features (those of a `--workspace` test
/// build, so nothing is compiled again then) and this test's profile; cargo says where each
/// program is.
async fn example(name: &str) -> Result<std::path::PathBuf> {
    let programs = BUILT
        .get_or_try_init(|| async {
            let exe = std::env::current_exe()?;
            let profile = match exe
                .parent()
                .and_then(std::path::Path::parent)
                .and_then(std::path::Path::file_name)
                .and_then(|n| n.to_str())
            {
                Some("debug") => "dev".to_owned(),
                Some(other) => other.to_owned(),
                None => anyhow::bail!("no profile directory above {}", exe.display()),
            };
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .context("the workspace directory")?;
            let out = tokio::process::Command::new(&cargo)
                .args(["build", "--workspace", "--examples", "--profile", &profile])
                .args(["--message-format", "json-render-diagnostics"])
                .current_dir(workspace)
                .output()
                .await
                .context("running cargo build --examples")?;
            ensure!(
                out.status.success(),
                "cargo build --examples failed: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            let mut programs = std::collections::HashMap::new();
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                let is_example = message["target"]["kind"]
                    .as_array()
                    .is_some_and(|kinds| kinds.iter().any(|k| k == "example"));
                if let (true, Some(name), Some(path)) = (
                    is_example,
                    message["target"]["name"].as_str(),
                    message["executable"].as_str(),
                ) {
                    programs.insert(name.to_owned(), std::path::PathBuf::from(path));
                }
            }
            Ok(programs)
        })
        .await?;
    programs
        .get(name)
        .cloned()
        .with_context(|| format!("cargo built no example {name}"))
}

static BUILT: tokio::sync::OnceCell<std::collections::HashMap<String, std::path::PathBuf>> =
    tokio::sync::OnceCell::const_new();

async fn run(name: &str) -> Result<()> {
    let path = example(name).await?;
    let out = tokio::process::Command::new(&path)
        .env("DATABASE_URL", database_url())
        .env("KAFKA_BROKERS", kafka_bootstrap())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {}", path.display()))?;
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
