//! The trainer's settings (`[learner.trainer]`): the objective mix, the teacher, the guards.
//! Defaults are the measured recipe (docs/experiments/; deploy/learner.example.toml).

use serde::{Deserialize, Serialize};

use crate::error::{LearnerError, Result};
use crate::objectives::{Divergence, KtoConfig};
use crate::optim::AdamWConfig;
use hindsight_model::LoraConfig;

/// Weight of each objective in the mixed loss (0 turns one off).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveWeights {
    /// Supervised fine-tuning on corrections.
    #[serde(default)]
    pub sft: f64,
    /// KTO on thumbs.
    #[serde(default)]
    pub kto: f64,
    /// Hindsight self-distillation on text feedback.
    #[serde(default)]
    pub distill: f64,
    /// Dense-reward policy gradient.
    #[serde(default)]
    pub dense: f64,
}

impl Default for ObjectiveWeights {
    /// Self-distillation alone: the measured recipe. Adding the dense reward never helped on
    /// the simulated tickets, dense alone gained nothing, and thumbs-only KTO gained +1.7 to +5
    /// points where distillation gained +25 (docs/experiments/).
    fn default() -> Self {
        Self {
            sft: 0.0,
            kto: 0.0,
            distill: 1.0,
            dense: 0.0,
        }
    }
}

