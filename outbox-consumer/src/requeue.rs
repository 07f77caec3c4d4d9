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

use outbox_core::wire::HEADER_REQUEUE_FOR;
use rdkafka::Message;
use rdkafka::message::OwnedMessage;

use crate::headers::{self, Read};

/// Whether `message` is a requeued copy for another consumer than `consumer`; logs it when it
/// is.
pub(crate) fn for_another(consumer: &str, message: &OwnedMessage, read: &[Read<'_>]) -> bool {
    if headers::name_defect(read).is_some() {
        return false;
    }
    let Ok(targets) = targets(read) else {
        return false;
    };
    if targets.is_empty() || targets.contains(&consumer) {
        return false;
    }
    tracing::info!(
        consumer,
        topic = message.topic(),
        partition = message.partition(),
        offset = message.offset(),
        for_consumers = %targets.iter().map(|t| outbox_core::escape(t).to_string()).collect::<Vec<_>>().join(", "),
        "requeued copy for another consumer; skipped"
    );
    true
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
