//! One example's loss terms besides distillation: SFT on a correction, the KL guard, the
//! dense-reward policy gradient, KTO; and what a step accumulates over its examples.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::*;

/// What a step accumulates over its examples besides the gradients.
#[derive(Default)]
pub(super) struct StepStats {
    pub(super) term_sums: BTreeMap<String, f64>,
    pub(super) applied: BTreeMap<String, usize>,
    pub(super) kl_sum: f64,
    pub(super) kl_n: usize,
    pub(super) gap_sum: f64,
    pub(super) gap_n: usize,
    pub(super) advs: Vec<f32>,
    pub(super) clip_sum: f64,
    pub(super) clip_n: usize,
    pub(super) z_updates: Vec<f64>,
    pub(super) baseline_updates: Vec<(String, f64)>,
    pub(super) teacher_counts: Option<TeacherAnswerCounts>,
}

impl StepStats {
    /// One example's value of a loss term.
    pub(super) fn note(&mut self, name: &str, v: f64) {
        *self.term_sums.entry(name.to_string()).or_default() += v;
        *self.applied.entry(name.to_string()).or_default() += 1;
    }

    /// Writes the means into `report`; returns the running statistics' observations (route
    /// rewards for the baselines, KTO rewards for its reference point).
    pub(super) fn into_report(self, report: &mut StepReport) -> (Vec<(String, f64)>, Vec<f64>) {
        report.kl_to_base = if self.kl_n > 0 {
            self.kl_sum / self.kl_n as f64
        } else {
            0.0
        };
        report.teacher_student_gap = (self.gap_n > 0).then(|| self.gap_sum / self.gap_n as f64);
        if !self.advs.is_empty() {
            let len = self.advs.len() as f64;
            let m = self.advs.iter().map(|x| *x as f64).sum::<f64>() / len;
            let var = self
                .advs
                .iter()
                .map(|x| (*x as f64 - m).powi(2))
                .sum::<f64>()
                / len;
            report.advantage_mean = Some(m);
            report.advantage_std = Some(var.sqrt());
        }
        report.clip_fraction = (self.clip_n > 0).then(|| self.clip_sum / self.clip_n as f64);
        report.teacher_answers = self.teacher_counts;
        report.terms = self
            .term_sums
            .iter()
            .map(|(k, v)| (k.clone(), v / self.applied[k] as f64))
            .collect();
        report.applied = self.applied;
        (self.baseline_updates, self.z_updates)
    }
}

/// SFT's term of one example and, when it measured the KL guard, the KL and its penalty.
pub(super) struct SftTerm {
    pub(super) loss: Tensor,
    pub(super) guard: Option<(f64, Option<Tensor>)>,
}

/// What the dense-reward term of one example yields besides its loss.
pub(super) struct DenseTerm {
    pub(super) loss: Tensor,
    pub(super) gap_sum: f64,
    pub(super) gap_n: usize,
    pub(super) advantages: Vec<f32>,
    pub(super) clip_fraction: f64,
    pub(super) baseline_update: Option<(String, f64)>,
}

impl Trainer {
    /// SFT on a correction: the mean token cross-entropy after the policy's prompt (run once
    /// for the example when its other passes ran it). An example only SFT learns from measures
    /// its KL guard here, at the correction's positions, so its pass keeps the logits (`[n, V]`,
    /// a few MB); otherwise the fused cross-entropy.
    pub(super) fn sft_term(
        &mut self,
        ex: &TrainExample,
        corr: &[u32],
        student_prompt: Option<&KvCache>,
        tokens: &mut usize,
    ) -> Result<SftTerm> {
        *tokens += match student_prompt {
            Some(_) => corr.len(),
            None => ex.context_ids.len() + corr.len(),
        };
        if student_prompt.is_none() && self.cfg.kl_penalty > 0.0 {
            let pass = self.policy_pass(&ex.context_ids, corr)?;
            let base_logits = self.base_pass(ex, corr, tokens)?.logits;
            Ok(SftTerm {
                loss: mean(&pass.logprobs.neg()?)?,
                guard: Some(self.kl_guard(&pass.logits, &base_logits)?),
            })
        } else {
            let ce = self.sft_token_ce(student_prompt, &ex.context_ids, corr)?;
            Ok(SftTerm {
                loss: mean(&ce)?,
                guard: None,
            })
        }
    }

