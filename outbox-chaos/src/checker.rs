//! The end-of-run checker. It trusts nothing the processes said about themselves: it reads
//! the database (outbox, state, attempts, effects, quarantine) and the whole topic, read back
//! with a plain consumer, and counts every violation of the framework's promises.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use anyhow::Result;
use outbox_core::TableNames;
use sqlx::types::chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::summary::Summary;
use outbox_tests::read_all_from as read_all;

/// What to check.
#[derive(Debug)]
pub(crate) struct Target<'a> {
    pub(crate) pool: &'a PgPool,
    pub(crate) tables: &'a TableNames,
    pub(crate) brokers: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) partitions: i32,
    pub(crate) groups: &'a [String],
}

#[derive(Debug, sqlx::FromRow)]
struct OutboxRow {
    seq: i64,
    id: Uuid,
    aggregateid: String,
    status: String,
    version: Option<i64>,
    last_error: Option<String>,
    published_at: Option<DateTime<Utc>>,
}

/// A row the harness discarded as the operator (`chaos_operator_discards`).
#[derive(Debug, sqlx::FromRow)]
struct DiscardRow {
    event_id: Uuid,
    key: String,
    seq: i64,
    last_error: Option<String>,
    discarded_at: DateTime<Utc>,
}

#[derive(Debug, sqlx::FromRow)]
struct EffectRow {
    consumer: String,
    event_id: Uuid,
    key: String,
    version: i64,
}

#[derive(Debug, sqlx::FromRow)]
struct PoisonRow {
    partition: i32,
    kafka_offset: i64,
    expected_reason: String,
    epoch: i32,
}

#[derive(Debug, sqlx::FromRow)]
struct QuarantineRow {
    consumer: String,
    partition: i32,
    offset: i64,
    reason: String,
    quarantined_at: DateTime<Utc>,
}

/// Logs the first few examples of a violation.
pub(crate) fn report<T: std::fmt::Debug>(what: &str, examples: &[T]) {
    if !examples.is_empty() {
        let shown: Vec<_> = examples.iter().take(5).collect();
        tracing::error!(count = examples.len(), examples = ?shown, "violation: {what}");
    }
}

pub(crate) fn n(len: usize) -> u64 {
    u64::try_from(len).unwrap_or(u64::MAX)
}

/// Rows published before the operator discarded an earlier quarantined row of their key:
/// under `BlockKey` the key's later rows wait for that. Exact, since a row is marked
/// published (`clock_timestamp()`) only after its claim, which cannot pass the quarantined
/// row before the discard's commit, and `discarded_at` is taken before that commit.
fn published_past_block<'a>(
    outbox: &[OutboxRow],
    discards: impl Iterator<Item = &'a DiscardRow>,
) -> Vec<String> {
    let mut early = Vec::new();
    for d in discards {
        for row in outbox
            .iter()
            .filter(|r| r.aggregateid == d.key && r.seq > d.seq)
        {
            if row.published_at.is_some_and(|at| at < d.discarded_at) {
                early.push(format!(
                    "key {} seq {} published at {:?}, before seq {} was discarded at {}",
                    d.key, row.seq, row.published_at, d.seq, d.discarded_at
                ));
            }
        }
    }
    early
}

