//! The policy's log-probabilities of the logged tokens under the distribution the behaviour
//! policy drew them from, so that the dense term's importance ratio `π(y)/μ(y)` compares like
//! with like: exactly 1 where the policy has not moved from the weights that served.
//!
//! `hindsight serve` logs the log-probability of each sampled token under what it sampled
//! from: the logits divided by the request's temperature, renormalised over the tokens the
//! request's grammar allowed at that step, and over the nucleus when `top_p < 1`
//! (serve/src/sampler.rs). Compared with the policy's full-vocabulary log-probs at
//! temperature 1 instead, three in four logged tokens fell outside the ratio clip before the
//! policy had taken a step (docs/experiments/2026-12-06-top-k-and-clips.md).

use candle_core::Tensor;
use tracing::debug;

use super::*;
use crate::objectives::{sampled_logprobs, Support};
use crate::trainer::config::BehaviourLogprobs;

/// Allowed tokens lighter than the logged one by more than this (nats, after the temperature)
/// are left out of the normaliser: each weighs under e^-30 of it, all 49k of the default
/// vocabulary together under 5e-9 relative (the rule of `choice_logprob`).
const WINDOW_NATS: f64 = 30.0;

/// The policy's log-probs of an example's logged answer for the dense term.
pub(super) struct BehaviourView {
    /// `[n]` differentiable log-probs under the behaviour's transform where it is known
    /// (`comparable`), the full-vocabulary ones at temperature 1 elsewhere.
    pub(super) logprobs: Tensor,
    /// Per position: whether the logged behaviour log-prob there describes the same
    /// distribution as `logprobs` (an importance ratio is meaningful).
    pub(super) comparable: Vec<bool>,
}

impl Trainer {
    /// The policy's view of `ex`'s logged answer that matches its behaviour log-probs.
    /// `logits` are the policy's `[n, V]` at the answer positions and `raw` its full-vocabulary
    /// log-probs of the answer at temperature 1. Positions the learner cannot put on the
    /// behaviour's footing (greedy decoding, a grammar it does not rebuild, an answer that
    /// leaves its grammar) keep `raw` and count as on-policy.
    pub(super) fn behaviour_view(
        &self,
        ex: &TrainExample,
        logits: &Tensor,
        raw: &Tensor,
    ) -> Result<BehaviourView> {
        let n = ex.answer_ids.len();
        let s = ex.sampling;
        let raw_view = |comparable: bool| BehaviourView {
            logprobs: raw.clone(),
            comparable: vec![comparable; n],
        };
        match self.cfg.behaviour_logprobs {
            BehaviourLogprobs::Raw => return Ok(raw_view(true)),
            BehaviourLogprobs::Sampled if s.temperature <= 0.0 || s.unknown_grammar => {
                return Ok(raw_view(false))
            }
            BehaviourLogprobs::Sampled => {}
        }
        let grammar = match ex.answer_format.as_ref().map(response_format_grammar) {
            Some(Ok(Some(g))) => Some(g),
            Some(Ok(None)) | None => None,
            Some(Err(e)) => {
                debug!(error = %e, "Unusable response_format: the behaviour log-probs are not comparable.");
                return Ok(raw_view(false));
            }
        };
        // Following the grammar needs the tokens' text: without it (no Trainer::set_decoding)
        // this is an error, not a silent fallback.
        let vocab = match &grammar {
            Some(_) => Some(self.decoding()?.vocab.clone()),
            None => None,
        };
        if grammar.is_none() && s.top_p >= 1.0 {
            let lp = sampled_logprobs(
                logits,
                &ex.answer_ids,
                &vec![Support::Vocab; n],
                s.temperature,
            )?;
            return Ok(BehaviourView {
                logprobs: lp,
                comparable: vec![true; n],
            });
        }
        let rows = logits.detach().to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let mut state = grammar.as_ref().map(JsonState::new);
        let mut lost = false;
        let mut supports = Vec::with_capacity(n);
        let mut comparable = Vec::with_capacity(n);
        for (row, &y) in rows.iter().zip(&ex.answer_ids) {
            let (support, known) = match (&mut state, &vocab) {
                (Some(_), _) if lost => (Support::Vocab, false),
                // The grammar ended the document: the end of the answer was forced.
                (Some(st), _) if st.finished() => (Support::Among(vec![y]), true),
                (Some(st), Some(vocab)) => {
                    let text = vocab.get(y as usize).and_then(|t| t.as_deref());
                    let support = {
                        let allowed = allowed_by_grammar(st, vocab);
                        (text.is_some() && allowed(y))
                            .then(|| nucleus(row, y, s.temperature, s.top_p, &allowed))
                    };
                    match (support, text) {
                        (Some(support), Some(text)) if st.feed_str(text) => (support, true),
                        // The logged token is not one the grammar allows (re-tokenised text,
                        // a different grammar upstream): the rest cannot be followed.
                        _ => {
                            lost = true;
                            (Support::Vocab, false)
                        }
                    }
                }
                _ => (nucleus(row, y, s.temperature, s.top_p, &|_| true), true),
            };
            supports.push(support);
            comparable.push(known);
        }
        let restricted = sampled_logprobs(logits, &ex.answer_ids, &supports, s.temperature)?;
        // Positions not on the behaviour's footing take the raw log-probs.
        let m = Tensor::from_vec(
            comparable
                .iter()
                .map(|c| if *c { 1f32 } else { 0.0 })
                .collect::<Vec<_>>(),
            n,
            logits.device(),
        )?
        .to_dtype(raw.dtype())?;
        let logprobs = ((restricted * &m)? + (raw * m.affine(-1.0, 1.0)?)?)?;
        Ok(BehaviourView {
            logprobs,
            comparable,
        })
    }
}

/// The tokens one sampling step drew `y` from: those `allowed` admits within
/// [`WINDOW_NATS`] of `y` (after the temperature), cut to the nucleus of `top_p` (best first,
/// as serve's sampler) and always holding `y`, first.
fn nucleus(
    row: &[f32],
    y: u32,
    temperature: f64,
    top_p: f64,
    allowed: &dyn Fn(u32) -> bool,
) -> Support {
    let scaled = |i: usize| f64::from(row[i]) / temperature;
    let Some(own) = row.get(y as usize).map(|_| scaled(y as usize)) else {
        return Support::Vocab;
    };
    let mut cands: Vec<(u32, f64)> = (0..row.len())
        .filter(|&i| i as u32 != y && scaled(i) >= own - WINDOW_NATS && allowed(i as u32))
        .map(|i| (i as u32, scaled(i)))
        .collect();
    cands.push((y, own));
    if top_p < 1.0 {
        cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let top = cands[0].1;
        let w: Vec<f64> = cands.iter().map(|(_, s)| (s - top).exp()).collect();
        let z: f64 = w.iter().sum();
        let mut cum = 0.0;
        let mut keep = cands.len();
        for (j, wj) in w.iter().enumerate() {
            cum += wj;
            if cum >= top_p * z {
                keep = j + 1;
                break;
            }
        }
        cands.truncate(keep);
        if !cands.iter().any(|(i, _)| *i == y) {
            cands.push((y, own));
        }
    }
    let mut ids = vec![y];
    ids.extend(cands.iter().map(|(i, _)| *i).filter(|i| *i != y));
    Support::Among(ids)
}
