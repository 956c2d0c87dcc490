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

/// What an upstream's logged log-probs describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BehaviourLogprobs {
    /// The distribution the token was drawn from: the logits divided by the request's
    /// temperature, renormalised over the tokens its grammar allowed (and its nucleus), as
    /// `hindsight serve` reports them. The policy's log-probs go through the same transform.
    #[default]
    Sampled,
    /// The model's full-vocabulary distribution at temperature 1 whatever the request's
    /// sampling (vLLM's default `logprobs_mode = "raw_logprobs"`).
    Raw,
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
    /// Teacher tokens kept per position (plus a tail bucket). Measured on 24 critiqued events
    /// at step 1 (docs/experiments/2026-12-06-top-k-and-clips.md): the top 64 hold 88% of the
    /// teacher's mass; the loss reads 12% below the full-vocabulary KL, but its gradient in the
    /// student's logits has cosine 0.9994 with the exact one (k = 16: 0.995, 256: 0.9999).
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    /// EMA rate of the teacher towards the policy after each step (0 = frozen at the start).
    #[serde(default = "default_ema_rate")]
    pub teacher_ema_rate: f64,
    /// Clip of the per-token teacher/student gap in the dense advantage. Measured: binds on 6%
    /// of logged tokens at step 1 and on 26% after 8 default steps, as the policy leaves the
    /// frozen teacher (docs/experiments/2026-12-06-top-k-and-clips.md).
    #[serde(default = "default_gap_clip")]
    pub gap_clip: f64,
    /// ε of the importance-ratio clip of the dense term. With `behaviour_logprobs = "raw"`
    /// against the serve's logs, 75% of logged tokens fell outside [1 − ε, 1 + ε] at step 1,
    /// before the policy moved (docs/experiments/2026-12-06-top-k-and-clips.md); compared
    /// like with like (`"sampled"`) none do.
    #[serde(default = "default_ratio_clip")]
    pub ratio_clip: f64,
    /// What the logged behaviour log-probs describe, so the dense term's importance ratio
    /// compares the policy with the distribution the answer was really drawn from.
    #[serde(default)]
    pub behaviour_logprobs: BehaviourLogprobs,
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
    /// keys and values. It saves the prompt's graph (0.75 GB and 25% of the step's time on a
    /// 500-token prompt with the default model); learner/README.md has the measured figures.
    #[serde(default = "default_prefix_grad")]
    pub prefix_grad: bool,
    /// Which answer self-distillation compares teacher and student on.
    #[serde(default)]
    pub distill_target: DistillTarget,
    /// Longest answer the teacher may decode (an answer that does not end within it falls
    /// back to the logged answer).
    #[serde(default = "default_teacher_answer_max_tokens")]
    pub teacher_answer_max_tokens: usize,
    /// Weight of a cross-entropy term on the distillation target's tokens when the target is
    /// not the logged answer (the teacher's answer): sequence-level distillation with hard
    /// targets, next to the per-token divergence. 0 = off.
    #[serde(default = "default_target_ce_weight")]
    pub target_ce_weight: f64,
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
    /// Knobs that lost every comparison they were measured in, kept for a measurement that
    /// still needs them (`[learner.trainer.experimental]`). Not recommended.
    #[serde(default)]
    pub experimental: ExperimentalTrainer,
}

/// `[learner.trainer.experimental]`: not recommended — every knob here lost every comparison
/// it was measured in (docs/experiments/2026-12-01-teacher-answer-and-edit.md,
/// 2026-12-02-edit-control-and-confident-edits.md); kept for `bench/examples/edit_probe.rs`,
/// which scores the edit targets these build. The defaults turn them all off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentalTrainer {
    /// Distil on the teacher's edit of the logged answer ([`DistillTarget::Edit`]) instead of
    /// `distill_target`. Measured: 0–20% held-out at 64 events in every run, never above the
    /// constant answer's 20%; with corrections 0 → 15% where the teacher's own answer reached
    /// 25–55%.
    #[serde(default)]
    pub edit_target: bool,
    /// With `edit_target`: how far (nats, summed over the value's tokens) the feedback must
    /// lower the log-probability of a logged field's value — teacher (shown the feedback)
    /// minus the reference (`edit_baseline`) — for the teacher's own value to replace it.
    /// Measured (edit_probe, 24 tickets): 0–1 nats gave targets 64–72% right per field, 2 nats
    /// 51–54%; no margin lifted a learning run above the constant answer.
    #[serde(default = "default_edit_margin_nats")]
    pub edit_margin_nats: f64,
    /// With `edit_target`: what the teacher's log-probability of a logged value is compared
    /// with to decide whether the feedback speaks against it. Measured: the control critique
    /// separated no better than the student and its learning run ended lower (15% vs 20%).
    #[serde(default)]
    pub edit_baseline: EditBaseline,
    /// Context-aware decoding of the teacher's own answer (and of the edit's values): at each
    /// step the logits `(1 + α)·teacher − α·control`, where `control` is the teacher shown the
    /// content-free critique (`examples.control_feedback`) instead of the feedback (Shi et al.
    /// 2023, "Trusting Your Evidence"). 0 = plain greedy; examples without a control context
    /// decode plainly. Measured: α = 1 made a few more of the probe's 24 edit targets right,
    /// but its learning runs ended lower: 15% (edit) and 0 → 20% against 25–55% without it
    /// (teacher's answer, corrections).
    #[serde(default)]
    pub teacher_contrast: f64,
}

