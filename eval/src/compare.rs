//! Paired comparison of two runs over the same items: mean difference with a 95% confidence
//! interval from a paired bootstrap (resampling items), plus the normal approximation.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::EvalError;
use crate::runner::RunReport;

/// A paired difference (B − A) of one per-item metric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairedDiff {
    /// Mean of A over the paired items.
    pub mean_a: f64,
    /// Mean of B over the paired items.
    pub mean_b: f64,
    /// mean_b − mean_a.
    pub diff: f64,
    /// 95% percentile interval of the paired bootstrap.
    pub ci95: [f64; 2],
    /// 95% normal-approximation interval (diff ± 1.96 · sd / √n).
    pub ci95_normal: [f64; 2],
    /// Items where B scored higher.
    pub b_better: usize,
    /// Items where A scored higher.
    pub a_better: usize,
    /// Items with equal scores.
    pub ties: usize,
}

impl PairedDiff {
    /// B is better than A beyond the noise of which items were drawn: both 95% intervals (the
    /// bootstrap's and the normal approximation's) lie above zero.
    pub fn clearly_positive(&self) -> bool {
        self.ci95[0] > 0.0 && self.ci95_normal[0] > 0.0
    }
}

/// In points (per-item rates × 100): `+25.0 pts (95% CI +6.2 … +43.8, bootstrap; normal +3.1 …
/// +46.9); B better on 4, A better on 0, ties 12`.
impl std::fmt::Display for PairedDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:+.1} pts (95% CI {:+.1} … {:+.1}, bootstrap; normal {:+.1} … {:+.1}); B better on {}, A better on {}, ties {}",
            100.0 * self.diff,
            100.0 * self.ci95[0],
            100.0 * self.ci95[1],
            100.0 * self.ci95_normal[0],
            100.0 * self.ci95_normal[1],
            self.b_better,
            self.a_better,
            self.ties
        )
    }
}

/// The comparison of run B against run A.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Model of run A.
    pub a: String,
    /// Model of run B.
    pub b: String,
    /// Items present in both runs (paired by id).
    pub items: usize,
    /// Bootstrap resamples drawn.
    pub resamples: usize,
    /// Seed of the bootstrap.
    pub seed: u64,
    /// Exact match (per-item pass rate) difference.
    pub exact_match: PairedDiff,
    /// Field-accuracy difference (JSON scorers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_accuracy: Option<PairedDiff>,
}

/// Compares two runs item by item (paired by id; items only in one run are ignored).
pub fn compare_runs(
    a: &RunReport,
    b: &RunReport,
    resamples: usize,
    seed: u64,
) -> Result<Comparison, EvalError> {
    if a.set.sha256 != b.set.sha256 {
        return Err(EvalError::InvalidConfig {
            field: "compare",
            reason: format!(
                "runs used different eval sets ({} vs {})",
                a.set.sha256, b.set.sha256
            ),
        });
    }
    let by_id: HashMap<&str, _> = a.items.iter().map(|i| (i.id.as_str(), i)).collect();
    let pairs: Vec<_> = b
        .items
        .iter()
        .filter_map(|ib| by_id.get(ib.id.as_str()).map(|ia| (*ia, ib)))
        .collect();
    if pairs.is_empty() {
        return Err(EvalError::InvalidConfig {
            field: "compare",
            reason: "the runs share no item ids".into(),
        });
    }
    let exact: Vec<(f64, f64)> = pairs
        .iter()
        .map(|(x, y)| (x.pass_rate, y.pass_rate))
        .collect();
    let fields: Vec<(f64, f64)> = pairs
        .iter()
        .filter_map(|(x, y)| Some((x.field_accuracy?, y.field_accuracy?)))
        .collect();
    Ok(Comparison {
        a: a.model.clone(),
        b: b.model.clone(),
        items: pairs.len(),
        resamples,
        seed,
        exact_match: paired_diff(&exact, resamples, seed),
        field_accuracy: (!fields.is_empty()).then(|| paired_diff(&fields, resamples, seed)),
    })
}

