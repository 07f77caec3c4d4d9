//! Requeued copies are for one consumer. `outbox quarantine requeue` publishes a message a
//! consumer quarantined again to its topic, which every consumer group reads; the others
//! handled the original, and once their dedup rows for it are pruned they would handle the
//! copy a second time. The copy names its consumer in `wire::HEADER_REQUEUE_FOR`. Every other
//! consumer skips it, before decoding, if it recorded the copy's event id (it handled the
//! original): not theirs to handle, nor to quarantine. A copy whose id a consumer never
//! recorded is quarantined by it as `requeue_unseen`: anyone who can write to the topic can
//! add the header, and a skip on the header's word alone made every consumer drop a record
//! it never handled, with a log line only. Its dedup row pruned, a true copy is quarantined
//! too, and an operator discards it.
//!
//! Only a header read whole (`headers.rs`) with a non-empty UTF-8 value names a consumer. A
//! record with a header name librdkafka cuts at a NUL (`outbox-requeue-for\0x` reads as the
//! requeue header) or cannot read, or with a requeue header that names nobody (no value, an
//! empty one, bytes that are not UTF-8), is no copy: skipped by every consumer, it would be
//! handled by none and quarantined by none. It is decoded, and `decode` quarantines it.

use outbox_core::wire::{self, HEADER_REQUEUE_FOR};
use uuid::Uuid;

use crate::decode::Rejected;
use crate::headers::{self, Read};

/// The consumers a record (its headers `read`) is a requeued copy for, escaped and joined,
/// when they are not `consumer`.
pub(crate) fn for_another(consumer: &str, read: &[Read<'_>]) -> Option<String> {
    if headers::name_defect(read).is_some() {
        return None;
    }
    let targets = targets(read).ok()?;
    if targets.is_empty() || targets.contains(&consumer) {
        return None;
    }
    Some(
        targets
            .iter()
            .map(|t| outbox_core::escape(t).to_string())
            .collect::<Vec<_>>()
            .join(", "),
    )
}

/// The event id of a record (its headers `read`, names all whole), if it has one.
pub(crate) fn event_id(read: &[Read<'_>]) -> Option<Uuid> {
    let whole = read.iter().filter_map(|h| match *h {
        Read::Whole(name, value) => Some((name, value)),
        _ => None,
    });
    wire::event_id(whole).ok().map(|id| *id.as_uuid())
}

/// The quarantine reason of a copy for another consumer of an event this one never recorded.
pub(crate) const UNSEEN: &str = "requeue_unseen";

/// Why a copy for `targets` (escaped) with event id `id` is quarantined by a consumer that
/// never recorded that id (nor handles it earlier in the same batch). Never parks a key.
pub(crate) fn unseen(targets: &str, id: Option<Uuid>) -> Rejected {
    let error = match id {
        Some(id) => format!(
            "a copy requeued for {targets}, of event {id}, which this consumer never recorded: \
             its {HEADER_REQUEUE_FOR} header may be forged, or the dedup row was pruned; \
             requeue it for this consumer to handle it, or discard it"
        ),
        None => format!(
            "a copy requeued for {targets} without a readable event id: \
             its {HEADER_REQUEUE_FOR} header may be forged"
        ),
    };
    Rejected {
        reason: UNSEEN,
        error,
        event_id: id,
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
