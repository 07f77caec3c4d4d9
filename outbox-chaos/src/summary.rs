//! Fault counts and the one-line summary.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// kill -9 of a relay at a random point (mostly mid-batch).
    RelayKill,
    /// A relay dying after Kafka acknowledged its batch, before marking it.
    RelayAfterAck,
    /// kill -9 of a consumer at a random point (mostly mid-handler).
    ConsumerKill,
    /// A consumer dying after its handler committed, before the offset was stored.
    ConsumerAfterCommit,
    /// kill -9 of the producer at a random point.
    ProducerKill,
    /// The producer dying with its transaction open.
    ProducerBeforeCommit,
    /// The producer dying right after its commit.
    ProducerAfterCommit,
    /// The broker shut down cleanly (SIGTERM, awaited) and started again.
    BrokerRestart,
    /// The broker killed (`kill -9`) and started again.
    BrokerKill,
    /// Every connection of the run terminated by `pg_terminate_backend`.
    PgTerminate,
    /// A group member joining or leaving while messages are in flight.
    Rebalance,
    /// The long-fault phase: the broker down for minutes (`kill -9`, then started again).
    BrokerOutage,
    /// The long-fault phase: the run's own Postgres server stopped (`pg_ctl stop -m
    /// immediate`) for tens of seconds, then started again on the same data directory.
    PgStop,
    /// The long-fault phase: a row the broker rejects for good, its key's backlog behind it.
    StuckKey,
    /// The same under the relays' `BlockKey` policy: the backlog waits until the harness,
    /// as the operator, discards the row.
    BlockedKey,
    /// The long-fault phase: the topic deleted and, a little later, created again.
    TopicRecreate,
    /// The long-fault phase: one node of three down while the topic still takes writes
    /// (`min.insync.replicas` 2); timed from the kill, and must drain before the node is back.
    PartialOutage,
    /// One node of three down while the topic refuses writes (`min.insync.replicas` 3):
    /// timed from the node's return; nothing may be quarantined for it.
    IsrOutage,
    /// kill -9 of a dispatcher at a random point (mostly with calls in flight).
    DispatcherKill,
    /// A dispatcher dying after its calls were answered, before their outcomes were recorded.
    DispatcherAfterCall,
    /// kill -9 of the writer of actions.
    ActionWriterKill,
    /// The billing API down (its listener closed, its connections cut) for a few seconds.
    ApiOutage,
    /// The billing API applying charges and then holding their responses back past the
    /// dispatchers' `call_timeout`.
    ApiStall,
    /// The dispatchers' PostgreSQL connections terminated, twice a second through the fault
    /// phase (counted per round that found any).
    DispatcherPgTerminate,
    /// The run's own PostgreSQL stopped as in a crash (`pg_ctl stop -m immediate`) in the
    /// fault loop, and started again 0.3-2 s later: every process's connections break,
    /// claims, leases and records cut midway included.
    PgRestart,
}

impl Kind {
    pub(crate) const ALL: [Self; 25] = [
        Self::RelayKill,
        Self::RelayAfterAck,
        Self::ConsumerKill,
        Self::ConsumerAfterCommit,
        Self::ProducerKill,
        Self::ProducerBeforeCommit,
        Self::ProducerAfterCommit,
        Self::BrokerRestart,
        Self::BrokerKill,
        Self::PgTerminate,
        Self::Rebalance,
        Self::BrokerOutage,
        Self::PgStop,
        Self::StuckKey,
        Self::BlockedKey,
        Self::TopicRecreate,
        Self::PartialOutage,
        Self::IsrOutage,
        Self::DispatcherKill,
        Self::DispatcherAfterCall,
        Self::ActionWriterKill,
        Self::ApiOutage,
        Self::ApiStall,
        Self::DispatcherPgTerminate,
        Self::PgRestart,
    ];

