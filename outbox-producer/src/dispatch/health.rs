//! The destination's health: whose failure a failed call is, whether the destination is down
//! (and when to probe it again), and how fast it may be called.
//!
//! The rule: a failure every call gets is the destination's, not the action's. A call that
//! failed is charged to its action only if another call to the destination succeeded after it
//! started (the destination answered others meanwhile). Without such a success, and after
//! [`DOWN_AFTER`] failures in a row, the destination is down: nothing more is claimed until
//! its pause ends, then one action at a time probes it, until a call succeeds.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use std::collections::HashMap;

use outbox_core::EventId;
use tokio::time::Instant;

/// Failures in a row, with no success since the first of them started, after which the
/// destination is down.
pub(crate) const DOWN_AFTER: u32 = 3;

/// Longest pause between probes of a destination that is down.
const PAUSE_MAX: Duration = Duration::from_secs(30);

/// Slowest rate the adaptive limit goes down to, in calls per second.
const MIN_RATE: f64 = 0.5;

/// Multiplicative decrease on a 429: the sawtooth between this share of the destination's
/// limit and the limit averages about 0.93 of it.
const DECREASE: f64 = 0.85;

/// Additive increase: this share of the rate the last 429 left, per second without one.
const INCREASE_PER_SECOND: f64 = 0.05;

/// Most call starts [`State::recent_starts`] keeps.
const RECENT_STARTS: usize = 4096;

/// The least wait of an action answered 429 without `Retry-After`.
const MIN_WAIT: Duration = Duration::from_millis(50);

/// Without `max_rate`, the adaptive limit is lifted after this long without a 429.
const UNLIMITED_AFTER: Duration = Duration::from_secs(60);

/// Whose failure a failed call was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// The action's own: the destination answered other calls meanwhile.
    Action,
    /// The destination's: no call succeeded since this one started.
    Destination,
}

/// What the dispatcher may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Claim and call as usual.
    Open,
    /// Down: call one action, to see whether the destination answers again.
    Probe,
    /// Call nothing before then (down, or asked to wait by a `Retry-After`).
    PausedUntil(Instant),
}

#[derive(Debug)]
struct State {
    last_success: Option<Instant>,
    failures_in_a_row: u32,
    /// Set while the destination is down: since when, and how many probes failed.
    down_since: Option<Instant>,
    /// While down: when the current probe was let through.
    probe_since: Option<Instant>,
    probes_failed: u32,
    /// No call before then (a pause while down, or a wait the destination asked for).
    paused_until: Option<Instant>,
    reason: Option<String>,
    /// The adaptive rate limit, calls per second (`None`: none).
    rate: Option<f64>,
    /// The next moment a call may start (the token bucket's theoretical arrival time).
    next_call: Instant,
    last_rate_limited: Option<Instant>,
    /// Decreases so far: a 429 to a call whose turn was booked at an earlier rate answers
    /// that rate, and decreases nothing more.
    rate_epoch: u64,
    rate_after_decrease: f64,
    /// Calls started in the current one-second window, and in the last full one.
    window_start: Instant,
    window_calls: u32,
    last_window_calls: u32,
    /// Calls started in the last second (a ring of the last [`RECENT_STARTS`] start times):
    /// where a slow-down starts when no call was answered yet.
    recent_starts: std::collections::VecDeque<Instant>,
    /// When each action's call last failed in a way blamed on the destination: a success
    /// since then makes its next such failure its own (an action that fails alone while
    /// the destination answers others now and then).
    failed_before: HashMap<EventId, Instant>,
}

/// Most actions [`State::failed_before`] remembers; past it, it starts over.
const REMEMBERED_FAILURES: usize = 10_000;

/// A call's turn: when it started, and at which rate its turn was booked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Turn {
    pub(crate) started: Instant,
    rate_epoch: u64,
}