/// Paired difference of `(a, b)` values with bootstrap and normal 95% intervals.
pub fn paired_diff(pairs: &[(f64, f64)], resamples: usize, seed: u64) -> PairedDiff {
    let n = pairs.len();
    let d: Vec<f64> = pairs.iter().map(|(a, b)| b - a).collect();
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let diff = mean(&d);
    let sd = if n > 1 {
        (d.iter().map(|x| (x - diff).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    let half = 1.96 * sd / (n.max(1) as f64).sqrt();

    let mut rng = SplitMix64(seed);
    let mut means = Vec::with_capacity(resamples);
    if n > 0 {
        for _ in 0..resamples {
            let mut sum = 0.0;
            for _ in 0..n {
                sum += d[(rng.next() % n as u64) as usize];
            }
            means.push(sum / n as f64);
        }
    }
    means.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if means.is_empty() {
            diff
        } else {
            let idx = ((means.len() - 1) as f64 * p).round() as usize;
            means[idx.min(means.len() - 1)]
        }
    };
    const EPS: f64 = 1e-12;
    PairedDiff {
        mean_a: mean(&pairs.iter().map(|p| p.0).collect::<Vec<_>>()),
        mean_b: mean(&pairs.iter().map(|p| p.1).collect::<Vec<_>>()),
        diff,
        ci95: [pct(0.025), pct(0.975)],
        ci95_normal: [diff - half, diff + half],
        b_better: d.iter().filter(|x| **x > EPS).count(),
        a_better: d.iter().filter(|x| **x < -EPS).count(),
        ties: d.iter().filter(|x| x.abs() <= EPS).count(),
    }
}

/// SplitMix64: tiny, deterministic, good enough for resampling indices.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_runs_have_zero_difference() {
        let pairs = vec![(1.0, 1.0), (0.0, 0.0), (0.5, 0.5)];
        let d = paired_diff(&pairs, 1000, 7);
        assert_eq!(d.diff, 0.0);
        assert_eq!(d.ci95, [0.0, 0.0]);
        assert_eq!(d.ties, 3);
    }

    #[test]
    fn a_clear_improvement_has_an_interval_above_zero() {
        // B right on 40 of 50 items, A on 10 (A's ten are among B's forty).
        let pairs: Vec<(f64, f64)> = (0..50)
            .map(|i| {
                (
                    if i < 10 { 1.0 } else { 0.0 },
                    if i < 40 { 1.0 } else { 0.0 },
                )
            })
            .collect();
        let d = paired_diff(&pairs, 5000, 1);
        assert!((d.diff - 0.6).abs() < 1e-12);
        assert!(d.ci95[0] > 0.4 && d.ci95[1] < 0.8, "{:?}", d.ci95);
        assert!(d.ci95_normal[0] > 0.4, "{:?}", d.ci95_normal);
        assert_eq!((d.b_better, d.a_better, d.ties), (30, 0, 20));
        // Deterministic for a seed.
        assert_eq!(paired_diff(&pairs, 5000, 1), d);
    }

    #[test]
    fn clearly_positive_needs_both_intervals_above_zero() {
        // k of 16 items gained, none lost: 4 is the fewest both intervals put above zero.
        let gained = |k: usize| -> Vec<(f64, f64)> {
            (0..16)
                .map(|i| (0.0, if i < k { 1.0 } else { 0.0 }))
                .collect()
        };
        assert!(paired_diff(&gained(4), 10_000, 0).clearly_positive());
        assert!(!paired_diff(&gained(3), 10_000, 0).clearly_positive());
        assert!(!paired_diff(&gained(0), 10_000, 0).clearly_positive());
        // Gains offset by losses are not a gain.
        let mixed: Vec<(f64, f64)> = (0..20)
            .map(|i| match i {
                0..=4 => (0.0, 1.0),
                5..=7 => (1.0, 0.0),
                _ => (0.0, 0.0),
            })
            .collect();
        let d = paired_diff(&mixed, 10_000, 0);
        assert!(!d.clearly_positive(), "{d}");
        assert_eq!(
            d.to_string(),
            format!(
                "+10.0 pts (95% CI {:+.1} … {:+.1}, bootstrap; normal {:+.1} … {:+.1}); B better on 5, A better on 3, ties 12",
                100.0 * d.ci95[0],
                100.0 * d.ci95[1],
                100.0 * d.ci95_normal[0],
                100.0 * d.ci95_normal[1]
            )
        );
    }

    #[test]
    fn noise_gives_an_interval_around_zero() {
        let pairs: Vec<(f64, f64)> = (0..40)
            .map(|i| if i % 2 == 0 { (1.0, 0.0) } else { (0.0, 1.0) })
            .collect();
        let d = paired_diff(&pairs, 5000, 3);
        assert!(d.ci95[0] < 0.0 && d.ci95[1] > 0.0, "{:?}", d.ci95);
    }
}
