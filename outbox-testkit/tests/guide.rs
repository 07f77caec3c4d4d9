//! The guide's page on the kit shows the example that `tests/example.rs` runs, unchanged.

use std::path::Path;

#[test]
fn the_guide_shows_the_example_that_runs() -> std::io::Result<()> {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(crate_dir.join("../docs/src/testing.md"))?;
    let example = std::fs::read_to_string(crate_dir.join("tests/example.rs"))?;
    let shown: Vec<&str> = page
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("docs/src/testing.md has a ```rust block")
        .lines()
        .collect();
    // The file's own header (`//!` lines) is not shown.
    let code: Vec<&str> = example
        .lines()
        .skip_while(|line| line.starts_with("//!") || line.is_empty())
        .collect();
    let differs = shown
        .iter()
        .zip(&code)
        .position(|(a, b)| a != b)
        .or_else(|| (shown.len() != code.len()).then(|| shown.len().min(code.len())));
    if let Some(line) = differs {
        panic!(
            "docs/src/testing.md's example differs from outbox-testkit/tests/example.rs from \
             the example's line {} on (page: {:?}, file: {:?}): copy the file over",
            line + 1,
            shown.get(line),
            code.get(line)
        );
    }
    Ok(())
}
