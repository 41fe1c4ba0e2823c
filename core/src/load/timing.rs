//! [`PrefillModel`]: how long a worker takes to prefill `T` new prompt tokens, learned online
//! from the time to first token of the requests it served.
//!
//! # The curve
//! An engine prefills in steps of at most `B` new tokens (vLLM's `max_num_batched_tokens`,
//! chunked prefill), and a step that also decodes the running requests takes longer. The
//! Dynamo mocker's step time (engine-model.md §4) is `c·t² + b·t + a` for `t` new tokens in the
//! step, plus the decode term when requests decode. So a request's own prefill of `T` tokens,
//! split into `n = ⌈T/B⌉` chunks `t₁ … tₙ`, takes
//!
//! ```text
//! prefill_ms(T) = a·n + b·T + c·Σ tᵢ² + d·n·u
//! ```
//!
//! with `u` ∈ [0, 1] the worker's decode load (the share of its KV memory held by running
//! requests: [`crate::load::active::decode_load`]), linear in `θ = (a, b, c, d)` over the
//! features `x = (n, T, Σ tᵢ², n·u)`.
//!
//! # Learning
//! The shape of `a·n + b·T + c·Σ tᵢ²` is the mocker's ([`PRIOR`]); what a worker's GPU, model
//! and parallelism change is its scale. So each worker learns two numbers, `θ = (s, d)`:
//!
//! ```text
//! prefill_ms(T) = s · (a₀·n + b₀·T + c₀·Σ tᵢ²) + d·n·u
//! ```
//!
//! by recursive least squares with exponential forgetting (factor [`FORGETTING`]) over
//! samples `(x, observed TTFT)` from requests that waited behind no other prefill on their
//! worker (the router's own bookkeeping said so at dispatch): their TTFT is their own
//! prefill. Memory is bounded (a 2-vector and a 2×2 matrix per worker), there is nothing to
//! configure, and each worker learns its own curve, so heterogeneous GPUs get their own.
//! Fitting all four polynomial coefficients instead was measured and refused: `n` and `Σ tᵢ²`
//! are nearly collinear once prompts span several chunks, and with real (noisy) samples the
//! fit drifted to 8k-token predictions of 450–1,850 ms against a true 169 (Mooncake ×1, 8
//! engines). The scale is kept within [`BOUND`]× of 1 either way and `d` ≥ 0, so a run of odd
//! samples can neither make a worker look free nor unusable. The prior is `(1, d₀)` with a
//! standard deviation of 1 and `d₀`, so a few dozen samples override it.
//!
//! The step token budget is [`STEP_TOKENS`] for every worker (a worker's own is not known to
//! the router); a worker with another budget is learned on these features all the same.
//!
//! Source of the estimator: the textbook RLS update (Haykin, *Adaptive Filter Theory*, §10),
//! `k = P·x / (λ + xᵀ·P·x)`, `θ += k·(y − xᵀ·θ)`, `P = (P − k·xᵀ·P) / λ`, with `P` scaled
//! down whenever its trace exceeds the prior's, so directions no sample excites do not wind
//! up.

/// The prior curve, in the scaled features' units: `a` ms per step, `b` ms per 1,000
/// tokens, `c` ms per (1,000 tokens)², `d` ms per step at full decode load. Source: the
/// Dynamo mocker's polynomial (engine-model.md §4: `4.209989e-07·T² + 1.518344e-02·T +
/// 16.50142`), and its decode step at a full KV cache (34.01 ms, same table) less the 5.74
/// ms it takes with nothing cached: 28.27 ms.
pub const PRIOR: [f64; 4] = [16.50142, 15.18344, 0.4209989, 28.27];

/// The learned scale stays within this factor of 1, both ways (a GPU 20× faster or slower
/// than the mocker's H100-class curve is outside what one router fleet mixes), and `d`
/// within this factor of its prior. kvroute's choice.
pub const BOUND: f64 = 20.0;

