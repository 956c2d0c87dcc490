//! Anytime-valid sequential statistics for canary rollouts: confidence sequences (CSs) for arm
//! means and canary-minus-stable differences, guard and drift verdicts on them, a fixed-horizon
//! z-test baseline, and simulations for the rollout benchmark. The controller looks after every
//! observation, which voids fixed-horizon tests; a CS holds at all times at once (with
//! probability `>= 1 - alpha` every interval ever reported covers), so verdicts may be acted on
//! whenever they appear.
//!
//! # One arm: the beta-binomial mixture CS
//! `X_i` in `[0, 1]` with constant conditional mean `mu = E[X_i | past]`; `t` observations sum to
//! `S`. For a candidate `m`, `M_t(m) = B(1/2 + S, 1/2 + t - S) / (B(1/2, 1/2) m^S (1 - m)^(t - S))`
//! is the likelihood ratio of `Bernoulli(q)` to `Bernoulli(m)` mixed over `q ~ Beta(1/2, 1/2)`.
//! Each factor `x -> (q/m)^x ((1-q)/(1-m))^(1-x)` is convex in `x`, so under any `[0, 1]` law
//! with mean `m` its mean is at most that under `Bernoulli(m)`, i.e. 1 (Hoeffding 1963). So
//! `M_t(mu)` is a nonnegative supermartingale, Ville's inequality gives
//! `P(exists t: M_t(mu) >= 1/alpha) <= alpha`, and the CS is `{m : M_t(m) < 1/alpha}`: the
//! conjugate beta-binomial mixture for sub-Bernoulli processes of Howard, Ramdas, McAuliffe &
//! Sekhon (2021), "Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann.
//! Statist. 49(2), §3 (after Robbins 1970). Why: it needs only `(t, S)`, so arms are counts that
//! can be rebuilt from stored totals; it is exact for Bernoulli data, so small rates get width
//! ~ `sqrt(p(1-p) log t / t)`, not Hoeffding's `sqrt(log t / 4t)`; it is valid for any bounded
//! data. `-ln(m^S (1-m)^(t-S))` is convex with its minimum at `S/t`, where `M_t <= 1`, so the CS
//! is an interval around `S/t`; its ends are found by bisection and rounded outward.
//!
//! # Two arms, assumptions, limits
//! Each arm gets a CS at `alpha/2`; `[lo_c - hi_s, hi_c - lo_s]` then covers `mu_c - mu_s` at all
//! times with probability `>= 1 - alpha` (union bound), for any traffic split (1-5% canary
//! included) as long as assignment does not depend on outcomes. A small canary's interval is the
//! wide one, so the union bound costs little. Assumed: each arm's conditional mean is constant
//! (do not run one CS across a deploy or incident). `alpha` is per guard: split it across guards
//! for a rollout-wide bound. For real metrics the width follows the Bernoulli worst case of the
//! scaled value, so it is conservative when values sit far inside their bounds (latency far
//! below the timeout): choose the tightest honest bounds.

use std::fmt;

/// Jeffreys mixing prior: near-minimax regret for Bernoulli likelihoods at every sample size.
const PRIOR_A: f64 = 0.5;
const PRIOR_B: f64 = 0.5;
/// Bisection halvings per interval end: `2^-44 ~ 6e-14` on `[0, 1]`.
const BISECTION_STEPS: u32 = 44;

/// Invalid configuration of a statistic; raised once when the controller's config is validated,
/// so the per-observation path cannot fail.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StatsError {
    /// `alpha` must lie strictly between 0 and 1.
    InvalidAlpha(f64),
    /// Metric bounds must be finite with `lo < hi`.
    InvalidBounds { lo: f64, hi: f64 },
    /// A probability, traffic share or power outside `(0, 1)` (or `[0, 1]` for true rates).
    InvalidProbability(f64),
    /// A ratio (drift band, stable-per-canary allocation) out of range.
    InvalidRatio(f64),
    /// Sample-size planning needs `p_canary != p_stable`.
    NoEffect,
}

impl fmt::Display for StatsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::InvalidAlpha(a) => write!(f, "alpha must be in (0, 1), got {a}"),
            Self::InvalidBounds { lo, hi } => {
                write!(f, "bounds must be finite, lo < hi: [{lo}, {hi}]")
            }
            Self::InvalidProbability(p) => write!(f, "probability out of range: {p}"),
            Self::InvalidRatio(r) => write!(f, "ratio out of range: {r}"),
            Self::NoEffect => write!(f, "p_canary equals p_stable: no finite sample size"),
        }
    }
}