impl Default for ExperimentalTrainer {
    fn default() -> Self {
        Self {
            edit_target: false,
            edit_margin_nats: default_edit_margin_nats(),
            edit_baseline: EditBaseline::default(),
            teacher_contrast: 0.0,
        }
    }
}

/// [`DistillTarget::Edit`]: the reference a logged value's log-probability under the teacher
/// (shown the feedback) is compared with ([`ExperimentalTrainer::edit_baseline`]).
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
    /// Measured: ended at the constant answer's 20%, as the teacher's answer then did
    /// (docs/experiments/2026-12-01-teacher-answer-and-edit.md).
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
    /// log-probability of its logged value by more than `experimental.edit_margin_nats` (teacher shown the
    /// feedback minus student, summed over the value's tokens); its new value is the one in
    /// the teacher's own greedy answer (decoded as with `teacher`). Fields the feedback does
    /// not speak against keep the logged value, so the teacher's prior does not replace them.
    /// The edited answer is laid out as the logged one and encoded by the model's tokenizer
    /// ([`TeacherDecoding::tokenizer`]; without one the teacher spells it). Answers that are not
    /// JSON objects, or that no field of is changed, are distilled on as logged. The refined
    /// answer of learning from language feedback (Scheurer et al. 2023), made by the model's
    /// own hindsight teacher. Experimental: set with `experimental.edit_target`, not read as
    /// a `distill_target` value ([`ExperimentalTrainer::edit_target`]).
    #[serde(skip)]
    Edit,
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
            behaviour_logprobs: BehaviourLogprobs::default(),
            baseline_rate: default_baseline_rate(),
            kto: KtoConfig::default(),
            kl_budget: default_kl_budget(),
            kl_penalty: default_kl_penalty(),
            max_grad_norm: default_max_grad_norm(),
            seed: 0,
            prefix_grad: default_prefix_grad(),
            distill_target: DistillTarget::default(),
            teacher_answer_max_tokens: default_teacher_answer_max_tokens(),
            target_ce_weight: default_target_ce_weight(),
            teacher_cache_examples: default_teacher_cache_examples(),
            base_cache_examples: default_base_cache_examples(),
            experimental: ExperimentalTrainer::default(),
        }
    }
}

impl TrainerConfig {
    /// The answer distillation reads: `distill_target`, or [`DistillTarget::Edit`] with
    /// `experimental.edit_target`.
    pub fn target(&self) -> DistillTarget {
        if self.experimental.edit_target {
            DistillTarget::Edit
        } else {
            self.distill_target
        }
    }

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
        if !(self.target_ce_weight.is_finite() && self.target_ce_weight >= 0.0) {
            return Err(bad("target_ce_weight must be a finite number >= 0"));
        }
        let x = &self.experimental;
        if !(x.edit_margin_nats.is_finite() && x.edit_margin_nats >= 0.0) {
            return Err(bad(
                "experimental.edit_margin_nats must be a finite number >= 0",
            ));
        }
        if !(x.teacher_contrast.is_finite() && x.teacher_contrast >= 0.0) {
            return Err(bad(
                "experimental.teacher_contrast must be a finite number >= 0",
            ));
        }
        Ok(())
    }
}

fn bad(msg: &str) -> LearnerError {
    LearnerError::InvalidArgument(format!("trainer config: {msg}"))
}
