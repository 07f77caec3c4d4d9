//! SQL text for the consumer's tables. Only validated `Ident`s are spliced in.

use outbox_core::TableNames;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

#[derive(Debug, Clone)]
pub(crate) struct ConsumerSql {
    pub(crate) insert_dedup: SqlStr,
    /// Inserts many ids at once; returns those that were new.
    pub(crate) insert_dedup_batch: SqlStr,
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
                "INSERT INTO {dedup} (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ))
            .into_sql_str(),
            insert_dedup_batch: AssertSqlSafe(format!(
                "INSERT INTO {dedup} (consumer, event_id) SELECT $1, unnest($2::uuid[]) \
                 ON CONFLICT DO NOTHING RETURNING event_id"
            ))
            .into_sql_str(),
            delete_dedup_batch: AssertSqlSafe(format!(
                "DELETE FROM {dedup} WHERE consumer = $1 AND event_id = ANY($2)"
            ))
            .into_sql_str(),
            quarantine: AssertSqlSafe(format!(
                "INSERT INTO {quarantine} \
                    (consumer, topic, partition, \"offset\", event_id, message_key, payload, headers, reason, error) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
                 ON CONFLICT (consumer, topic, partition, \"offset\") DO NOTHING"
            ))
            .into_sql_str(),
        }
    }
}