/// Runs every check; the returned summary has `runs = 1` and no fault counts.
pub(crate) async fn check(t: &Target<'_>) -> Result<Summary> {
    let mut s = Summary {
        runs: 1,
        ..Summary::default()
    };
    let outbox_table = &t.tables.outbox;
    // The events for Kafka; the dispatcher fleet's actions share the table and are checked
    // against the billing API's ledger (`dispatch::check`). A relay that took one would
    // publish it, and the record would show here as a phantom.
    let outbox: Vec<OutboxRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT seq, id, aggregateid, status, (payload->>'version')::bigint AS version, last_error, \
                published_at \
         FROM {outbox_table} WHERE topic NOT LIKE 'dispatch:%' ORDER BY seq"
    )))
    .fetch_all(t.pool)
    .await?;
    let committed: HashMap<Uuid, &OutboxRow> = outbox.iter().map(|r| (r.id, r)).collect();
    // Rows the operator deleted were committed all the same (their state rows are there).
    let discards: HashMap<Uuid, DiscardRow> = sqlx::query_as::<_, DiscardRow>(
        "SELECT event_id, key, seq, last_error, discarded_at FROM chaos_operator_discards",
    )
    .fetch_all(t.pool)
    .await?
    .into_iter()
    .map(|d| (d.event_id, d))
    .collect();
    s.events_committed = n(committed.len() + discards.len());
    s.pending = n(outbox.iter().filter(|r| r.status == "pending").count());
    // Rows made to fail for good on purpose: quarantined with their reason, and missing from
    // the topic and the effects by design. Any other quarantined row is a violation.
    let expected: HashMap<Uuid, String> =
        sqlx::query_as("SELECT event_id, reason_contains FROM chaos_expected_quarantine")
            .fetch_all(t.pool)
            .await?
            .into_iter()
            .collect();
    s.outbox_quarantined = n(outbox
        .iter()
        .filter(|r| r.status == "quarantined" && !expected.contains_key(&r.id))
        .count());
    let mut expected_failures = Vec::new();
    for (id, reason) in &expected {
        s.expected_quarantine_planned += 1;
        let has_reason =
            |e: &Option<String>| e.as_deref().is_some_and(|e| e.contains(reason.as_str()));
        // A discarded row is judged by what it was when the operator discarded it.
        let quarantined = match (committed.get(id), discards.get(id)) {
            (Some(row), None) => row.status == "quarantined" && has_reason(&row.last_error),
            (None, Some(discard)) => has_reason(&discard.last_error),
            _ => false,
        };
        if quarantined {
            s.expected_quarantined += 1;
        } else {
            expected_failures.push(format!(
                "{id}: expected quarantined with {reason}, got {:?}, discarded {:?}",
                committed.get(id).map(|r| (&r.status, &r.last_error)),
                discards.get(id),
            ));
        }
    }
    report("rows expected in quarantine", &expected_failures);
    s.expected_quarantine_failures = n(expected_failures.len());
    let past_block = published_past_block(&outbox, discards.values());
    report(
        "published while an earlier row of the key was blocked",
        &past_block,
    );
    s.published_past_block = n(past_block.len());

    // Deletions of the topic: the events it held then are verified by their effects only.
    let deletions: Vec<DateTime<Utc>> =
        sqlx::query_scalar("SELECT deleted_at FROM chaos_topic_deletions ORDER BY epoch")
            .fetch_all(t.pool)
            .await?;
    let epoch_now = i32::try_from(deletions.len())?;
    let epoch_at = |at: DateTime<Utc>| deletions.iter().filter(|d| **d < at).count();
    let deleted_with_topic: HashSet<Uuid> =
        sqlx::query_scalar("SELECT event_id FROM chaos_deleted_with_topic")
            .fetch_all(t.pool)
            .await?
            .into_iter()
            .collect();

    // Atomicity: state rows and outbox rows agree, one for one.
    let attempts: HashSet<Uuid> =
        sqlx::query_scalar("SELECT DISTINCT event_id FROM chaos_attempts")
            .fetch_all(t.pool)
            .await?
            .into_iter()
            .collect();
    let never_committed: HashSet<Uuid> = attempts
        .iter()
        .filter(|id| !committed.contains_key(id) && !discards.contains_key(id))
        .copied()
        .collect();
    s.rolled_back = n(never_committed.len());
    let state_log: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT event_id, key, version FROM chaos_state_log")
            .fetch_all(t.pool)
            .await?;
    let state: Vec<(String, i64)> = sqlx::query_as("SELECT key, version FROM chaos_state")
        .fetch_all(t.pool)
        .await?;
    let mut atomicity = Vec::new();
    let mut log_by_id: HashMap<Uuid, Vec<(&str, i64)>> = HashMap::new();
    let mut versions_by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for (id, key, version) in &state_log {
        log_by_id.entry(*id).or_default().push((key, *version));
        versions_by_key.entry(key).or_default().push(*version);
        if !committed.contains_key(id) && !discards.contains_key(id) {
            atomicity.push(format!("state row without outbox row: {id}"));
        }
    }
    for row in &outbox {
        match log_by_id.get(&row.id).map(Vec::as_slice) {
            Some([(key, version)]) if *key == row.aggregateid && Some(*version) == row.version => {}
            other => atomicity.push(format!("outbox row {} has state rows {other:?}", row.id)),
        }
        if !attempts.contains(&row.id) {
            atomicity.push(format!("outbox row {} was never attempted", row.id));
        }
    }
    for (key, version) in &state {
        let mut versions = versions_by_key.remove(key.as_str()).unwrap_or_default();
        versions.sort_unstable();
        if versions != (1..=*version).collect::<Vec<_>>() {
            atomicity.push(format!(
                "key {key}: state version {version}, logged {} versions",
                versions.len()
            ));
        }
    }
    report("state and outbox disagree", &atomicity);
    s.atomicity_violations = n(atomicity.len());

    // Per-key outbox order is commit order: versions rise with seq.
    let mut order = Vec::new();
    let mut last_version: HashMap<&str, i64> = HashMap::new();
    for row in &outbox {
        let v = row.version.unwrap_or(i64::MIN);
        let last = last_version.insert(&row.aggregateid, v);
        if last.is_some_and(|l| l >= v) {
            order.push(format!(
                "outbox key {} seq {} version {v} after {last:?}",
                row.aggregateid, row.seq
            ));
        }
    }

    // The topic, read back whole.
    let poison: Vec<PoisonRow> =
        sqlx::query_as("SELECT partition, kafka_offset, expected_reason, epoch FROM chaos_poison")
            .fetch_all(t.pool)
            .await?;
    // Positions in the topic as it is now (records of a deleted epoch are gone).
    let poison_at: HashSet<(i32, i64)> = poison
        .iter()
        .filter(|p| p.epoch == epoch_now)
        .map(|p| (p.partition, p.kafka_offset))
        .collect();
    let records = read_all(t.brokers, t.topic, t.partitions, Duration::from_secs(120)).await?;
    let mut seen: HashMap<Uuid, u64> = HashMap::new();
    let mut phantoms = Vec::new();
    let mut last_seq: HashMap<(i32, String), i64> = HashMap::new();
    // Highest offset of a good record per partition: the partition kept flowing past poison.
    let mut last_good: HashMap<i32, i64> = HashMap::new();
    for r in &records {
        if poison_at.contains(&(r.partition, r.offset)) {
            continue;
        }
        let id = r.headers.get("id").and_then(|v| v.parse::<Uuid>().ok());
        let Some(row) = id.and_then(|id| committed.get(&id)) else {
            let rolled_back = id.is_some_and(|id| never_committed.contains(&id));
            phantoms.push(format!(
                "record at {}:{} id {id:?} (rolled back: {rolled_back})",
                r.partition, r.offset
            ));
            continue;
        };
        let count = seen.entry(row.id).or_default();
        *count += 1;
        last_good.insert(r.partition, r.offset);
        if *count == 1 {
            let last = last_seq.insert((r.partition, r.key.clone()), row.seq);
            if last.is_some_and(|l| l >= row.seq) {
                order.push(format!(
                    "topic key {} seq {} after seq {last:?}",
                    r.key, row.seq
                ));
            }
        }
    }
    s.published = n(seen.len()
        + deleted_with_topic
            .iter()
            .filter(|id| !seen.contains_key(id))
            .count());
    s.duplicates_delivered = seen.values().map(|c| c - 1).sum();
    let unpublished: Vec<Uuid> = outbox
        .iter()
        .filter(|r| {
            !seen.contains_key(&r.id)
                && !expected.contains_key(&r.id)
                && !deleted_with_topic.contains(&r.id)
        })
        .map(|r| r.id)
        .collect();
    report("committed but never published", &unpublished);
    let mut lost = n(unpublished.len());

    // Effects: once per group, in per-key commit order, none for anything uncommitted.
    let effects: Vec<EffectRow> = sqlx::query_as(
        "SELECT consumer, event_id, key, version FROM chaos_effects ORDER BY effect_order",
    )
    .fetch_all(t.pool)
    .await?;
    s.effects = n(effects.len());
    let mut per_group: BTreeMap<&str, HashMap<Uuid, u64>> = BTreeMap::new();
    let mut last_effect: HashMap<(&str, &str), i64> = HashMap::new();
    for e in &effects {
        *per_group
            .entry(&e.consumer)
            .or_default()
            .entry(e.event_id)
            .or_default() += 1;
        let Some(row) = committed.get(&e.event_id) else {
            phantoms.push(format!(
                "effect of uncommitted {} in {}",
                e.event_id, e.consumer
            ));
            continue;
        };
        if row.version != Some(e.version) || row.aggregateid != e.key {
            atomicity.push(format!("effect of {} carries other data", e.event_id));
            s.atomicity_violations += 1;
        }
        if per_group[e.consumer.as_str()][&e.event_id] == 1 {
            let last = last_effect.insert((&e.consumer, &e.key), row.seq);
            if last.is_some_and(|l| l >= row.seq) {
                order.push(format!(
                    "{}: key {} effect of seq {} after seq {last:?}",
                    e.consumer, e.key, row.seq
                ));
            }
        }
    }
    let mut doubles = Vec::new();
    for group in t.groups {
        let counts = per_group.get(group.as_str());
        let missing: Vec<Uuid> = outbox
            .iter()
            .filter(|r| {
                counts.is_none_or(|c| !c.contains_key(&r.id)) && !expected.contains_key(&r.id)
            })
            .map(|r| r.id)
            .collect();
        report(&format!("no effect in {group}"), &missing);
        lost += n(missing.len());
        for (id, c) in counts.into_iter().flatten() {
            if *c > 1 {
                doubles.push((group.clone(), *id, *c));
            }
        }
    }
    report("double effects", &doubles);
    s.double_effects = doubles.iter().map(|(_, _, c)| c - 1).sum();
    s.lost = lost;
    report("order", &order);
    s.order_violations = n(order.len());
    report("uncommitted ids visible", &phantoms);
    s.phantoms = n(phantoms.len());

    // Malformed records: quarantined by every group with the expected reason, and the
    // partition went on past them.
    let quarantine_table = &t.tables.consumer_quarantine;
    let quarantined: Vec<QuarantineRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT consumer, partition, \"offset\", reason, quarantined_at FROM {quarantine_table} \
         WHERE topic = $1"
    )))
    .bind(t.topic)
    .fetch_all(t.pool)
    .await?;
    // A position names a record within one epoch of the topic.
    let by_position: HashMap<(&str, usize, i32, i64), &str> = quarantined
        .iter()
        .map(|q| {
            (
                (
                    q.consumer.as_str(),
                    epoch_at(q.quarantined_at),
                    q.partition,
                    q.offset,
                ),
                q.reason.as_str(),
            )
        })
        .collect();
    let poison_positions: HashSet<(usize, i32, i64)> = poison
        .iter()
        .map(|p| {
            (
                usize::try_from(p.epoch).unwrap_or(0),
                p.partition,
                p.kafka_offset,
            )
        })
        .collect();
    let mut poison_failures = Vec::new();
    for p in &poison {
        for group in t.groups {
            s.poison_injected += 1;
            let epoch = usize::try_from(p.epoch)?;
            match by_position.get(&(group.as_str(), epoch, p.partition, p.kafka_offset)) {
                Some(reason) if *reason == p.expected_reason => s.poison_quarantined += 1,
                other => poison_failures.push(format!(
                    "{group}: {}:{} expected {}, got {other:?}",
                    p.partition, p.kafka_offset, p.expected_reason
                )),
            }
        }
        // In a deleted epoch, the records after it are known by their effects.
        let flowed_past = match deletions.get(usize::try_from(p.epoch)?) {
            None => last_good
                .get(&p.partition)
                .is_some_and(|o| *o > p.kafka_offset),
            Some(deleted_at) => {
                sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM chaos_effects \
                 WHERE partition = $1 AND kafka_offset > $2 AND at < $3)",
                )
                .bind(p.partition)
                .bind(p.kafka_offset)
                .bind(deleted_at)
                .fetch_one(t.pool)
                .await?
            }
        };
        if !flowed_past {
            poison_failures.push(format!(
                "no good record after poison at {}:{}",
                p.partition, p.kafka_offset
            ));
        }
    }
    report("malformed records", &poison_failures);
    s.poison_failures = n(poison_failures.len());
    let unexpected: Vec<String> = quarantined
        .iter()
        .filter(|q| {
            !poison_positions.contains(&(epoch_at(q.quarantined_at), q.partition, q.offset))
        })
        .map(|q| format!("{}: {}:{} {}", q.consumer, q.partition, q.offset, q.reason))
        .collect();
    report("good records quarantined", &unexpected);
    s.unexpected_quarantines = n(unexpected.len());
    Ok(s)
}
