//! Picking the next token under temperature, top-p and a grammar constraint, and reporting the
//! log-probability of the pick under exactly that (renormalised) distribution.

use rand::Rng;

use crate::grammar::JsonState;

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
    let greedy = params.temperature <= 0.0;
    let t = if greedy { 1.0 } else { params.temperature };
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
    // Allowed candidates in descending order, until the unchecked mass is negligible.
    let mut order = sorted_prefix(&weights, FIRST_CUT);
    let mut kept: Vec<(u32, f64)> = Vec::new();
    let mut checked = 0.0;
    let mut allowed_mass = 0.0;
    let mut i = 0;
    loop {
        if i == order.len() {
            if order.len() == weights.len() {
                break;
            }
            order = sorted_prefix(&weights, weights.len());
        }
        let id = order[i];
        i += 1;
        let w = weights[id as usize];
        checked += w;
        if allowed.is_none_or(|f| f(id)) {
            kept.push((id, w));
            allowed_mass += w;
            if greedy {
                break;
            }
        }
        let rest = (z_all - checked).max(0.0);
        let enough = match allowed {
            // Unconstrained: stop once the nucleus is covered.
            None => checked >= params.top_p.min(1.0) * z_all * (1.0 - 1e-12) && params.top_p < 1.0,
            Some(_) => allowed_mass > 0.0 && rest <= NEGLIGIBLE * allowed_mass,
        };
        if enough || (allowed.is_none() && params.top_p >= 1.0 && i >= FIRST_CUT) {
            break;
        }
    }
    if kept.is_empty() {
        return None;
    }
    if greedy {
        let id = kept[0].0;
        return Some(Pick {
            id,
            logprob: 0.0,
            top: if params.top_logprobs > 0 {
                vec![(id, 0.0)]
            } else {
                vec![]
            },
        });
    }
    // Unconstrained with top_p = 1: the distribution is the whole vocabulary.
    let full = allowed.is_none() && params.top_p >= 1.0;
    let z_allowed = if allowed.is_none() {
        z_all
    } else {
        allowed_mass
    };
    // Nucleus over the allowed tokens.
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
    let z: f64 = if full {
        z_all
    } else {
        kept.iter().map(|(_, w)| w).sum()
    };
    let mut r = rng.random::<f64>() * z;
    let mut chosen = None;
    if full {
        // Scan the whole vocabulary (the kept prefix holds only the top candidates).
        for (id, &w) in weights.iter().enumerate() {
            if r < w {
                chosen = Some((id as u32, w));
                break;
            }
            r -= w;
        }
    } else {
        for &(id, w) in &kept {
            if r < w {
                chosen = Some((id, w));
                break;
            }
            r -= w;
        }
    }
    let (id, w) = match chosen {
        Some(c) => c,
        None => *kept
            .iter()
            .rev()
            .find(|(_, w)| *w > 0.0)
            .unwrap_or(&kept[0]),
    };
    let lp = |w: f64| (w / z).ln() as f32;
    Some(Pick {
        id,
        logprob: lp(w),
        top: kept
            .iter()
            .take(params.top_logprobs)
            .map(|&(i, w)| (i, lp(w)))
            .collect(),
    })
}

/// The decoded text of every vocabulary entry usable under a grammar (`None`: special tokens,
/// empty tokens and tokens that are not whole UTF-8 characters).
pub fn allowed_by_grammar<'a>(
    state: &JsonState,
    vocab: &'a [Option<String>],
) -> impl Fn(u32) -> bool + 'a {
    let state = state.clone();
    move |id| match vocab.get(id as usize) {
        Some(Some(text)) => {
            let mut s = state.clone();
            s.feed_str(text)
        }
        _ => false,
    }
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