    /// The long faults, whose liveness figures the summary reports.
    pub(crate) const LONG: [Self; 7] = [
        Self::BrokerOutage,
        Self::PgStop,
        Self::StuckKey,
        Self::BlockedKey,
        Self::TopicRecreate,
        Self::PartialOutage,
        Self::IsrOutage,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::RelayKill => "relay_kill9",
            Self::RelayAfterAck => "relay_after_ack",
            Self::ConsumerKill => "consumer_kill9",
            Self::ConsumerAfterCommit => "consumer_after_commit",
            Self::ProducerKill => "producer_kill9",
            Self::ProducerBeforeCommit => "producer_before_commit",
            Self::ProducerAfterCommit => "producer_after_commit",
            Self::BrokerRestart => "broker_restart",
            Self::BrokerKill => "broker_kill9",
            Self::PgTerminate => "pg_terminate",
            Self::Rebalance => "rebalance",
            Self::BrokerOutage => "broker_outage",
            Self::PgStop => "pg_stop",
            Self::StuckKey => "stuck_key",
            Self::BlockedKey => "blocked_key",
            Self::TopicRecreate => "topic_recreate",
            Self::PartialOutage => "partial_outage",
            Self::IsrOutage => "isr_outage",
            Self::DispatcherKill => "dispatcher_kill9",
            Self::DispatcherAfterCall => "dispatcher_after_call",
            Self::ActionWriterKill => "action_writer_kill9",
            Self::ApiOutage => "api_outage",
            Self::ApiStall => "api_stall",
            Self::DispatcherPgTerminate => "dispatcher_pg_terminate",
            Self::PgRestart => "pg_restart",
        }
    }

    /// Whether a process died (or the broker or Postgres went down): a kill cycle.
    pub(crate) fn is_kill(self) -> bool {
        !matches!(
            self,
            Self::PgTerminate
                | Self::Rebalance
                | Self::StuckKey
                | Self::BlockedKey
                | Self::TopicRecreate
                | Self::ApiOutage
                | Self::ApiStall
                | Self::DispatcherPgTerminate
        )
    }
}

/// Faults by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counts(BTreeMap<Kind, u64>);

impl Counts {
    pub(crate) fn add(&mut self, kind: Kind, n: u64) {
        *self.0.entry(kind).or_default() += n;
    }

    pub(crate) fn get(&self, kind: Kind) -> u64 {
        self.0.get(&kind).copied().unwrap_or(0)
    }

    pub(crate) fn kill_cycles(&self) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| k.is_kill())
            .map(|(_, n)| n)
            .sum()
    }

    fn merge(&mut self, other: &Self) {
        for (k, n) in &other.0 {
            self.add(*k, *n);
        }
    }
}

/// What one run (or several, merged) found. Every field after `counts` that names a
/// violation must be zero for the run to pass.
#[derive(Debug, Clone, Default)]
pub(crate) struct Summary {
    pub(crate) runs: u64,
    pub(crate) counts: Counts,
    pub(crate) events_committed: u64,
    pub(crate) rolled_back: u64,
    pub(crate) published: u64,
    pub(crate) duplicates_delivered: u64,
    pub(crate) effects: u64,
    pub(crate) poison_injected: u64,
    pub(crate) poison_quarantined: u64,
    /// Outbox rows the run made fail for good on purpose, and how many of them the relays
    /// quarantined with the expected reason.
    pub(crate) expected_quarantine_planned: u64,
    pub(crate) expected_quarantined: u64,
    /// Worst liveness figure per long fault: from the fault's end until every event
    /// committed by then had flowed (published, and applied by every group).
    pub(crate) liveness: BTreeMap<Kind, Duration>,
    /// The bound the figures are checked against (`None`: no long-fault phase).
    pub(crate) liveness_bound: Option<Duration>,
    /// The dispatcher fleet: actions committed, actions tried and rolled back, charges in
    /// the billing API's ledger, and the requests it received (retries and replays included).
    pub(crate) actions_committed: u64,
    pub(crate) actions_rolled_back: u64,
    pub(crate) charges: u64,
    pub(crate) api_requests: u64,
    /// Requests the API answered 429 (its rate limit).
    pub(crate) api_rate_limited: u64,
    // Violations:
    pub(crate) lost: u64,
    pub(crate) double_effects: u64,
    pub(crate) order_violations: u64,
    pub(crate) phantoms: u64,
    pub(crate) atomicity_violations: u64,
    pub(crate) pending: u64,
    pub(crate) outbox_quarantined: u64,
    pub(crate) poison_failures: u64,
    pub(crate) unexpected_quarantines: u64,
    pub(crate) unexpected_exits: u64,
    pub(crate) drain_timeouts: u64,
    /// Long faults whose liveness figure exceeded the bound (or that never drained).
    pub(crate) liveness_exceeded: u64,
    /// Planned failing rows not quarantined, or quarantined with another reason.
    pub(crate) expected_quarantine_failures: u64,
    /// Rows published while an earlier row of their key was quarantined under `BlockKey`
    /// (before the operator discarded it).
    pub(crate) published_past_block: u64,
    /// Committed actions not done, or without a charge in the API's ledger.
    pub(crate) actions_lost: u64,
    /// Charges of an action beyond its first: under its own key again, or for its invoice
    /// under a key no action has.
    pub(crate) actions_double_applied: u64,
    /// A key's charges out of its commit order.
    pub(crate) actions_out_of_order: u64,
    /// Charges under a key no committed action has (a rolled-back action's, or one the
    /// dispatcher made up).
    pub(crate) actions_phantom: u64,
    /// Done actions whose stored outcome is not the answer to their charge.
    pub(crate) actions_bad_outcome: u64,
}

