//! How big and how long a run is.

use std::time::Duration;

/// A named set of run parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProfileName {
    /// The test suite's profile: about 2–3 minutes on 2 cores.
    Ci,
    /// By hand: about 20 minutes, five runs.
    Long,
    /// The test suite's, on a 3-broker cluster: partition leaders killed under load.
    Cluster,
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
}

impl Profile {
    pub(crate) fn named(name: ProfileName) -> Self {
        match name {
            ProfileName::Ci => Self {
                name: "ci",
                runs: 1,
                fault_phase: Duration::from_secs(90),
                max_faults: 80,
                fault_gap_ms: (400, 1200),
                brokers: 1,
                broker_fault_weight: 2,
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
            },
            ProfileName::Cluster => Self {
                name: "cluster",
                // The CI profile on three nodes, with broker faults weighted up: a node
                // restart takes longer than one fault gap, and the loop takes no second node
                // down while one is starting, so most broker picks are skipped.
                broker_fault_weight: 10,
                brokers: 3,
                ..Self::named(ProfileName::Ci)
            },
        }
    }
}