/// Forgetting factor of the least-squares fit: a sample's weight halves after
/// `ln 2 / −ln 0.99 ≈ 69` newer samples, so a worker whose speed changes (another model, a
/// throttled GPU) is re-learned within a few hundred requests. Dimensionless, in (0, 1].
pub const FORGETTING: f64 = 0.99;

/// A sample's error is clipped to this multiple of the predicted prefill (at least 1 ms)
/// (Huber's robust regression, Haykin §10's RLS with a clipped residual), so one sample
/// that waited on something the router does not see cannot wreck a worker's curve.
/// Measured on WEKA seed 9 (8 engines, capacity 1.25× the largest request): one alone
/// request of 3,184 new tokens predicted at 162 ms took 19,816 ms (its engine's KV memory
/// 99 % full); unclipped, that one sample dropped the worker's scale to ~1/20, every new
/// conversation then looked fastest there and piled on (requests per engine max/mean 2.81;
/// 1.93 with the clip; perf/runs/2026-12-04-busy-alpha). 1: an error of ±100 %; a truly 2× faster or slower
/// worker is still learned, at most one prediction's error per sample.
pub const OUTLIER: f64 = 1.0;

/// Step token budget assumed when the worker's is unknown, tokens. Source: vLLM's default
/// `max_num_batched_tokens` with chunked prefill (8,192 for the Dynamo mocker,
/// engine-model.md §1).
pub const STEP_TOKENS: usize = 8_192;

/// A worker's prefill curve, learned online (module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillModel {
    /// (s, d).
    theta: [f64; 2],
    p: [[f64; 2]; 2],
    samples: u64,
}

impl Default for PrefillModel {
    fn default() -> Self {
        Self::new(1.0, PRIOR[3])
    }
}

/// The features `(shape(T), n·u)` of `tokens` new tokens in chunks of `step` (≥ 1) at decode
/// load `u` (clamped to 0–1): shape = the prior's `a·n + b·T + c·Σtᵢ²`.
fn features(tokens: u64, step: usize, u: f64) -> [f64; 2] {
    let s = Shape::of(tokens, step);
    [s.shape, s.steps * u.clamp(0.0, 1.0)]
}

/// The part of a prefill's features that depends on the request only: `tokens` new tokens
/// in chunks of `step` (the same for every worker that would compute as many), so a policy
/// scoring thousands of workers computes it once per distinct count
/// ([`PrefillModel::prefill_ms_shaped`]; its integer and float divisions were most of
/// `predicted_ttft`'s per-worker cost at 4,096 workers, perf/runs/2026-12-02-fleet-2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// New tokens.
    pub tokens: u64,
    /// The prior's `a·n + b·T + c·Σtᵢ²` (module doc).
    pub shape: f64,
    /// Steps `n`.
    pub steps: f64,
}

impl Shape {
    /// The shape of `tokens` new tokens in chunks of `step` (≥ 1).
    pub fn of(tokens: u64, step: usize) -> Self {
        let step = step.max(1) as u64;
        let n = tokens.div_ceil(step) as f64;
        let (full, rest) = (tokens / step, tokens % step);
        let sq = (full as f64 * (step as f64).powi(2) + (rest as f64).powi(2)) / 1e6;
        let shape = PRIOR[0] * n + PRIOR[1] * tokens as f64 / 1e3 + PRIOR[2] * sq;
        Self {
            tokens,
            shape,
            steps: n,
        }
    }
}

impl PrefillModel {
    /// A model starting from scale `s` and decode term `d` (ms per step at full decode
    /// load), prior variances 1 and `d₀²`.
    pub fn new(s: f64, d: f64) -> Self {
        Self {
            theta: [s, d],
            p: [[1.0, 0.0], [0.0, PRIOR[3].powi(2)]],
            samples: 0,
        }
    }

