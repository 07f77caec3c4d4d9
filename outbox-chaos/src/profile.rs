//! How big and how long a run is.

use std::time::Duration;

use crate::fleet::RelayRetry;

/// The dispatcher fleet: a writer committing actions for many keys, dispatchers performing
/// them against the billing API the orchestrator serves, which fails and lags at random.
#[derive(Debug, Clone)]
pub(crate) struct DispatchLoad {
    /// Keys of the actions (`a000`, `a001`, ...), each with its own counter.
    pub(crate) keys: u32,
    /// The writer's pause between transactions (1 to 3 actions each), in milliseconds.
    pub(crate) writer_pause_ms: (u64, u64),
    /// Dispatcher processes in normal mode (one more runs in crash-after-call mode).
    pub(crate) dispatchers: usize,
    /// Each dispatcher's `max_in_flight` (its batch size is drawn from 4 to 16).
    pub(crate) max_in_flight: usize,
    /// Each dispatcher's `call_timeout`: a stalled response outlasts it.
    pub(crate) call_timeout: Duration,
    /// The API's latency per request, drawn from this range.
    pub(crate) latency: std::ops::Range<Duration>,
    /// The share of requests the API answers 503 or 500 (before applying anything).
    pub(crate) fail_rate: f64,
    /// The API's rate limit (429 beyond it, without `Retry-After`): reached when the
    /// dispatchers catch up after an outage.
    pub(crate) rate_limit: Option<f64>,
    /// PostgreSQL restarts (as in a crash) in the fault loop, at least: the run then has a
    /// server of its own.
    pub(crate) pg_restarts: u32,
}

/// A named set of run parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProfileName {
    /// The test suite's profile: about 2–3 minutes on 2 cores.
    Ci,
    /// By hand: about 22 minutes, five runs; the first ends with the long faults, held
    /// longer than the liveness profile holds them (the broker down for minutes).
    Long,
    /// The test suite's, on a 3-broker cluster: partition leaders killed under load.
    Cluster,
    /// The test suite's too: a short fault phase, then long faults one after another (the
    /// broker down for minutes, Postgres stopped, a key stuck behind a row the broker
    /// rejects under each quarantine policy, the topic deleted and re-created), each timed
    /// until everything drained.
    Liveness,
}

/// The long-fault phase (`long_faults.rs`): which faults, how long, and the bound on the
/// seconds from a fault's end until everything committed by then has flowed.
#[derive(Debug, Clone)]
pub(crate) struct LongFaults {
    /// The relays' retry settings for the phase, which restarts them with these at its start
    /// (`None`: they keep the profile's). A broker outage only shows that it charges rows
    /// nothing when it lasts longer than `max_attempts` × `message.timeout.ms`.
    pub(crate) relay_retry: Option<RelayRetry>,
    /// How long the broker stays down (`kill -9`, started again on the same storage; `None`:
    /// no such fault).
    pub(crate) broker_outage: Option<Duration>,
    /// How long one node of a three-node cluster stays down in each half of the partial
    /// outage (`partial_outage.rs`; `None`: no such fault).
    pub(crate) partial_outage: Option<Duration>,
    /// How long the run's own Postgres server stays stopped (`None`: no such fault, and the
    /// run uses the shared server).
    pub(crate) pg_outage: Option<Duration>,
    /// A row the broker rejects for good, with a backlog of its key behind it, under the
    /// relays' default `SkipQuarantined` policy.
    pub(crate) stuck_key: bool,
    /// The same with the relays restarted under `BlockKey`: the backlog waits until the
    /// harness, as the operator, discards the row.
    pub(crate) blocked_key: bool,
    /// How long the topic stays deleted before it is created again (`None`: no such fault).
    pub(crate) topic_absence: Option<Duration>,
    /// The relays' retry settings while the topic is missing (see `long_faults.rs`).
    pub(crate) topic_fault_retry: RelayRetry,
    /// The checked bound on a fault's liveness figure.
    pub(crate) bound: Duration,
    /// How long a fault's drain is awaited before the phase goes on (longer than `bound`,
    /// so that a figure over the bound is still measured).
    pub(crate) drain_wait: Duration,
}

