//! Worker health as the gateway sees it: a per-worker circuit [`Breaker`] fed by request
//! outcomes, a [`HealthTracker`] fed by active health checks, the retry [`Backoff`] schedule
//! and the fleet-wide [`RetryBudget`]. Pure state machines: every method takes the time
//! (`now_ms`, milliseconds on the caller's monotonic clock) instead of reading a clock, so the
//! same code runs under `kvroute serve` and under a virtual clock in tests.
//!
//! What counts, in one table (operations.md §1, bug-cases.md B40):
//!
//! | outcome of one attempt | [`Outcome`] | breaker |
//! |---|---|---|
//! | 2xx / 3xx response head | `Success` | success |
//! | 4xx other than 408 and 429 (the client's fault) | `Neutral` | nothing |
//! | 429 (overloaded, not broken) | `Neutral` | nothing |
//! | 408, 500, 502, 503, 504 from the worker | `Failure` | failure |
//! | connect refused / reset / timeout, first-byte timeout, broken head | `Failure` | failure |

use rand::Rng;
use std::sync::atomic::{AtomicU64, Ordering};

/// How one attempt on a worker ended, for its [`Breaker`] (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The worker answered.
    Success,
    /// The worker failed (transport error, timeout, or a retryable 5xx / 408).
    Failure,
    /// Says nothing about the worker (a client error, 429).
    Neutral,
}

impl Outcome {
    /// The outcome of a response head with `status` (see the module table).
    pub fn of_status(status: u16) -> Outcome {
        match status {
            408 | 500 | 502 | 503 | 504 => Outcome::Failure,
            400..=499 => Outcome::Neutral,
            _ => Outcome::Success,
        }
    }
}

/// True when a worker's response `status` may be retried on another worker before the client
/// saw anything: 502, 503, 504 (issue 13; SMG also retries 408, 429 and 500, but a 500 is
/// usually the request's own fault on vLLM, and a 429 would only move the overload).
pub fn is_retryable_status(status: u16) -> bool {
    matches!(status, 502..=504)
}

/// Settings of a [`Breaker`] (defaults: `config::defaults::BREAKER_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// Failures further apart than this do not add up, ms (SMG: "within 120 s").
    pub window_ms: u64,
    /// Time the breaker stays open before it lets requests probe again, ms.
    pub open_ms: u64,
    /// Successes in half-open that close it again.
    pub success_threshold: u32,
}

/// The state of a [`Breaker`], as exported in `kvroute_worker_breaker_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Requests flow.
    Closed,
    /// Requests flow as probes; one failure reopens, `success_threshold` successes close.
    HalfOpen,
    /// No request is sent until the open time has passed.
    Open,
}

impl BreakerState {
    /// Gauge value: 0 closed, 1 half-open, 2 open.
    pub fn as_gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }

    /// Label / JSON name: `closed`, `half_open`, `open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Open => "open",
        }
    }
}

/// A per-worker circuit breaker (SMG's, operations.md §1).
///
/// # Invariants
/// 1. `Open` holds `opened_at_ms`; the state reads as half-open once `open_ms` has passed.
/// 2. `failures` counts consecutive failures, each within `window_ms` of the previous one.
#[derive(Debug, Clone)]
pub struct Breaker {
    cfg: BreakerConfig,
    state: BreakerState,
    failures: u32,
    last_failure_ms: u64,
    half_open_successes: u32,
    opened_at_ms: u64,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(cfg: BreakerConfig) -> Self {
        Self {
            cfg,
            state: BreakerState::Closed,
            failures: 0,
            last_failure_ms: 0,
            half_open_successes: 0,
            opened_at_ms: 0,
        }
    }

    /// Its settings.
    pub fn config(&self) -> BreakerConfig {
        self.cfg
    }

    /// How long it stays open, ms.
    pub fn open_ms(&self) -> u64 {
        self.cfg.open_ms
    }

