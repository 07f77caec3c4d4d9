//! Confirmation of actions on many rows: asked on a terminal, refused without one unless
//! `--yes` (a script that forgot `--yes` fails, and changes nothing).

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Result, bail};

/// Whether to go on with `what` (a question without its `?`): `yes` says so at once; else a
/// terminal on stdin is asked, and anything but `y`/`yes` declines; without a terminal it is
/// an error.
pub(crate) fn confirm(what: &str, yes: bool) -> Result<()> {
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        bail!("refusing to {what} without confirmation: stdin is not a terminal; pass --yes");
    }
    let mut stderr = std::io::stderr();
    write!(stderr, "{what}? [y/N] ")?;
    stderr.flush()?;
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    if !matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes") {
        bail!("not confirmed; nothing was changed");
    }
    Ok(())
}