/// Trainer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerConfig {
    /// The adapter trained.
    #[serde(default = "default_lora")]
    pub lora: LoraConfig,
    /// AdamW.
    #[serde(default = "default_optimizer")]
    pub optimizer: AdamWConfig,
    /// Objective mix.
    #[serde(default)]
    pub objectives: ObjectiveWeights,
    /// Divergence of self-distillation.
    #[serde(default)]
    pub divergence: Divergence,
    /// Teacher tokens kept per position (plus a tail bucket).
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// EMA rate of the teacher towards the policy after each step (0 = frozen at the start).
    #[serde(default = "default_ema_rate")]
    pub teacher_ema_rate: f64,
    /// Clip of the per-token teacher/student gap in the dense advantage.
    #[serde(default = "default_gap_clip")]
    pub gap_clip: f64,
    /// ε of the importance-ratio clip.
    #[serde(default = "default_ratio_clip")]
    pub ratio_clip: f64,
    /// Rate of the running reward baseline per route.
    #[serde(default = "default_baseline_rate")]
    pub baseline_rate: f64,
    /// KTO.
    #[serde(default)]
    pub kto: KtoConfig,
    /// Mean exact KL(policy ‖ base) per logged position (nats, summed over the vocabulary)
    /// above which the penalty applies.
    #[serde(default = "default_kl_budget")]
    pub kl_budget: f64,
    /// Weight of the penalty on KL above the budget.
    #[serde(default = "default_kl_penalty")]
    pub kl_penalty: f64,
    /// Global gradient-norm clip.
    #[serde(default = "default_max_grad_norm")]
    pub max_grad_norm: f64,
    /// Seed of the adapter's initialisation.
    #[serde(default)]
    pub seed: u64,
    /// Back-propagate through the prompt's positions too (exact). `false` runs the prompt
    /// once without a graph (its keys and values, under the current adapter, go into a KV
    /// cache) and keeps the graph only over the answer positions: the adapter then learns
    /// from how the answer positions read the prompt, not from how it writes the prompt's
    /// keys and values. Memory and backward cost fall from O(prompt²) attention to
    /// O(answer × prompt); learner/README.md has the measured figures.
    #[serde(default = "default_prefix_grad")]
    pub prefix_grad: bool,
    /// Which answer self-distillation compares teacher and student on.
    #[serde(default)]
    pub distill_target: DistillTarget,
    /// Longest answer the teacher may decode with [`DistillTarget::Teacher`] or
    /// [`DistillTarget::Edit`] (an answer that does not end within it falls back to the logged
    /// answer).
    #[serde(default = "default_teacher_answer_max_tokens")]
    pub teacher_answer_max_tokens: usize,
    /// [`DistillTarget::Edit`]: how far (nats, summed over the value's tokens) the feedback
    /// must lower the log-probability of a logged field's value — teacher (shown the feedback)
    /// minus student — for the teacher's own value to replace it.
    #[serde(default = "default_edit_margin_nats")]
    pub edit_margin_nats: f64,
    /// Weight of a cross-entropy term on the distillation target's tokens when the target is
    /// not the logged answer (the teacher's answer or edit): sequence-level distillation with
    /// hard targets, next to the per-token divergence. 0 = off.
    #[serde(default = "default_target_ce_weight")]
    pub target_ce_weight: f64,
    /// [`DistillTarget::Edit`]: what the teacher's log-probability of a logged value is
    /// compared with to decide whether the feedback speaks against it.
    #[serde(default)]
    pub edit_baseline: EditBaseline,
    /// Context-aware decoding of the teacher's own answer ([`DistillTarget::Teacher`] and the
    /// values of [`DistillTarget::Edit`]): at each step the logits
    /// `(1 + α)·teacher − α·control`, where `control` is the teacher shown the content-free
    /// critique (`examples.control_feedback`) instead of the feedback, so tokens the critique's
    /// *content* makes likelier win over the teacher's prior (Shi et al. 2023, "Trusting Your
    /// Evidence"). 0 = plain greedy; examples without a control context decode plainly.
    #[serde(default)]
    pub teacher_contrast: f64,
    /// [`DistillTarget::Teacher`] and [`DistillTarget::Edit`]: distil only on targets the
    /// teacher is confident in as a whole. A target's confidence is the teacher's (shown the
    /// feedback) joint log-probability of its field values, summed over every value's tokens
    /// (nats): of its own decoded answer, or of the edit ([`EditPreview::confidence`]). An
    /// example whose target falls below this is not distilled on (counted in
    /// [`TeacherAnswerCounts::unconfident`]; its other objectives still run). Trades examples
    /// for target precision. `None` = every target is used. Formerly
    /// `edit_min_target_logprob` (still read).
    #[serde(default, alias = "edit_min_target_logprob")]
    pub min_target_logprob: Option<f64>,
    /// [`DistillTarget::Teacher`] and [`DistillTarget::Edit`]: per field of a JSON-object
    /// target, the teacher's (shown the feedback) log-probability of its value, summed over the
    /// value's tokens (nats), below which that value's tokens carry no weight in distillation
    /// and the target's cross-entropy; the rest of the target is still learned. Where the
    /// whole-target floor ([`TrainerConfig::min_target_logprob`]) drops an example for one
    /// doubtful field, this keeps its confident fields. Masked fields are counted in
    /// [`TeacherAnswerCounts::masked_fields`]. `None` = every token counts.
    #[serde(default)]
    pub min_field_logprob: Option<f64>,
    /// How the teacher's log-probability of a value is read for the two floors above.
    #[serde(default)]
    pub confidence: Confidence,
    /// With a frozen teacher (`teacher_ema_rate = 0`): how many examples' teacher work to keep
    /// for replay — the teacher's own answer ([`DistillTarget::Teacher`]), or the edit and the
    /// teacher's pass over the logged answer ([`DistillTarget::Edit`] against the control
    /// critique, [`EditBaseline::Control`]). Those depend on the teacher alone, so a replayed
    /// example reuses them bit for bit instead of decoding again (on the CPU the decoding is
    /// most of an edit step). Each entry holds the teacher's logits over the answer and the
    /// target (`[n, vocab]` f32 each: ~6 MB per 30 tokens with the default model's 49k
    /// vocabulary). Oldest out first; 0 = off. Edits measured against the student are never
    /// cached (they move with it).
    #[serde(default = "default_teacher_cache_examples")]
    pub teacher_cache_examples: usize,
    /// How many examples' base-model passes to keep for replay: the base model (no adapter)
    /// over the logged answer (the KL guard's reference and KTO's) or, for an example only SFT
    /// learns from, over the correction. The base never changes, so a replayed example reuses
    /// its pass bit for bit instead of running the prompt again. Each entry holds `[n, vocab]`
    /// f32 logits (~6 MB per 30 tokens with the default model). Oldest out first; 0 = off.
    #[serde(default = "default_base_cache_examples")]
    pub base_cache_examples: usize,
}