impl std::error::Error for StatsError {}

/// A validated error level in `(0, 1)`: the probability that a CS ever misses.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Alpha(f64);

impl Alpha {
    /// Rejects NaN and anything outside `(0, 1)`.
    pub fn new(alpha: f64) -> Result<Self, StatsError> {
        (alpha > 0.0 && alpha < 1.0)
            .then_some(Self(alpha))
            .ok_or(StatsError::InvalidAlpha(alpha))
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// Half the level, for each arm of a two-arm comparison (union bound).
    pub fn halved(self) -> Self {
        Self(self.0 / 2.0)
    }
}

/// A closed interval `[lo, hi]` in the units of the quantity it bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    /// The interval for `self - other`, valid whenever both hold.
    pub fn minus(self, other: Interval) -> Interval {
        Interval {
            lo: self.lo - other.hi,
            hi: self.hi - other.lo,
        }
    }

    pub fn contains(self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }
}

/// Counts of one Bernoulli guard event (negative feedback, upstream error or timeout, empty or
/// unparseable answer) on one arm. Plain counts, so an arm can be rebuilt from stored totals;
/// `events > exposures` is read as `events == exposures` rather than failing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateArm {
    pub exposures: u64,
    pub events: u64,
}

impl RateArm {
    /// Records one exposure and whether the guard event happened on it.
    pub fn record(&mut self, event: bool) {
        self.exposures = self.exposures.saturating_add(1);
        self.events = self.events.saturating_add(u64::from(event));
    }

    /// Observed event rate; `None` before the first exposure.
    pub fn rate(&self) -> Option<f64> {
        (self.exposures > 0).then(|| self.events.min(self.exposures) as f64 / self.exposures as f64)
    }

    /// Anytime-valid CS for the event rate at `alpha` (`[0, 1]` when empty).
    pub fn confidence_sequence(&self, alpha: Alpha) -> Interval {
        unit_mean_cs(self.exposures as f64, self.events as f64, alpha)
    }
}

/// Accumulator for a real metric with known bounds (latency ms, answer tokens, tool calls per
/// turn). Values are clamped into the bounds, so the CS is for the mean of the clamped metric:
/// with `hi` = the upstream timeout, a timed-out call counts as the timeout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundedMeanArm {
    lo: f64,
    hi: f64,
    count: u64,
    /// Sum of the observations scaled to `[0, 1]`.
    sum_unit: f64,
    clamped: u64,
}

impl BoundedMeanArm {
    /// An empty arm for values in `[lo, hi]`; the bounds must be finite with `lo < hi`.
    pub fn new(lo: f64, hi: f64) -> Result<Self, StatsError> {
        if !(lo.is_finite() && hi.is_finite() && lo < hi) {
            return Err(StatsError::InvalidBounds { lo, hi });
        }
        Ok(Self {
            lo,
            hi,
            count: 0,
            sum_unit: 0.0,
            clamped: 0,
        })
    }

    /// Records one value, clamped into the bounds (`+inf` becomes `hi`). NaN is not recorded and
    /// returns `false`, so the caller can count it as a separate failure.
    pub fn record(&mut self, value: f64) -> bool {
        if value.is_nan() {
            return false;
        }
        self.clamped += u64::from(value < self.lo || value > self.hi);
        let unit = (value.clamp(self.lo, self.hi) - self.lo) / (self.hi - self.lo);
        self.sum_unit += unit.clamp(0.0, 1.0);
        self.count = self.count.saturating_add(1);
        true
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Values that fell outside the bounds; a large share means the bounds are wrong.
    pub fn clamped(&self) -> u64 {
        self.clamped
    }

    /// Observed mean of the clamped values; `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.unscale(self.sum_unit / self.count as f64))
    }

    /// Anytime-valid CS for the mean at `alpha`, in the metric's units (the bounds when empty).
    pub fn confidence_sequence(&self, alpha: Alpha) -> Interval {
        let unit = unit_mean_cs(self.count as f64, self.sum_unit, alpha);
        Interval {
            lo: self.unscale(unit.lo),
            hi: self.unscale(unit.hi),
        }
    }

    fn unscale(&self, unit: f64) -> f64 {
        self.lo + (self.hi - self.lo) * unit
    }
}

