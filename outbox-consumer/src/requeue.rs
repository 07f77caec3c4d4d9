//! Requeued copies are for one consumer. `outbox quarantine requeue` publishes a message a
//! consumer quarantined again to its topic, which every consumer group reads; the others
//! handled the original, and once their dedup rows for it are pruned they would handle the
//! copy a second time. The copy names its consumer in `wire::HEADER_REQUEUE_FOR`, and every
//! other consumer skips it here, before decoding: it is not theirs to handle, nor to
//! quarantine.

use std::panic::AssertUnwindSafe;

use outbox_core::wire::HEADER_REQUEUE_FOR;
use rdkafka::Message;
use rdkafka::message::{Headers, OwnedMessage};

use crate::consumer::{Counters, bump};

/// Whether `message` is a requeued copy for another consumer than `consumer`; counts and logs
/// it when it is.
pub(crate) fn for_another(consumer: &str, counters: &Counters, message: &OwnedMessage) -> bool {
    let Some(headers) = message.headers() else {
        return false;
    };
    let mut targets = (0..headers.count())
        // rdkafka 0.39 panics reading a header name that is not UTF-8: such a header is not
        // this one, and the record's other headers are still read.
        .filter_map(|i| std::panic::catch_unwind(AssertUnwindSafe(|| headers.try_get(i))).ok())
        .flatten()
        .filter(|h| h.key == HEADER_REQUEUE_FOR)
        .map(|h| h.value)
        .peekable();
    if targets.peek().is_none() || targets.any(|to| to == Some(consumer.as_bytes())) {
        return false;
    }
    bump(&counters.not_for_us);
    tracing::debug!(
        consumer,
        topic = message.topic(),
        partition = message.partition(),
        offset = message.offset(),
        "requeued copy for another consumer; skipped"
    );
    true
}
