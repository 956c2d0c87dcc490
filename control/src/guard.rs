//! The eval gate's forgetting and collapse guard.
//!
//! The task eval set says whether a candidate got better at the job; it cannot say what the
//! candidate forgot or whether it is collapsing onto one kind of answer, which dense
//! self-distillation is reported to do in long continual runs. So every candidate is also run,
//! next to the **base model** (not the live version: comparing each version with the one before
//! would let small losses add up over versions), on a capability set the learner never trains
//! on — general instructions the base model gets right, shipped in `eval/sets/capability.jsonl`
//! — and three indicators are compared on those answers:
//! - **forgetting**: capability exact match more than `capability_margin` below the base's;
//! - **entropy collapse**: mean next-token entropy of the model's own distribution (estimated
//!   from the top `top_logprobs` alternatives of answers sampled at temperature 1 — a greedy
//!   answer's log-probs are those of a deterministic policy, all 0) below
//!   `min_entropy_ratio` × the base's;
//! - **self-similarity**: answers to *different* prompts that look alike (mean pairwise ROUGE-L
//!   F1) more than `max_self_similarity_rise` above the base's;
//! - **log-prob drift**: the base model's own greedy answers, scored under each model (vLLM's
//!   `continue_final_message` + `prompt_logprobs`, which `hindsight serve` implements), losing
//!   more than `max_logprob_drop` nats per token under the candidate: the candidate has moved
//!   away from what the base would say even where its own answers still score. A server
//!   without prompt log-probs leaves this check unmeasured (said in the report), not failed.
//!
//! Any of them rejects the candidate, with the reason in the registry.

use std::path::PathBuf;

use futures::stream::{self, StreamExt};
use hindsight_eval::{evaluate, EvalItem, EvalSet, RunConfig, RunReport};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::publish::PublishError;

/// The built-in capability set (`eval/sets/capability.jsonl`).
const CAPABILITY_SET: &str = include_str!("../../eval/sets/capability.jsonl");

/// `[publish.gate.guard]`: forgetting and collapse checks against the base model.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GuardConfig {
    /// Run the guard (on by default; off only to measure without it).
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Capability set (`hindsight eval` JSONL) of general instructions the base model gets
    /// right and the learner never sees; default: the built-in `eval/sets/capability.jsonl`.
    #[serde(default)]
    pub capability_set: Option<PathBuf>,
    /// Exact-match points (as a fraction) the candidate may lose against the base model on the
    /// capability set.
    #[serde(default = "default_capability_margin")]
    pub capability_margin: f64,
    /// Collapse: the candidate's mean answer-token entropy must stay above this fraction of the
    /// base model's.
    #[serde(default = "default_min_entropy_ratio")]
    pub min_entropy_ratio: f64,
    /// Collapse: the candidate's mean ROUGE-L between answers to different prompts may exceed
    /// the base model's by at most this much.
    #[serde(default = "default_max_self_similarity_rise")]
    pub max_self_similarity_rise: f64,
    /// Alternatives per token the entropy is estimated from (1..=20).
    #[serde(default = "default_top_logprobs")]
    pub top_logprobs: u32,
    /// `max_tokens` of each capability request (greedy, scored).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// `max_tokens` of each entropy probe (sampled at temperature 1, not scored).
    #[serde(default = "default_probe_max_tokens")]
    pub probe_max_tokens: u32,
    /// Drift: the mean log-prob per token of the base model's greedy capability answers may
    /// fall at most this many nats under the candidate below their log-prob under the base.
    #[serde(default = "default_max_logprob_drop")]
    pub max_logprob_drop: f64,
}

fn default_enabled() -> bool {
    true
}
fn default_capability_margin() -> f64 {
    0.10
}
fn default_min_entropy_ratio() -> f64 {
    0.5
}
fn default_max_self_similarity_rise() -> f64 {
    0.2
}
fn default_top_logprobs() -> u32 {
    10
}
fn default_max_tokens() -> u32 {
    48
}
fn default_probe_max_tokens() -> u32 {
    16
}
fn default_max_logprob_drop() -> f64 {
    1.0
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            enabled: default_enabled(),
            capability_set: None,
            capability_margin: default_capability_margin(),
            min_entropy_ratio: default_min_entropy_ratio(),
            max_self_similarity_rise: default_max_self_similarity_rise(),
            top_logprobs: default_top_logprobs(),
            max_tokens: default_max_tokens(),
            probe_max_tokens: default_probe_max_tokens(),
            max_logprob_drop: default_max_logprob_drop(),
        }
    }
}