/// CS for `rate_canary - rate_stable` at `alpha` (each arm at `alpha/2`).
pub fn rate_difference_cs(canary: &RateArm, stable: &RateArm, alpha: Alpha) -> Interval {
    let half = alpha.halved();
    canary
        .confidence_sequence(half)
        .minus(stable.confidence_sequence(half))
}

/// CS for `mean_canary - mean_stable` in metric units at `alpha` (each arm at `alpha/2`).
pub fn mean_difference_cs(
    canary: &BoundedMeanArm,
    stable: &BoundedMeanArm,
    alpha: Alpha,
) -> Interval {
    let half = alpha.halved();
    canary
        .confidence_sequence(half)
        .minus(stable.confidence_sequence(half))
}

/// Which way a guard metric gets worse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Error rates, negative feedback, latency.
    HigherIsWorse,
    /// E.g. positive feedback or task completion.
    LowerIsWorse,
}

/// A guard's decision from a difference CS and a non-inferiority margin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every value in the CS has the canary worse than stable by more than the margin: roll back.
    Harm,
    /// Every value in the CS has the canary worse by at most the margin.
    NonInferior,
    /// Neither yet: keep collecting.
    Undecided,
}

/// Verdict from `diff`, a CS for `canary - stable`, and `margin` (the worsening tolerated, `>= 0`,
/// in metric units). Both verdicts lean on the same CS, so with probability `>= 1 - alpha` no
/// verdict returned at any time is wrong. NaN anywhere yields `Undecided`.
pub fn guard_verdict(diff: Interval, margin: f64, direction: Direction) -> Verdict {
    // How much worse the canary is, in the guard's own orientation.
    let worse = match direction {
        Direction::HigherIsWorse => diff,
        Direction::LowerIsWorse => Interval {
            lo: -diff.hi,
            hi: -diff.lo,
        },
    };
    if worse.lo > margin {
        Verdict::Harm
    } else if worse.hi <= margin {
        Verdict::NonInferior
    } else {
        Verdict::Undecided
    }
}

/// Which side of the ratio band raises a drift alarm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriftSides {
    /// Only `mean_c > ratio * mean_s` (e.g. latency, tool calls).
    Up,
    /// Only `mean_c < mean_s / ratio` (e.g. answers collapsing to empty).
    Down,
    Both,
}

/// A drift decision for `mean_canary / mean_stable` against the band `[1/ratio, ratio]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriftVerdict {
    /// Outside the band on a watched side, for every pair of values in the two CSs.
    Drift,
    /// Inside the band on every watched side, for every pair of values in the two CSs.
    NoDrift,
    Undecided,
}

/// A validated drift rule: alarm when `mean_c / mean_s` leaves `[1/ratio, ratio]` on `sides`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftBand {
    ratio: f64,
    sides: DriftSides,
}

impl DriftBand {
    /// `ratio` must be finite and `>= 1` (1.5 tolerates a 50% rise or a 33% fall).
    pub fn new(ratio: f64, sides: DriftSides) -> Result<Self, StatsError> {
        let valid = ratio.is_finite() && ratio >= 1.0;
        valid
            .then_some(Self { ratio, sides })
            .ok_or(StatsError::InvalidRatio(ratio))
    }

    /// Decides from simultaneously valid CSs for two nonnegative means. When both cover, the
    /// ratio lies in `[c.lo / s.hi, c.hi / s.lo]`, so: Drift up iff `c.lo > r s.hi`, Drift down iff
    /// `c.hi r < s.lo`; no drift up iff `c.hi <= r s.lo`, no drift down iff `c.lo r >= s.hi`.
    /// Ratios of signed quantities mean nothing, so an interval reaching below 0 is `Undecided`.
    pub fn verdict(&self, canary: Interval, stable: Interval) -> DriftVerdict {
        if !(canary.lo >= 0.0 && stable.lo >= 0.0) {
            return DriftVerdict::Undecided;
        }
        let r = self.ratio;
        let (up, down) = match self.sides {
            DriftSides::Up => (true, false),
            DriftSides::Down => (false, true),
            DriftSides::Both => (true, true),
        };
        if (up && canary.lo > r * stable.hi) || (down && canary.hi * r < stable.lo) {
            DriftVerdict::Drift
        } else if (!up || canary.hi <= r * stable.lo) && (!down || canary.lo * r >= stable.hi) {
            DriftVerdict::NoDrift
        } else {
            DriftVerdict::Undecided
        }
    }

