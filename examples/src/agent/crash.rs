//! Where the demo kills its own process, and the switch that does it.

use std::sync::atomic::{AtomicBool, Ordering};

/// The exit status of a worker that crashed where it was told to.
pub const CRASH_EXIT_CODE: i32 = 75;

/// A step between the agent's decision and the charge at which the process can die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrashPoint {
    /// State and the decided tool call are written, the transaction is not committed.
    BeforeCommit,
    /// The decision is committed; nothing is published yet.
    AfterCommit,
    /// Kafka acknowledged the event; the relay has not marked the row published.
    AfterPublish,
    /// The billing handler charged the card and enqueued its follow-up; its transaction has
    /// not committed.
    InHandler,
    /// The handler's transaction committed; the Kafka offset is not stored.
    AfterHandlerCommit,
}

impl CrashPoint {
    /// Every crash point, in the order the steps happen.
    pub const ALL: [CrashPoint; 5] = [
        CrashPoint::BeforeCommit,
        CrashPoint::AfterCommit,
        CrashPoint::AfterPublish,
        CrashPoint::InHandler,
        CrashPoint::AfterHandlerCommit,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::BeforeCommit => "before-commit",
            CrashPoint::AfterCommit => "after-commit",
            CrashPoint::AfterPublish => "after-publish",
            CrashPoint::InHandler => "in-handler",
            CrashPoint::AfterHandlerCommit => "after-handler-commit",
        }
    }

    /// What has happened when the process dies there.
    pub fn describe(self) -> &'static str {
        match self {
            CrashPoint::BeforeCommit => "agent dies before committing state + decided tool call",
            CrashPoint::AfterCommit => "agent dies right after committing, before any publish",
            CrashPoint::AfterPublish => "relay dies after Kafka acked, before marking published",
            CrashPoint::InHandler => "billing handler dies after charging, before its commit",
            CrashPoint::AfterHandlerCommit => {
                "billing consumer dies after its commit, before storing the offset"
            }
        }
    }
}

/// Kills the process the first time its armed point is reached.
#[derive(Debug)]
pub struct CrashSwitch {
    armed: Option<CrashPoint>,
    fired: AtomicBool,
}

impl CrashSwitch {
    /// A switch for `armed` (`None`: never crash).
    pub fn new(armed: Option<CrashPoint>) -> Self {
        Self {
            armed,
            fired: AtomicBool::new(false),
        }
    }

    /// Whether `point` is the one this process dies at.
    pub fn is_armed(&self, point: CrashPoint) -> bool {
        self.armed == Some(point)
    }

    /// Dies here if `point` is armed and has not fired yet.
    pub fn reached(&self, point: CrashPoint) {
        if self.is_armed(point) && !self.fired.swap(true, Ordering::SeqCst) {
            die(point);
        }
    }
}

/// Ends the process at once, the way a power cut or `kill -9` would: no destructor runs, no
/// transaction is committed, nothing buffered is flushed.
pub fn die(point: CrashPoint) -> ! {
    eprintln!("   ** crash injected: {} **", point.describe());
    std::process::exit(CRASH_EXIT_CODE)
}
