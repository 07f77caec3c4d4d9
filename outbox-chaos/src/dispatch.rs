//! The dispatcher fleet's destination and its checker.
//!
//! The orchestrator serves the billing API (`outbox_examples::billing_api`, a real axum
//! server with the idempotency semantics of payment APIs) in its own process, so the API and
//! its ledger outlive every child: it lags (a random latency per request) and fails (503 for
//! a share of requests) throughout the run, and the fault loop stops it for seconds at a time
//! and makes it apply charges whose responses it then holds back past the dispatchers'
//! `call_timeout`.
//!
//! The checker trusts neither the dispatchers nor the outbox's statuses alone: it holds the
//! API's ledger against the committed actions. Every committed action must have exactly one
//! charge, applied under its own idempotency key (its event id) and for its own invoice
//! (`<key>/<n>`), be done in the outbox with that charge's answer as its stored outcome, and
//! each key's charges must follow its commit order; no charge may belong to an action that
//! never committed.

use std::collections::HashMap;

use anyhow::Result;
use outbox_core::TableNames;
use outbox_examples::billing_api::{BillingApi, Charge};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

use crate::checker::{n, report};
use crate::children::action_writer::{DESTINATION, parse_invoice};
use crate::profile::DispatchLoad;
use crate::summary::Summary;

/// Starts the billing API with the profile's latency and failure rate.
pub(crate) async fn start_api(load: &DispatchLoad) -> Result<BillingApi> {
    let api = BillingApi::start().await?;
    api.set_latency(load.latency.clone());
    api.fail_rate(load.fail_rate);
    api.fail_some_with_500(true);
    api.rate_limit(load.rate_limit);
    tracing::info!(url = %api.charges_url(), "billing API serving");
    Ok(api)
}

#[derive(Debug, sqlx::FromRow)]
struct ActionRow {
    id: Uuid,
    aggregateid: String,
    status: String,
    invoice: Option<String>,
    n: Option<i64>,
    charge_id: Option<String>,
}

