//! Text from outside (a Kafka record's ids, header values, payload text quoted by a serde
//! error, a quarantine row's error) on its way to a log line or a terminal: a CR, LF or ESC in
//! it would forge log lines or drive the operator's terminal. Everything that prints such
//! text goes through [`escape`] or [`escape_bytes`].

use std::fmt;

/// `text` for one log or terminal line: control characters (C0, DEL, C1), invisible and
/// direction-changing characters, backslashes and quotes are written as Rust escapes
/// (`\n`, `\u{1b}`, `\\`); everything else as is. Shown with `Display` (`%` in `tracing`).
///
/// ```
/// assert_eq!(outbox_core::escape("a\r\n\x1b[31mb").to_string(), r"a\r\n\u{1b}[31mb");
/// ```
pub fn escape(text: &str) -> Escaped<'_> {
    Escaped(text)
}

/// [`escape`] for bytes that may not be UTF-8: invalid bytes are written as `\xNN`.
///
/// ```
/// assert_eq!(outbox_core::escape_bytes(b"id\n\xff").to_string(), r"id\n\xff");
/// ```
pub fn escape_bytes(bytes: &[u8]) -> EscapedBytes<'_> {
    EscapedBytes(bytes)
}

/// Text shown escaped; made by [`escape`].
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0.escape_debug(), f)
    }
}

/// Bytes shown escaped; made by [`escape_bytes`].
#[derive(Debug, Clone, Copy)]
pub struct EscapedBytes<'a>(&'a [u8]);

impl fmt::Display for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for chunk in self.0.utf8_chunks() {
            fmt::Display::fmt(&chunk.valid().escape_debug(), f)?;
            for byte in chunk.invalid() {
                write!(f, "\\x{byte:02x}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `shown` could break a line or reach a terminal as a control sequence.
    fn unsafe_char(shown: &str) -> Option<char> {
        shown.chars().find(|c| {
            c.is_control() || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}')
        })
    }

    #[test]
    fn control_characters_never_pass() {
        let hostile = "id\nforged line\r\x1b[31mred\x07\x08\x7f\u{85}\u{9b}2J\u{202e}txt\u{200b}";
        let shown = escape(hostile).to_string();
        assert_eq!(unsafe_char(&shown), None, "{shown}");
        assert!(
            shown.starts_with(r"id\nforged line\r\u{1b}[31mred"),
            "{shown}"
        );
        let all: String = (0..=0x9f_u32).filter_map(char::from_u32).collect();
        assert_eq!(unsafe_char(&escape(&all).to_string()), None);
    }

    #[test]
    fn readable_text_is_kept_and_escapes_are_unambiguous() {
        assert_eq!(escape("Grüße, 注文 #42").to_string(), "Grüße, 注文 #42");
        // A literal backslash-n is not shown like a newline.
        assert_ne!(escape("a\\nb").to_string(), escape("a\nb").to_string());
    }

    #[test]
    fn bytes_keep_valid_text_and_show_the_rest_as_hex() {
        assert_eq!(
            escape_bytes(b"ok \xe2\x82\xac \xff\xfe\n\x1b").to_string(),
            r"ok € \xff\xfe\n\u{1b}"
        );
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(unsafe_char(&escape_bytes(&all).to_string()), None);
    }
}