/// [`DistillTarget::Edit`]: the reference a logged value's log-probability under the teacher
/// (shown the feedback) is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EditBaseline {
    /// The student on the original prompt: the shift mixes what the feedback says with
    /// everything else that separates teacher from student (a longer prompt, a complaint, and
    /// with an EMA or frozen teacher, the training since).
    #[default]
    Student,
    /// The teacher shown a content-free critique in the same place (a counterfactual
    /// control): only what the critique's content changes counts. Examples without a control
    /// context use the student.
    Control,
}

/// The answer on which self-distillation reads the teacher's and the student's next-token
/// distributions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillTarget {
    /// The logged answer: per-token distillation on the tokens the behaviour policy sampled.
    /// The teacher grades those tokens but never says which answer it would have given.
    Logged,
    /// The teacher's own answer: the teacher (EMA policy shown the feedback) decodes greedily
    /// after its hindsight prompt, under the logged request's `response_format` grammar when
    /// there was one (so in the serve's layout), and the student is distilled on that sequence
    /// (sequence-level knowledge distillation, Kim & Rush 2016, with a hindsight teacher). When
    /// the teacher's answer equals the logged one this is the same as `logged`. The default:
    /// it is what made distillation gain +25 points (docs/experiments/).
    #[default]
    Teacher,
    /// The logged answer with only the decisions the feedback speaks against changed to the
    /// teacher's. For a JSON-object answer, a field is changed when the feedback lowers the
    /// log-probability of its logged value by more than `edit_margin_nats` (teacher shown the
    /// feedback minus student, summed over the value's tokens); its new value is the one in
    /// the teacher's own greedy answer (decoded as with `teacher`). Fields the feedback does
    /// not speak against keep the logged value, so the teacher's prior does not replace them.
    /// The edited answer is laid out as the logged one and encoded by the model's tokenizer
    /// ([`TeacherDecoding::tokenizer`]; without one the teacher spells it). Answers that are not
    /// JSON objects, or that no field of is changed, are distilled on as logged. The refined
    /// answer of learning from language feedback (Scheurer et al. 2023), made by the model's
    /// own hindsight teacher.
    Edit,
}

/// How the teacher's confidence in a value of its target is measured
/// ([`TrainerConfig::min_target_logprob`], [`TrainerConfig::min_field_logprob`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Confidence {
    /// The log-probability of the value's tokens over the whole vocabulary. Under a grammar
    /// that allows only a few values it also counts the mass the teacher puts on tokens the
    /// grammar forbids (other spellings, prose), so it is low (−7 and below on the simulated
    /// tickets' critiques) even for a value the teacher clearly prefers among the allowed ones.
    #[default]
    Vocabulary,
    /// The log-probability of each of the teacher's decoding choices renormalised over the
    /// tokens the grammar allowed at that step ([`hindsight_model::grammar::choice_logprob`]): the
    /// probability of the decision among the values it could have taken (a token the grammar
    /// forces counts 0). Read from the decoding itself, so only for
    /// [`DistillTarget::Teacher`]; log(1/2) then means "this value against all the others".
    Decision,
}

fn default_teacher_answer_max_tokens() -> usize {
    256
}

fn default_edit_margin_nats() -> f64 {
    0.5
}

fn default_teacher_cache_examples() -> usize {
    64
}

fn default_base_cache_examples() -> usize {
    64
}

fn default_prefix_grad() -> bool {
    true
}