/// The health and rate of one destination, shared by a dispatcher's calls.
#[derive(Debug)]
pub(crate) struct Health {
    state: Mutex<State>,
    /// `DispatcherConfig::max_rate`.
    ceiling: Option<f64>,
    backoff_base: Duration,
    labels: Vec<(&'static str, String)>,
}

impl Health {
    pub(crate) fn new(
        max_rate: Option<f64>,
        backoff_base: Duration,
        labels: Vec<(&'static str, String)>,
    ) -> Self {
        let now = Instant::now();
        let health = Self {
            state: Mutex::new(State {
                last_success: None,
                failures_in_a_row: 0,
                down_since: None,
                probe_since: None,
                probes_failed: 0,
                paused_until: None,
                reason: None,
                rate: max_rate,
                next_call: now,
                last_rate_limited: None,
                rate_epoch: 0,
                rate_after_decrease: max_rate.unwrap_or(0.0),
                window_start: now,
                window_calls: 0,
                last_window_calls: 0,
                recent_starts: std::collections::VecDeque::new(),
                failed_before: HashMap::new(),
            }),
            ceiling: max_rate,
            backoff_base,
            labels,
        };
        health.export(true);
        health
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn export(&self, up: bool) {
        metrics::gauge!("outbox_dispatch_destination_up", &self.labels)
            .set(f64::from(u8::from(up)));
    }

    /// What the dispatcher may do now.
    pub(crate) fn admission(&self) -> Admission {
        let state = self.state();
        let now = Instant::now();
        match state.paused_until {
            Some(until) if until > now => Admission::PausedUntil(until),
            _ if state.down_since.is_some() => Admission::Probe,
            _ => Admission::Open,
        }
    }

    /// The dispatcher lets one call through to see whether the destination is back.
    pub(crate) fn probing(&self) {
        self.state().probe_since = Some(Instant::now());
    }

    /// Whether the destination is down (or paused), so that a key's further calls wait.
    pub(crate) fn is_open(&self) -> bool {
        self.admission() == Admission::Open
    }

    /// Why the destination is down, while it is (escaped).
    pub(crate) fn reason(&self) -> Option<String> {
        let state = self.state();
        state.down_since.and(state.reason.clone())
    }

    /// Waits for the rate limit, then returns the call's turn.
    pub(crate) async fn start_call(&self) -> Turn {
        let (at, rate_epoch) = {
            let mut state = self.state();
            let now = Instant::now();
            if state.recent_starts.len() >= RECENT_STARTS {
                state.recent_starts.pop_front();
            }
            state.recent_starts.push_back(now);
            let at = match state.rate {
                Some(rate) => {
                    let at = state.next_call.max(now);
                    state.next_call = at + Duration::from_secs_f64(1.0 / rate);
                    at
                }
                None => now,
            };
            (at, state.rate_epoch)
        };
        tokio::time::sleep_until(at).await;
        Turn {
            started: Instant::now(),
            rate_epoch,
        }
    }

    /// A call that the destination answered (done, or refused for the action's own reason).
    pub(crate) fn succeeded(&self) {
        let mut state = self.state();
        let now = Instant::now();
        state.last_success = Some(now);
        // Calls answered per second: what the destination takes, where a slow-down starts.
        if now.duration_since(state.window_start) >= Duration::from_secs(1) {
            state.last_window_calls = state.window_calls;
            state.window_calls = 0;
            state.window_start = now;
        }
        state.window_calls = state.window_calls.saturating_add(1);
        state.failures_in_a_row = 0;
        state.probes_failed = 0;
        state.probe_since = None;
        if let Some(since) = state.down_since.take() {
            tracing::warn!(down_for = ?now.duration_since(since), "the destination answers again; dispatching resumes");
            state.reason = None;
            self.export(true);
        }
        if let Some(rate) = state.rate {
            // Additive increase: `INCREASE_PER_SECOND` of the last decrease's rate per second,
            // spread over the calls of that second.
            let step = (state.rate_after_decrease * INCREASE_PER_SECOND) / rate;
            let mut raised = rate + step;
            if let Some(ceiling) = self.ceiling {
                raised = raised.min(ceiling);
            }
            let quiet = state
                .last_rate_limited
                .is_none_or(|at| now.duration_since(at) >= UNLIMITED_AFTER);
            state.rate = if self.ceiling.is_none() && quiet {
                None
            } else {
                Some(raised)
            };
        }
    }

    /// A call that failed in a way every call of a failing destination does (a 5xx, a
    /// timeout, no connection): whose failure it is.
    pub(crate) fn failed(&self, action: EventId, started: Instant, reason: &str) -> Blame {
        let mut state = self.state();
        state.failures_in_a_row = state.failures_in_a_row.saturating_add(1);
        if state.failed_before.len() >= REMEMBERED_FAILURES {
            state.failed_before.clear();
        }
        let since = state
            .failed_before
            .insert(action, Instant::now())
            .map_or(started, |before| before.min(started));
        if state.last_success.is_some_and(|at| at > since) {
            state.failed_before.remove(&action);
            return Blame::Action;
        }
        if state.down_since.is_some() {
            // A failed probe waits longer before the next; the calls of keys already under way
            // when the destination went down are no probes.
            if state.probe_since.is_some_and(|probe| started >= probe) {
                state.probe_since = None;
                state.probes_failed = state.probes_failed.saturating_add(1);
                self.pause(&mut state, reason);
            }
        } else if state.failures_in_a_row >= DOWN_AFTER {
            let now = Instant::now();
            state.down_since = Some(now);
            tracing::warn!(
                failures = state.failures_in_a_row,
                error = %outbox_core::escape(reason),
                "the destination fails every call; it is down: actions wait uncharged, one probes it"
            );
            self.export(false);
            self.pause(&mut state, reason);
        }
        Blame::Destination
    }

    fn pause(&self, state: &mut State, reason: &str) {
        let wait = outbox_core::backoff(self.backoff_base, PAUSE_MAX, state.probes_failed);
        let until = Instant::now() + wait;
        state.paused_until = Some(state.paused_until.map_or(until, |u| u.max(until)));
        state.reason = Some(outbox_core::escape(reason).to_string());
    }

    /// The destination limits the rate (a 429 to the call of `turn`): slow every call down,
    /// and call nothing before `after`, when it asked. Returns how long the action waits:
    /// `after`, or its turn at the new rate.
    pub(crate) fn rate_limited(&self, turn: Turn, after: Option<Duration>) -> Duration {
        let mut state = self.state();
        let now = Instant::now();
        if let Some(after) = after {
            let until = now + after;
            state.paused_until = Some(state.paused_until.map_or(until, |u| u.max(until)));
        }
        state.last_rate_limited = Some(now);
        let wait = |rate: Option<f64>| {
            after.unwrap_or_else(|| {
                rate.map_or(MIN_WAIT, |r| Duration::from_secs_f64(1.0 / r).max(MIN_WAIT))
            })
        };
        // One decrease per rate: the calls whose turns were booked before the last decrease
        // were paced by the rate before (or by none), and decreasing for each brought 200/s
        // down to 18/s within a millisecond, 64 calls started at once answering 429 one
        // after the other.
        if turn.rate_epoch != state.rate_epoch {
            return wait(state.rate);
        }
        state.rate_epoch += 1;
        let current = state.rate.unwrap_or_else(|| {
            // The calls sent per second, over the time they were sent in (at most the last
            // second, at least 50 ms), or the calls answered per second, whichever is more:
            // an over-estimate, which the decreases that follow (one per round trip) bring
            // down in a fraction of a second, where an under-estimate takes the additive
            // increase minutes to make up (bench P9d, 2026-12-07: the first 429 came 10
            // answers after a start that counted as 0.3 s, and the rate set out from 26/s
            // against an API taking 200/s).
            let elapsed = now
                .duration_since(state.window_start)
                .as_secs_f64()
                .clamp(0.05, 1.0);
            let answered =
                f64::from(state.last_window_calls).max(f64::from(state.window_calls) / elapsed);
            let second_ago = now.checked_sub(Duration::from_secs(1));
            let recent = state
                .recent_starts
                .iter()
                .filter(|&&at| second_ago.is_none_or(|ago| at >= ago));
            let (sent, oldest) = recent.fold((0_u32, now), |(n, oldest), &at| {
                (n.saturating_add(1), oldest.min(at))
            });
            let span = now.duration_since(oldest).as_secs_f64().clamp(0.05, 1.0);
            answered.max(f64::from(sent) / span).max(MIN_RATE)
        });
        let floor = self.ceiling.map_or(MIN_RATE, |c| c.min(MIN_RATE));
        let rate = (current * DECREASE).max(floor);
        state.rate = Some(rate);
        state.rate_after_decrease = rate;
        tracing::debug!(
            calls_per_second = rate,
            "the destination limits the rate; slowing down"
        );
        wait(Some(rate))
    }

    /// The destination asked for a wait (`Retry-After` on a 5xx): call nothing before it.
    pub(crate) fn wait_asked(&self, after: Duration) {
        let mut state = self.state();
        let until = Instant::now() + after;
        state.paused_until = Some(state.paused_until.map_or(until, |u| u.max(until)));
    }

    /// The current rate limit (calls per second), if any, and how far ahead the calls
    /// already waiting for their turn have booked it.
    pub(crate) fn rate(&self) -> Option<(f64, Duration)> {
        let state = self.state();
        state.rate.map(|rate| {
            (
                rate,
                state.next_call.saturating_duration_since(Instant::now()),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(max_rate: Option<f64>) -> Health {
        Health::new(max_rate, Duration::from_millis(10), Vec::new())
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_is_the_actions_only_if_another_call_succeeded_since_it_started() {
        let h = health(None);
        let started = h.start_call().await.started;
        tokio::time::advance(Duration::from_millis(5)).await;
        h.succeeded();
        assert_eq!(h.failed(EventId::new(), started, "503"), Blame::Action);
        let later = h.start_call().await.started;
        assert_eq!(h.failed(EventId::new(), later, "503"), Blame::Destination);
        assert_eq!(
            h.admission(),
            Admission::Open,
            "one failure is not an outage"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_action_failing_alone_is_charged_once_others_succeeded_since_its_last_failure() {
        let h = health(None);
        let lonely = EventId::new();
        let first = h.start_call().await.started;
        assert_eq!(h.failed(lonely, first, "500"), Blame::Destination);
        tokio::time::advance(Duration::from_millis(5)).await;
        // Another action's call succeeds between its tries, none during its second.
        h.succeeded();
        tokio::time::advance(Duration::from_millis(5)).await;
        let second = h.start_call().await.started;
        assert_eq!(h.failed(lonely, second, "500"), Blame::Action);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_in_a_row_take_the_destination_down_until_a_call_succeeds() {
        let h = health(None);
        for _ in 0..DOWN_AFTER {
            let started = h.start_call().await.started;
            assert_eq!(h.failed(EventId::new(), started, "503"), Blame::Destination);
        }
        assert!(matches!(h.admission(), Admission::PausedUntil(_)));
        assert!(h.reason().is_some());
        // Calls in flight when it went down fail too: they are no probes, and do not make
        // the next probe wait longer.
        let before = tokio::time::Instant::now() - Duration::from_millis(1);
        let Admission::PausedUntil(first) = h.admission() else {
            panic!("paused");
        };
        for _ in 0..20 {
            h.failed(EventId::new(), before, "503");
        }
        assert_eq!(h.admission(), Admission::PausedUntil(first));
        tokio::time::advance(PAUSE_MAX).await;
        assert_eq!(h.admission(), Admission::Probe);
        // A failed probe waits longer before the next.
        h.probing();
        let probe = h.start_call().await.started;
        h.failed(EventId::new(), probe, "503");
        let Admission::PausedUntil(next) = h.admission() else {
            panic!("paused after a failed probe");
        };
        assert!(next > first);
        tokio::time::advance(PAUSE_MAX).await;
        h.succeeded();
        assert_eq!(h.admission(), Admission::Open);
        assert_eq!(h.reason(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_slows_down_then_the_rate_climbs_back_to_the_ceiling() {
        let h = health(Some(100.0));
        let before = h.start_call().await;
        tokio::time::advance(Duration::from_millis(1)).await;
        h.rate_limited(before, None);
        let (slowed, _) = h.rate().expect("a rate");
        assert!((slowed - 85.0).abs() < 1e-9, "{slowed}");
        // The other 429s to calls sent at the rate before decrease nothing more ...
        h.rate_limited(before, None);
        assert_eq!(h.rate().map(|(r, _)| r), Some(slowed));
        // ... a 429 to a call sent at the new rate does.
        tokio::time::advance(Duration::from_millis(1)).await;
        let after = h.start_call().await;
        tokio::time::advance(Duration::from_millis(1)).await;
        let wait = h.rate_limited(after, None);
        let (again, _) = h.rate().expect("a rate");
        assert!(again < slowed, "{again}");
        assert!(
            wait >= MIN_WAIT && wait < Duration::from_secs(1),
            "{wait:?}"
        );
        for _ in 0..10_000 {
            h.succeeded();
        }
        assert_eq!(h.rate().map(|(r, _)| r), Some(100.0));
    }

    /// The first 429 came back before any call was answered: the slow-down started from
    /// nothing answered, 0.5 calls/s, and climbed back by 0.025/s per second (bench P9d).
    #[tokio::test(start_paused = true)]
    async fn a_429_before_any_answer_slows_down_from_the_calls_sent() {
        let h = health(None);
        tokio::time::advance(Duration::from_secs(30)).await;
        let mut first = None;
        for _ in 0..64 {
            first.get_or_insert(h.start_call().await);
        }
        h.rate_limited(first.expect("a call"), None);
        let (rate, _) = h.rate().expect("a rate");
        assert!(rate > 50.0, "{rate}");
    }

    /// The first 429s came 10 answers into a start that counted as 0.3 s: the rate set out
    /// from 26/s against an API taking 200/s, and climbed back by 1.3/s per second (bench
    /// P9d, 2026-12-07).
    #[tokio::test(start_paused = true)]
    async fn a_429_early_on_slows_down_from_the_calls_sent_over_the_time_they_took() {
        let h = health(None);
        tokio::time::advance(Duration::from_millis(300)).await;
        let mut first = None;
        for _ in 0..64 {
            first.get_or_insert(h.start_call().await);
        }
        tokio::time::advance(Duration::from_millis(2)).await;
        for _ in 0..10 {
            h.succeeded();
        }
        h.rate_limited(first.expect("a call"), None);
        let (rate, _) = h.rate().expect("a rate");
        // 64 calls sent within 50 ms: at least 1,280/s, 1,088/s after the decrease.
        assert!(rate > 1000.0, "{rate}");
    }

    /// 64 calls started at once, before any rate: each 429 came after the last decrease and
    /// decreased again, 200/s down to 18/s within a millisecond (the decreases counted from
    /// when a call started, not from the rate its turn was booked at).
    #[tokio::test(start_paused = true)]
    async fn calls_booked_before_a_decrease_decrease_nothing_more_whenever_they_start() {
        let h = health(None);
        tokio::time::advance(Duration::from_secs(1)).await;
        let mut turns = Vec::new();
        for _ in 0..64 {
            turns.push(h.start_call().await);
        }
        h.rate_limited(turns[0], None);
        let (first, _) = h.rate().expect("a rate");
        tokio::time::advance(Duration::from_millis(1)).await;
        for turn in &turns[1..] {
            // Booked before the decrease, started (woken) after it.
            let late = Turn {
                started: Instant::now(),
                ..*turn
            };
            h.rate_limited(late, None);
        }
        assert_eq!(h.rate().map(|(r, _)| r), Some(first), "one decrease");
        let paced = h.start_call().await;
        h.rate_limited(paced, None);
        let (second, _) = h.rate().expect("a rate");
        assert!(
            (second - first * DECREASE).abs() < 1e-6,
            "{second} after {first}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_pauses_the_whole_destination_in_full() {
        let h = health(None);
        let turn = h.start_call().await;
        h.rate_limited(turn, Some(Duration::from_secs(3600)));
        let Admission::PausedUntil(until) = h.admission() else {
            panic!("paused");
        };
        assert!(until >= Instant::now() + Duration::from_secs(3599));
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_spaces_calls() {
        let h = health(Some(10.0));
        let t0 = Instant::now();
        for _ in 0..5 {
            h.start_call().await;
        }
        assert!(Instant::now().duration_since(t0) >= Duration::from_millis(400));
    }
}
