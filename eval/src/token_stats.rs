//! What the model's own token distribution says about an answer: the mean log-prob of the
//! tokens it chose and the mean entropy of its next-token distribution, read from an
//! OpenAI-style `logprobs` block (`choices[0].logprobs.content[i].{logprob, top_logprobs}`).
//!
//! The entropy is estimated from the top-k alternatives the server returned, with the mass
//! outside them lumped into one outcome: `H_k = -Σ p_i ln p_i - r ln r`, `r = 1 - Σ p_i`. It is
//! a lower bound of the true entropy that tightens as k grows, so two runs compare only at the
//! same k (the eval gate's guard asks both models for the same k). A model that collapses onto
//! one answer is near-certain at every step and its estimate falls towards 0.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Per-answer statistics of the chosen tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenStats {
    /// Answer tokens with a log-prob.
    pub tokens: usize,
    /// Mean log-prob (natural log) of the chosen tokens.
    pub mean_logprob: f64,
    /// Mean estimated entropy (nats) of the next-token distribution; `None` when the server
    /// sent no alternatives (`top_logprobs` not asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_entropy: Option<f64>,
}

impl TokenStats {
    /// Reads a choice's `logprobs` object (`{"content": [...]}`); `None` when it carries no
    /// token with a finite log-prob.
    pub fn from_logprobs(logprobs: &Value) -> Option<Self> {
        let entries = logprobs.get("content")?.as_array()?;
        let mut tokens = 0usize;
        let mut logprob_sum = 0.0;
        let mut entropy_sum = 0.0;
        let mut with_alternatives = 0usize;
        for entry in entries {
            let Some(lp) = entry.get("logprob").and_then(Value::as_f64) else {
                continue;
            };
            if !lp.is_finite() {
                continue;
            }
            tokens += 1;
            logprob_sum += lp;
            let alternatives: Vec<f64> = entry
                .get("top_logprobs")
                .and_then(Value::as_array)
                .map(|alts| {
                    alts.iter()
                        .filter_map(|a| a.get("logprob").and_then(Value::as_f64))
                        .filter(|l| l.is_finite())
                        .collect()
                })
                .unwrap_or_default();
            if !alternatives.is_empty() {
                entropy_sum += entropy_estimate(&alternatives);
                with_alternatives += 1;
            }
        }
        (tokens > 0).then(|| TokenStats {
            tokens,
            mean_logprob: logprob_sum / tokens as f64,
            mean_entropy: (with_alternatives > 0).then(|| entropy_sum / with_alternatives as f64),
        })
    }
}

/// `-Σ p ln p` over the listed alternatives plus the unlisted rest as one outcome.
pub fn entropy_estimate(top_logprobs: &[f64]) -> f64 {
    let mut listed = 0.0;
    let mut h = 0.0;
    for &lp in top_logprobs {
        let p = lp.exp();
        listed += p;
        if p > 0.0 {
            h -= p * lp;
        }
    }
    let rest = 1.0 - listed;
    if rest > 1e-12 {
        h -= rest * rest.ln();
    }
    h.max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn entropy_of_a_certain_token_is_zero_and_of_a_fair_coin_ln2() {
        assert!(entropy_estimate(&[0.0]).abs() < 1e-12);
        let half = 0.5f64.ln();
        assert!((entropy_estimate(&[half, half]) - 2f64.ln()).abs() < 1e-12);
        // One listed half, the other half unlisted: the lumped rest counts as one outcome.
        assert!((entropy_estimate(&[half]) - 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn reads_an_openai_logprobs_block() {
        let q = 0.25f64.ln();
        let block = json!({"content": [
            {"token": "a", "logprob": 0.0, "top_logprobs": [{"token": "a", "logprob": 0.0}]},
            {"token": "b", "logprob": q, "top_logprobs": [
                {"token": "b", "logprob": q}, {"token": "c", "logprob": q},
                {"token": "d", "logprob": q}, {"token": "e", "logprob": q}]},
        ]});
        let s = TokenStats::from_logprobs(&block).unwrap();
        assert_eq!(s.tokens, 2);
        assert!((s.mean_logprob - q / 2.0).abs() < 1e-12);
        assert!((s.mean_entropy.unwrap() - 4f64.ln() / 2.0).abs() < 1e-12);
    }

    #[test]
    fn without_alternatives_there_is_no_entropy_and_without_tokens_no_stats() {
        let block = json!({"content": [{"token": "a", "logprob": -1.0}]});
        let s = TokenStats::from_logprobs(&block).unwrap();
        assert_eq!(s.mean_entropy, None);
        assert_eq!(TokenStats::from_logprobs(&json!({"content": []})), None);
        assert_eq!(TokenStats::from_logprobs(&Value::Null), None);
    }
}
