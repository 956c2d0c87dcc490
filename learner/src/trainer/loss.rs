//! One example's loss: which objectives it feeds, the passes they need (the policy's prompt run
//! once for all of them), and the sum of its weighted terms.

use candle_core::Tensor;
use hindsight_model::KvCache;

use super::terms::StepStats;
use super::*;

impl Trainer {
    /// One example's weighted loss (`None` when no objective contributes a term), with the
    /// tokens it ran and its statistics added to `report` and `stats`; an example no objective
    /// learns from is listed in [`StepReport::unlearned`].
    pub(super) fn example_loss(
        &mut self,
        ex: &TrainExample,
        report: &mut StepReport,
        stats: &mut StepStats,
    ) -> Result<Option<Tensor>> {
        if ex.context_ids.is_empty() || ex.answer_ids.is_empty() {
            return Err(LearnerError::InvalidArgument(format!(
                "example {} has an empty context or answer",
                ex.record_id
            )));
        }
        let w = self.cfg.objectives;
        // Which objectives this example feeds; one that feeds none costs no forward pass.
        let applies = w.distill > 0.0 && ex.teacher_context_ids.is_some()
            || w.dense > 0.0 && (ex.teacher_context_ids.is_some() || ex.reward.is_some())
            || w.kto > 0.0 && ex.thumbs.is_some()
            || w.sft > 0.0 && ex.correction_ids.is_some();
        if !applies {
            report.unlearned.push(ex.record_id);
            return Ok(None);
        }
        let mut total: Option<Tensor> = None;
        // Whether an objective other than the KL guard contributes a term.
        let mut learned = false;
        // The policy's pass over the logged answer feeds distillation, dense rewards, KTO
        // and the KL guard. An example that only carries a correction skips it and the base
        // pass: SFT has its own pass over the correction, so a pure-SFT example costs one
        // forward instead of three (the KL guard is measured where the policy pass runs).
        let needs_student = w.distill > 0.0 && ex.teacher_context_ids.is_some()
            || w.dense > 0.0 && (ex.teacher_context_ids.is_some() || ex.reward.is_some())
            || w.kto > 0.0 && ex.thumbs.is_some();
        // The policy's prompt, run once for all of this example's passes (the logged
        // answer, the teacher's target, the correction).
        let student_prompt = if needs_student {
            report.tokens += ex.context_ids.len() - 1;
            Some(self.policy_prompt(&ex.context_ids)?)
        } else {
            None
        };
        if let Some(prompt) = &student_prompt {
            learned |= self.student_terms(ex, prompt, report, stats, &mut total)?;
        }

        if let (Some(corr), true) = (&ex.correction_ids, w.sft > 0.0) {
            let sft = self.sft_term(ex, corr, student_prompt.as_ref(), &mut report.tokens)?;
            if let Some((kl_val, penalty)) = sft.guard {
                stats.kl_sum += kl_val;
                stats.kl_n += 1;
                if let Some(pen) = penalty {
                    stats.note("kl_penalty", pen.to_scalar::<f32>()? as f64);
                    push(&mut total, pen)?;
                }
            }
            stats.note("sft", sft.loss.to_scalar::<f32>()? as f64);
            push(&mut total, (sft.loss * w.sft)?)?;
            learned = true;
        }

        if !learned {
            report.unlearned.push(ex.record_id);
        }
        Ok(total)
    }