    /// The state at `now_ms` (an open breaker whose time has passed reads half-open).
    pub fn state(&self, now_ms: u64) -> BreakerState {
        match self.state {
            BreakerState::Open if now_ms.saturating_sub(self.opened_at_ms) >= self.cfg.open_ms => {
                BreakerState::HalfOpen
            }
            s => s,
        }
    }

    /// True when a request may be sent at `now_ms` (closed or half-open).
    pub fn allows(&self, now_ms: u64) -> bool {
        self.state(now_ms) != BreakerState::Open
    }

    /// Records one attempt's outcome at `now_ms`; returns the new state.
    pub fn record(&mut self, outcome: Outcome, now_ms: u64) -> BreakerState {
        self.state = self.state(now_ms);
        match (outcome, self.state) {
            (Outcome::Neutral, _) => {}
            (Outcome::Success, BreakerState::HalfOpen) => {
                self.half_open_successes += 1;
                if self.half_open_successes >= self.cfg.success_threshold {
                    self.close();
                }
            }
            (Outcome::Success, _) => self.failures = 0,
            (Outcome::Failure, BreakerState::HalfOpen) => self.open(now_ms),
            (Outcome::Failure, _) => {
                if self.failures > 0
                    && now_ms.saturating_sub(self.last_failure_ms) > self.cfg.window_ms
                {
                    self.failures = 0;
                }
                self.failures += 1;
                self.last_failure_ms = now_ms;
                if self.failures >= self.cfg.failure_threshold {
                    self.open(now_ms);
                }
            }
        }
        self.state
    }

    fn open(&mut self, now_ms: u64) {
        self.state = BreakerState::Open;
        self.opened_at_ms = now_ms;
        self.half_open_successes = 0;
        self.failures = 0;
    }

    fn close(&mut self) {
        self.state = BreakerState::Closed;
        self.failures = 0;
        self.half_open_successes = 0;
    }
}

/// Settings of a [`HealthTracker`] (defaults: `config::defaults::HEALTH_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Consecutive failed checks that make a healthy worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive passed checks that make an unhealthy worker healthy.
    pub success_threshold: u32,
}

/// Active health of one worker: N failed checks in a row → unhealthy, M passed → healthy
/// (SMG: 3 and 2, operations.md §1).
#[derive(Debug, Clone)]
pub struct HealthTracker {
    cfg: HealthConfig,
    healthy: bool,
    streak: u32,
}

/// What one health check changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// No change of state.
    Same,
    /// The worker just became healthy.
    BecameHealthy,
    /// The worker just became unhealthy.
    BecameUnhealthy,
}

impl HealthTracker {
    /// A tracker starting `healthy` or not (a worker unreachable at start-up starts
    /// unhealthy and needs `success_threshold` passed checks).
    pub fn new(cfg: HealthConfig, healthy: bool) -> Self {
        Self {
            cfg,
            healthy,
            streak: 0,
        }
    }

    /// True while the worker is healthy.
    pub fn is_healthy(&self) -> bool {
        self.healthy
    }

    /// Records one check (`passed`: a 200 within the timeout).
    pub fn record(&mut self, passed: bool) -> HealthChange {
        if passed == self.healthy {
            self.streak = 0;
            return HealthChange::Same;
        }
        self.streak += 1;
        let needed = if self.healthy {
            self.cfg.failure_threshold
        } else {
            self.cfg.success_threshold
        };
        if self.streak < needed.max(1) {
            return HealthChange::Same;
        }
        self.healthy = passed;
        self.streak = 0;
        if passed {
            HealthChange::BecameHealthy
        } else {
            HealthChange::BecameUnhealthy
        }
    }
}

