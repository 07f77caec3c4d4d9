//! What the commands print, with text from outside (Kafka records, their headers, error
//! messages quoting them) escaped so that it cannot break a line or drive the terminal.

use anyhow::Result;
use serde::Serialize;

/// `value` as JSON (indented when `pretty`) safe for a terminal. serde_json escapes the C0
/// control characters inside strings but writes DEL, C1 controls and invisible or
/// direction-changing characters as they are; those are written as `\uXXXX` too. They can
/// only occur inside strings, so the JSON reads back to the same values.
pub(crate) fn json(value: &impl Serialize, pretty: bool) -> Result<String> {
    let text = if pretty {
        serde_json::to_string_pretty(value)?
    } else {
        serde_json::to_string(value)?
    };
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if needs_escape(c) {
            for unit in c.encode_utf16(&mut [0; 2]) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Whether `c` (outside JSON's own syntax) is one `outbox_core::escape` would escape.
fn needs_escape(c: char) -> bool {
    !matches!(c, '\n' | '"' | '\\' | '\'')
        && outbox_core::escape(c.encode_utf8(&mut [0; 4]))
            .to_string()
            .starts_with('\\')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_no_raw_control_characters_and_reads_back_the_same() -> Result<()> {
        let hostile = serde_json::json!({
            "error": "x\n\r\x1b[31m\x7f\u{85}\u{9b}2J\u{202e}\u{200b}é \"q\" \\ 'a'",
        });
        for pretty in [false, true] {
            let shown = json(&hostile, pretty)?;
            assert!(
                !shown.chars().any(|c| c != '\n' && c.is_control()),
                "{shown}"
            );
            assert!(!shown.contains(['\u{202e}', '\u{200b}']), "{shown}");
            assert!(shown.contains("é"), "{shown}");
            let read: serde_json::Value = serde_json::from_str(&shown)?;
            assert_eq!(read, hostile);
        }
        Ok(())
    }
}