impl GuardConfig {
    pub(crate) fn validate(&self) -> Result<(), PublishError> {
        let bad = |m: &str| Err(PublishError::Config(format!("gate.guard: {m}")));
        let fraction = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !fraction(self.capability_margin) {
            return bad("capability_margin must be between 0 and 1");
        }
        if !fraction(self.min_entropy_ratio) {
            return bad("min_entropy_ratio must be between 0 and 1");
        }
        if !fraction(self.max_self_similarity_rise) {
            return bad("max_self_similarity_rise must be between 0 and 1");
        }
        if !(1..=20).contains(&self.top_logprobs) {
            return bad("top_logprobs must be between 1 and 20");
        }
        if !self.max_logprob_drop.is_finite() || self.max_logprob_drop < 0.0 {
            return bad("max_logprob_drop must be a finite number >= 0");
        }
        if self.max_tokens == 0 || self.probe_max_tokens == 0 {
            return bad("max_tokens and probe_max_tokens must be at least 1");
        }
        Ok(())
    }

    /// The capability set: the configured file, or the built-in one.
    pub fn capability_set(&self) -> Result<EvalSet, PublishError> {
        match &self.capability_set {
            Some(path) => Ok(EvalSet::load(path)?),
            None => builtin_capability_set(),
        }
    }
}

/// The built-in capability set.
pub fn builtin_capability_set() -> Result<EvalSet, PublishError> {
    let items = CAPABILITY_SET
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str::<EvalItem>)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PublishError::Config(format!("built-in capability set: {e}")))?;
    Ok(EvalSet::from_items("capability", items)?)
}

/// The guard's measurements of one model on the capability set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Indicators {
    /// Capability exact match (0..1).
    pub exact_match: f64,
    /// Mean next-token entropy estimate of the answers, nats.
    pub entropy: Option<f64>,
    /// Mean pairwise ROUGE-L F1 between answers to different prompts.
    pub self_similarity: f64,
    /// Mean answer length, words.
    pub mean_words: f64,
    /// Mean log-prob per token (nats) of the base model's greedy answers under this model,
    /// over the items both models scored; `None` when the server returned no prompt log-probs.
    pub base_answer_logprob: Option<f64>,
}

impl Indicators {
    /// From the greedy capability run and the sampled entropy probe of one model.
    fn of(runs: &Runs, base_answer_logprob: Option<f64>) -> Self {
        let (run, probe) = (&runs.capability, &runs.probe);
        let answers: Vec<&str> = run
            .items
            .iter()
            .map(|i| {
                i.samples
                    .first()
                    .and_then(|s| s.content.as_deref())
                    .unwrap_or("")
            })
            .collect();
        let words: usize = answers.iter().map(|a| a.split_whitespace().count()).sum();
        Self {
            exact_match: run.metrics.exact_match,
            entropy: probe.metrics.mean_token_entropy,
            self_similarity: mean_pairwise_rouge_l(&answers),
            mean_words: words as f64 / answers.len().max(1) as f64,
            base_answer_logprob,
        }
    }
}

/// The guard's finding.
#[derive(Debug, Clone, PartialEq)]
pub struct GuardReport {
    /// Why the candidate must be rejected (empty: it passed).
    pub reasons: Vec<String>,
    /// The measurements, for the registry.
    pub json: Value,
}

/// One model's two runs on the capability set: greedy answers, scored, and answers sampled
/// at temperature 1 with their log-probs (the entropy probe).
pub(crate) struct Runs {
    /// Greedy, scored.
    pub capability: RunReport,
    /// Sampled, with token statistics.
    pub probe: RunReport,
    /// Per capability item, the mean log-prob per token of the base model's greedy answer
    /// under this model (`None`: not scored).
    pub base_answer_logprobs: Vec<Option<f64>>,
}