/// Retry schedule: the wait before retry `k` (1-based) is `initial × multiplier^(k−1)`, capped
/// at `max_ms`, times a uniform jitter factor in `[1 − jitter, 1 + jitter]` (SMG's shape,
/// operations.md §1; defaults `config::defaults::RETRY_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Wait before the first retry, ms.
    pub initial_ms: u64,
    /// Growth per retry (≥ 1).
    pub multiplier: f64,
    /// Largest wait, ms (before jitter).
    pub max_ms: u64,
    /// Relative jitter, in [0, 1).
    pub jitter: f64,
}

impl Backoff {
    /// The wait before retry `k` (1-based), ms, with jitter drawn from `rng`.
    pub fn delay_ms(&self, k: u32, rng: &mut impl Rng) -> u64 {
        let base = self.initial_ms as f64 * self.multiplier.powi(k.saturating_sub(1) as i32);
        let base = base.min(self.max_ms as f64);
        let j = if self.jitter > 0.0 {
            rng.random_range(-self.jitter..=self.jitter)
        } else {
            0.0
        };
        (base * (1.0 + j)).max(0.0).round() as u64
    }
}

/// A fleet-wide retry budget (Finagle's and Envoy's idea): every request deposits `ratio` of
/// a retry, every retry withdraws one, and the balance is capped at `cap`, so retries add at
/// most about `ratio` × requests plus `cap` during an outage, instead of multiplying the load
/// on the workers that are left. Lock-free; shared by all shards.
///
/// Balances are kept in thousandths of a retry.
#[derive(Debug)]
pub struct RetryBudget {
    milli: AtomicU64,
    deposit_milli: u64,
    cap_milli: u64,
}

impl RetryBudget {
    /// A full budget: `ratio` retries earned per request (e.g. 0.2), at most `cap` banked.
    pub fn new(ratio: f64, cap: u32) -> Self {
        let cap_milli = u64::from(cap) * 1000;
        Self {
            milli: AtomicU64::new(cap_milli),
            deposit_milli: (ratio.clamp(0.0, 1000.0) * 1000.0).round() as u64,
            cap_milli,
        }
    }