    /// Drift verdict for two bounded-metric arms, each CS at `alpha/2`.
    pub fn verdict_for_arms(
        &self,
        canary: &BoundedMeanArm,
        stable: &BoundedMeanArm,
        alpha: Alpha,
    ) -> DriftVerdict {
        let half = alpha.halved();
        self.verdict(
            canary.confidence_sequence(half),
            stable.confidence_sequence(half),
        )
    }
}

/// Outcome of the fixed-horizon two-proportion z-test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZTestOutcome {
    /// `(p_c - p_s) / sqrt(p_pool (1 - p_pool) (1/n_c + 1/n_s))`; positive means canary higher.
    pub z: f64,
    /// `|z| > z_{1 - alpha/2}`. Valid only if looked at once, at the planned n: this is the
    /// benchmark's baseline, not something to evaluate continuously.
    pub reject: bool,
}

/// Classic pooled two-sided two-proportion z-test. `None` when an arm is empty or the pooled
/// rate is 0 or 1 (no variance, no test).
pub fn two_proportion_z_test(
    canary: &RateArm,
    stable: &RateArm,
    alpha: Alpha,
) -> Option<ZTestOutcome> {
    let (pc, ps) = (canary.rate()?, stable.rate()?);
    let (nc, ns) = (canary.exposures as f64, stable.exposures as f64);
    let pooled = (pc * nc + ps * ns) / (nc + ns);
    let var = pooled * (1.0 - pooled) * (1.0 / nc + 1.0 / ns);
    let z = (var > 0.0).then(|| (pc - ps) / var.sqrt())?;
    Some(ZTestOutcome {
        z,
        reject: z.abs() > normal_quantile(1.0 - alpha.get() / 2.0),
    })
}

/// Canary exposures a fixed-horizon two-sided z-test at `alpha` needs for `power` against
/// `p_canary` vs `p_stable`, with `k = stable_per_canary` stable exposures per canary exposure
/// (Fleiss, Levin & Paik 2003, unequal allocation; `k = 1` is the classic per-arm n):
/// `n_c = [z_{1-a/2} sqrt(pbar qbar (1 + 1/k)) + z_power sqrt(p_c q_c + p_s q_s / k)]^2 / (p_c - p_s)^2`
/// with `pbar = (p_c + k p_s) / (1 + k)`.
pub fn fixed_horizon_canary_n(
    alpha: Alpha,
    power: f64,
    p_stable: f64,
    p_canary: f64,
    stable_per_canary: f64,
) -> Result<u64, StatsError> {
    for p in [power, p_stable, p_canary] {
        open_unit(p)?;
    }
    let k = stable_per_canary;
    if !(k.is_finite() && k > 0.0) {
        return Err(StatsError::InvalidRatio(k));
    }
    let effect = p_canary - p_stable;
    if effect == 0.0 {
        return Err(StatsError::NoEffect);
    }
    let pbar = (p_canary + k * p_stable) / (1.0 + k);
    let null_sd = (pbar * (1.0 - pbar) * (1.0 + 1.0 / k)).sqrt();
    let alt_sd = (p_canary * (1.0 - p_canary) + p_stable * (1.0 - p_stable) / k).sqrt();
    let root = normal_quantile(1.0 - alpha.get() / 2.0) * null_sd + normal_quantile(power) * alt_sd;
    Ok((root * root / (effect * effect)).ceil() as u64)
}

/// Standard normal quantile (Acklam's rational approximation, relative error < 1.2e-9);
/// `-inf`/`+inf` at 0/1, NaN outside `[0, 1]`.
#[rustfmt::skip]
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [-3.969683028665376e1, 2.209460984245205e2, -2.759285104469687e2, 1.38357751867269e2, -3.066479806614716e1, 2.506628277459239];
    const B: [f64; 5] = [-5.447609879822406e1, 1.615858368580409e2, -1.556989798598866e2, 6.680131188771972e1, -1.328068155288572e1];
    const C: [f64; 6] = [-7.784894002430293e-3, -3.223964580411365e-1, -2.400758277161838, -2.549732539343734, 4.374664141464968, 2.938163982698783];
    const D: [f64; 4] = [7.784695709041462e-3, 3.224671290700398e-1, 2.445134137142996, 3.754408661907416];
    const P_LOW: f64 = 0.02425;
    let tail = |q: f64| (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
        / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0);
    if p.is_nan() || !(0.0..=1.0).contains(&p) { return f64::NAN; }
    if p == 0.0 { return f64::NEG_INFINITY; }
    if p == 1.0 { return f64::INFINITY; }
    if p < P_LOW { return tail((-2.0 * p.ln()).sqrt()); }
    if p > 1.0 - P_LOW { return -tail((-2.0 * (-p).ln_1p()).sqrt()); }
    let (q, r) = (p - 0.5, (p - 0.5) * (p - 0.5));
    (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
        / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
}