fn default_lora() -> LoraConfig {
    LoraConfig::default()
}
fn default_optimizer() -> AdamWConfig {
    AdamWConfig::default()
}
fn default_top_k() -> usize {
    64
}
/// A frozen teacher (the base model shown the feedback): an EMA teacher drifted with the
/// student and lost the gain over longer runs (docs/experiments/).
fn default_ema_rate() -> f64 {
    0.0
}
fn default_gap_clip() -> f64 {
    2.0
}
fn default_ratio_clip() -> f64 {
    0.2
}
fn default_baseline_rate() -> f64 {
    0.1
}
/// 2 nats per logged position: 0.5 held the adapter too close to the base to learn the rules
/// within 64 events (docs/experiments/).
fn default_kl_budget() -> f64 {
    2.0
}
fn default_target_ce_weight() -> f64 {
    1.0
}
fn default_kl_penalty() -> f64 {
    1.0
}
fn default_max_grad_norm() -> f64 {
    1.0
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            lora: default_lora(),
            optimizer: default_optimizer(),
            objectives: ObjectiveWeights::default(),
            divergence: Divergence::default(),
            top_k: default_top_k(),
            teacher_ema_rate: default_ema_rate(),
            gap_clip: default_gap_clip(),
            ratio_clip: default_ratio_clip(),
            baseline_rate: default_baseline_rate(),
            kto: KtoConfig::default(),
            kl_budget: default_kl_budget(),
            kl_penalty: default_kl_penalty(),
            max_grad_norm: default_max_grad_norm(),
            seed: 0,
            prefix_grad: default_prefix_grad(),
            distill_target: DistillTarget::default(),
            teacher_answer_max_tokens: default_teacher_answer_max_tokens(),
            edit_margin_nats: default_edit_margin_nats(),
            target_ce_weight: default_target_ce_weight(),
            edit_baseline: EditBaseline::default(),
            teacher_contrast: 0.0,
            min_target_logprob: None,
            min_field_logprob: None,
            confidence: Confidence::default(),
            teacher_cache_examples: default_teacher_cache_examples(),
            base_cache_examples: default_base_cache_examples(),
        }
    }
}

impl TrainerConfig {
    /// Checks ranges once at start-up.
    pub fn check(&self) -> Result<()> {
        self.optimizer.check()?;
        let w = self.objectives;
        let weights = [w.sft, w.kto, w.distill, w.dense];
        if weights.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(bad("objectives weights must be finite and >= 0"));
        }
        if weights.iter().all(|x| *x == 0.0) {
            return Err(bad("at least one objective weight must be > 0"));
        }
        if self.top_k == 0 {
            return Err(bad("top_k must be >= 1"));
        }
        if !(0.0..=1.0).contains(&self.teacher_ema_rate) {
            return Err(bad("teacher_ema_rate must be in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.baseline_rate) {
            return Err(bad("baseline_rate must be in [0, 1]"));
        }
        if !(self.ratio_clip > 0.0 && self.gap_clip > 0.0 && self.max_grad_norm > 0.0) {
            return Err(bad("ratio_clip, gap_clip and max_grad_norm must be > 0"));
        }
        if self.kl_budget < 0.0 || self.kl_penalty < 0.0 {
            return Err(bad("kl_budget and kl_penalty must be >= 0"));
        }
        if self.teacher_answer_max_tokens == 0 {
            return Err(bad("teacher_answer_max_tokens must be >= 1"));
        }
        if !(self.edit_margin_nats.is_finite() && self.edit_margin_nats >= 0.0) {
            return Err(bad("edit_margin_nats must be a finite number >= 0"));
        }
        if !(self.target_ce_weight.is_finite() && self.target_ce_weight >= 0.0) {
            return Err(bad("target_ce_weight must be a finite number >= 0"));
        }
        if !(self.teacher_contrast.is_finite() && self.teacher_contrast >= 0.0) {
            return Err(bad("teacher_contrast must be a finite number >= 0"));
        }
        for (name, floor) in [
            ("min_target_logprob", self.min_target_logprob),
            ("min_field_logprob", self.min_field_logprob),
        ] {
            if floor.is_some_and(|x| !(x.is_finite() && x <= 0.0)) {
                return Err(bad(&format!(
                    "{name} must be a finite number <= 0 (a log-probability)"
                )));
            }
        }
        if self.confidence == Confidence::Decision && self.distill_target != DistillTarget::Teacher
        {
            return Err(bad(
                "confidence = \"decision\" needs distill_target = \"teacher\" (only the \
                 teacher's own decoded answer has decisions to read)",
            ));
        }
        Ok(())
    }
}

fn bad(msg: &str) -> LearnerError {
    LearnerError::InvalidArgument(format!("trainer config: {msg}"))
}
