//! Picking the next token under temperature, top-p and a grammar constraint, and reporting the
//! log-probability of the pick under exactly that (renormalised) distribution.

use hindsight_model::grammar::best_allowed;
use rand::Rng;

/// How to sample one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f64,
    /// Nucleus mass (1 = off).
    pub top_p: f64,
    /// How many alternatives to report per token (0 = none).
    pub top_logprobs: usize,
}

/// A sampled token and its provenance.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// The token id.
    pub id: u32,
    /// Its log-probability under the distribution it was sampled from (0 for greedy).
    pub logprob: f32,
    /// The most likely alternatives under that distribution, `(id, logprob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// Candidates examined before falling back to a full sort.
const FIRST_CUT: usize = 256;
/// Unchecked mass below which the rest of the vocabulary is ignored in constrained decoding.
const NEGLIGIBLE: f64 = 1e-7;

fn sorted_prefix(weights: &[f64], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..weights.len() as u32).collect();
    let k = k.min(idx.len());
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            weights[b as usize].total_cmp(&weights[a as usize])
        });
        idx.truncate(k);
    }
    idx.sort_unstable_by(|&a, &b| weights[b as usize].total_cmp(&weights[a as usize]));
    idx
}

/// Picks a token from `logits`. `allowed` says whether a token may follow (the grammar); `None`
/// allows every token. Returns `None` only when no token is allowed at all.
pub fn pick(
    logits: &[f32],
    params: &SamplingParams,
    allowed: Option<&dyn Fn(u32) -> bool>,
    rng: &mut impl Rng,
) -> Option<Pick> {
    let ok = |id: u32| allowed.is_none_or(|f| f(id));
    if params.temperature <= 0.0 {
        // Greedy: the best allowed token, probability 1 under the (deterministic) policy.
        let id = best_allowed(logits, &ok)?;
        let top = if params.top_logprobs > 0 {
            vec![(id, 0.0)]
        } else {
            vec![]
        };
        return Some(Pick {
            id,
            logprob: 0.0,
            top,
        });
    }
    let t = params.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| {
            let w = ((l as f64 - max) / t).exp();
            if w.is_finite() {
                w
            } else {
                0.0
            }
        })
        .collect();
    let z_all: f64 = weights.iter().sum();
    let lp = |w: f64, z: f64| (w / z).ln() as f32;
    if allowed.is_none() && params.top_p >= 1.0 {
        // The whole vocabulary: one linear scan, no sorting.
        let mut r = rng.random::<f64>() * z_all;
        let mut chosen = weights.len() - 1;
        for (i, &w) in weights.iter().enumerate() {
            if r < w {
                chosen = i;
                break;
            }
            r -= w;
        }
        let top = if params.top_logprobs > 0 {
            sorted_prefix(&weights, params.top_logprobs)
                .into_iter()
                .map(|i| (i, lp(weights[i as usize], z_all)))
                .collect()
        } else {
            vec![]
        };
        return Some(Pick {
            id: chosen as u32,
            logprob: lp(weights[chosen], z_all),
            top,
        });
    }
    // Candidates, best first: the allowed tokens carrying all but a negligible part of the
    // allowed mass (constrained), or the nucleus (unconstrained).
    let (mut kept, z_allowed) = candidates(&weights, z_all, params.top_p, allowed);
    if kept.is_empty() || z_allowed <= 0.0 {
        return None;
    }
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = kept.len();
        for (j, (_, w)) in kept.iter().enumerate() {
            cum += w;
            if cum >= params.top_p * z_allowed {
                keep = j + 1;
                break;
            }
        }
        kept.truncate(keep);
    }
    let z: f64 = kept.iter().map(|(_, w)| w).sum();
    let mut r = rng.random::<f64>() * z;
    let mut chosen = kept[kept.len() - 1];
    for &(id, w) in &kept {
        if r < w {
            chosen = (id, w);
            break;
        }
        r -= w;
    }
    Some(Pick {
        id: chosen.0,
        logprob: lp(chosen.1, z),
        top: kept
            .iter()
            .take(params.top_logprobs)
            .map(|&(i, w)| (i, lp(w, z)))
            .collect(),
    })
}