/// Tiny deterministic PRNG (SplitMix64, Steele, Lea & Flood 2014) so simulations are
/// reproducible without a dependency.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` from 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A simulated canary rollout on one Bernoulli guard (higher is worse), for the benchmark.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HarmSimulation {
    pub p_stable: f64,
    pub p_canary: f64,
    /// Fraction of exposures routed to the canary, in `(0, 1)`.
    pub canary_share: f64,
    pub alpha: Alpha,
    /// Non-inferiority margin on `p_c - p_s`.
    pub margin: f64,
    /// A run ends without Harm once the canary has had this many exposures.
    pub max_canary_exposures: u64,
}

impl HarmSimulation {
    /// Canary exposures at which the guard first says Harm, checked after every exposure to
    /// either arm exactly as the controller would; `None` if it never does within the budget.
    pub fn exposures_to_harm(&self, seed: u64) -> Result<Option<u64>, StatsError> {
        for p in [self.p_stable, self.p_canary] {
            if !(0.0..=1.0).contains(&p) {
                return Err(StatsError::InvalidProbability(p));
            }
        }
        open_unit(self.canary_share)?;
        let half = self.alpha.halved();
        let mut rng = SplitMix64(seed);
        let (mut canary, mut stable) = (RateArm::default(), RateArm::default());
        let (mut canary_cs, mut stable_cs) = (
            canary.confidence_sequence(half),
            stable.confidence_sequence(half),
        );
        while canary.exposures < self.max_canary_exposures {
            // Only the arm that changed needs its CS recomputed.
            if rng.next_f64() < self.canary_share {
                canary.record(rng.next_f64() < self.p_canary);
                canary_cs = canary.confidence_sequence(half);
            } else {
                stable.record(rng.next_f64() < self.p_stable);
                stable_cs = stable.confidence_sequence(half);
            }
            if guard_verdict(
                canary_cs.minus(stable_cs),
                self.margin,
                Direction::HigherIsWorse,
            ) == Verdict::Harm
            {
                return Ok(Some(canary.exposures));
            }
        }
        Ok(None)
    }

    /// Fraction of `runs` rollouts that ever say Harm. With `p_canary <= p_stable + margin` this
    /// is the false-rollback rate and is at most `alpha`.
    pub fn harm_rate(&self, runs: u32, seed: u64) -> Result<f64, StatsError> {
        let mut seeds = SplitMix64(seed);
        let mut alarms = 0u32;
        for _ in 0..runs {
            alarms += u32::from(self.exposures_to_harm(seeds.next_u64())?.is_some());
        }
        Ok(f64::from(alarms) / f64::from(runs.max(1)))
    }
}

fn open_unit(p: f64) -> Result<f64, StatsError> {
    (p > 0.0 && p < 1.0)
        .then_some(p)
        .ok_or(StatsError::InvalidProbability(p))
}

/// CS at `alpha` for the mean of `n` observations in `[0, 1]` summing to `sum` (module docs).
fn unit_mean_cs(n: f64, sum: f64, alpha: Alpha) -> Interval {
    if n <= 0.0 {
        return Interval { lo: 0.0, hi: 1.0 };
    }
    let sum = sum.clamp(0.0, n);
    let fails = n - sum;
    let log_marginal = ln_beta(PRIOR_A + sum, PRIOR_B + fails) - ln_beta(PRIOR_A, PRIOR_B);
    let threshold = -alpha.get().ln();
    // `m` is outside the CS iff ln M_t(m) >= ln(1/alpha); 0 * ln(0) terms are skipped.
    let outside = |m: f64| {
        let hits = if sum > 0.0 { sum * m.ln() } else { 0.0 };
        let misses = if fails > 0.0 {
            fails * (-m).ln_1p()
        } else {
            0.0
        };
        log_marginal - hits - misses >= threshold
    };
    // Bisect between a point inside (the observed mean) and one outside (an edge), returning
    // the outside end so the interval errs wide.
    let boundary = |edge: f64| {
        let (mut inside, mut out) = (sum / n, edge);
        for _ in 0..BISECTION_STEPS {
            let mid = 0.5 * (inside + out);
            if outside(mid) {
                out = mid;
            } else {
                inside = mid;
            }
        }
        out
    };
    Interval {
        lo: if sum > 0.0 { boundary(0.0) } else { 0.0 },
        hi: if fails > 0.0 { boundary(1.0) } else { 1.0 },
    }
}