/// Runs the capability set and the entropy probe on the candidate and the base model, all four
/// at the same time; `run_cfg` gives a model's settings as the task runs use them (endpoint,
/// key, seed, concurrency, timeout).
pub(crate) async fn run(
    guard: &GuardConfig,
    set: &EvalSet,
    run_cfg: impl Fn(&str) -> RunConfig,
    candidate: &str,
    base: &str,
) -> Result<(Runs, Runs), PublishError> {
    let capability = |model: &str| {
        let mut r = run_cfg(model);
        r.samples = 1;
        r.pass_k = vec![1];
        r.temperature = 0.0;
        r.top_p = None;
        r.max_tokens = Some(guard.max_tokens);
        r.keep_content = true;
        r
    };
    let probe = |model: &str| {
        let mut r = capability(model);
        r.temperature = 1.0;
        r.max_tokens = Some(guard.probe_max_tokens);
        r.top_logprobs = Some(guard.top_logprobs);
        r.keep_content = false;
        r
    };
    let (cc, bc, cp, bp) = (
        capability(candidate),
        capability(base),
        probe(candidate),
        probe(base),
    );
    let (cc, bc, cp, bp) = tokio::join!(
        evaluate(set, &cc),
        evaluate(set, &bc),
        evaluate(set, &cp),
        evaluate(set, &bp)
    );
    let (cc, bc, cp, bp) = (cc?, bc?, cp?, bp?);
    // The drift probe scores the base's greedy answers, so it follows the runs.
    let (cd, bd) = score_base_answers(set, &bc, &run_cfg(candidate), &run_cfg(base)).await?;
    Ok((
        Runs {
            capability: cc,
            probe: cp,
            base_answer_logprobs: cd,
        },
        Runs {
            capability: bc,
            probe: bp,
            base_answer_logprobs: bd,
        },
    ))
}

/// Per item, the mean log-prob per token of the base model's greedy answer in `base_run`
/// under `candidate`'s model and under `base`'s (same endpoint).
async fn score_base_answers(
    set: &EvalSet,
    base_run: &RunReport,
    candidate: &RunConfig,
    base: &RunConfig,
) -> Result<(Vec<Option<f64>>, Vec<Option<f64>>), PublishError> {
    let answers = greedy_answers(base_run);
    let prompts = prompt_tokens(set, &answers, base).await?;
    let (c, b) = tokio::join!(
        answer_logprobs(set, &answers, &prompts, candidate),
        answer_logprobs(set, &answers, &prompts, base)
    );
    Ok((c?, b?))
}

/// The log-prob drift check on its own: the base model's greedy answers in `base_run` (run
/// with `keep_content`) scored under `candidate`'s model and `base`'s (same endpoint).
pub async fn answer_drift(
    set: &EvalSet,
    base_run: &RunReport,
    candidate: &RunConfig,
    base: &RunConfig,
) -> Result<Option<Drift>, PublishError> {
    let (c, b) = score_base_answers(set, base_run, candidate, base).await?;
    Ok(paired_means(&c, &b).map(|(candidate, base, items)| Drift {
        candidate,
        base,
        items,
    }))
}

/// Mean log-prob per token of the base model's answers under each model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Drift {
    /// Under the candidate.
    pub candidate: f64,
    /// Under the base model.
    pub base: f64,
    /// Items both scored.
    pub items: usize,
}

impl Drift {
    /// candidate − base (negative: the candidate finds the base's answers less likely).
    pub fn change(&self) -> f64 {
        self.candidate - self.base
    }
}

/// Each item's first answer, `None` where empty (nothing to score).
fn greedy_answers(run: &RunReport) -> Vec<Option<String>> {
    run.items
        .iter()
        .map(|i| {
            i.samples
                .first()
                .and_then(|s| s.content.clone())
                .filter(|a| !a.trim().is_empty())
        })
        .collect()
}

/// Per item with an answer, the prompt's token count (chat template and generation prompt
/// included) from a prompt-only request to `base`'s model: where the answer's tokens start in
/// the scored request (the tokenizer is shared by base and adapters).
async fn prompt_tokens(
    set: &EvalSet,
    answers: &[Option<String>],
    base: &RunConfig,
) -> Result<Vec<Option<usize>>, PublishError> {
    let client = base.client()?;
    Ok(
        stream::iter(set.items.iter().zip(answers).map(|(item, answer)| {
            let client = &client;
            async move {
                answer.as_ref()?;
                let asked = json!({
                    "model": base.model, "messages": item.messages, "tools": item.tools,
                    "max_tokens": 1, "temperature": 0,
                });
                let body = client.complete(&asked).await.ok()?.body;
                Some(body["usage"]["prompt_tokens"].as_u64()? as usize)
            }
        }))
        .buffered(base.concurrency.max(1))
        .collect()
        .await,
    )
}