    /// The KL guard at one answer's positions: the mean exact KL(policy ‖ base) per position
    /// and, above the budget (with the guard on), the penalty term.
    pub(super) fn kl_guard(&self, policy: &Tensor, base: &Tensor) -> Result<(f64, Option<Tensor>)> {
        let kl = mean(&kl_exact(policy, base)?)?;
        let value = kl.to_scalar::<f32>()? as f64;
        let penalty = if self.cfg.kl_penalty > 0.0 && value > self.cfg.kl_budget {
            Some(((kl - self.cfg.kl_budget)? * self.cfg.kl_penalty)?)
        } else {
            None
        };
        Ok((value, penalty))
    }

    /// The dense-reward policy-gradient term of one example: per-token advantages from the
    /// teacher/student gap on the logged tokens (when a teacher ran) plus the scalar feedback
    /// against the route's running baseline, importance-weighted against the behaviour
    /// log-probs and clipped.
    pub(super) fn dense_term(
        &self,
        ex: &TrainExample,
        student: &AnswerPass,
        teacher: Option<&AnswerPass>,
        s_lp: &[f32],
    ) -> Result<DenseTerm> {
        let n = ex.answer_ids.len();
        let dev = self.model.device();
        let (scalar_adv, baseline_update) = match ex.reward {
            Some(r) => {
                let b = self.state.baselines.get(&ex.route).copied().unwrap_or(0.0);
                (r - b, Some((ex.route.clone(), r)))
            }
            None => (0.0, None),
        };
        let (mut gap_sum, mut gap_n) = (0.0, 0usize);
        let advantages = match teacher {
            Some(t) => {
                let t_lp: Vec<f32> = t.logprobs.to_vec1()?;
                for (a, b) in t_lp.iter().zip(s_lp) {
                    gap_sum += (*a - *b) as f64;
                    gap_n += 1;
                }
                dense_advantages(&t_lp, s_lp, scalar_adv, self.cfg.gap_clip)
            }
            None => vec![scalar_adv as f32; n],
        };
        // The ratio compares the policy with the logged behaviour under the same transform
        // (temperature, grammar; see behaviour.rs). Unknown behaviour entries (NaN, or a
        // distribution the learner cannot rebuild) are treated as on-policy: ratio 1.
        let (policy_lp, behaviour) = match &ex.behaviour_logprobs {
            Some(b) => {
                let view = self.behaviour_view(ex, &student.logits, &student.logprobs)?;
                let own: Vec<f32> = view.logprobs.detach().to_dtype(DType::F32)?.to_vec1()?;
                let reference = b
                    .iter()
                    .zip(&own)
                    .zip(&view.comparable)
                    .map(|((x, o), c)| if *c && x.is_finite() { *x } else { *o })
                    .collect::<Vec<f32>>();
                let reference =
                    Tensor::from_vec(reference, n, dev)?.to_dtype(view.logprobs.dtype())?;
                (view.logprobs, Some(reference))
            }
            None => (student.logprobs.clone(), None),
        };
        let adv = Tensor::from_vec(advantages.clone(), n, dev)?.to_dtype(policy_lp.dtype())?;
        let (pg, stats) = pg_loss(&policy_lp, behaviour.as_ref(), &adv, self.cfg.ratio_clip)?;
        Ok(DenseTerm {
            loss: mean(&pg)?,
            gap_sum,
            gap_n,
            advantages,
            clip_fraction: stats.clip_fraction,
            baseline_update,
        })
    }

    /// The KTO term of one thumbed example against the base model's log-probs of the same
    /// tokens, with the reward (for the running reference point z) it observed.
    pub(super) fn kto_term(
        &self,
        student: &AnswerPass,
        base_lp: &Tensor,
        up: bool,
    ) -> Result<(Tensor, f64)> {
        let seq = student.logprobs.sum_all()?;
        let reference = base_lp.sum_all()?.to_scalar::<f32>()? as f64;
        let r = seq.to_scalar::<f32>()? as f64 - reference;
        let k = kto_loss(&seq, reference, up, self.state.kto_z, &self.cfg.kto)?;
        Ok((k, r.max(0.0)))
    }
}
