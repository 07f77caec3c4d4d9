//! A claimed row, and a batch's rows grouped by key.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use outbox_core::EventId;

/// One claimed outbox row. `payload` and `headers` are read as their JSON text and parsed
/// per row: the column allows any JSONB (other writers share the table), including values
/// serde_json refuses (`1e400`, nesting past 127 levels), and such a value must fail its own
/// row when it is sent, never the claim of the whole batch.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct OutboxRow {
    pub(crate) seq: i64,
    pub(crate) id: EventId,
    pub(crate) aggregatetype: String,
    pub(crate) aggregateid: String,
    #[sqlx(rename = "type")]
    pub(crate) event_type: String,
    pub(crate) payload: String,
    pub(crate) headers: String,
    pub(crate) topic: String,
    pub(crate) created_at: DateTime<Utc>,
    /// Attempts charged before this claim.
    pub(crate) attempts: i32,
    /// Calls before this claim that may have applied it (always 0 for the relay's rows).
    pub(crate) calls: i32,
    /// The lease this claim took (a dispatcher's claim; `None` for the relay's).
    pub(crate) lease: Option<uuid::Uuid>,
    /// The row was leased by a claim that never recorded it (its dispatcher died or was cut
    /// off mid-call): a call may have applied it.
    pub(crate) orphaned: bool,
}

/// The batch's rows grouped by aggregate (`aggregatetype`, `aggregateid`), each group in
/// sequence order: a key's rows are performed one after the other, keys side by side.
pub(crate) fn chains(rows: &[OutboxRow]) -> Vec<Vec<usize>> {
    let mut index: HashMap<(&str, &str), usize> = HashMap::new();
    let mut chains: Vec<Vec<usize>> = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let key = (row.aggregatetype.as_str(), row.aggregateid.as_str());
        let n = *index.entry(key).or_insert_with(|| {
            chains.push(Vec::new());
            chains.len() - 1
        });
        chains[n].push(i);
    }
    chains
}

#[cfg(test)]
pub(crate) fn test_row(kind: &str, key: &str, topic: &str) -> OutboxRow {
    OutboxRow {
        seq: 0,
        id: EventId::new(),
        aggregatetype: kind.into(),
        aggregateid: key.into(),
        event_type: "T".into(),
        payload: "{}".into(),
        headers: "{}".into(),
        topic: topic.into(),
        created_at: Utc::now(),
        attempts: 0,
        calls: 0,
        lease: None,
        orphaned: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregate_is_its_type_and_id() {
        let rows = [
            test_row("invoice", "a", "t1"),
            test_row("invoice", "b", "t1"),
            test_row("invoice", "a", "t2"),
            test_row("customer", "a", "t1"),
            test_row("invoice", "a", "t1"),
        ];
        assert_eq!(chains(&rows), [vec![0, 2, 4], vec![1], vec![3]]);
    }
}