/// Per item, the mean log-prob per token of `answers[i]` (the base model's greedy answer) under
/// `scorer`'s model: the chat request with the answer as a final assistant message the prompt
/// continues, `prompt_logprobs: 0`, the answer's tokens being those after `prompts[i]`. `None`
/// per item the server could not score (no `prompt_logprobs` in its answer).
async fn answer_logprobs(
    set: &EvalSet,
    answers: &[Option<String>],
    prompts: &[Option<usize>],
    scorer: &RunConfig,
) -> Result<Vec<Option<f64>>, PublishError> {
    let client = scorer.client()?;
    let items = set.items.iter().zip(answers).zip(prompts);
    Ok(stream::iter(items.map(|((item, answer), prompt_tokens)| {
        let client = &client;
        async move {
            let (answer, prompt_tokens) = (answer.as_ref()?, (*prompt_tokens)?);
            let mut messages = item.messages.clone();
            messages.push(json!({"role": "assistant", "content": answer}));
            let continued = json!({
                "model": scorer.model, "messages": messages, "tools": item.tools,
                "continue_final_message": true, "add_generation_prompt": false,
                "prompt_logprobs": 0, "max_tokens": 1, "temperature": 0,
            });
            mean_answer_logprob(&client.complete(&continued).await.ok()?.body, prompt_tokens)
        }
    }))
    .buffered(scorer.concurrency.max(1))
    .collect()
    .await)
}

/// The mean log-prob of the prompt tokens after the first `prompt_tokens` in a response's
/// `prompt_logprobs` (vLLM's shape: `null`, then per token `{"<id>": {"logprob", "rank"}}`
/// holding the prompt's token, the only one with `prompt_logprobs: 0`).
fn mean_answer_logprob(body: &Value, prompt_tokens: usize) -> Option<f64> {
    let entries = body
        .get("prompt_logprobs")?
        .as_array()?
        .get(prompt_tokens..)?;
    let mut sum = 0.0;
    for e in entries {
        let mut own = e.as_object()?.values();
        let lp = own.next()?.get("logprob")?.as_f64()?;
        if own.next().is_some() || !lp.is_finite() {
            return None;
        }
        sum += lp;
    }
    (!entries.is_empty()).then(|| sum / entries.len() as f64)
}

/// The mean over the items both models scored (paired).
fn paired_means(a: &[Option<f64>], b: &[Option<f64>]) -> Option<(f64, f64, usize)> {
    let pairs: Vec<(f64, f64)> = a
        .iter()
        .zip(b)
        .filter_map(|(x, y)| Some(((*x)?, (*y)?)))
        .collect();
    let n = pairs.len();
    (n > 0).then(|| {
        let (sa, sb) = pairs
            .iter()
            .fold((0.0, 0.0), |(sa, sb), (x, y)| (sa + x, sb + y));
        (sa / n as f64, sb / n as f64, n)
    })
}

/// Compares the candidate's capability run with the base model's.
pub(crate) fn judge(guard: &GuardConfig, candidate: &Runs, base: &Runs) -> GuardReport {
    let drift = paired_means(&candidate.base_answer_logprobs, &base.base_answer_logprobs);
    let c = Indicators::of(candidate, drift.map(|d| d.0));
    let b = Indicators::of(base, drift.map(|d| d.1));
    let mut reasons = Vec::new();
    if c.exact_match + 1e-9 < b.exact_match - guard.capability_margin {
        reasons.push(format!(
            "forgetting: capability exact match {:.1}% < base {:.1}% − margin {:.1} points",
            c.exact_match * 100.0,
            b.exact_match * 100.0,
            guard.capability_margin * 100.0
        ));
    }
    if let (Some(ce), Some(be)) = (c.entropy, b.entropy) {
        if ce < be * guard.min_entropy_ratio {
            reasons.push(format!(
                "collapse: answer-token entropy {ce:.3} nats < {:.0}% of base {be:.3}",
                guard.min_entropy_ratio * 100.0
            ));
        }
    }
    if c.self_similarity > b.self_similarity + guard.max_self_similarity_rise {
        reasons.push(format!(
            "collapse: answers to different prompts alike (ROUGE-L {:.2} > base {:.2} + {:.2})",
            c.self_similarity, b.self_similarity, guard.max_self_similarity_rise
        ));
    }
    if let Some((cl, bl, _)) = drift {
        if cl < bl - guard.max_logprob_drop {
            reasons.push(format!(
                "drift: the base model's answers score {cl:.3} nats per token, base {bl:.3} − \
                 max drop {:.2}",
                guard.max_logprob_drop
            ));
        }
    }
    let json = json!({
        "set": {
            "name": candidate.capability.set.name,
            "sha256": candidate.capability.set.sha256,
            "items": candidate.capability.set.items,
        },
        "base_model": base.capability.model,
        "candidate": c,
        "base": b,
        "capability_margin": guard.capability_margin,
        "min_entropy_ratio": guard.min_entropy_ratio,
        "max_self_similarity_rise": guard.max_self_similarity_rise,
        "top_logprobs": guard.top_logprobs,
        "probe_max_tokens": guard.probe_max_tokens,
        "max_logprob_drop": guard.max_logprob_drop,
        "drift_items": drift.map_or(0, |d| d.2),
        "reasons": reasons,
    });
    GuardReport { reasons, json }
}

