//! SQL text for a given outbox table. Table names are validated `Ident`s, the only thing
//! ever spliced into these statements; every value is a bind parameter.

use outbox_core::Ident;
use sqlx::{AssertSqlSafe, SqlStr};

use crate::lane::LaneRows;
use crate::relay::QuarantinePolicy;

fn sql(text: String) -> SqlStr {
    sqlx::SqlSafeStr::into_sql_str(AssertSqlSafe(text))
}

/// The `NOTIFY` channel of an outbox table: its OID, so that outboxes in different schemas
/// (or under different names) never wake each other's relays. Writers and relays both resolve
/// the table through their `search_path`.
pub(crate) fn channel_sql(table: &Ident) -> String {
    format!("'outbox_' || '{}'::regclass::oid::text", table.as_str())
}

/// The enqueue statements for one table and one choice of options.
#[derive(Debug, Clone)]
pub(crate) struct EnqueueSql {
    pub(crate) one: SqlStr,
    pub(crate) many: SqlStr,
}

const COLUMNS: &str = "id, aggregatetype, aggregateid, type, payload, headers, topic";

impl EnqueueSql {
    pub(crate) fn new(table: &Ident, lock_per_key: bool, notify: bool) -> Self {
        // The advisory lock's first key namespaces it by table, so the framework's locks never
        // meet the application's. The lock is taken before the row draws its sequence number,
        // so for one aggregate the sequence order is the commit order.
        let name = table.as_str();
        let lock_one =
            format!("lock AS (SELECT pg_advisory_xact_lock(hashtext('{name}'), hashtext($3)))");
        let lock_many = format!(
            "lock AS (SELECT count(pg_advisory_xact_lock(hashtext('{name}'), h)) AS n \
             FROM (SELECT DISTINCT hashtext(k) AS h FROM unnest($3::text[]) AS k ORDER BY h) AS keys)"
        );
        let values_one = "SELECT $1, $2, $3, $4, $5, $6, $7";
        let values_many = "SELECT t.id, t.aggregatetype, t.aggregateid, t.type, t.payload, t.headers, t.topic \
             FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[], $7::text[]) \
             WITH ORDINALITY AS t(id, aggregatetype, aggregateid, type, payload, headers, topic, ord)";
        let build = |lock: &str, values: &str, order: &str| {
            let mut ctes = Vec::new();
            let mut source = values.to_owned();
            if lock_per_key {
                ctes.push(lock.to_owned());
                source = format!(
                    "{source} {} lock",
                    if order.is_empty() {
                        "FROM"
                    } else {
                        "CROSS JOIN"
                    }
                );
            }
            let insert = format!("INSERT INTO {table} ({COLUMNS}) {source} {order}");
            if notify {
                // Delivered at commit, and only then: a rolled-back write wakes nobody.
                ctes.push(format!("ins AS ({insert} RETURNING 1)"));
                let with = ctes.join(", ");
                sql(format!(
                    "WITH {with} SELECT pg_notify({}, '') FROM (SELECT 1 FROM ins LIMIT 1) AS written",
                    channel_sql(table)
                ))
            } else if ctes.is_empty() {
                sql(insert)
            } else {
                sql(format!("WITH {} {insert}", ctes.join(", ")))
            }
        };
        Self {
            one: build(&lock_one, values_one, ""),
            many: build(&lock_many, values_many, "ORDER BY t.ord"),
        }
    }
}

/// Statements of the relay.
#[derive(Debug, Clone)]
pub(crate) struct RelaySql {
    pub(crate) claim: SqlStr,
    pub(crate) mark_published: SqlStr,
    /// Marks done with each row's answer (`$2`, JSON text or NULL) as its outcome.
    pub(crate) mark_done: SqlStr,
    pub(crate) delete_published: SqlStr,
    pub(crate) record_failures: SqlStr,
    /// Whether the lane leases what it claims (a dispatcher's): the claim marks its rows with
    /// a lease and commits, and `mark_done` and `record_failures` are fenced by that lease
    /// and take the rows' outcomes and call counts.
    pub(crate) leased: bool,
    /// The lane's rows, as a predicate on `topic` (for its gauges).
    pub(crate) lane_rows: String,
    /// A dispatcher's: gives up the pending actions older than `$1` ms among the oldest
    /// 10,000 pending of its destination, unless a live lease holds them.
    pub(crate) give_up_expired: SqlStr,
}

