//! SQL text for the consumer's tables. Only validated `Ident`s are spliced in.

use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

#[derive(Debug, Clone)]
pub(crate) struct ConsumerSql {
    /// `$3` is the id's slice (`dedup_slice`), as in the next two.
    pub(crate) insert_dedup: SqlStr,
    /// Inserts many ids at once; returns those that were new.
    pub(crate) insert_dedup_batch: SqlStr,
    /// Inserts many ids expected to be new; fails on any that is not (a unique violation).
    pub(crate) insert_new_dedup_batch: SqlStr,
    /// Deletes ids this transaction inserted but did not handle.
    pub(crate) delete_dedup_batch: SqlStr,
    pub(crate) quarantine: SqlStr,
}

impl ConsumerSql {
    pub(crate) fn new(tables: &TableNames) -> Self {
        let dedup = &tables.consumer_dedup;
        let quarantine = &tables.consumer_quarantine;
        Self {
            insert_dedup: AssertSqlSafe(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING"
            ))
            .into_sql_str(),
            insert_dedup_batch: AssertSqlSafe(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) \
                 SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice) \
                 ON CONFLICT DO NOTHING RETURNING event_id"
            ))
            .into_sql_str(),
            insert_new_dedup_batch: AssertSqlSafe(format!(
                "INSERT INTO {dedup} (consumer, event_id, slice) \
                 SELECT $1, t.id, t.slice FROM unnest($2::uuid[], $3::int[]) AS t(id, slice)"
            ))
            .into_sql_str(),
            delete_dedup_batch: AssertSqlSafe(format!(
                "DELETE FROM {dedup} WHERE consumer = $1 \
                 AND (event_id, slice) IN (SELECT * FROM unnest($2::uuid[], $3::int[]))"
            ))
            .into_sql_str(),
            quarantine: AssertSqlSafe(format!(
                "INSERT INTO {quarantine} \
                    (consumer, topic, partition, \"offset\", event_id, message_key, payload, headers, \
                     header_bytes, reason, error) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
                 ON CONFLICT (consumer, topic, partition, \"offset\", record_digest) DO NOTHING"
            ))
            .into_sql_str(),
        }
    }
}