    /// One request arrived.
    pub fn deposit(&self) {
        let _ = self
            .milli
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                Some((m + self.deposit_milli).min(self.cap_milli))
            });
    }

    /// Takes one retry; false when the budget is spent (the retry must not happen).
    pub fn try_withdraw(&self) -> bool {
        self.milli
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                m.checked_sub(1000)
            })
            .is_ok()
    }

    /// Retries available now (whole).
    pub fn available(&self) -> u64 {
        self.milli.load(Ordering::Relaxed) / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    const CFG: BreakerConfig = BreakerConfig {
        failure_threshold: 3,
        window_ms: 1_000,
        open_ms: 5_000,
        success_threshold: 2,
    };

    #[test]
    fn breaker_opens_after_consecutive_failures_and_closes_after_probes() {
        let mut b = Breaker::new(CFG);
        assert_eq!(b.record(Outcome::Failure, 0), BreakerState::Closed);
        assert_eq!(b.record(Outcome::Failure, 10), BreakerState::Closed);
        // A success in between resets the count.
        b.record(Outcome::Success, 20);
        b.record(Outcome::Failure, 30);
        b.record(Outcome::Failure, 40);
        assert!(b.allows(40));
        assert_eq!(b.record(Outcome::Failure, 50), BreakerState::Open);
        assert!(!b.allows(50));
        assert!(!b.allows(5_049));
        // Open time passed: half-open, requests probe.
        assert_eq!(b.state(5_050), BreakerState::HalfOpen);
        assert!(b.allows(5_050));
        assert_eq!(b.record(Outcome::Success, 5_060), BreakerState::HalfOpen);
        assert_eq!(b.record(Outcome::Success, 5_070), BreakerState::Closed);
        // Back to counting from zero.
        b.record(Outcome::Failure, 6_000);
        b.record(Outcome::Failure, 6_001);
        assert!(b.allows(6_002));
    }

    #[test]
    fn breaker_half_open_failure_reopens_and_window_forgets_old_failures() {
        let mut b = Breaker::new(CFG);
        for t in 0..3 {
            b.record(Outcome::Failure, t);
        }
        assert_eq!(b.record(Outcome::Failure, 5_002), BreakerState::Open);
        assert!(!b.allows(10_001));
        assert!(b.allows(10_002));
        // Failures more than window_ms apart never add up.
        let mut b = Breaker::new(CFG);
        for t in [0, 1_500, 3_000, 4_500] {
            assert_eq!(b.record(Outcome::Failure, t), BreakerState::Closed);
        }
    }

    /// bug-cases.md B40: 100 client errors and 429s never open the breaker.
    #[test]
    fn b40_client_errors_and_429_are_neutral() {
        let mut b = Breaker::new(CFG);
        for i in 0..100 {
            let status = [400, 404, 413, 422, 429][i % 5];
            assert_eq!(Outcome::of_status(status), Outcome::Neutral);
            b.record(Outcome::of_status(status), i as u64);
        }
        assert_eq!(b.state(100), BreakerState::Closed);
        for s in [408, 500, 502, 503, 504] {
            assert_eq!(Outcome::of_status(s), Outcome::Failure, "{s}");
        }
        assert_eq!(Outcome::of_status(200), Outcome::Success);
        assert!(is_retryable_status(503) && !is_retryable_status(500));
        assert!(!is_retryable_status(429) && !is_retryable_status(400));
    }

    #[test]
    fn health_needs_streaks_both_ways() {
        let cfg = HealthConfig {
            failure_threshold: 3,
            success_threshold: 2,
        };
        let mut h = HealthTracker::new(cfg, true);
        assert_eq!(h.record(false), HealthChange::Same);
        assert_eq!(h.record(false), HealthChange::Same);
        assert_eq!(h.record(true), HealthChange::Same); // streak broken
        assert_eq!(h.record(false), HealthChange::Same);
        assert_eq!(h.record(false), HealthChange::Same);
        assert_eq!(h.record(false), HealthChange::BecameUnhealthy);
        assert!(!h.is_healthy());
        assert_eq!(h.record(true), HealthChange::Same);
        assert_eq!(h.record(true), HealthChange::BecameHealthy);
        let mut cold = HealthTracker::new(cfg, false);
        assert!(!cold.is_healthy());
        cold.record(true);
        assert_eq!(cold.record(true), HealthChange::BecameHealthy);
    }

    #[test]
    fn backoff_grows_caps_and_jitters_within_bounds() {
        let b = Backoff {
            initial_ms: 50,
            multiplier: 1.5,
            max_ms: 100,
            jitter: 0.0,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let d: Vec<u64> = (1..=4).map(|k| b.delay_ms(k, &mut rng)).collect();
        assert_eq!(d, vec![50, 75, 100, 100]);
        let j = Backoff { jitter: 0.2, ..b };
        for k in 1..=4 {
            for _ in 0..200 {
                let want = d[k as usize - 1] as f64;
                let got = j.delay_ms(k, &mut rng) as f64;
                assert!(
                    got >= (want * 0.8).floor() && got <= (want * 1.2).ceil(),
                    "{got}"
                );
            }
        }
    }

    #[test]
    fn retry_budget_caps_retries_at_ratio_of_requests() {
        let b = RetryBudget::new(0.2, 3);
        assert_eq!(b.available(), 3);
        assert!(b.try_withdraw() && b.try_withdraw() && b.try_withdraw());
        assert!(!b.try_withdraw());
        for _ in 0..10 {
            b.deposit();
        }
        // 10 requests × 0.2 = 2 retries.
        assert_eq!(b.available(), 2);
        assert!(b.try_withdraw() && b.try_withdraw());
        assert!(!b.try_withdraw());
        for _ in 0..1_000 {
            b.deposit();
        }
        assert_eq!(b.available(), 3, "capped");
    }
}