/// Run parameters.
#[derive(Debug, Clone)]
pub(crate) struct Profile {
    pub(crate) name: &'static str,
    /// Independent runs (fresh database, topic and broker each), seeds `seed`, `seed + 1`, ...
    pub(crate) runs: u64,
    /// How long faults are injected per run.
    pub(crate) fault_phase: Duration,
    /// Most orchestrated faults per run.
    pub(crate) max_faults: u32,
    /// Pause between two orchestrated faults, in milliseconds.
    pub(crate) fault_gap_ms: (u64, u64),
    /// Kafka nodes (broker and controller each); the topic's replication factor.
    pub(crate) brokers: usize,
    /// Weight of a broker fault among the fault loop's choices (the others weigh 20 in all).
    pub(crate) broker_fault_weight: u32,
    /// Topic partitions.
    pub(crate) partitions: i32,
    /// Aggregate keys.
    pub(crate) keys: u32,
    /// Producer pause between transactions per writer, in milliseconds.
    pub(crate) producer_pause_ms: (u64, u64),
    /// Relay processes in normal mode (one more runs in crash-after-ack mode).
    pub(crate) relays: usize,
    /// Members of the first consumer group (the second group has one).
    pub(crate) group_a_members: usize,
    /// Rounds of malformed-record injection per run.
    pub(crate) poison_rounds: u32,
    /// Bound on draining after the fault phase.
    pub(crate) drain_timeout: Duration,
    /// The relays' retry settings.
    pub(crate) relay_retry: RelayRetry,
    /// The long-fault phase after the fault loop, in the first run only (which then has a
    /// Postgres server of its own when the phase stops Postgres; the other runs use the
    /// shared one).
    pub(crate) long_faults: Option<LongFaults>,
    /// The dispatcher fleet beside the Kafka fleet (`None`: no actions, no billing API).
    pub(crate) dispatch: Option<DispatchLoad>,
}

/// The relays' retries while a topic is deleted and created again: while it is missing every
/// row of it fails with the broker's answer and is charged an attempt, so the budget must
/// outlast the absence.
const TOPIC_FAULT_RETRY: RelayRetry = RelayRetry {
    max_attempts: 20,
    backoff_ms: (500, 5000),
    message_timeout_ms: Some(5000),
};

/// Relays that quarantine a row after 5 attempts, each delivery timing out after 5 s: a
/// broker outage of minutes lasts many times that budget, so charging it to rows would show.
const LIVENESS_RELAY_RETRY: RelayRetry = RelayRetry {
    max_attempts: 5,
    backoff_ms: (50, 2000),
    message_timeout_ms: Some(5000),
};