    /// The model as 7 words ([`PrefillModel::from_words`] gives it back), for lock-free
    /// publication (`ActiveLoad`'s view).
    pub(crate) fn to_words(self) -> [u64; 7] {
        let [t0, t1] = self.theta;
        let [[p00, p01], [p10, p11]] = self.p;
        let b = f64::to_bits;
        [b(t0), b(t1), b(p00), b(p01), b(p10), b(p11), self.samples]
    }

    /// The model of [`PrefillModel::to_words`]'s words.
    pub(crate) fn from_words(w: [u64; 7]) -> Self {
        let f = |i: usize| f64::from_bits(w[i]);
        Self {
            theta: [f(0), f(1)],
            p: [[f(2), f(3)], [f(4), f(5)]],
            samples: w[6],
        }
    }

    /// Predicted ms to prefill `tokens` new tokens in chunks of `step` tokens at decode load
    /// `u` (0–1; 0 = nothing decodes in the same steps). 0 for 0 tokens; never negative.
    pub fn prefill_ms(&self, tokens: u64, step: usize, u: f64) -> f64 {
        self.prefill_ms_shaped(&Shape::of(tokens, step), u)
    }

    /// [`PrefillModel::prefill_ms`] of a request of shape `s` (the same value, bit for bit).
    pub fn prefill_ms_shaped(&self, s: &Shape, u: f64) -> f64 {
        self.prefill_ms_scaled(s, u, self.theta[0])
    }

    /// The curve at shape `s`, decode load `u`, with `scale` in place of the learned `s`.
    fn prefill_ms_scaled(&self, s: &Shape, u: f64, scale: f64) -> f64 {
        if s.tokens == 0 {
            return 0.0;
        }
        (s.shape * scale + s.steps * u.clamp(0.0, 1.0) * self.theta[1]).max(0.0)
    }

    /// [`PrefillModel::prefill_ms_shaped`] with the scale at its lower confidence bound,
    /// `max(s − k·σ, 1/BOUND)`, σ = the fit's standard deviation of `s` (√P₀₀: 1 before any
    /// sample, ~0.1 after a dozen): optimism in the face of uncertainty, so a policy tries a
    /// worker it has not measured instead of ranking it at the prior forever (a 2× faster
    /// engine that never gets a request alone is never learned). `k` ≥ 0; 0 = the fit.
    pub fn prefill_ms_optimistic(&self, s: &Shape, u: f64, k: f64) -> f64 {
        let scale = (self.theta[0] - k * self.p[0][0].max(0.0).sqrt()).max(1.0 / BOUND);
        self.prefill_ms_scaled(s, u, scale)
    }

