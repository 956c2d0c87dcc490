//! Token generation with the KV cache: greedy and temperature/top-k/top-p sampling.

use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};

use crate::error::{LearnerError, Result};
use crate::lora::AdapterSelection;
use crate::model::{BatchLayout, KvCache, Model};

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax).
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Nucleus: keep the smallest set with cumulative probability >= top_p (1 = off).
    pub top_p: f64,
    /// RNG seed, for reproducible sampling.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Self::greedy()
    }
}

impl Sampling {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Picks a token from one row of logits.
pub fn sample_token(logits: &[f32], sampling: &Sampling, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if sampling.temperature <= 0.0 {
        return argmax();
    }
    let t = sampling.temperature as f32;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if sampling.top_k > 0 {
        idx.truncate(sampling.top_k);
    }
    let max = logits[idx[0]];
    let mut probs: Vec<f32> = idx.iter().map(|&i| ((logits[i] - max) / t).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if sampling.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if cum as f64 >= sampling.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        idx.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut r = rng.random::<f32>() * total;
    for (p, &i) in probs.iter().zip(&idx) {
        if r < *p {
            return i as u32;
        }
        r -= p;
    }
    idx.last().copied().unwrap_or(0) as u32
}

/// Generates up to `max_new_tokens` after `prompt` (single stream, KV cache), stopping after
/// any of `stop_ids` (which is included in the output). Returns the new tokens.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    stop_ids: &[u32],
    adapters: &AdapterSelection,
    sampling: &Sampling,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(LearnerError::InvalidArgument("empty prompt".into()));
    }
    let dev = model.device();
    let mut rng = rand::rngs::StdRng::seed_from_u64(sampling.seed);
    let mut cache = KvCache::new();
    let mut out = Vec::with_capacity(max_new_tokens);
    let mut input = Tensor::new(prompt, dev)?.unsqueeze(0)?;
    let mut layout = BatchLayout::dense(1, prompt.len(), 0);
    for _ in 0..max_new_tokens {
        let logits = model.forward_last(&input, &layout, Some(&mut cache), adapters)?;
        let row: Vec<f32> = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?;
        let next = sample_token(&row, sampling, &mut rng);
        out.push(next);
        if stop_ids.contains(&next) {
            break;
        }
        input = Tensor::new(&[next], dev)?.unsqueeze(0)?;
        layout = BatchLayout::dense(1, 1, cache.len());
    }
    Ok(out)
}

/// Greedy [`generate`].
pub fn generate_greedy(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    stop_ids: &[u32],
    adapters: &AdapterSelection,
) -> Result<Vec<u32>> {
    generate(
        model,
        prompt,
        max_new_tokens,
        stop_ids,
        adapters,
        &Sampling::greedy(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_respects_top_k_and_greedy() {
        let logits = [0.0f32, 5.0, 1.0, 4.9];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(sample_token(&logits, &Sampling::greedy(), &mut rng), 1);
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 0,
        };
        for _ in 0..200 {
            let t = sample_token(&logits, &s, &mut rng);
            assert!(t == 1 || t == 3, "sampled {t} outside the top 2");
        }
    }
}