/// Mean ROUGE-L F1 over all pairs of answers (lower-cased words); 0 with fewer than two.
pub fn mean_pairwise_rouge_l(answers: &[&str]) -> f64 {
    let tokens: Vec<Vec<String>> = answers
        .iter()
        .map(|a| a.split_whitespace().map(str::to_lowercase).collect())
        .collect();
    let mut sum = 0.0;
    let mut pairs = 0usize;
    for i in 0..tokens.len() {
        for j in i + 1..tokens.len() {
            sum += rouge_l_f1(&tokens[i], &tokens[j]);
            pairs += 1;
        }
    }
    if pairs == 0 {
        0.0
    } else {
        sum / pairs as f64
    }
}

/// ROUGE-L F1 of two token sequences: the longest common subsequence over their lengths.
fn rouge_l_f1(a: &[String], b: &[String]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return if a.is_empty() && b.is_empty() {
            1.0
        } else {
            0.0
        };
    }
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut diagonal = 0;
        for (j, y) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = if x == y {
                diagonal + 1
            } else {
                above.max(row[j])
            };
            diagonal = above;
        }
    }
    let lcs = row[b.len()] as f64;
    let (p, r) = (lcs / b.len() as f64, lcs / a.len() as f64);
    if lcs == 0.0 {
        0.0
    } else {
        2.0 * p * r / (p + r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn rouge_l_of_identical_disjoint_and_partial_answers() {
        assert_eq!(rouge_l_f1(&words("a b c"), &words("a b c")), 1.0);
        assert_eq!(rouge_l_f1(&words("a b c"), &words("d e f")), 0.0);
        // LCS "a c" of 3 and 2 tokens: p = 1, r = 2/3, F1 = 0.8.
        assert!((rouge_l_f1(&words("a b c"), &words("a c")) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn one_answer_to_everything_is_self_similar_varied_answers_are_not() {
        let collapsed = ["the refund code is rx-42"; 5];
        let varied = [
            "Paris is the capital of France.",
            "Seven days.",
            "Water freezes at 0 degrees.",
            "Bees make honey.",
            "OK",
        ];
        assert_eq!(mean_pairwise_rouge_l(&collapsed), 1.0);
        assert!(mean_pairwise_rouge_l(&varied) < 0.2);
        assert_eq!(mean_pairwise_rouge_l(&["alone"]), 0.0);
    }

    #[test]
    fn the_answer_is_what_follows_the_prompt_and_both_models_must_score_an_item() {
        let body = json!({"prompt_logprobs": [
            null,
            {"7": {"logprob": -9.0, "rank": 40}},
            {"8": {"logprob": -1.0, "rank": 2}},
            {"9": {"logprob": -0.5, "rank": 1}},
        ]});
        assert_eq!(mean_answer_logprob(&body, 2), Some(-0.75));
        assert_eq!(mean_answer_logprob(&body, 4), None, "no answer tokens");
        assert_eq!(mean_answer_logprob(&json!({"choices": []}), 2), None);
        let alternatives = json!({"prompt_logprobs": [null,
            {"7": {"logprob": -1.0}, "3": {"logprob": -0.1}}]});
        assert_eq!(mean_answer_logprob(&alternatives, 1), None, "ambiguous");
        let paired = paired_means(
            &[Some(-1.0), None, Some(-3.0)],
            &[Some(-0.5), Some(-9.0), None],
        );
        assert_eq!(paired, Some((-1.0, -0.5, 1)));
        assert_eq!(paired_means(&[None], &[Some(1.0)]), None);
    }

    #[test]
    fn builtin_set_parses_and_defaults_validate() {
        let set = builtin_capability_set().unwrap();
        assert!(set.items.len() >= 30, "{} items", set.items.len());
        GuardConfig::default().validate().unwrap();
        let bad = GuardConfig {
            top_logprobs: 21,
            ..GuardConfig::default()
        };
        assert!(bad.validate().is_err());
        let g: GuardConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(g, GuardConfig::default());
        assert!(serde_json::from_str::<GuardConfig>(r#"{"margin": 1}"#).is_err());
    }
}