/// Holds the API's ledger (`charges`, in the order they were applied) against the committed
/// actions, and fills the summary's dispatcher fields.
pub(crate) async fn check(
    pool: &PgPool,
    tables: &TableNames,
    charges: &[Charge],
    api_requests: u64,
    s: &mut Summary,
) -> Result<()> {
    let topic = outbox_core::wire::dispatch_topic(DESTINATION)?;
    let actions: Vec<ActionRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, aggregateid, status, payload->>'invoice' AS invoice, \
                (payload->>'n')::bigint AS n, outcome->>'charge_id' AS charge_id \
         FROM {} WHERE topic = $1 ORDER BY seq",
        tables.outbox
    )))
    .bind(&topic)
    .fetch_all(pool)
    .await?;
    let attempted: Vec<Uuid> =
        sqlx::query_scalar("SELECT DISTINCT event_id FROM chaos_action_attempts")
            .fetch_all(pool)
            .await?;
    let committed: HashMap<Uuid, &ActionRow> = actions.iter().map(|a| (a.id, a)).collect();
    s.actions_committed = n(committed.len());
    s.actions_rolled_back = n(attempted
        .iter()
        .filter(|id| !committed.contains_key(id))
        .count());
    s.charges = n(charges.len());
    s.api_requests = api_requests;

    // Each charge: of a committed action, under its key, for its invoice. (A committed
    // action's invoice is its own: its key's counter went up in its transaction.)
    let mut phantoms = Vec::new();
    let mut foreign: Vec<&Charge> = Vec::new();
    let mut applied: HashMap<Uuid, Vec<&Charge>> = HashMap::new();
    for charge in charges {
        let action = charge
            .idempotency_key
            .parse::<Uuid>()
            .ok()
            .and_then(|id| committed.get(&id));
        match action {
            Some(action) if action.invoice.as_deref() == Some(charge.invoice.as_str()) => {
                applied.entry(action.id).or_default().push(charge);
            }
            Some(action) => phantoms.push(format!(
                "{charge:?}: under the key of {} whose invoice is {:?}",
                action.id, action.invoice
            )),
            None => {
                let rolled_back = attempted
                    .iter()
                    .any(|id| id.to_string() == charge.idempotency_key);
                phantoms.push(format!(
                    "{charge:?}: no committed action has this key (attempted and rolled back: \
                     {rolled_back})"
                ));
                if !rolled_back {
                    foreign.push(charge);
                }
            }
        }
    }
    report("charges of no committed action", &phantoms);
    s.actions_phantom = n(phantoms.len());

    // Each committed action: done, charged once under its own key, its outcome that
    // charge's answer. A charge for its invoice under a key never attempted (one the
    // dispatcher made up) is a second application once it has one under its own.
    let by_invoice: HashMap<&str, Uuid> = actions
        .iter()
        .filter_map(|a| Some((a.invoice.as_deref()?, a.id)))
        .collect();
    let mut again: HashMap<Uuid, usize> = HashMap::new();
    for charge in foreign {
        if let Some(id) = by_invoice.get(charge.invoice.as_str()) {
            *again.entry(*id).or_default() += 1;
        }
    }
    let (mut lost, mut doubles, mut bad_outcomes) = (Vec::new(), Vec::new(), Vec::new());
    for action in &actions {
        let charged = applied.get(&action.id).map_or(&[][..], Vec::as_slice);
        let what = format!("{} ({:?})", action.id, action.invoice);
        if action.status != "published" {
            lost.push(format!("{what}: {}, not done", action.status));
        } else if charged.is_empty() {
            lost.push(format!("{what}: done, no charge under its key"));
        }
        let extra = charged.len().saturating_sub(1)
            + if charged.is_empty() {
                0
            } else {
                again.get(&action.id).copied().unwrap_or(0)
            };
        if extra > 0 {
            doubles.push((what.clone(), extra));
        }
        if let Some(first) = charged.first()
            && action.status == "published"
            && action.charge_id.as_deref() != Some(first.charge_id.as_str())
        {
            bad_outcomes.push(format!(
                "{what}: outcome charge {:?}, ledger {}",
                action.charge_id, first.charge_id
            ));
        }
    }
    report(
        "committed actions not done, or charged under no key of theirs",
        &lost,
    );
    report("actions charged more than once (extra charges)", &doubles);
    report("outcomes that are not the ledger's answer", &bad_outcomes);
    s.actions_lost = n(lost.len());
    s.actions_double_applied = n(doubles.iter().map(|(_, extra)| extra).sum());
    s.actions_bad_outcome = n(bad_outcomes.len());

    // Per key: charges in the ledger's order follow the key's counter (its commit order),
    // and the counter matches the committed action's.
    let mut order = Vec::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for charge in charges {
        let Some(action) = charge
            .idempotency_key
            .parse::<Uuid>()
            .ok()
            .and_then(|id| committed.get(&id))
        else {
            continue;
        };
        let Some((key, counter)) = parse_invoice(&charge.invoice) else {
            order.push(format!("{charge:?}: not an invoice of the writer"));
            continue;
        };
        if key != action.aggregateid || Some(counter) != action.n {
            order.push(format!(
                "{charge:?}: invoice of another action than {}",
                action.id
            ));
            continue;
        }
        if let Some(previous) = last.insert(key, counter)
            && previous >= counter
        {
            order.push(format!(
                "key {key}: charge {} for n={counter} after n={previous}",
                charge.charge_id
            ));
        }
    }
    report("a key's charges out of commit order", &order);
    s.actions_out_of_order = n(order.len());

    // The counters themselves: each key's committed actions are 1..=counter.
    let counters: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, counter FROM chaos_action_state")
            .fetch_all(pool)
            .await?;
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for action in &actions {
        by_key
            .entry(&action.aggregateid)
            .or_default()
            .push(action.n.unwrap_or(-1));
    }
    let mut atomicity = Vec::new();
    for (key, counter) in &counters {
        let mut ns = by_key.remove(key.as_str()).unwrap_or_default();
        ns.sort_unstable();
        if ns != (1..=*counter).collect::<Vec<_>>() {
            atomicity.push(format!(
                "action key {key}: counter {counter}, {} committed actions",
                ns.len()
            ));
        }
    }
    report("action counters and committed actions disagree", &atomicity);
    s.atomicity_violations += n(atomicity.len());
    Ok(())
}
