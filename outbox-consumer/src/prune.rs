use std::time::Duration;

use outbox_core::TableNames;
use sqlx::PgConnection;

use crate::ConsumerError;

/// Deletes dedup rows processed more than `older_than` ago, at most `batch` rows per
/// statement (each its own short transaction), so it never holds long locks and can run while
/// consumers run, one instance at a time (another finds it running and returns 0). Returns
/// how many rows it removed.
///
/// Pick `older_than` longer than the longest time an event can be redelivered: the topic's
/// retention, or how far back a consumer group could be reset, plus the relay's longest
/// retry window. An event redelivered after its dedup row was pruned is handled again (it
/// looks new); its handler should then rely on the event id as an idempotency key with
/// outside systems.
pub async fn prune(
    conn: &mut PgConnection,
    tables: &TableNames,
    older_than: Duration,
    batch: u32,
) -> Result<u64, ConsumerError> {
    let t = &tables.consumer_dedup;
    // ctid lets each batch delete exactly the rows it selected, via the processed_at index.
    let query = format!(
        "DELETE FROM {t} WHERE ctid = ANY(ARRAY( \
            SELECT ctid FROM {t} WHERE processed_at < now() - $1 * interval '1 millisecond' \
            LIMIT $2))"
    );
    Ok(outbox_core::delete_in_batches(conn, t, query, older_than, batch).await?)
}