/// `ln B(a, b)` for `a, b > 0`.
fn ln_beta(a: f64, b: f64) -> f64 {
    ln_gamma(a) + ln_gamma(b) - ln_gamma(a + b)
}

/// `ln Gamma(x)` for `x > 0` (Lanczos, g = 7, 9 terms, ~1e-15 relative); std's is unstable.
#[rustfmt::skip]
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [0.999_999_999_999_809_9, 676.520_368_121_885_1, -1_259.139_216_722_402_8,
        771.323_428_777_653_1, -176.615_029_162_140_6, 12.507_343_278_686_905,
        -0.138_571_095_265_720_12, 9.984_369_578_019_572e-6, 1.505_632_735_149_311_6e-7];
    if x < 0.5 {
        // Gamma(x) = Gamma(x + 1) / x keeps the series in its accurate range.
        return ln_gamma(x + 1.0) - x.ln();
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let series = G.iter().enumerate().skip(1).fold(G[0], |acc, (i, g)| acc + g / (x + i as f64));
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + series.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alpha(a: f64) -> Alpha {
        Alpha::new(a).unwrap()
    }

    /// Allowed excess over `a` for a rate estimated from `runs` runs (3 standard errors).
    fn tolerance(a: f64, runs: u32) -> f64 {
        3.0 * (a * (1.0 - a) / f64::from(runs)).sqrt()
    }

    #[test]
    fn special_functions_match_reference_values() {
        // References: Python 3 `math.lgamma` and `statistics.NormalDist().inv_cdf`.
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-13);
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-13);
        assert!((ln_gamma(1000.5) - 5_908.674_175_848_678).abs() < 1e-8);
        assert!((normal_quantile(0.975) - 1.959_963_984_540_053_6).abs() < 1e-8);
        assert!((normal_quantile(0.8) - 0.841_621_233_572_914_4).abs() < 1e-8);
        assert!((normal_quantile(0.001) + 3.090_232_306_167_813).abs() < 1e-8);
        assert!(normal_quantile(1.5).is_nan());
    }

    #[test]
    fn edge_cases() {
        let a = alpha(0.05);
        let empty = RateArm::default();
        assert_eq!(empty.confidence_sequence(a), Interval { lo: 0.0, hi: 1.0 });
        let diff = rate_difference_cs(&empty, &empty, a);
        assert_eq!(
            guard_verdict(diff, 0.05, Direction::HigherIsWorse),
            Verdict::Undecided
        );
        assert_eq!(
            guard_verdict(diff, 0.05, Direction::LowerIsWorse),
            Verdict::Undecided
        );
        // n = 1: a single event rules out only rates very near 0.
        let one = RateArm {
            exposures: 1,
            events: 1,
        }
        .confidence_sequence(a);
        assert!(one.hi == 1.0 && one.lo > 0.0 && one.lo < 0.05, "{one:?}");
        // All zeros: the CS always contains 0 and shrinks toward it.
        let zeros = RateArm {
            exposures: 10_000,
            events: 0,
        }
        .confidence_sequence(a);
        assert!(zeros.lo == 0.0 && zeros.hi < 1e-3, "{zeros:?}");
        let inconsistent = RateArm {
            exposures: 3,
            events: 4,
        };
        assert_eq!(inconsistent.confidence_sequence(a).hi, 1.0);
        assert!(Alpha::new(0.0).is_err() && Alpha::new(f64::NAN).is_err());
        let lengths = BoundedMeanArm::new(0.0, 30_000.0).unwrap();
        assert_eq!(
            lengths.confidence_sequence(a),
            Interval {
                lo: 0.0,
                hi: 30_000.0
            }
        );
        assert_eq!(lengths.mean(), None);
        let band = DriftBand::new(1.5, DriftSides::Both).unwrap();
        assert_eq!(
            band.verdict_for_arms(&lengths, &lengths, a),
            DriftVerdict::Undecided
        );
        assert!(
            BoundedMeanArm::new(1.0, 1.0).is_err() && DriftBand::new(0.5, DriftSides::Up).is_err()
        );
        let diff = Interval { lo: -0.3, hi: -0.2 };
        assert_eq!(
            guard_verdict(diff, 0.05, Direction::LowerIsWorse),
            Verdict::Harm
        );
        assert_eq!(
            guard_verdict(diff, 0.05, Direction::HigherIsWorse),
            Verdict::NonInferior
        );
        let mut arm = BoundedMeanArm::new(0.0, 100.0).unwrap();
        assert!(arm.record(150.0) && arm.record(f64::INFINITY) && arm.record(-5.0));
        assert!(!arm.record(f64::NAN));
        assert_eq!((arm.count(), arm.clamped()), (3, 3));
        assert!((arm.mean().unwrap() - 200.0 / 3.0).abs() < 1e-9);
    }

    /// Fraction of runs in which `truth` ever leaves the CS of a stream drawn by `draw`.
    fn miscoverage(truth: f64, runs: u32, draw: impl Fn(&mut SplitMix64) -> f64) -> f64 {
        let mut misses = 0;
        for run in 0..runs {
            let mut rng = SplitMix64(1_000 + u64::from(run));
            let mut arm = BoundedMeanArm::new(0.0, 1.0).unwrap();
            for _ in 0..2_000 {
                arm.record(draw(&mut rng));
                if !arm.confidence_sequence(alpha(0.1)).contains(truth) {
                    misses += 1;
                    break;
                }
            }
        }
        f64::from(misses) / f64::from(runs)
    }

    #[test]
    fn one_arm_cs_is_time_uniformly_valid() {
        let runs = 600;
        for p in [0.02, 0.1, 0.5] {
            let miss = miscoverage(p, runs, |r| f64::from(u8::from(r.next_f64() < p)));
            eprintln!("Bernoulli({p}), 2000 looks: ever-miss rate {miss:.4} at alpha 0.1");
            assert!(miss <= 0.1 + tolerance(0.1, runs), "p={p}: {miss}");
        }
        // Continuous bounded data: U^2 has mean 1/3.
        let miss = miscoverage(1.0 / 3.0, runs, |r| r.next_f64().powi(2));
        eprintln!("U^2, 2000 looks: ever-miss rate {miss:.4} at alpha 0.1");
        assert!(miss <= 0.1 + tolerance(0.1, runs));
    }

    #[test]
    fn difference_cs_is_time_uniformly_valid_with_unequal_arms() {
        let (runs, pc, ps) = (300, 0.15, 0.1);
        let mut misses = 0;
        for run in 0..runs {
            let mut rng = SplitMix64(77 + u64::from(run));
            let (mut c, mut s) = (RateArm::default(), RateArm::default());
            for _ in 0..10_000 {
                if rng.next_f64() < 0.05 {
                    c.record(rng.next_f64() < pc);
                } else {
                    s.record(rng.next_f64() < ps);
                }
                if !rate_difference_cs(&c, &s, alpha(0.1)).contains(pc - ps) {
                    misses += 1;
                    break;
                }
            }
        }
        let miss = f64::from(misses) / f64::from(runs);
        eprintln!("difference, 5% canary, 10000 looks: ever-miss rate {miss:.4} at alpha 0.1");
        assert!(miss <= 0.1 + tolerance(0.1, runs));
    }

    fn rollout(p_canary: f64, share: f64, max_canary_exposures: u64) -> HarmSimulation {
        HarmSimulation {
            p_stable: 0.1,
            p_canary,
            canary_share: share,
            alpha: alpha(0.05),
            margin: 0.0,
            max_canary_exposures,
        }
    }

    #[test]
    fn false_rollback_rate_is_at_most_alpha() {
        let rate = rollout(0.1, 0.2, 500).harm_rate(2_000, 42).unwrap();
        eprintln!(
            "p_c = p_s = 0.1, margin 0, 20% share: false rollback rate {rate:.4} at alpha 0.05"
        );
        assert!(rate <= 0.05 + tolerance(0.05, 2_000), "{rate}");
    }

    #[test]
    fn harmful_canary_is_detected_quickly() {
        let sim = rollout(0.3, 0.05, 2_000);
        let mut hits: Vec<u64> = (0..200)
            .filter_map(|s| sim.exposures_to_harm(s).unwrap())
            .collect();
        assert_eq!(hits.len(), 200, "every harmful run must roll back");
        hits.sort_unstable();
        let (median, p90) = (hits[100], hits[180]);
        let fixed = fixed_horizon_canary_n(sim.alpha, 0.8, 0.1, 0.3, 19.0).unwrap();
        eprintln!("p_s 0.1 vs p_c 0.3, 5% share: median {median}, p90 {p90} canary exposures; fixed n_c {fixed}");
        assert!(median <= 150 && p90 <= 250, "median {median} p90 {p90}");
    }

    #[test]
    fn equal_canary_becomes_non_inferior() {
        let (a, mut rng) = (alpha(0.05), SplitMix64(9));
        let (mut c, mut s) = (RateArm::default(), RateArm::default());
        let decided_at = (0..200_000).find_map(|_| {
            if rng.next_f64() < 0.2 {
                c.record(rng.next_f64() < 0.1);
            } else {
                s.record(rng.next_f64() < 0.1);
            }
            match guard_verdict(
                rate_difference_cs(&c, &s, a),
                0.05,
                Direction::HigherIsWorse,
            ) {
                Verdict::Harm => panic!("false harm"),
                Verdict::NonInferior => Some(c.exposures),
                Verdict::Undecided => None,
            }
        });
        eprintln!("p = 0.1 both, margin 0.05, 20% share: NonInferior after {decided_at:?} canary exposures");
        assert!(decided_at.is_some());
    }

    #[test]
    fn halved_length_is_drift_and_equal_length_is_not() {
        let a = alpha(0.05);
        let band = DriftBand::new(1.25, DriftSides::Both).unwrap();
        let arm = || BoundedMeanArm::new(0.0, 1_024.0).unwrap();
        let (mut canary, mut stable, mut same) = (arm(), arm(), arm());
        let (mut drift_at, mut no_drift_at) = (None, None);
        let mut rng = SplitMix64(3);
        // Answer lengths in tokens (max_tokens 1024): uniform on [0, 800] vs half that.
        for i in 1..=20_000u32 {
            stable.record(800.0 * rng.next_f64());
            if i % 10 == 0 {
                canary.record(400.0 * rng.next_f64());
                same.record(800.0 * rng.next_f64());
            }
            if drift_at.is_none()
                && band.verdict_for_arms(&canary, &stable, a) == DriftVerdict::Drift
            {
                drift_at = Some(canary.count());
            }
            let equal = band.verdict_for_arms(&same, &stable, a);
            assert_ne!(equal, DriftVerdict::Drift);
            if no_drift_at.is_none() && equal == DriftVerdict::NoDrift {
                no_drift_at = Some(same.count());
            }
        }
        eprintln!("length ratio 0.5, band 1.25: Drift after {drift_at:?}; ratio 1: NoDrift after {no_drift_at:?}");
        assert!(drift_at.is_some_and(|n| n <= 400) && no_drift_at.is_some());
        let up_only = DriftBand::new(1.25, DriftSides::Up).unwrap();
        assert_eq!(
            up_only.verdict_for_arms(&canary, &stable, a),
            DriftVerdict::NoDrift
        );
    }

    #[test]
    fn fixed_horizon_matches_textbook_values() {
        // Classic per-arm n for 0.1 vs 0.3, two-sided 0.05, power 0.8: 61.6 -> 62.
        assert_eq!(
            fixed_horizon_canary_n(alpha(0.05), 0.8, 0.1, 0.3, 1.0),
            Ok(62)
        );
        assert_eq!(
            fixed_horizon_canary_n(alpha(0.05), 0.8, 0.1, 0.1, 1.0),
            Err(StatsError::NoEffect)
        );
        let c = RateArm {
            exposures: 100,
            events: 30,
        };
        let s = RateArm {
            exposures: 100,
            events: 10,
        };
        let out = two_proportion_z_test(&c, &s, alpha(0.05)).unwrap();
        // (0.3 - 0.1) / sqrt(0.2 * 0.8 * 0.02) = 3.5355.
        assert!((out.z - 3.535_533_905_932_737).abs() < 1e-9 && out.reject);
        assert_eq!(
            two_proportion_z_test(&RateArm::default(), &s, alpha(0.05)),
            None
        );
    }
}