impl Summary {
    /// The invariants, by their names in the summary line: each must be zero.
    fn violations(&self) -> [(&'static str, u64); 19] {
        [
            ("lost", self.lost),
            ("double_effects", self.double_effects),
            ("order_violations", self.order_violations),
            ("phantoms", self.phantoms),
            ("atomicity_violations", self.atomicity_violations),
            ("pending", self.pending),
            ("outbox_quarantined", self.outbox_quarantined),
            ("poison_failures", self.poison_failures),
            ("unexpected_quarantines", self.unexpected_quarantines),
            ("unexpected_exits", self.unexpected_exits),
            ("drain_timeouts", self.drain_timeouts),
            ("liveness_exceeded", self.liveness_exceeded),
            (
                "expected_quarantine_failures",
                self.expected_quarantine_failures,
            ),
            ("published_past_block", self.published_past_block),
            ("actions_lost", self.actions_lost),
            ("actions_double_applied", self.actions_double_applied),
            ("actions_out_of_order", self.actions_out_of_order),
            ("actions_phantom", self.actions_phantom),
            ("actions_bad_outcome", self.actions_bad_outcome),
        ]
    }

    /// Records one long fault's liveness figure, checked against `bound`.
    pub(crate) fn record_liveness(&mut self, kind: Kind, took: Duration, bound: Duration) {
        let worst = self.liveness.entry(kind).or_default();
        *worst = (*worst).max(took);
        self.liveness_bound = Some(bound);
        if took > bound {
            self.liveness_exceeded += 1;
        }
    }

    /// The worst liveness figure of any long fault.
    pub(crate) fn liveness_worst(&self) -> Duration {
        self.liveness.values().copied().max().unwrap_or_default()
    }

    /// Whether every invariant held.
    pub(crate) fn passed(&self) -> bool {
        self.runs > 0 && self.violations().iter().all(|(_, n)| *n == 0)
    }

    pub(crate) fn merge(&mut self, o: &Self) {
        self.runs += o.runs;
        self.counts.merge(&o.counts);
        for (mine, theirs) in [
            (&mut self.events_committed, o.events_committed),
            (&mut self.rolled_back, o.rolled_back),
            (&mut self.published, o.published),
            (&mut self.duplicates_delivered, o.duplicates_delivered),
            (&mut self.effects, o.effects),
            (&mut self.poison_injected, o.poison_injected),
            (&mut self.poison_quarantined, o.poison_quarantined),
            (&mut self.lost, o.lost),
            (&mut self.double_effects, o.double_effects),
            (&mut self.order_violations, o.order_violations),
            (&mut self.phantoms, o.phantoms),
            (&mut self.atomicity_violations, o.atomicity_violations),
            (&mut self.pending, o.pending),
            (&mut self.outbox_quarantined, o.outbox_quarantined),
            (&mut self.poison_failures, o.poison_failures),
            (&mut self.unexpected_quarantines, o.unexpected_quarantines),
            (&mut self.unexpected_exits, o.unexpected_exits),
            (&mut self.drain_timeouts, o.drain_timeouts),
            (&mut self.liveness_exceeded, o.liveness_exceeded),
            (
                &mut self.expected_quarantine_planned,
                o.expected_quarantine_planned,
            ),
            (&mut self.expected_quarantined, o.expected_quarantined),
            (
                &mut self.expected_quarantine_failures,
                o.expected_quarantine_failures,
            ),
            (&mut self.published_past_block, o.published_past_block),
            (&mut self.actions_committed, o.actions_committed),
            (&mut self.actions_rolled_back, o.actions_rolled_back),
            (&mut self.charges, o.charges),
            (&mut self.api_requests, o.api_requests),
            (&mut self.api_rate_limited, o.api_rate_limited),
            (&mut self.actions_lost, o.actions_lost),
            (&mut self.actions_double_applied, o.actions_double_applied),
            (&mut self.actions_out_of_order, o.actions_out_of_order),
            (&mut self.actions_phantom, o.actions_phantom),
            (&mut self.actions_bad_outcome, o.actions_bad_outcome),
        ] {
            *mine += theirs;
        }
        for (kind, took) in &o.liveness {
            let worst = self.liveness.entry(*kind).or_default();
            *worst = (*worst).max(*took);
        }
        self.liveness_bound = self.liveness_bound.or(o.liveness_bound);
    }

    /// The summary line: `chaos: key=value ...`, one line, stable keys.
    pub(crate) fn line(&self, profile: &str, seed: u64, seconds: u64) -> String {
        let mut s = format!(
            "chaos: result={} profile={profile} seed={seed} seconds={seconds} runs={} kill_cycles={}",
            if self.passed() { "PASS" } else { "FAIL" },
            self.runs,
            self.counts.kill_cycles(),
        );
        for kind in Kind::ALL {
            let _ = write!(s, " {}={}", kind.name(), self.counts.get(kind));
        }
        let _ = write!(
            s,
            " events_committed={} rolled_back={} published={} duplicates_delivered={} effects={} \
             poison_quarantined={}/{}",
            self.events_committed,
            self.rolled_back,
            self.published,
            self.duplicates_delivered,
            self.effects,
            self.poison_quarantined,
            self.poison_injected,
        );
        // Liveness: the worst figure, the bound it is checked against, and each long fault's.
        let _ = write!(
            s,
            " liveness_worst_s={:.1} liveness_bound_s={}",
            self.liveness_worst().as_secs_f64(),
            self.liveness_bound
                .map_or_else(|| "-".to_owned(), |b| b.as_secs().to_string()),
        );
        for kind in Kind::LONG {
            let figure = self
                .liveness
                .get(&kind)
                .map_or_else(|| "-".to_owned(), |d| format!("{:.1}", d.as_secs_f64()));
            let _ = write!(s, " liveness_{}_s={figure}", kind.name());
        }
        let _ = write!(
            s,
            " expected_quarantined={}/{} actions_committed={} actions_rolled_back={} charges={} \
             api_requests={} api_rate_limited={}",
            self.expected_quarantined,
            self.expected_quarantine_planned,
            self.actions_committed,
            self.actions_rolled_back,
            self.charges,
            self.api_requests,
            self.api_rate_limited,
        );
        for (name, n) in self.violations() {
            let _ = write!(s, " {name}={n}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_violation_fails_the_run_and_shows_in_the_line() {
        let clean = Summary {
            runs: 1,
            ..Summary::default()
        };
        assert!(clean.passed());
        let line = clean.line("ci", 1, 10);
        assert!(line.starts_with("chaos: result=PASS "), "{line}");
        assert!(
            line.ends_with(
                " unexpected_exits=0 drain_timeouts=0 liveness_exceeded=0 \
                 expected_quarantine_failures=0 published_past_block=0 actions_lost=0 \
                 actions_double_applied=0 actions_out_of_order=0 actions_phantom=0 \
                 actions_bad_outcome=0"
            ),
            "{line}"
        );
        assert!(
            line.contains(" liveness_worst_s=0.0 liveness_bound_s=- "),
            "{line}"
        );
        for (name, _) in clean.violations() {
            let mut broken = clean.clone();
            broken.merge(&Summary {
                lost: u64::from(name == "lost"),
                double_effects: u64::from(name == "double_effects"),
                order_violations: u64::from(name == "order_violations"),
                phantoms: u64::from(name == "phantoms"),
                atomicity_violations: u64::from(name == "atomicity_violations"),
                pending: u64::from(name == "pending"),
                outbox_quarantined: u64::from(name == "outbox_quarantined"),
                poison_failures: u64::from(name == "poison_failures"),
                unexpected_quarantines: u64::from(name == "unexpected_quarantines"),
                unexpected_exits: u64::from(name == "unexpected_exits"),
                drain_timeouts: u64::from(name == "drain_timeouts"),
                liveness_exceeded: u64::from(name == "liveness_exceeded"),
                expected_quarantine_failures: u64::from(name == "expected_quarantine_failures"),
                published_past_block: u64::from(name == "published_past_block"),
                actions_lost: u64::from(name == "actions_lost"),
                actions_double_applied: u64::from(name == "actions_double_applied"),
                actions_out_of_order: u64::from(name == "actions_out_of_order"),
                actions_phantom: u64::from(name == "actions_phantom"),
                actions_bad_outcome: u64::from(name == "actions_bad_outcome"),
                ..Summary::default()
            });
            assert!(!broken.passed(), "{name}");
            let line = broken.line("ci", 1, 10);
            assert!(line.contains(&format!(" {name}=1")), "{line}");
            assert!(line.starts_with("chaos: result=FAIL "), "{line}");
        }
        assert!(!Summary::default().passed(), "no run is no pass");
    }

    #[test]
    fn both_kinds_of_broker_fault_are_kill_cycles_counted_apart() {
        let mut summary = Summary {
            runs: 1,
            ..Summary::default()
        };
        summary.counts.add(Kind::BrokerRestart, 2);
        summary.counts.add(Kind::BrokerKill, 3);
        summary.counts.add(Kind::PgTerminate, 7);
        let line = summary.line("ci", 1, 10);
        assert!(line.contains(" kill_cycles=5 "), "{line}");
        assert!(line.contains(" broker_restart=2 broker_kill9=3 "), "{line}");
    }

    #[test]
    fn a_liveness_figure_over_the_bound_fails_the_run() {
        let bound = Duration::from_secs(60);
        let mut summary = Summary {
            runs: 1,
            ..Summary::default()
        };
        summary.record_liveness(Kind::BrokerOutage, Duration::from_millis(4_240), bound);
        summary.record_liveness(Kind::PgStop, Duration::from_millis(21_040), bound);
        assert!(summary.passed());
        let line = summary.line("liveness", 7, 300);
        assert!(
            line.contains(
                " liveness_worst_s=21.0 liveness_bound_s=60 liveness_broker_outage_s=4.2 \
                 liveness_pg_stop_s=21.0 liveness_stuck_key_s=- liveness_blocked_key_s=- \
                 liveness_topic_recreate_s=- "
            ),
            "{line}"
        );
        let mut other = Summary {
            runs: 1,
            ..Summary::default()
        };
        other.record_liveness(Kind::BrokerOutage, Duration::from_secs(61), bound);
        summary.merge(&other);
        assert!(!summary.passed());
        let line = summary.line("liveness", 7, 300);
        assert!(line.contains(" liveness_worst_s=61.0 "), "{line}");
        assert!(line.contains(" liveness_broker_outage_s=61.0 "), "{line}");
        assert!(line.contains(" liveness_exceeded=1"), "{line}");
    }
}