/// The candidates of a constrained or nucleus draw over `weights` (summing to `z_all`), best
/// first, and the mass they are drawn against: with `allowed`, the allowed tokens carrying all
/// but a negligible part of the allowed mass, and that mass; without, the nucleus of `top_p`,
/// and `z_all`.
fn candidates(
    weights: &[f64],
    z_all: f64,
    top_p: f64,
    allowed: Option<&dyn Fn(u32) -> bool>,
) -> (Vec<(u32, f64)>, f64) {
    let mut kept: Vec<(u32, f64)> = Vec::new();
    let order = sorted_prefix(weights, FIRST_CUT);
    let z_allowed = match allowed {
        None => {
            let mut cum = 0.0;
            let mut covered = false;
            for &i in &order {
                kept.push((i, weights[i as usize]));
                cum += weights[i as usize];
                if cum >= top_p * z_all {
                    covered = true;
                    break;
                }
            }
            if !covered {
                kept = sorted_prefix(weights, weights.len())
                    .into_iter()
                    .map(|i| (i, weights[i as usize]))
                    .collect();
            }
            z_all
        }
        Some(f) => {
            let mut seen = 0.0;
            let mut mass = 0.0;
            for &i in &order {
                let w = weights[i as usize];
                seen += w;
                if f(i) {
                    kept.push((i, w));
                    mass += w;
                }
            }
            if z_all - seen > NEGLIGIBLE * mass {
                // Scan the rest, skipping tokens too light to matter together.
                let floor = NEGLIGIBLE * mass / weights.len() as f64;
                let cut = order
                    .last()
                    .map(|&i| weights[i as usize])
                    .unwrap_or(f64::INFINITY);
                let in_order: std::collections::HashSet<u32> = order.iter().copied().collect();
                for (i, &w) in weights.iter().enumerate() {
                    let i = i as u32;
                    if w > floor && w <= cut && !in_order.contains(&i) && f(i) {
                        kept.push((i, w));
                        mass += w;
                    }
                }
                kept.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            }
            mass
        }
    };
    (kept, z_allowed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(temperature: f64, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_logprobs: 3,
        }
    }

    #[test]
    fn logprobs_are_those_of_the_renormalised_distribution() {
        let logits = [0.0f32, 2.0, 1.0, 2.0f32.ln() + 2.0];
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Only tokens 1 and 3 allowed: weights e^2 and 2e^2, so p = 1/3, 2/3.
        let allow = |id: u32| id == 1 || id == 3;
        let mut seen = [0usize; 4];
        for _ in 0..600 {
            let p = pick(&logits, &params(1.0, 1.0), Some(&allow), &mut rng).unwrap();
            seen[p.id as usize] += 1;
            let want = if p.id == 1 {
                (1.0f32 / 3.0).ln()
            } else {
                (2.0f32 / 3.0).ln()
            };
            assert!((p.logprob - want).abs() < 1e-5, "{p:?}");
            assert_eq!(p.top.len(), 2);
        }
        assert_eq!(seen[0] + seen[2], 0);
        assert!(seen[3] > seen[1] && seen[1] > 100, "{seen:?}");
    }

    #[test]
    fn greedy_top_p_and_unconstrained_full_distribution() {
        let logits = [0.0f32, 5.0, 1.0, 4.0];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let g = pick(&logits, &params(0.0, 1.0), None, &mut rng).unwrap();
        assert_eq!((g.id, g.logprob), (1, 0.0));
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for _ in 0..100 {
            let p = pick(&logits, &params(1.0, 1.0), None, &mut rng).unwrap();
            let want = ((logits[p.id as usize] as f64).exp() / z).ln() as f32;
            assert!((p.logprob - want).abs() < 1e-5);
            // top_p 0.5 keeps only token 1 (p ~ 0.7): probability 1 after renormalisation.
            let q = pick(&logits, &params(1.0, 0.5), None, &mut rng).unwrap();
            assert_eq!((q.id, q.logprob), (1, 0.0));
        }
        assert!(pick(&logits, &params(1.0, 1.0), Some(&|_| false), &mut rng).is_none());
    }
}
