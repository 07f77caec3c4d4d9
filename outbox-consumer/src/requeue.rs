//! Requeued copies are for one consumer. `outbox quarantine requeue` publishes a message a
//! consumer quarantined again to its topic, which every consumer group reads; the others
//! handled the original, and once their dedup rows for it are pruned they would handle the
//! copy a second time. The copy names its consumer in `wire::HEADER_REQUEUE_FOR`, and every
//! other consumer skips it here, before decoding: it is not theirs to handle, nor to
//! quarantine.
//!
//! Only a header read whole (`headers.rs`) with a non-empty UTF-8 value names a consumer. A
//! record with a header name librdkafka cuts at a NUL (`outbox-requeue-for\0x` reads as the
//! requeue header) or cannot read, or with a requeue header that names nobody (no value, an
//! empty one, bytes that are not UTF-8), is no copy: skipped by every consumer, it would be
//! handled by none and quarantined by none. It is decoded, and `decode` quarantines it.
//!
//! Nor is a record whose `wire::HEADER_REQUEUE_TOKEN` does not name a requeue the database
//! recorded for the consumer the copy names (`batch.rs` checks, one statement for a batch's
//! copies): anyone who may produce to the topic could set the header and have every other
//! consumer skip the record. It is quarantined as `forged_requeue`.

use outbox_core::wire::{HEADER_REQUEUE_FOR, HEADER_REQUEUE_TOKEN};
use std::collections::HashMap;

use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use uuid::Uuid;

use crate::headers::{self, Read};

/// What a record that says it is a requeued copy for other consumers says: the requeue (its
/// token) and the consumers it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) token: Option<Uuid>,
    pub(crate) targets: Vec<String>,
}

impl Copy {
    /// Whether the requeue `recorded` (token → the consumer it was made for) holds it.
    pub(crate) fn is_recorded(&self, recorded: &HashMap<Uuid, String>) -> bool {
        self.token
            .and_then(|token| recorded.get(&token))
            .is_some_and(|to| self.targets.contains(to))
    }

    /// Logs the copy, skipped.
    pub(crate) fn skipped(&self, consumer: &str, message: &OwnedMessage) {
        tracing::info!(
            consumer,
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            for_consumers = %self.targets.iter().map(|t| outbox_core::escape(t).to_string()).collect::<Vec<_>>().join(", "),
            "requeued copy for another consumer; skipped"
        );
    }

    /// Why a copy whose requeue is not recorded is quarantined.
    pub(crate) fn forged(&self) -> String {
        format!(
            "header {HEADER_REQUEUE_FOR} names other consumers ({}), but {}: a copy              `outbox quarantine requeue` did not make (skipping it, every other consumer would              have dropped the record)",
            self.targets
                .iter()
                .map(|t| outbox_core::escape(t).to_string())
                .collect::<Vec<_>>()
                .join(", "),
            match self.token {
                None => format!("no single UUID in {HEADER_REQUEUE_TOKEN}"),
                Some(token) => format!("requeue {token} is not recorded for any of them"),
            }
        )
    }
}

/// Whether `message` says it is a requeued copy for another consumer than `consumer`: what it
/// says, to be checked against the requeues recorded (see the module docs).
pub(crate) fn for_another(consumer: &str, read: &[Read<'_>]) -> Option<Copy> {
    if headers::name_defect(read).is_some() {
        return None;
    }
    let targets = targets(read).ok()?;
    if targets.is_empty() || targets.contains(&consumer) {
        return None;
    }
    Some(Copy {
        token: token(read),
        targets: targets.into_iter().map(str::to_owned).collect(),
    })
}

/// The requeue a copy says it is (its one `outbox-requeue-token` header, a UUID), if any.
fn token(read: &[Read<'_>]) -> Option<Uuid> {
    let mut tokens = read.iter().filter_map(|h| match *h {
        Read::Whole(name, value) if name == HEADER_REQUEUE_TOKEN => Some(value),
        _ => None,
    });
    match (tokens.next(), tokens.next()) {
        (Some(Some(bytes)), None) => Uuid::try_parse_ascii(bytes).ok(),
        _ => None,
    }
}

/// The consumers the requeue headers of a record (its headers `read`, names all whole) name,
/// or why one of them names none.
pub(crate) fn targets<'m>(read: &[Read<'m>]) -> Result<Vec<&'m str>, String> {
    read.iter()
        .enumerate()
        .filter_map(|(i, h)| match *h {
            Read::Whole(name, value) if name == HEADER_REQUEUE_FOR => Some((i, value)),
            _ => None,
        })
        .map(|(i, value)| match value {
            None => Err(format!("header {i} ({HEADER_REQUEUE_FOR}) has no value")),
            Some([]) => Err(format!("header {i} ({HEADER_REQUEUE_FOR}) is empty")),
            Some(bytes) => std::str::from_utf8(bytes).map_err(|_| {
                format!(
                    "header {i} ({HEADER_REQUEUE_FOR}) is not UTF-8: {}",
                    bytes.escape_ascii()
                )
            }),
        })
        .collect()
}
