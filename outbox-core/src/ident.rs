use std::fmt;

use crate::CoreError;

/// Longest table name accepted. Postgres truncates identifiers at 63 bytes; derived names
/// (its indexes) append up to 20 bytes to the table name.
const MAX_TABLE_NAME: usize = 40;

/// A validated SQL identifier: lowercase ASCII letters, digits and `_`, starting with a
/// letter or `_`, at most 40 bytes. Only such names are ever interpolated into SQL.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; anything else is a [`CoreError::InvalidIdentifier`], never SQL.
    pub fn new(name: impl Into<String>) -> Result<Self, CoreError> {
        let name = name.into();
        let reject = |reason| {
            Err(CoreError::InvalidIdentifier {
                name: name.clone(),
                reason,
            })
        };
        let Some(first) = name.chars().next() else {
            return reject("empty");
        };
        if name.len() > MAX_TABLE_NAME {
            return reject("longer than 40 bytes");
        }
        if !(first.is_ascii_lowercase() || first == '_') {
            return reject("must start with a lowercase ASCII letter or '_'");
        }
        if !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return reject("only lowercase ASCII letters, digits and '_' are allowed");
        }
        Ok(Self(name))
    }

    fn from_static(name: &'static str) -> Self {
        Self(name.to_owned())
    }

    /// The name of a table a migration derives from this one (`outbox_consumer_quarantine` →
    /// `outbox_consumer_quarantine_parked`); `suffix` is lowercase letters and `_`, and the
    /// name stays within Postgres's 63 bytes whatever this one's length.
    #[must_use]
    pub fn suffixed(&self, suffix: &'static str) -> Self {
        debug_assert!(suffix.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
        debug_assert!(self.0.len() + suffix.len() <= 63);
        Self(format!("{}{suffix}", self.0))
    }

    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    /// Formats the quoted form, ready to splice into SQL.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0)
    }
}

impl fmt::Debug for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// Names of the framework's tables. They resolve through the connection's `search_path`,
/// so a schema is chosen the Postgres way (for example `options=-c search_path=app` in the
/// connection URL); [`crate::migrator`] creates tables under these names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableNames {
    /// The outbox the producer writes and the relay reads.
    pub outbox: Ident,
    /// The consumer's dedup table.
    pub consumer_dedup: Ident,
    /// The consumer's quarantine table.
    pub consumer_quarantine: Ident,
}

impl TableNames {
    pub(crate) const DEFAULT_OUTBOX: &'static str = "outbox_events";
    pub(crate) const DEFAULT_CONSUMER_DEDUP: &'static str = "outbox_consumer_dedup";
    pub(crate) const DEFAULT_CONSUMER_QUARANTINE: &'static str = "outbox_consumer_quarantine";

    /// Same as the defaults but with another outbox table name.
    pub fn with_outbox(mut self, name: &str) -> Result<Self, CoreError> {
        self.outbox = Ident::new(name)?;
        Ok(self)
    }

    /// Same as the defaults but with other consumer table names.
    pub fn with_consumer_tables(
        mut self,
        dedup: &str,
        quarantine: &str,
    ) -> Result<Self, CoreError> {
        self.consumer_dedup = Ident::new(dedup)?;
        self.consumer_quarantine = Ident::new(quarantine)?;
        Ok(self)
    }
}

impl Default for TableNames {
    fn default() -> Self {
        Self {
            outbox: Ident::from_static(Self::DEFAULT_OUTBOX),
            consumer_dedup: Ident::from_static(Self::DEFAULT_CONSUMER_DEDUP),
            consumer_quarantine: Ident::from_static(Self::DEFAULT_CONSUMER_QUARANTINE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        assert_eq!(
            Ident::new("outbox_events_2").map(|i| i.to_string()).ok(),
            Some("\"outbox_events_2\"".into())
        );
    }

    #[test]
    fn rejects_hostile_names() {
        for name in [
            "",
            "x\"; DROP TABLE users; --",
            "Outbox",
            "1outbox",
            "outbox events",
            "public.outbox",
            "outbox-events",
            "a_name_that_is_far_too_long_for_derived_names",
            "ünicode",
        ] {
            assert!(
                matches!(Ident::new(name), Err(CoreError::InvalidIdentifier { .. })),
                "{name:?} should be rejected"
            );
        }
    }
}
