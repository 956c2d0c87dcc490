//! Token generation with the KV cache: greedy and temperature/top-k/top-p sampling.

use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::lora::AdapterSelection;
use crate::model::{BatchLayout, Model};

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
    sample_token_with_logprob(logits, sampling, rng).0
}

/// Picks a token and returns it with its log-probability under the distribution actually
/// sampled from (after temperature, top-k and top-p; 0 for greedy): the behaviour log-prob an
/// off-policy learner needs.
pub fn sample_token_with_logprob(
    logits: &[f32],
    sampling: &Sampling,
    rng: &mut impl Rng,
) -> (u32, f32) {
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
    if sampling.temperature <= 0.0 || logits.is_empty() {
        return (argmax(), 0.0);
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
            return (i as u32, (p / total).ln());
        }
        r -= p;
    }
    let last = probs.len() - 1;
    (idx[last] as u32, (probs[last] / total).ln())
}

/// `log_softmax` of one row of logits.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln() + max;
    logits.iter().map(|&l| l - lse).collect()
}

/// One generated token with the log-probabilities serving and learning need.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    /// The token id.
    pub id: u32,
    /// Its log-probability under the model's unmodified distribution (OpenAI `logprob`).
    pub logprob: f32,
    /// Its log-probability under the distribution actually sampled from (temperature, top-k,
    /// top-p applied; 0 for greedy).
    pub sampling_logprob: f32,
    /// The most likely alternatives under the unmodified distribution, best first (OpenAI
    /// `top_logprobs`; empty unless asked for).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Options of [`generate_stream`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Upper bound on new tokens.
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (the stop token is included).
    pub stop_ids: Vec<u32>,
    /// Token choice.
    pub sampling: Sampling,
    /// How many alternatives to report per token (0 = none).
    pub top_logprobs: usize,
}

/// Generates after `prompt` (single stream, KV cache), calling `on_token` for every token as it
/// is produced (for streaming); `on_token` returning `false` stops generation (e.g. a stop
/// string matched or the client went away). Returns all tokens produced.
pub fn generate_stream(
    model: &Model,
    prompt: &[u32],
    options: &GenerateOptions,
    adapters: &AdapterSelection,
    mut on_token: impl FnMut(&GeneratedToken) -> bool,
) -> Result<Vec<GeneratedToken>> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidArgument("empty prompt".into()));
    }
    let dev = model.device();
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.sampling.seed);
    let mut cache = KvCache::new();
    let mut out = Vec::with_capacity(options.max_new_tokens);
    let mut input = Tensor::new(prompt, dev)?.unsqueeze(0)?;
    let mut layout = BatchLayout::dense(1, prompt.len(), 0);
    for _ in 0..options.max_new_tokens {
        let logits = model.forward_last(&input, &layout, Some(&mut cache), adapters)?;
        let row: Vec<f32> = logits.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?;
        let (id, sampling_logprob) = sample_token_with_logprob(&row, &options.sampling, &mut rng);
        let lp = log_softmax(&row);
        let top_logprobs = if options.top_logprobs > 0 {
            let mut idx: Vec<usize> = (0..lp.len()).collect();
            let k = options.top_logprobs.min(idx.len());
            idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]));
            idx.truncate(k);
            idx.sort_unstable_by(|&a, &b| lp[b].total_cmp(&lp[a]));
            idx.into_iter().map(|i| (i as u32, lp[i])).collect()
        } else {
            Vec::new()
        };
        let token = GeneratedToken {
            id,
            logprob: lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY),
            sampling_logprob,
            top_logprobs,
        };
        let keep_going = on_token(&token);
        out.push(token);
        if !keep_going || options.stop_ids.contains(&id) {
            break;
        }
        input = Tensor::new(&[id], dev)?.unsqueeze(0)?;
        layout = BatchLayout::dense(1, 1, cache.len());
    }
    Ok(out)
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
    let options = GenerateOptions {
        max_new_tokens,
        stop_ids: stop_ids.to_vec(),
        sampling: sampling.clone(),
        top_logprobs: 0,
    };
    Ok(
        generate_stream(model, prompt, &options, adapters, |_| true)?
            .into_iter()
            .map(|t| t.id)
            .collect(),
    )
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
    fn sampling_logprob_is_that_of_the_truncated_distribution() {
        let logits = [0.0f32, 2.0, 1.0, -3.0];
        let s = Sampling {
            temperature: 0.5,
            top_k: 2,
            top_p: 1.0,
            seed: 0,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Top-2 at T = 0.5: logits 2 and 1 become 4 and 2; p(1) = 1 / (1 + e^-2).
        let p1 = 1.0 / (1.0 + (-2.0f32).exp());
        for _ in 0..50 {
            let (t, lp) = sample_token_with_logprob(&logits, &s, &mut rng);
            let want = if t == 1 { p1.ln() } else { (1.0 - p1).ln() };
            assert!(t == 1 || t == 2);
            assert!((lp - want).abs() < 1e-5, "token {t}: {lp} vs {want}");
        }
        let lsm = log_softmax(&logits);
        let total: f32 = lsm.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

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