    /// The terms computed on the policy's pass over the logged answer (after `prompt`, the
    /// policy's prompt cache for `ex`): the KL guard against the base model, distillation on
    /// the teacher's target (and its hard-target cross-entropy), the dense-reward policy
    /// gradient and KTO. Adds them to `total`; returns whether any term other than the KL
    /// guard was added.
    fn student_terms(
        &mut self,
        ex: &TrainExample,
        prompt: &KvCache,
        report: &mut StepReport,
        stats: &mut StepStats,
        total: &mut Option<Tensor>,
    ) -> Result<bool> {
        let w = self.cfg.objectives;
        let n = ex.answer_ids.len();
        let mut learned = false;
        let student = self.policy_pass_after(prompt, &ex.context_ids, &ex.answer_ids)?;
        report.tokens += n;
        let s_lp: Vec<f32> = student.logprobs.detach().to_vec1()?;

        // The base model at the logged positions: the KL guard (its full next-token
        // distributions) and KTO's reference (its log-probs of the logged tokens).
        let need_base = self.cfg.kl_penalty > 0.0 || (w.kto > 0.0 && ex.thumbs.is_some());
        let base_pass = if need_base {
            Some(self.base_pass(ex, &ex.answer_ids, &mut report.tokens)?)
        } else {
            None
        };
        let base = base_pass.as_ref().map(|b| b.logprobs.clone());
        if let Some(bp) = &base_pass {
            let (kl_val, penalty) = self.kl_guard(&student.logits, &bp.logits)?;
            stats.kl_sum += kl_val;
            stats.kl_n += 1;
            if let Some(pen) = penalty {
                stats.note("kl_penalty", pen.to_scalar::<f32>()? as f64);
                push(total, pen)?;
            }
        }

        // Teacher: the EMA policy shown the feedback, on the same answer tokens, and the
        // target distilled on (its own answer or edit, or the logged answer).
        let TeacherTarget { own, teacher } =
            self.teacher_target(ex, &s_lp, &mut stats.teacher_counts, &mut report.tokens)?;

        // Distillation on the teacher's own answer or edit (a second student pass unless
        // it is the logged answer) or on the logged one. A target that is not the logged
        // answer may also be learned as hard targets (`target_ce_weight`).
        let on_own = match &own {
            Some(a) if a.ids == ex.answer_ids => Some((student.logits.clone(), &a.logits)),
            Some(a) => {
                report.tokens += a.ids.len();
                let pass = self.policy_pass_after(prompt, &ex.context_ids, &a.ids)?;
                if self.cfg.target_ce_weight > 0.0 && w.distill > 0.0 {
                    let ce = mean(&pass.logprobs.neg()?)?;
                    stats.note("target_ce", ce.to_scalar::<f32>()? as f64);
                    push(total, (ce * self.cfg.target_ce_weight)?)?;
                    learned = true;
                }
                Some((pass.logits, &a.logits))
            }
            None => None,
        };
        let pair = on_own.or_else(|| {
            teacher
                .as_ref()
                .map(|t| (student.logits.clone(), &t.logits))
        });
        if let (Some((s_logits, t_logits)), true) = (pair, w.distill > 0.0) {
            let d = mean(&distill_loss(
                &s_logits,
                t_logits,
                self.cfg.top_k.min(t_logits.dim(1)?),
                self.cfg.divergence,
            )?)?;
            stats.note("distill", d.to_scalar::<f32>()? as f64);
            push(total, (d * w.distill)?)?;
            learned = true;
        }

        if w.dense > 0.0 && (teacher.is_some() || ex.reward.is_some()) {
            let d = self.dense_term(ex, &student, teacher.as_ref(), &s_lp)?;
            stats.gap_sum += d.gap_sum;
            stats.gap_n += d.gap_n;
            stats.advs.extend_from_slice(&d.advantages);
            stats.clip_sum += d.clip_fraction;
            stats.clip_n += 1;
            stats.baseline_updates.extend(d.baseline_update);
            stats.note("dense", d.loss.to_scalar::<f32>()? as f64);
            push(total, (d.loss * w.dense)?)?;
            learned = true;
        }

        if let (Some(up), Some(base_lp), true) = (ex.thumbs, &base, w.kto > 0.0) {
            let (k, z) = self.kto_term(&student, base_lp, up)?;
            stats.z_updates.push(z);
            stats.note("kto", k.to_scalar::<f32>()? as f64);
            push(total, (k * w.kto)?)?;
            learned = true;
        }
        Ok(learned)
    }
}