impl Profile {
    pub(crate) fn named(name: ProfileName) -> Self {
        match name {
            ProfileName::Ci => Self {
                name: "ci",
                runs: 1,
                fault_phase: Duration::from_secs(90),
                // 80 for the Kafka fleet (it reached them before its 90 s were up), and as
                // many again in proportion for the dispatcher fleet's faults (weight 6 beside
                // the Kafka fleet's 23): the Kafka fleet's faults are not thinned out by them.
                max_faults: 105,
                fault_gap_ms: (400, 1200),
                brokers: 1,
                // 3 of 29 with the dispatcher fleet's 6: about the share 2 of 22 had before.
                broker_fault_weight: 3,
                partitions: 4,
                keys: 24,
                // At 10-40 ms the debug build's consumers ended the fault phase half behind
                // (measured on the previous broker); at this rate they keep up on 2 cores and
                // the run stays near 2-3 minutes.
                producer_pause_ms: (25, 70),
                relays: 2,
                group_a_members: 3,
                poison_rounds: 2,
                drain_timeout: Duration::from_secs(180),
                relay_retry: RelayRetry::PATIENT,
                long_faults: None,
                dispatch: Some(DispatchLoad {
                    keys: 150,
                    // About 30 actions a second, a dozen per key over the run: beside the
                    // Kafka fleet on 2 cores, without slowing its consumers' catching up.
                    writer_pause_ms: (40, 120),
                    dispatchers: 2,
                    max_in_flight: 16,
                    call_timeout: Duration::from_secs(2),
                    latency: Duration::ZERO..Duration::from_millis(30),
                    fail_rate: 0.1,
                    rate_limit: Some(150.0),
                    pg_restarts: 2,
                }),
            },
            ProfileName::Long => Self {
                name: "long",
                runs: 5,
                fault_phase: Duration::from_secs(150),
                max_faults: 150,
                fault_gap_ms: (400, 1500),
                brokers: 1,
                broker_fault_weight: 2,
                partitions: 6,
                keys: 64,
                // The release build's consumers keep up with about twice the CI profile's rate.
                producer_pause_ms: (10, 40),
                relays: 3,
                group_a_members: 4,
                poison_rounds: 4,
                drain_timeout: Duration::from_secs(180),
                relay_retry: RelayRetry::PATIENT,
                long_faults: Some(LongFaults {
                    // The fault loop's relays never quarantine (what the five runs have always
                    // measured); the phase's may, after 5 attempts of 5 s deliveries: the
                    // broker outage is then ten times their whole budget.
                    relay_retry: Some(LIVENESS_RELAY_RETRY),
                    // Minutes: at this profile's rate (about 150 events/s) some 37,000 events
                    // pile up; in the first run (seed 7) the relays had published them 22 s
                    // after the broker's return and both groups had applied them after 68 s.
                    broker_outage: Some(Duration::from_secs(240)),
                    partial_outage: None,
                    pg_outage: Some(Duration::from_secs(45)),
                    stuck_key: true,
                    blocked_key: true,
                    topic_absence: Some(Duration::from_secs(30)),
                    // 20 attempts, each a 5 s delivery timeout and 0.5-5 s of backoff,
                    // outlast the 30 s absence several times over.
                    topic_fault_retry: TOPIC_FAULT_RETRY,
                    // The outage's backlog takes the consumers about a minute on 2 cores.
                    bound: Duration::from_secs(120),
                    drain_wait: Duration::from_secs(300),
                }),
                // The long faults' drains count the whole outbox; the dispatcher fleet runs in
                // the `ci` profile.
                dispatch: None,
            },
            ProfileName::Cluster => Self {
                name: "cluster",
                // The CI profile on three nodes, with broker faults weighted up: a node
                // restart takes longer than one fault gap, and the loop takes no second node
                // down while one is starting, so most broker picks are skipped.
                broker_fault_weight: 10,
                // Without the dispatcher fleet (the CI profile's 105 count its faults).
                max_faults: 80,
                brokers: 3,
                // Then one node of three down, twice: once with the topic still taking writes
                // (`min.insync.replicas` 2), once with it refusing them (3). The relays
                // quarantine after 5 attempts of 5 s deliveries, so 40 s of refused writes
                // charged to rows would show as quarantined rows.
                long_faults: Some(LongFaults {
                    relay_retry: Some(LIVENESS_RELAY_RETRY),
                    broker_outage: None,
                    partial_outage: Some(Duration::from_secs(40)),
                    pg_outage: None,
                    stuck_key: false,
                    blocked_key: false,
                    topic_absence: None,
                    topic_fault_retry: TOPIC_FAULT_RETRY,
                    bound: Duration::from_secs(60),
                    drain_wait: Duration::from_secs(150),
                }),
                dispatch: None,
                ..Self::named(ProfileName::Ci)
            },
            ProfileName::Liveness => Self {
                name: "liveness",
                runs: 1,
                // A short normal fault phase first (the long faults follow it).
                fault_phase: Duration::from_secs(30),
                max_faults: 30,
                // Without the dispatcher fleet: 2 of 22, as before it.
                broker_fault_weight: 2,
                // Slower writers than the CI profile's: a two-minute outage then leaves a
                // backlog of about 2,000 events, which the debug build's consumers clear
                // within the bound; at the CI rate the figure would measure their
                // throughput on 2 cores, not the framework's resuming.
                producer_pause_ms: (150, 350),
                poison_rounds: 1,
                // Rows that fail while a broker answers are quarantined after 5 attempts,
                // and each delivery times out after 5 s: the broker outage (130 s) is over
                // five times max_attempts x message.timeout.ms.
                relay_retry: LIVENESS_RELAY_RETRY,
                long_faults: Some(LongFaults {
                    relay_retry: None,
                    broker_outage: Some(Duration::from_secs(130)),
                    partial_outage: None,
                    pg_outage: Some(Duration::from_secs(25)),
                    stuck_key: true,
                    blocked_key: true,
                    topic_absence: Some(Duration::from_secs(12)),
                    // 20 attempts 0.5-5 s apart (at least about 40 s of backoff) outlast
                    // the 12 s absence.
                    topic_fault_retry: TOPIC_FAULT_RETRY,
                    bound: Duration::from_secs(60),
                    drain_wait: Duration::from_secs(150),
                }),
                dispatch: None,
                ..Self::named(ProfileName::Ci)
            },
        }
    }
}