impl RelaySql {
    pub(crate) fn new(table: &Ident, policy: QuarantinePolicy, lane: &LaneRows) -> Self {
        // A lane's rows, for the claimed row `e` and for the earlier rows `h` and `p` of its
        // key that may hold it back: a relay and a dispatcher never hold each other's keys.
        // The claim's predicates on `e` are those of the lane's pending index (migration
        // 0013), word for word. A destination's topic is validated (letters, digits, `.`,
        // `_`, `-` after the prefix): the only value spliced into these statements.
        let (mine, lock_ns) = match lane {
            LaneRows::Relay => ("NOT LIKE 'dispatch:%'".to_owned(), String::new()),
            LaneRows::Dispatch(topic) => (format!("= '{topic}'"), format!(" || '/{topic}'")),
        };
        let lane_e_plain = match lane {
            LaneRows::Relay => "topic NOT LIKE 'dispatch:%'".to_owned(),
            LaneRows::Dispatch(topic) => format!("topic LIKE 'dispatch:%' AND topic = '{topic}'"),
        };
        let lane_e = match lane {
            LaneRows::Relay => "e.topic NOT LIKE 'dispatch:%'".to_owned(),
            LaneRows::Dispatch(topic) => {
                format!("e.topic LIKE 'dispatch:%' AND e.topic = '{topic}'")
            }
        };
        // An aggregate is (aggregatetype, aggregateid): `invoice/42` never holds `customer/42`
        // back. The unpublished-key index is on (aggregateid, seq), the holding index (0009) on
        // (aggregateid, aggregatetype, seq); on the former, aggregatetype is checked on the few
        // rows of one id it returns.
        //
        // Which earlier rows of a key hold its later rows back. Both forms contain the
        // predicate of the partial index on (aggregateid, seq) of unpublished rows, written as
        // literals, so the planner can use that index.
        let blocking = match policy {
            QuarantinePolicy::SkipQuarantined => {
                "p.status <> 'published' AND p.status <> 'quarantined'"
            }
            QuarantinePolicy::BlockKey => "p.status <> 'published'",
        };
        // Which earlier rows hold a key's later rows back before the LIMIT: those waiting for
        // their retry and (BlockKey) quarantined ones. Written so that they imply the predicate
        // of the small index on such rows (migration 0009), and never say status = 'pending':
        // that would also let the planner probe the pending index, which it did whenever its
        // statistics dated from a fully published table (36 ms vs 7 ms per batch, bench P5).
        // A row waiting out its partition's outage has no attempt charged, only a
        // `last_error`: both forms name it, as does the index's predicate (migration 0009).
        let held = match policy {
            QuarantinePolicy::SkipQuarantined => {
                "(h.status <> 'published' AND h.status <> 'quarantined' \
                  AND (h.attempts > 0 OR h.last_error IS NOT NULL) AND h.next_attempt_at > now())"
            }
            // Quarantined, or waiting (failed before, its time not come), written as a
            // conjunction: Postgres proved the index's predicate from it, not from the nested
            // `quarantined OR (failed AND waiting)`, and probed the unpublished-key index.
            QuarantinePolicy::BlockKey => {
                "(h.status <> 'published' \
                  AND (h.status = 'quarantined' OR h.attempts > 0 OR h.last_error IS NOT NULL) \
                  AND (h.status = 'quarantined' OR h.next_attempt_at > now()))"
            }
        };
        // The relay's reads no column newer than its own migrations (a rolling upgrade).
        let lease = match lane {
            LaneRows::Relay => "",
            LaneRows::Dispatch(_) => ", lease",
        };
        let claimed = format!(
            "WITH claimed AS ( \
                SELECT seq, id, aggregatetype, aggregateid, type, payload, headers, topic, \
                       created_at, attempts{lease} \
                FROM {table} e \
                WHERE status = 'pending' AND {lane_e} AND next_attempt_at <= now() \
                  AND CASE WHEN NOT EXISTS ( \
                    SELECT 1 FROM {table} h \
                    WHERE h.aggregateid = e.aggregateid AND h.aggregatetype = e.aggregatetype \
                      AND h.seq < e.seq AND h.topic {mine} AND {held} \
                    OFFSET 0) \
                  THEN pg_try_advisory_xact_lock(hashtextextended( \
                    '{table}'::regclass::oid::text{lock_ns} || '/' || e.aggregatetype || '/' || e.aggregateid, 0)) \
                  ELSE false END \
                ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
        let kept = format!(
            "NOT EXISTS ( \
                SELECT 1 FROM {table} p \
                WHERE p.aggregateid = c.aggregateid AND p.aggregatetype = c.aggregatetype \
                  AND p.seq < c.seq AND p.topic {mine} AND {blocking} \
                  AND p.seq NOT IN (SELECT seq FROM claimed) OFFSET 0)"
        );
        Self {
            // Lock a batch of due pending rows that no waiting or blocking row of their key
            // holds back (filtered before the LIMIT: held-back rows never fill the batch and
            // starve the keys behind them). Then keep only those with no earlier blocking row
            // of the same key outside this batch: such a row is being published by another
            // relay (locked, so skipped), or was written in a way the first filter cannot see.
            // The claim also takes a transaction-scoped advisory lock per aggregate (in the
            // table's namespace, its OID; not the enqueue's lock, which writers wait for), and
            // skips the aggregates whose lock another relay holds, before the LIMIT: otherwise a
            // busy aggregate's later rows, held back by the rows another relay is publishing,
            // fill the LIMIT and are all dropped by the second filter, and the claim returns
            // nothing while other keys' rows wait.
            // The lock is taken only for a row no earlier row holds back, in a CASE because
            // Postgres orders a scan's conditions by cost alone: the cheap lock ran before the
            // costlier held probe, and every held key the claim walked past stayed locked until
            // its batch committed (one entry each in the server's shared lock table).
            // `OFFSET 0` keeps both NOT EXISTS per-row lookups on (aggregateid, seq): as
            // anti-joins the planner, misled by stale statistics on fresh pending rows, scanned
            // every pending row per claimed row (2 s vs 12 ms per batch with 1M retained rows;
            // for the held check, 2.2 s vs 0.25 s per batch at 10M pending, bench P7).
            // The claimed rows' columns are those of the version each lock took: a row
            // updated and committed after the statement's snapshot is locked (and rechecked)
            // in its newest version, where a join back to the table, reading with the
            // snapshot, returned the version before the update, and fetched every row twice
            // (0.34 vs 0.27 ms to plan, 0.19 vs 0.14 ms to run for 16 rows, EXPLAIN ANALYZE
            // on PostgreSQL 15, 2026-12-06).
            claim: match lane {
                LaneRows::Relay => sql(format!(
                    "{claimed} \
                     SELECT c.seq, c.id, c.aggregatetype, c.aggregateid, c.type, \
                            c.payload::text AS payload, c.headers::text AS headers, c.topic, \
                            c.created_at, c.attempts, 0 AS calls, NULL::uuid AS lease, \
                            false AS orphaned \
                     FROM claimed c WHERE {kept} ORDER BY c.seq"
                )),
                // The dispatcher's claim leases what it keeps and commits: `lease` ($2) marks
                // the rows, `next_attempt_at` is the lease's end (a key's n-th row of the batch
                // may wait for the calls before it: n call timeouts, $3 ms each, and a margin,
                // $4 ms), and the attempt is charged now, so that a leased row holds its key's
                // later rows back (the `held` forms above and the holding index, 0009), and an
                // action whose dispatcher died mid-call counts that attempt. A row whose lease
                // a dead claim left (`previous`) keeps that claim's charge instead of a second.
                // `calls` counts calls that may have applied it; the record takes back what was
                // not sent.
                LaneRows::Dispatch(_) => sql(format!(
                    "{claimed}, \
                     kept AS ( \
                        SELECT c.seq, c.lease AS previous, row_number() OVER \
                               (PARTITION BY c.aggregatetype, c.aggregateid ORDER BY c.seq) AS position \
                        FROM claimed c WHERE {kept}), \
                     leased AS ( \
                        UPDATE {table} AS e SET lease = $2, calls = e.calls + 1, \
                               attempts = e.attempts + CASE WHEN k.previous IS NULL THEN 1 ELSE 0 END, \
                               next_attempt_at = clock_timestamp() \
                                   + (k.position * $3 + $4) * interval '1 millisecond' \
                        FROM kept k WHERE e.seq = k.seq \
                        RETURNING e.seq, e.id, e.aggregatetype, e.aggregateid, e.type, \
                               e.payload::text AS payload, e.headers::text AS headers, e.topic, \
                               e.created_at, \
                               e.attempts - 1 AS attempts, \
                               e.calls - 1 AS calls, e.lease, k.previous IS NOT NULL AS orphaned) \
                     SELECT * FROM leased ORDER BY seq"
                )),
            },
            // clock_timestamp(), not now(): the transaction began before the (possibly slow)
            // publish, and a retry time computed from its start could already be past.
            mark_published: sql(format!(
                "UPDATE {table} SET status = 'published', published_at = clock_timestamp(), \
                        attempts = attempts + 1, last_error = NULL \
                 WHERE seq = ANY($1)"
            )),
            // A dispatcher's: the attempt was charged by the claim; fenced by the lease.
            mark_done: sql(format!(
                "UPDATE {table} AS e SET status = 'published', published_at = clock_timestamp(), \
                        last_error = NULL, outcome = d.outcome::jsonb, lease = NULL \
                 FROM unnest($1::bigint[], $2::text[], $3::uuid[]) AS d(seq, outcome, lease) \
                 WHERE e.seq = d.seq AND e.lease = d.lease"
            )),
            delete_published: sql(format!("DELETE FROM {table} WHERE seq = ANY($1)")),
            // The relay's leaves `outcome` alone (it has none to store), so it also runs on
            // a table from before migration 0012 during a rolling upgrade.
            record_failures: sql(match lane {
                LaneRows::Relay => format!(
                    "UPDATE {table} AS e SET attempts = e.attempts + f.charge, status = f.status, \
                            next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond', \
                            last_error = f.error \
                     FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[]) \
                          AS f(seq, status, delay_ms, error, charge) \
                     WHERE e.seq = f.seq"
                ),
                // Fenced by the lease; `charge` takes back the claim's (0 or -1), `calls` the
                // call that was not sent (0 or -1); a row released untried keeps its error.
                LaneRows::Dispatch(_) => format!(
                    "UPDATE {table} AS e SET attempts = e.attempts + f.charge, status = f.status, \
                            next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond', \
                            last_error = COALESCE(f.error, e.last_error), \
                            outcome = CASE WHEN f.error IS NULL THEN e.outcome ELSE f.outcome::jsonb END, \
                            calls = e.calls + f.calls, lease = NULL \
                     FROM unnest($1::bigint[], $2::text[], $3::float8[], $4::text[], $5::int[], \
                                 $6::text[], $7::uuid[], $8::int[]) \
                          AS f(seq, status, delay_ms, error, charge, outcome, lease, calls) \
                     WHERE e.seq = f.seq AND e.lease = f.lease"
                ),
            }),
            leased: matches!(lane, LaneRows::Dispatch(_)),
            // The oldest pending actions by seq, from the dispatch pending index (0013): the
            // expired ones are among them, and the scan stops at 10,000 whatever the backlog.
            give_up_expired: sql(format!(
                "UPDATE {table} AS e SET status = 'quarantined', lease = NULL, \
                        last_error = 'Permanent: older than max_age, given up without a call: ' \
                            || CASE WHEN e.calls > 0 THEN 'an earlier call may have applied it' \
                                    ELSE 'it was never sent' END \
                 FROM (SELECT seq FROM (SELECT seq, created_at FROM {table} \
                                         WHERE status = 'pending' AND {lane_e_plain} \
                                         ORDER BY seq LIMIT 10000) AS oldest \
                       WHERE created_at < now() - $1 * interval '1 millisecond') AS x \
                 WHERE e.seq = x.seq AND e.status = 'pending' \
                   AND (e.lease IS NULL OR e.next_attempt_at <= now())"
            )),
            lane_rows: format!("topic {mine}"),
        }
    }
}