    /// Learns from one request that waited behind no other prefill: it had `tokens` new
    /// tokens (prompt − cached), chunks of `step`, decode load `u`, and its first token came
    /// `ttft_ms` after dispatch. Non-finite or negative times are ignored.
    pub fn observe(&mut self, tokens: u64, step: usize, u: f64, ttft_ms: f64) {
        if tokens == 0 || !ttft_ms.is_finite() || ttft_ms < 0.0 || !u.is_finite() {
            return;
        }
        let x = features(tokens, step, u);
        let px = [
            self.p[0][0] * x[0] + self.p[0][1] * x[1],
            self.p[1][0] * x[0] + self.p[1][1] * x[1],
        ];
        let denom = FORGETTING + x[0] * px[0] + x[1] * px[1];
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let k = [px[0] / denom, px[1] / denom];
        // Huber's clip: a sample further than the prediction itself from it (a TTFT more
        // than twice the predicted prefill: a preemption, a wait for KV memory the router
        // could not see) moves the fit as one at twice the prediction would.
        let predicted = x[0] * self.theta[0] + x[1] * self.theta[1];
        let width = OUTLIER * predicted.max(1.0);
        let err = (ttft_ms - predicted).clamp(-width, width);
        self.theta[0] = (self.theta[0] + k[0] * err).clamp(1.0 / BOUND, BOUND);
        self.theta[1] = (self.theta[1] + k[1] * err).clamp(0.0, PRIOR[3] * BOUND);
        // P = (P − k·(P·x)ᵀ) / λ (P is symmetric, so xᵀ·P = (P·x)ᵀ).
        for (row, ki) in self.p.iter_mut().zip(k) {
            for (v, pxj) in row.iter_mut().zip(px) {
                *v = (*v - ki * pxj) / FORGETTING;
            }
        }
        // Wind-up guard: directions no sample excites grow by 1/λ per sample; past the
        // prior's trace, shrink the whole matrix (keeps it positive definite).
        let trace = self.p[0][0] + self.p[1][1];
        let cap = 1.0 + PRIOR[3].powi(2);
        if trace > cap {
            let f = cap / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= f);
        }
        self.samples += 1;
    }

    /// The curve's coefficients `(a, b, c, d)` in the scaled units of [`PRIOR`]: the prior's
    /// `a, b, c` times the learned scale, and the learned `d`.
    pub fn coefficients(&self) -> [f64; 4] {
        let s = self.theta[0];
        [PRIOR[0] * s, PRIOR[1] * s, PRIOR[2] * s, self.theta[1]]
    }

    /// Samples learned from.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prior is the mocker's curve: engine-model.md §4's table (one chunk, no decode).
    #[test]
    fn the_prior_is_the_mockers_curve() {
        let m = PrefillModel::default();
        for (t, ms) in [(1, 16.52), (512, 24.39), (1_024, 32.49), (8_192, 169.14)] {
            assert!((m.prefill_ms(t, STEP_TOKENS, 0.0) - ms).abs() < 0.01, "{t}");
        }
        // 16,384 tokens are two chunks of 8,192: twice 169.14, not the one-step 378.28.
        assert!((m.prefill_ms(16_384, STEP_TOKENS, 0.0) - 2.0 * 169.14).abs() < 0.02);
        assert_eq!(m.prefill_ms(0, STEP_TOKENS, 1.0), 0.0);
        // Decoding at full load adds d per step.
        let full = m.prefill_ms(100, STEP_TOKENS, 1.0);
        assert!((full - m.prefill_ms(100, STEP_TOKENS, 0.0) - 28.27).abs() < 1e-9);
    }

    /// An engine twice as fast, at decode loads from 0 to 0.9: within 200 samples of mixed
    /// sizes the learned curve is within 2 % of the true one at every size and load.
    #[test]
    fn learns_a_faster_engine() {
        let truth =
            |t: u64, u: f64| PrefillModel::new(0.5, PRIOR[3] / 2.0).prefill_ms(t, STEP_TOKENS, u);
        let mut m = PrefillModel::default();
        let mut s = 7u64;
        for i in 0..200 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let t = 1 + (s >> 33) % 30_000;
            let u = (i % 10) as f64 / 10.0;
            m.observe(t, STEP_TOKENS, u, truth(t, u));
        }
        for t in [64, 1_000, 4_096, 8_192, 20_000] {
            for u in [0.0, 0.5, 0.9] {
                let (got, want) = (m.prefill_ms(t, STEP_TOKENS, u), truth(t, u));
                assert!(
                    (got - want).abs() / want < 0.02,
                    "{t} {u}: {got} against {want}"
                );
            }
        }
        assert_eq!(m.samples(), 200);
    }

    /// The first five samples one worker learned from on WEKA seed 9 (8 engines, capacity
    /// 1.25× the largest request; new tokens, decode load, TTFT ms as the simulator observed
    /// them), the fifth a 3,184-token prefill that waited 19.8 s for KV memory. Unclipped,
    /// that sample dropped the 8k-token prediction to ~1/20 of the prior's 169.14 ms; clipped
    /// (OUTLIER), it stays within 2× of it, and exact samples bring it back.
    #[test]
    #[allow(
        clippy::approx_constant,
        reason = "0.318 is a measured decode load, not 1/π"
    )]
    fn one_outlier_cannot_wreck_the_curve() {
        let mut m = PrefillModel::default();
        for (t, u, ttft) in [
            (259_335, 0.312, 6_292.4),
            (446, 0.314, 69.1),
            (120_651, 0.0, 2_489.9),
            (601, 0.318, 73.3),
        ] {
            m.observe(t, STEP_TOKENS, u, ttft);
        }
        let before = m.prefill_ms(8_192, STEP_TOKENS, 0.0);
        m.observe(3_184, STEP_TOKENS, 0.99, 19_816.1);
        let after = m.prefill_ms(8_192, STEP_TOKENS, 0.0);
        assert!(
            after > 0.5 * 169.14 && after < 2.0 * 169.14,
            "{before} -> {after}"
        );
        for t in (1..=100u64).map(|i| i * 600) {
            let truth = PrefillModel::default().prefill_ms(t, STEP_TOKENS, 0.0);
            m.observe(t, STEP_TOKENS, 0.0, truth);
        }
        let healed = m.prefill_ms(8_192, STEP_TOKENS, 0.0);
        assert!((healed - 169.14).abs() < 0.05 * 169.14, "{healed}");
    }

    /// The optimistic curve: before any sample the scale's σ is 1, so at k 0.5 an 8k-token
    /// prefill is predicted at half the prior's 169.14 ms; after 50 samples of the prior's
    /// own curve σ is small and the prediction is within 5 % of it; k 0 is the fit.
    #[test]
    fn optimism_shrinks_with_samples() {
        let mut m = PrefillModel::default();
        let s = Shape::of(8_192, STEP_TOKENS);
        assert!((m.prefill_ms_optimistic(&s, 0.0, 0.5) - 169.14 / 2.0).abs() < 0.01);
        assert_eq!(
            m.prefill_ms_optimistic(&s, 0.0, 0.0),
            m.prefill_ms_shaped(&s, 0.0)
        );
        for t in (1..=50u64).map(|i| i * 600) {
            let truth = PrefillModel::default().prefill_ms(t, STEP_TOKENS, 0.0);
            m.observe(t, STEP_TOKENS, 0.0, truth);
        }
        let got = m.prefill_ms_optimistic(&s, 0.0, 0.5);
        assert!(got < 169.14 && got > 0.95 * 169.14, "{got}");
    }

    /// Garbage is ignored: the model is unchanged.
    #[test]
    fn bad_samples_are_ignored() {
        let mut m = PrefillModel::default();
        m.observe(100, STEP_TOKENS, 0.0, f64::NAN);
        m.observe(100, STEP_TOKENS, 0.0, -1.0);
        m.observe(0, STEP_TOKENS, 0.0, 10.0);
        m.observe(100, STEP_TOKENS, f64::NAN, 10.0);
        assert_eq!(m, PrefillModel::default());
    }

    /// Samples that say prefill is free (a TTFT of 0 for 30,000 tokens) cannot make it so: the
    /// scale stops at its bound and a large prefill still costs at least 1/20 of the prior.
    #[test]
    fn coefficients_stay_within_their_bounds() {
        let mut m = PrefillModel::default();
        for _ in 0..500 {
            m.observe(30_000, STEP_TOKENS, 0.0, 0.0);
            m.observe(10, STEP_TOKENS, 1.0, 5_000.0);
        }
        let prior = PrefillModel::default().prefill_ms(30_000, STEP_TOKENS, 0.0);
        assert!(m.prefill_ms(30_000, STEP_TOKENS, 0.0) >= prior / BOUND - 1e-9);
        for (c, p) in m.coefficients().iter().zip(PRIOR) {
            assert!((0.0..=p * BOUND + 1e-9).contains(c), "{c} against {p}");
        }
        assert!(m.coefficients()[0] >= PRIOR[0] / BOUND - 1e-9);
    }
}
