//! The trainer: one optimizer step of the LoRA policy on a micro-batch of examples, mixing the
//! objectives of [`crate::objectives`] by configured weights, with the guards (KL-to-base
//! budget, gradient clipping, refusal of non-finite losses and weights), the slowly moving
//! teacher (EMA of the policy) and the per-route reward baselines.
//!
//! Per example the step runs: the student (policy, tracked) on context + logged answer; the
//! base model (no adapter) on the same tokens when the KL guard or KTO needs it; the teacher
//! (EMA adapter) on the hindsight context + the same answer when there is text feedback and
//! distillation or dense rewards are on; and the policy on context + correction for SFT.
//! The student's passes over one example's answers (the logged one, the teacher's target, the
//! correction) start from one run of its prompt (`Trainer::policy_prompt`); what depends only on
//! the base model, or on a frozen teacher, is kept for replays of the example.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use tracing::{debug, info_span, warn};

use crate::error::{LearnerError, Result};
use crate::example::TrainExample;
use crate::objectives::{
    dense_advantages, distill_loss, kl_exact, kto_loss, mean, pg_loss, token_logprobs,
    weighted_mean, Divergence, KtoConfig,
};
use crate::optim::{AdamW, AdamWConfig};
use hindsight_model::encode;
use hindsight_model::grammar::{
    allowed_by_grammar, best_allowed, choice_logprob, object_value_spans, response_format_grammar,
    JsonState, OJson,
};
use hindsight_model::ops;
use hindsight_model::{Adapter, AdapterSelection, LoraConfig, LoraInit};
use hindsight_model::{BatchLayout, KvCache, Model};

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
    /// Self-distillation plus dense rewards, the configuration the design recommends.
    fn default() -> Self {
        Self {
            sft: 0.0,
            kto: 0.0,
            distill: 1.0,
            dense: 1.0,
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
    /// O(answer × prompt); see the README's learner section for the measured figures.
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
    #[serde(default)]
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
    #[default]
    Logged,
    /// The teacher's own answer: the teacher (EMA policy shown the feedback) decodes greedily
    /// after its hindsight prompt, under the logged request's `response_format` grammar when
    /// there was one (so in the serve's layout), and the student is distilled on that sequence
    /// (sequence-level knowledge distillation, Kim & Rush 2016, with a hindsight teacher). When
    /// the teacher's answer equals the logged one this is the same as `logged`.
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
    LoraConfig {
        rank: 8,
        alpha: 16.0,
        ..LoraConfig::default()
    }
}
fn default_optimizer() -> AdamWConfig {
    AdamWConfig {
        lr: 5e-4,
        ..AdamWConfig::default()
    }
}
fn default_top_k() -> usize {
    64
}
fn default_ema_rate() -> f64 {
    0.05
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
fn default_kl_budget() -> f64 {
    0.5
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
            target_ce_weight: 0.0,
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

/// What one step did (also the JSONL run-log line and the metrics).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StepReport {
    /// Optimizer steps taken so far (after this one).
    pub step: u64,
    /// Examples in the micro-batch.
    pub examples: usize,
    /// Tokens processed (all forward passes).
    pub tokens: usize,
    /// Total loss.
    pub loss: f64,
    /// Mean loss per objective over the examples it applied to (`sft`, `kto`, `distill`,
    /// `dense`, `kl_penalty`).
    pub terms: BTreeMap<String, f64>,
    /// Examples each objective applied to.
    pub applied: BTreeMap<String, usize>,
    /// Mean KL(policy ‖ base) per logged token.
    pub kl_to_base: f64,
    /// Mean teacher − student log-prob of the logged tokens (where a teacher ran).
    pub teacher_student_gap: Option<f64>,
    /// Mean and standard deviation of the dense advantages.
    pub advantage_mean: Option<f64>,
    /// Standard deviation of the dense advantages.
    pub advantage_std: Option<f64>,
    /// Share of tokens whose importance ratio was clipped.
    pub clip_fraction: Option<f64>,
    /// With [`DistillTarget::Teacher`] or [`DistillTarget::Edit`]: examples whose teacher
    /// answer was decoded, and of those the ones where the target differs from the logged
    /// answer (the teacher changed its mind in hindsight) and the ones that did not finish
    /// within the token limit (distilled on the logged answer instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_answers: Option<TeacherAnswerCounts>,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Why the step was skipped (non-finite loss, gradient or weights), if it was.
    pub skipped: Option<String>,
    /// Wall time of the step, ms.
    pub duration_ms: u64,
    /// Examples of the batch that no objective learned from: none applied, or the only one
    /// was distillation on a target below the confidence floor (the KL guard alone does
    /// not count). The online loop keeps them out of its replay buffer, where they would only
    /// cost passes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unlearned: Vec<uuid::Uuid>,
}

/// What the hindsight teacher's decoded answers were, per step ([`DistillTarget::Teacher`],
/// [`DistillTarget::Edit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TeacherAnswerCounts {
    /// Answers decoded (with `edit`: only for answers with a field the feedback speaks
    /// against).
    pub decoded: usize,
    /// Targets that differ from the logged answer.
    pub changed: usize,
    /// Answers cut at `teacher_answer_max_tokens` or with an invalid `response_format`
    /// (distilled on the logged answer instead).
    pub fallback: usize,
    /// With `edit`: fields whose value was replaced by the teacher's.
    #[serde(default)]
    pub edited_fields: usize,
    /// With `min_target_logprob`: examples not distilled on because the teacher's confidence
    /// in their target (its own answer or the edit) was below it.
    #[serde(default)]
    pub unconfident: usize,
    /// With `min_field_logprob`: target fields whose value's tokens were masked out (the
    /// teacher's confidence in the value below the floor).
    #[serde(default)]
    pub masked_fields: usize,
    /// Targets taken from the teacher cache (no decoding; the other counts include them as
    /// when they were made). See [`TrainerConfig::teacher_cache_examples`].
    #[serde(default)]
    pub cached: usize,
}

impl std::ops::AddAssign for TeacherAnswerCounts {
    fn add_assign(&mut self, o: Self) {
        self.decoded += o.decoded;
        self.changed += o.changed;
        self.fallback += o.fallback;
        self.edited_fields += o.edited_fields;
        self.unconfident += o.unconfident;
        self.masked_fields += o.masked_fields;
        self.cached += o.cached;
    }
}

/// Tokens the teacher needs to decode its own answer: the text of every token (for the
/// grammar) and the end-of-turn token that closes an answer.
#[derive(Debug, Clone)]
pub struct TeacherDecoding {
    /// Decoded text per token id, `None` for tokens a guided document cannot contain (see
    /// [`hindsight_model::grammar::grammar_vocab`]).
    pub vocab: Arc<Vec<Option<String>>>,
    /// The end-of-turn token appended after a finished answer (and the stop token of an
    /// unconstrained one).
    pub end_of_turn: u32,
    /// The model's tokenizer: a [`DistillTarget::Edit`] target is encoded by it, as any text
    /// is (the tokens the model reads and writes such text in), and scored in one teacher
    /// pass. Without it the teacher spells the edit itself (its most likely token among those
    /// that continue the text), which, where the teacher disagrees with the text, wanders
    /// into tokenizations nobody writes (`"ret"` + `"urns"` for `"returns"` when it expects
    /// `"retention"`): improbable tokens to train on.
    pub tokenizer: Option<Arc<Tokenizer>>,
}

/// A teacher's decoded answer and its logits at the positions that predict it.
#[derive(Clone)]
struct TeacherAnswer {
    ids: Vec<u32>,
    logits: Tensor,
    /// For a decoded answer: per token, its log-probability among the tokens the decoding
    /// allowed at that step ([`choice_logprob`]); `None` for a target the teacher was given.
    choices: Option<Vec<f64>>,
}

impl TeacherAnswer {
    /// The log-probability of each of the answer's tokens under its logits.
    fn logprobs(&self) -> Result<Vec<f64>> {
        let ids = Tensor::from_slice(&self.ids, self.ids.len(), self.logits.device())?;
        let lps: Vec<f32> = token_logprobs(&self.logits.to_dtype(DType::F32)?, &ids)?.to_vec1()?;
        Ok(lps.into_iter().map(f64::from).collect())
    }
}

/// Per top-level field of the JSON-object answer `ids` (empty for any other answer): the sum
/// of `lps` (one per token) over the field value's tokens. Their sum is the joint
/// log-probability [`TrainerConfig::min_target_logprob`] is compared with.
fn value_confidence(dec: &TeacherDecoding, ids: &[u32], lps: &[f64]) -> Vec<(String, f64)> {
    answer_fields(dec, ids)
        .1
        .map_or_else(Vec::new, |fields| field_sums(&fields, lps))
}

/// What [`DistillTarget::Edit`] made of one logged answer ([`Trainer::edit_preview`]).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EditPreview {
    /// The logged answer's text.
    pub logged: String,
    /// Per top-level field of a JSON-object answer (empty otherwise): the teacher's
    /// log-probability of the logged value minus the reference's
    /// ([`TrainerConfig::edit_baseline`]), summed over the value's tokens (nats).
    pub shifts: Vec<(String, f64)>,
    /// The fields whose shift is below `-edit_margin_nats`.
    pub flagged: Vec<String>,
    /// The teacher's own answer, when one was decoded (only for answers with a flagged field).
    pub teacher: Option<String>,
    /// The edited answer trained on, when it differs from the logged one.
    pub edited: Option<String>,
    /// Per top-level field of the target (the edited answer, else the logged one): the
    /// teacher's log-probability of its value given the feedback, summed over the value's
    /// tokens (nats). Their sum is [`EditPreview::target_logprob`].
    #[serde(default)]
    pub confidence: Vec<(String, f64)>,
}

impl EditPreview {
    /// The teacher's joint log-probability of the target's field values (0 for an answer
    /// that is not a JSON object): what `min_target_logprob` is compared with.
    pub fn target_logprob(&self) -> f64 {
        self.confidence.iter().map(|(_, lp)| lp).sum()
    }
}

/// The text of `ids` and each token's byte range in it (the end-of-turn token is empty).
fn answer_text(dec: &TeacherDecoding, ids: &[u32]) -> (String, Vec<std::ops::Range<usize>>) {
    let mut text = String::new();
    let mut spans = Vec::with_capacity(ids.len());
    for &id in ids {
        let start = text.len();
        if id != dec.end_of_turn {
            text.push_str(
                dec.vocab
                    .get(id as usize)
                    .and_then(|t| t.as_deref())
                    .unwrap_or(""),
            );
        }
        spans.push(start..text.len());
    }
    (text, spans)
}

/// One top-level field of a JSON-object answer.
struct AnswerField {
    key: String,
    /// The value's byte range in the answer's text.
    value: std::ops::Range<usize>,
    /// The answer's tokens (indices) that overlap the value.
    tokens: Vec<usize>,
}

/// The text of `ids` and its top-level fields, each with its value's tokens; `None` for an
/// answer that is not a JSON object. The one place a field's value is mapped to tokens: the
/// edit's shifts, the per-field confidence and the field mask all sum or mask over these.
fn answer_fields(dec: &TeacherDecoding, ids: &[u32]) -> (String, Option<Vec<AnswerField>>) {
    let (text, spans) = answer_text(dec, ids);
    let fields = object_value_spans(&text).map(|fields| {
        fields
            .into_iter()
            .map(|(key, value)| {
                let tokens = spans
                    .iter()
                    .enumerate()
                    .filter(|(_, tok)| tok.start < value.end && tok.end > value.start)
                    .map(|(i, _)| i)
                    .collect();
                AnswerField { key, value, tokens }
            })
            .collect()
    });
    (text, fields)
}

/// Per field: the sum of `values` (one per token of the answer) over its value's tokens.
fn field_sums(fields: &[AnswerField], values: &[f64]) -> Vec<(String, f64)> {
    fields
        .iter()
        .map(|f| {
            let sum = f.tokens.iter().filter_map(|&i| values.get(i)).sum();
            (f.key.clone(), sum)
        })
        .collect()
}

/// Per token of the JSON-object answer `ids`: 0 for the tokens of a field value whose
/// confidence (`per_field`, as [`value_confidence`] makes it) is below `floor`, else 1; and how
/// many fields that masked. `None` for an answer that is not a JSON object.
fn field_mask(
    dec: &TeacherDecoding,
    ids: &[u32],
    per_field: &[(String, f64)],
    floor: f64,
) -> Option<(Vec<f32>, usize)> {
    let fields = answer_fields(dec, ids).1?;
    let mut weights = vec![1.0; ids.len()];
    let mut masked = 0;
    for f in &fields {
        if per_field.iter().any(|(k, lp)| *k == f.key && *lp < floor) {
            masked += 1;
            for &i in &f.tokens {
                weights[i] = 0.0;
            }
        }
    }
    Some((weights, masked))
}

/// An edit and the teacher's spelling of it (the distillation target).
#[derive(Clone)]
struct EditOutcome {
    preview: EditPreview,
    target: Option<TeacherAnswer>,
}

/// Counters and running statistics that belong in a checkpoint.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps applied.
    pub steps: u64,
    /// Steps refused by a guard.
    pub skipped_steps: u64,
    /// Examples trained on.
    pub examples: u64,
    /// Tokens processed.
    pub tokens: u64,
    /// Running reward baseline per route.
    pub baselines: BTreeMap<String, f64>,
    /// KTO's reference point (running KL estimate).
    pub kto_z: f64,
}

/// The policy adapter, its teacher and optimizer, over a frozen base model.
pub struct Trainer {
    model: Arc<Model>,
    cfg: TrainerConfig,
    policy: Adapter,
    teacher: Adapter,
    opt: AdamW,
    state: TrainerState,
    decoding: Option<TeacherDecoding>,
    /// The frozen teacher's work per example, for replay ([`TrainerConfig::teacher_cache_examples`]).
    cache: ReplayCache<TeacherWork>,
    /// The base model's pass per example, for replay ([`TrainerConfig::base_cache_examples`]).
    base_cache: ReplayCache<AnswerPass>,
}

/// The teacher's work on one example that depends on the teacher alone: with a frozen teacher
/// it is the same every time the example is trained.
#[derive(Clone)]
struct TeacherWork {
    /// The teacher's pass over the logged answer ([`DistillTarget::Edit`]).
    pass: Option<AnswerPass>,
    /// The target: the teacher's own answer or the edit (`None`: the logged answer).
    target: Option<TeacherAnswer>,
    /// The teacher's confidence in the target: the joint log-probability of its field values
    /// (of its own answer, or of the edit: [`EditPreview::target_logprob`]); `None` when the
    /// teacher's answer did not finish.
    confidence: Option<f64>,
    /// With `min_field_logprob`: per token of the answer distilled on (the target, else the
    /// logged answer), 0 where it belongs to a doubtful field's value, else 1.
    weights: Option<Vec<f32>>,
    /// The counts the work added when it was made.
    counts: TeacherAnswerCounts,
    /// The tokens its passes cost when it was made.
    tokens: usize,
}

/// The teacher's keys and values for the prompts of one example's teacher work (the hindsight
/// prompt, the control prompt). Each prompt but its last token runs through the teacher once
/// ([`Trainer::prompt_cache`]); every pass after it — over the logged answer, the decoding, the
/// edit's scoring pass — starts from a copy, so a prompt of hundreds of tokens is not run three
/// times for one example. Counts the tokens its passes ran. Made per example (it is valid for
/// one teacher).
#[derive(Default)]
struct TeacherPrompts {
    caches: Vec<(Vec<u32>, KvCache)>,
    tokens: usize,
}

/// Bounded first-in-first-out store of work on one example that a replay of it can reuse
/// ([`TeacherWork`] of a frozen teacher, the base model's passes), by record id. An entry is
/// used only for the same tokens it was made for.
struct ReplayCache<V> {
    entries: std::collections::HashMap<uuid::Uuid, (Vec<u32>, V)>,
    order: std::collections::VecDeque<uuid::Uuid>,
}

impl<V> Default for ReplayCache<V> {
    fn default() -> Self {
        Self {
            entries: Default::default(),
            order: Default::default(),
        }
    }
}

impl<V> ReplayCache<V> {
    fn get(&self, id: uuid::Uuid, tokens: &[u32]) -> Option<&V> {
        self.entries
            .get(&id)
            .filter(|(made_for, _)| made_for == tokens)
            .map(|(_, v)| v)
    }

    fn put(&mut self, id: uuid::Uuid, tokens: &[u32], v: V, cap: usize) {
        if cap == 0 {
            return;
        }
        if self.entries.insert(id, (tokens.to_vec(), v)).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > cap {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("cfg", &self.cfg)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

/// One forward's quantities at the answer positions.
#[derive(Clone)]
struct AnswerPass {
    /// `[n, V]` logits (tracked for the student).
    logits: Tensor,
    /// `[n]` log-probs of the logged tokens.
    logprobs: Tensor,
}

impl Trainer {
    /// A new trainer with a fresh adapter (B = 0: starts as the base model) named `name`.
    pub fn new(model: Arc<Model>, cfg: TrainerConfig, name: &str) -> Result<Self> {
        cfg.check()?;
        let policy = Adapter::new(
            name,
            cfg.lora.clone(),
            model.config(),
            LoraInit::Peft,
            cfg.seed,
            model.device(),
        )?;
        Self::with_policy(model, cfg, policy)
    }

    /// A trainer continuing from an existing adapter (the teacher starts as a copy).
    pub fn with_policy(model: Arc<Model>, cfg: TrainerConfig, policy: Adapter) -> Result<Self> {
        cfg.check()?;
        let teacher = policy.snapshot(format!("{}-teacher", policy.name()), model.config())?;
        let opt = AdamW::new(cfg.optimizer)?;
        Ok(Self {
            model,
            cfg,
            policy,
            teacher,
            opt,
            state: TrainerState::default(),
            decoding: None,
            cache: ReplayCache::default(),
            base_cache: ReplayCache::default(),
        })
    }

    /// What the teacher needs to decode its own answers ([`DistillTarget::Teacher`]; the
    /// online loop sets it from the tokenizer).
    pub fn set_decoding(&mut self, decoding: TeacherDecoding) {
        self.decoding = Some(decoding);
        self.cache.clear();
    }

    /// Whether `ex`'s teacher work can come from (and goes into) the cache: the teacher is
    /// frozen and the work does not read the student ([`TrainerConfig::teacher_cache_examples`]).
    fn caches_teacher_work(&self, ex: &TrainExample) -> bool {
        self.cfg.teacher_cache_examples > 0
            && self.cfg.teacher_ema_rate == 0.0
            && match self.cfg.distill_target {
                DistillTarget::Teacher => true,
                DistillTarget::Edit => {
                    self.cfg.edit_baseline == EditBaseline::Control
                        && ex.control_context_ids.is_some()
                }
                DistillTarget::Logged => false,
            }
    }

    /// The policy being trained.
    pub fn policy(&self) -> &Adapter {
        &self.policy
    }
    /// The teacher (EMA of the policy).
    pub fn teacher(&self) -> &Adapter {
        &self.teacher
    }
    /// The base model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }
    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }
    /// Counters and running statistics.
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// Final hidden states `[n, hidden]` of the positions that predict `answer` after
    /// `prefix` (the prefix's last position and the answer's first n - 1). `tracked` = training
    /// forward of the policy; with [`TrainerConfig::prefix_grad`] off, a tracked pass keeps its
    /// graph over these n positions only (the prompt goes through a KV cache without one).
    fn answer_hidden(
        &self,
        prefix: &[u32],
        answer: &[u32],
        adapters: &AdapterSelection,
        tracked: bool,
    ) -> Result<Tensor> {
        let dev = self.model.device();
        let (p, n) = (prefix.len(), answer.len());
        if p == 0 || n == 0 {
            return Err(LearnerError::InvalidArgument(
                "empty prefix or answer".into(),
            ));
        }
        if tracked && !self.cfg.prefix_grad && p > 1 {
            let cache = self.prefill(&prefix[..p - 1], adapters, false)?;
            return self.hidden_from(cache, prefix, answer, adapters, true);
        }
        let ids: Vec<u32> = prefix.iter().chain(answer).copied().collect();
        let len = ids.len();
        let input = Tensor::from_vec(ids, (1, len), dev)?;
        let hidden = self.model.hidden(
            &input,
            &BatchLayout::dense(1, len, 0),
            None,
            adapters,
            tracked,
        )?;
        // Position p predicts token p + 1: the answer's tokens are predicted from prefix.len() - 1.
        let rows = hidden.narrow(1, p - 1, n)?.squeeze(0)?;
        Ok(if tracked { rows } else { rows.detach() })
    }

    /// A KV cache of `ids` under `adapters` (`train`: its keys and values keep their graph, so
    /// passes after it back-propagate into the prompt); empty when `ids` is.
    fn prefill(&self, ids: &[u32], adapters: &AdapterSelection, train: bool) -> Result<KvCache> {
        let mut cache = KvCache::new();
        if !ids.is_empty() {
            let input = Tensor::from_slice(ids, (1, ids.len()), self.model.device())?;
            self.model.hidden(
                &input,
                &BatchLayout::dense(1, ids.len(), 0),
                Some(&mut cache),
                adapters,
                train,
            )?;
        }
        Ok(cache)
    }

    /// [`Trainer::answer_hidden`] from `cache`, which holds `prefix` but at least its last
    /// token: runs the rest of `prefix` and `answer`'s first n - 1 tokens (`train` keeps their
    /// graph) and returns the n positions that predict `answer`. `answer` is not empty.
    fn hidden_from(
        &self,
        mut cache: KvCache,
        prefix: &[u32],
        answer: &[u32],
        adapters: &AdapterSelection,
        train: bool,
    ) -> Result<Tensor> {
        let (head, n) = (cache.len(), answer.len());
        let tail: Vec<u32> = prefix[head..]
            .iter()
            .chain(&answer[..n - 1])
            .copied()
            .collect();
        let input = Tensor::from_vec(tail, (1, n), self.model.device())?;
        let hidden = self.model.hidden(
            &input,
            &BatchLayout::dense(1, n, head),
            Some(&mut cache),
            adapters,
            train,
        )?;
        Ok(hidden.squeeze(0)?)
    }

    /// The logits of the positions `rows` that predict `answer`, and `answer`'s log-probs.
    fn pass_from_rows(&self, rows: &Tensor, answer: &[u32]) -> Result<AnswerPass> {
        let logits = self.model.logits(rows)?;
        let targets = Tensor::from_slice(answer, answer.len(), self.model.device())?;
        let logprobs = token_logprobs(&logits, &targets)?;
        Ok(AnswerPass { logits, logprobs })
    }

    /// Runs the model on `prefix ++ answer` and returns the answer positions' logits and the
    /// log-probs of `answer`. `tracked` = training forward of the policy.
    fn answer_pass(
        &self,
        prefix: &[u32],
        answer: &[u32],
        adapters: &AdapterSelection,
        tracked: bool,
    ) -> Result<AnswerPass> {
        let rows = self.answer_hidden(prefix, answer, adapters, tracked)?;
        self.pass_from_rows(&rows, answer)
    }

    /// A copy of the teacher's cache of `ctx` without its last token, from `prompts` or run
    /// now (and kept there).
    fn prompt_cache(&self, prompts: &mut TeacherPrompts, ctx: &[u32]) -> Result<KvCache> {
        let Some(head) = ctx.len().checked_sub(1) else {
            return Err(LearnerError::InvalidArgument("empty teacher prompt".into()));
        };
        if let Some((_, cache)) = prompts.caches.iter().find(|(c, _)| c == ctx) {
            return Ok(cache.clone());
        }
        let cache = self.prefill(&ctx[..head], &AdapterSelection::All(&self.teacher), false)?;
        prompts.tokens += head;
        prompts.caches.push((ctx.to_vec(), cache.clone()));
        Ok(cache)
    }

    /// The teacher's pass (no gradient) over `answer` after `ctx`, starting from the prompt's
    /// cache in `prompts`: the logits at the positions that predict `answer` and its log-probs.
    fn teacher_pass_after(
        &self,
        prompts: &mut TeacherPrompts,
        ctx: &[u32],
        answer: &[u32],
    ) -> Result<AnswerPass> {
        let n = answer.len();
        if n == 0 {
            return Err(LearnerError::InvalidArgument("empty answer".into()));
        }
        let cache = self.prompt_cache(prompts, ctx)?;
        let teacher = AdapterSelection::All(&self.teacher);
        let rows = self.hidden_from(cache, ctx, answer, &teacher, false)?;
        prompts.tokens += n;
        self.pass_from_rows(&rows, answer)
    }

    /// The policy's training pass (tracked) over `answer` after `prefix`.
    fn policy_pass(&self, prefix: &[u32], answer: &[u32]) -> Result<AnswerPass> {
        self.answer_pass(prefix, answer, &AdapterSelection::All(&self.policy), true)
    }

    /// The policy's prompt for its training passes over one example's answers (the logged
    /// one, the teacher's target, the correction): `prefix` but its last token, run once under
    /// the policy into a KV cache. With [`TrainerConfig::prefix_grad`] its keys and values keep
    /// their graph, so every pass after it back-propagates into the prompt through one shared
    /// graph, exactly as separate full passes would; otherwise the prompt has none (the
    /// detached prefix). A step with two answers runs a prompt of hundreds of tokens once, not
    /// twice.
    fn policy_prompt(&self, prefix: &[u32]) -> Result<KvCache> {
        let Some(head) = prefix.len().checked_sub(1) else {
            return Err(LearnerError::InvalidArgument("empty prompt".into()));
        };
        self.prefill(
            &prefix[..head],
            &AdapterSelection::All(&self.policy),
            self.cfg.prefix_grad,
        )
    }

    /// The policy's tracked final hidden states `[n, hidden]` at the positions that predict
    /// `answer` after `prefix`, from `prompt` ([`Trainer::policy_prompt`] of `prefix`).
    fn policy_rows_after(
        &self,
        prompt: &KvCache,
        prefix: &[u32],
        answer: &[u32],
    ) -> Result<Tensor> {
        if answer.is_empty() || prompt.len() >= prefix.len() {
            return Err(LearnerError::InvalidArgument(
                "empty answer, or a prompt cache that is not the prompt's".into(),
            ));
        }
        let policy = AdapterSelection::All(&self.policy);
        self.hidden_from(prompt.clone(), prefix, answer, &policy, true)
    }

    /// [`Trainer::policy_pass`] from the prompt's cache ([`Trainer::policy_prompt`]).
    fn policy_pass_after(
        &self,
        prompt: &KvCache,
        prefix: &[u32],
        answer: &[u32],
    ) -> Result<AnswerPass> {
        let rows = self.policy_rows_after(prompt, prefix, answer)?;
        self.pass_from_rows(&rows, answer)
    }

    /// The base model's pass (no adapter, no graph) over `answer` after `ex`'s prompt, from
    /// the replay cache when this example's was made before
    /// ([`TrainerConfig::base_cache_examples`]); adds the tokens it ran to `tokens`.
    fn base_pass(
        &mut self,
        ex: &TrainExample,
        answer: &[u32],
        tokens: &mut usize,
    ) -> Result<AnswerPass> {
        if let Some(pass) = self.base_cache.get(ex.record_id, answer) {
            return Ok(pass.clone());
        }
        *tokens += ex.context_ids.len() + answer.len();
        let pass = self.answer_pass(&ex.context_ids, answer, &AdapterSelection::None, false)?;
        let cap = self.cfg.base_cache_examples;
        self.base_cache.put(ex.record_id, answer, pass.clone(), cap);
        Ok(pass)
    }

    /// Per-token cross-entropy of `answer` after `prefix` under the policy (tracked), through
    /// the fused LM-head cross-entropy (no `[n, V]` logits kept); from `prompt`
    /// ([`Trainer::policy_prompt`] of `prefix`) when the step has one.
    fn sft_token_ce(
        &self,
        prompt: Option<&KvCache>,
        prefix: &[u32],
        answer: &[u32],
    ) -> Result<Tensor> {
        let rows = match prompt {
            Some(prompt) => self.policy_rows_after(prompt, prefix, answer)?,
            None => {
                self.answer_hidden(prefix, answer, &AdapterSelection::All(&self.policy), true)?
            }
        };
        let targets = Tensor::from_slice(answer, answer.len(), self.model.device())?;
        Ok(ops::cross_entropy_with_head(
            &rows,
            self.model.lm_head(),
            &targets,
        )?)
    }

    /// The decoding vocabulary, or an error naming what sets it.
    fn decoding(&self) -> Result<&TeacherDecoding> {
        self.decoding.as_ref().ok_or_else(|| {
            LearnerError::InvalidArgument(
                "distill_target = teacher | edit needs the tokenizer's vocabulary (Trainer::set_decoding)"
                    .into(),
            )
        })
    }

    /// Decodes after `tctx` with the teacher (KV cache): `next` picks each token from the
    /// teacher's logits (`None`: give up). With `control = (cctx, α)` the logits are
    /// `(1 + α)·teacher − α·control`, the control decoding the same tokens after `cctx` in a
    /// cache of its own. Ends at the end-of-turn token; `None` when `next` gives up or the
    /// answer does not end within `teacher_answer_max_tokens`. Returns the tokens and the
    /// logits (contrasted when `control` is given) at the positions that predict them. Each
    /// stream starts from its prompt's cache in `prompts`.
    fn teacher_decode(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        control: Option<(&[u32], f64)>,
        end_of_turn: u32,
        mut next: impl FnMut(&[f32]) -> Option<u32>,
    ) -> Result<Option<TeacherAnswer>> {
        let dev = self.model.device();
        let adapters = AdapterSelection::All(&self.teacher);
        // One decoding stream per prompt, the teacher's then the control's: its cache and the
        // prompt's token(s) not in it, the first input.
        let mut streams = Vec::with_capacity(2);
        for ctx in std::iter::once(tctx).chain(control.map(|(cctx, _)| cctx)) {
            let cache = self.prompt_cache(prompts, ctx)?;
            let rest = ctx[cache.len()..].to_vec();
            streams.push((cache, rest));
        }
        let mut last: Option<u32> = None;
        let (mut ids, mut rows) = (Vec::new(), Vec::new());
        for _ in 0..self.cfg.teacher_answer_max_tokens {
            let mut logits = Vec::with_capacity(streams.len());
            for (cache, rest) in &mut streams {
                let input: &[u32] = match &last {
                    None => rest,
                    Some(id) => std::slice::from_ref(id),
                };
                let layout = BatchLayout::dense(1, input.len(), cache.len());
                let input = Tensor::from_slice(input, (1, input.len()), dev)?;
                prompts.tokens += layout.seq();
                logits.push(
                    self.model
                        .forward_last(&input, &layout, Some(cache), &adapters)?,
                );
            }
            let logits = match (control, logits.as_slice()) {
                (Some((_, alpha)), [t, c]) => ((t * (1.0 + alpha))? - (c * alpha)?)?,
                _ => logits.swap_remove(0),
            };
            let row: Vec<f32> = logits.squeeze(0)?.to_vec1()?;
            rows.push(logits);
            let Some(id) = next(&row) else {
                return Ok(None);
            };
            ids.push(id);
            if id == end_of_turn {
                return Ok(Some(TeacherAnswer {
                    logits: Tensor::cat(&rows, 0)?,
                    ids,
                    choices: None,
                }));
            }
            last = Some(id);
        }
        Ok(None)
    }

    /// The teacher's own answer after `tctx`: greedy, under the grammar of `format` when given
    /// (then closed with the end-of-turn token), else until the end-of-turn token; contrasted
    /// with the teacher after `control` when `teacher_contrast > 0` and a control prompt is
    /// given. Returns the answer and the logits at the positions that predict it (the
    /// decoding's own forward passes), or `None` when it does not finish within the token
    /// limit.
    fn teacher_answer(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        control: Option<&[u32]>,
        format: Option<&OJson>,
    ) -> Result<Option<TeacherAnswer>> {
        let dec = self.decoding()?;
        let grammar = match format.map(response_format_grammar) {
            Some(Ok(g)) => g,
            Some(Err(e)) => {
                debug!(error = %e, "Unusable response_format; the teacher's answer falls back to the logged one.");
                return Ok(None);
            }
            None => None,
        };
        let alpha = self.cfg.teacher_contrast;
        let control = control.filter(|_| alpha > 0.0).map(|c| (c, alpha));
        let mut state = grammar.as_ref().map(JsonState::new);
        let mut choices = Vec::new();
        let answer =
            self.teacher_decode(
                prompts,
                tctx,
                control,
                dec.end_of_turn,
                |row| match &mut state {
                    Some(st) if st.finished() => {
                        choices.push(0.0);
                        Some(dec.end_of_turn)
                    }
                    Some(st) => {
                        let allowed = allowed_by_grammar(st, &dec.vocab);
                        let id = best_allowed(row, &allowed)?;
                        choices.push(choice_logprob(row, id, &allowed));
                        let text = dec.vocab.get(id as usize)?.as_deref()?;
                        st.feed_str(text).then_some(id)
                    }
                    None => {
                        let id = best_allowed(row, &|_| true).unwrap_or(dec.end_of_turn);
                        choices.push(choice_logprob(row, id, &|_| true));
                        Some(id)
                    }
                },
            )?;
        Ok(answer.map(|a| TeacherAnswer {
            choices: Some(choices),
            ..a
        }))
    }

    /// The greedy answer of the teacher (the EMA policy) after `context`, under the grammar of
    /// `format` when given, ending with the end-of-turn token; `None` when it does not finish
    /// within `teacher_answer_max_tokens`. Needs [`Trainer::set_decoding`]. For probes: what
    /// the model answers a prompt before any feedback.
    pub fn teacher_greedy(
        &self,
        context: &[u32],
        format: Option<&OJson>,
    ) -> Result<Option<Vec<u32>>> {
        let mut prompts = TeacherPrompts::default();
        Ok(self
            .teacher_answer(&mut prompts, context, None, format)?
            .map(|a| a.ids))
    }

    /// `text` as the teacher would write it after `tctx`: at each step the teacher's most
    /// likely token among those whose text continues `text`, then the end-of-turn token. The
    /// tokens and the teacher's logits that predict them; `None` if some character has no
    /// token or the text does not fit the token limit.
    fn teacher_spells(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        text: &str,
    ) -> Result<Option<TeacherAnswer>> {
        let dec = self.decoding()?;
        let mut rest = text;
        self.teacher_decode(prompts, tctx, None, dec.end_of_turn, |row| {
            if rest.is_empty() {
                return Some(dec.end_of_turn);
            }
            let piece = |id: u32| dec.vocab.get(id as usize).and_then(|t| t.as_deref());
            let id = best_allowed(row, &|id| {
                piece(id).is_some_and(|t| !t.is_empty() && rest.starts_with(t))
            })?;
            rest = &rest[piece(id)?.len()..];
            Some(id)
        })
    }

    /// An edit's text as a target: its tokens and the teacher's logits that predict them. With
    /// the tokenizer ([`TeacherDecoding::tokenizer`]) the text's own tokens, scored in one
    /// teacher pass; without it, as the teacher spells it ([`Trainer::teacher_spells`]).
    /// `None` when the answer does not fit `teacher_answer_max_tokens` or cannot be spelled.
    fn edit_tokens(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        text: &str,
    ) -> Result<Option<TeacherAnswer>> {
        let dec = self.decoding()?;
        let Some(tokenizer) = &dec.tokenizer else {
            return self.teacher_spells(prompts, tctx, text);
        };
        let mut ids = encode(tokenizer, text)?;
        ids.push(dec.end_of_turn);
        if ids.len() > self.cfg.teacher_answer_max_tokens {
            return Ok(None);
        }
        let pass = self.teacher_pass_after(prompts, tctx, &ids)?;
        Ok(Some(TeacherAnswer {
            logits: pass.logits,
            ids,
            choices: None,
        }))
    }

    /// Log-probs of `ex`'s logged answer tokens that the teacher's are compared with by
    /// [`DistillTarget::Edit`]: the teacher after the control prompt
    /// ([`EditBaseline::Control`], when `ex` has one; its pass starts from the control
    /// prompt's cache in `prompts`, which the contrasted decoding reuses) or the student's
    /// (from `student`, only called then).
    fn edit_reference(
        &self,
        prompts: &mut TeacherPrompts,
        ex: &TrainExample,
        student: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        match (self.cfg.edit_baseline, ex.control_context_ids.as_deref()) {
            (EditBaseline::Control, Some(cctx)) => Ok(self
                .teacher_pass_after(prompts, cctx, &ex.answer_ids)?
                .logprobs
                .to_vec1()?),
            _ => student(),
        }
    }

    /// [`DistillTarget::Edit`]: the logged answer with the fields the feedback speaks against
    /// given the teacher's values (see the variant), and the teacher's confidence in each of
    /// the target's values. `t_lp` are the teacher's log-probs of the logged tokens, `r_lp`
    /// the reference's ([`Trainer::edit_reference`]). The outcome's `target` is `None` when
    /// the logged answer is distilled on as it is.
    fn teacher_edit(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        ex: &TrainExample,
        t_lp: &[f32],
        r_lp: &[f32],
        counts: &mut TeacherAnswerCounts,
    ) -> Result<EditOutcome> {
        let mut out = self.edit_target(prompts, tctx, ex, t_lp, r_lp, counts)?;
        let dec = self.decoding()?;
        // The teacher's log-probs of the target's tokens: from the pass that spelled an edit,
        // or the pass over the logged answer.
        out.preview.confidence = match &out.target {
            Some(a) => value_confidence(dec, &a.ids, &a.logprobs()?),
            None => value_confidence(
                dec,
                &ex.answer_ids,
                &t_lp.iter().map(|x| f64::from(*x)).collect::<Vec<_>>(),
            ),
        };
        Ok(out)
    }

    /// The target of [`Trainer::teacher_edit`], without the confidence.
    fn edit_target(
        &self,
        prompts: &mut TeacherPrompts,
        tctx: &[u32],
        ex: &TrainExample,
        t_lp: &[f32],
        r_lp: &[f32],
        counts: &mut TeacherAnswerCounts,
    ) -> Result<EditOutcome> {
        let dec = self.decoding()?;
        // The logged answer's text and its fields.
        let (logged, fields) = answer_fields(dec, &ex.answer_ids);
        let mut out = EditOutcome {
            preview: EditPreview {
                logged: logged.clone(),
                ..EditPreview::default()
            },
            target: None,
        };
        let Some(fields) = fields else {
            return Ok(out);
        };
        let gaps: Vec<f64> = t_lp
            .iter()
            .zip(r_lp)
            .map(|(t, r)| f64::from(*t) - f64::from(*r))
            .collect();
        out.preview.shifts = field_sums(&fields, &gaps);
        debug!(
            record = %ex.record_id,
            logged = %logged,
            shifts = ?out.preview.shifts,
            feedback = ex.feedback_text.as_deref().unwrap_or(""),
            "How the feedback shifts each logged field (teacher minus reference, nats)."
        );
        let against: Vec<&AnswerField> = fields
            .iter()
            .zip(&out.preview.shifts)
            .filter(|(_, (_, shift))| *shift < -self.cfg.edit_margin_nats)
            .map(|(field, _)| field)
            .collect();
        out.preview.flagged = against.iter().map(|f| f.key.clone()).collect();
        if against.is_empty() {
            return Ok(out);
        }
        counts.decoded += 1;
        let Some(own) = self.teacher_answer(
            prompts,
            tctx,
            ex.control_context_ids.as_deref(),
            ex.answer_format.as_ref(),
        )?
        else {
            counts.fallback += 1;
            return Ok(out);
        };
        let (own_text, _) = answer_text(dec, &own.ids);
        out.preview.teacher = Some(own_text.clone());
        let Some(own_fields) = object_value_spans(&own_text) else {
            counts.fallback += 1;
            return Ok(out);
        };
        let (mut target, mut at, mut edited) = (String::new(), 0, 0);
        for AnswerField { key, value, .. } in against {
            let Some((_, own_value)) = own_fields.iter().find(|(k, _)| k == key) else {
                continue;
            };
            let new = &own_text[own_value.clone()];
            if new == &logged[value.clone()] {
                continue;
            }
            target.push_str(&logged[at..value.start]);
            target.push_str(new);
            at = value.end;
            edited += 1;
        }
        if edited == 0 {
            return Ok(out);
        }
        target.push_str(&logged[at..]);
        debug!(record = %ex.record_id, edited = %target, "The teacher's edit of the logged answer.");
        let Some(spelled) = self.edit_tokens(prompts, tctx, &target)? else {
            counts.fallback += 1;
            return Ok(out);
        };
        out.preview.edited = Some(target);
        counts.changed += 1;
        counts.edited_fields += edited;
        out.target = Some(spelled);
        Ok(out)
    }

    /// With `min_field_logprob`: the per-token weights of the target `ids` ([`field_mask`]),
    /// counting the masked fields; `None` without the floor or for a non-object answer.
    fn field_weights(
        &self,
        ids: &[u32],
        per_field: &[(String, f64)],
        counts: &mut TeacherAnswerCounts,
    ) -> Result<Option<Vec<f32>>> {
        let Some(floor) = self.cfg.min_field_logprob else {
            return Ok(None);
        };
        Ok(
            field_mask(self.decoding()?, ids, per_field, floor).map(|(w, masked)| {
                counts.masked_fields += masked;
                w
            }),
        )
    }

    /// The teacher's work on `ex` for [`DistillTarget::Teacher`] (its own answer) or
    /// [`DistillTarget::Edit`] (its pass over the logged answer, the edit and the confidence
    /// in it); `s_lp` are the student's log-probs of the logged tokens (the edit's default
    /// reference).
    fn teacher_work(&self, tctx: &[u32], ex: &TrainExample, s_lp: &[f32]) -> Result<TeacherWork> {
        let mut counts = TeacherAnswerCounts::default();
        let mut prompts = TeacherPrompts::default();
        if self.cfg.distill_target == DistillTarget::Teacher {
            let control = ex.control_context_ids.as_deref();
            let own =
                self.teacher_answer(&mut prompts, tctx, control, ex.answer_format.as_ref())?;
            counts.decoded += 1;
            let (mut confidence, mut weights) = (None, None);
            match &own {
                Some(a) => {
                    counts.changed += usize::from(a.ids != ex.answer_ids);
                    let dec = self.decoding()?;
                    let fields = answer_fields(dec, &a.ids).1.unwrap_or_default();
                    let vocabulary = field_sums(&fields, &a.logprobs()?);
                    let decision = a
                        .choices
                        .as_deref()
                        .map(|c| field_sums(&fields, c))
                        .unwrap_or_default();
                    let per_field = match self.cfg.confidence {
                        Confidence::Vocabulary => &vocabulary,
                        Confidence::Decision => &decision,
                    };
                    let joint = per_field.iter().map(|(_, lp)| lp).sum::<f64>();
                    confidence = Some(joint);
                    weights = self.field_weights(&a.ids, per_field, &mut counts)?;
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        debug!(
                            record = %ex.record_id,
                            logged = %answer_text(dec, &ex.answer_ids).0,
                            own = %answer_text(dec, &a.ids).0,
                            feedback = ex.feedback_text.as_deref().unwrap_or(""),
                            per_field = ?vocabulary,
                            decision = ?decision,
                            confidence = joint,
                            "The teacher's own answer."
                        );
                    }
                }
                None => counts.fallback += 1,
            }
            return Ok(TeacherWork {
                pass: None,
                target: own,
                confidence,
                weights,
                counts,
                tokens: prompts.tokens,
            });
        }
        let pass = self.teacher_pass_after(&mut prompts, tctx, &ex.answer_ids)?;
        let t_lp: Vec<f32> = pass.logprobs.to_vec1()?;
        let r_lp = self.edit_reference(&mut prompts, ex, || Ok(s_lp.to_vec()))?;
        let edit = self.teacher_edit(&mut prompts, tctx, ex, &t_lp, &r_lp, &mut counts)?;
        let tokens = prompts.tokens;
        let confidence = edit.preview.target_logprob();
        let distilled = edit.target.as_ref().map_or(&ex.answer_ids, |a| &a.ids);
        let weights = self.field_weights(distilled, &edit.preview.confidence, &mut counts)?;
        debug!(record = %ex.record_id, per_field = ?edit.preview.confidence, confidence, "The teacher's confidence in the target's values (log p, nats).");
        Ok(TeacherWork {
            pass: Some(pass),
            target: edit.target,
            confidence: Some(confidence),
            weights,
            counts,
            tokens,
        })
    }

    /// The [`DistillTarget::Edit`] target of `ex` as a step would build it now (same passes,
    /// same configuration), without training: for probes and diagnostics. `None` when `ex`
    /// has no teacher prompt. Needs [`Trainer::set_decoding`].
    pub fn edit_preview(&self, ex: &TrainExample) -> Result<Option<EditPreview>> {
        let Some(tctx) = ex.teacher_context_ids.as_deref() else {
            return Ok(None);
        };
        let mut prompts = TeacherPrompts::default();
        let t_lp: Vec<f32> = self
            .teacher_pass_after(&mut prompts, tctx, &ex.answer_ids)?
            .logprobs
            .to_vec1()?;
        let r_lp = self.edit_reference(&mut prompts, ex, || {
            Ok(self
                .answer_pass(
                    &ex.context_ids,
                    &ex.answer_ids,
                    &AdapterSelection::All(&self.policy),
                    false,
                )?
                .logprobs
                .to_vec1()?)
        })?;
        let mut counts = TeacherAnswerCounts::default();
        Ok(Some(
            self.teacher_edit(&mut prompts, tctx, ex, &t_lp, &r_lp, &mut counts)?
                .preview,
        ))
    }

    /// One optimizer step on `batch`. A step refused by a guard leaves the weights untouched
    /// and says why in [`StepReport::skipped`].
    pub fn step(&mut self, batch: &[TrainExample]) -> Result<StepReport> {
        let started = Instant::now();
        let span = info_span!(
            "train_step",
            step = self.state.steps + 1,
            examples = batch.len()
        );
        let _guard = span.enter();
        if batch.is_empty() {
            return Err(LearnerError::InvalidArgument("empty micro-batch".into()));
        }
        let w = self.cfg.objectives;
        let dev = self.model.device().clone();
        let mut report = StepReport {
            examples: batch.len(),
            ..Default::default()
        };
        // Each example's loss is back-propagated on its own and only the adapter's gradients
        // are kept: one example's graph is alive at a time (a 2-example batch of 500-token
        // prompts held 6.6 GB when their losses were summed first).
        let nb = batch.len() as f64;
        let vars = self.policy.vars();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let (mut loss_sum, mut any_loss, mut non_finite) = (0.0f64, false, false);
        let mut total: Option<Tensor> = None;
        let mut term_sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut applied: BTreeMap<String, usize> = BTreeMap::new();
        let mut note = |name: &str, v: f64| {
            *term_sums.entry(name.to_string()).or_default() += v;
            *applied.entry(name.to_string()).or_default() += 1;
        };
        let (mut kl_sum, mut kl_n, mut gap_sum, mut gap_n) = (0.0, 0usize, 0.0, 0usize);
        let mut advs: Vec<f32> = Vec::new();
        let (mut clip_sum, mut clip_n) = (0.0, 0usize);
        let mut z_updates = Vec::new();
        let mut baseline_updates = Vec::new();
        let mut teacher_counts: Option<TeacherAnswerCounts> = None;

        for ex in batch {
            if ex.context_ids.is_empty() || ex.answer_ids.is_empty() {
                return Err(LearnerError::InvalidArgument(format!(
                    "example {} has an empty context or answer",
                    ex.record_id
                )));
            }
            let n = ex.answer_ids.len();
            // Which objectives this example feeds; one that feeds none costs no forward pass.
            let applies = w.distill > 0.0 && ex.teacher_context_ids.is_some()
                || w.dense > 0.0 && (ex.teacher_context_ids.is_some() || ex.reward.is_some())
                || w.kto > 0.0 && ex.thumbs.is_some()
                || w.sft > 0.0 && ex.correction_ids.is_some();
            if !applies {
                report.unlearned.push(ex.record_id);
                continue;
            }
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
                    let kl = mean(&kl_exact(&student.logits, &bp.logits)?)?;
                    let kl_val = kl.to_scalar::<f32>()? as f64;
                    kl_sum += kl_val;
                    kl_n += 1;
                    if self.cfg.kl_penalty > 0.0 && kl_val > self.cfg.kl_budget {
                        let pen = ((kl - self.cfg.kl_budget)? * self.cfg.kl_penalty)?;
                        note("kl_penalty", pen.to_scalar::<f32>()? as f64);
                        push(&mut total, pen)?;
                    }
                }

                // Teacher: the EMA policy shown the feedback, on the same answer tokens. With
                // `distill_target = teacher` the teacher first decodes its own answer (and this
                // pass is only needed when that fails or for dense rewards); with `edit` this
                // pass says which fields the feedback speaks against.
                let target = self.cfg.distill_target;
                let teacher_pass = |tr: &Self| -> Result<AnswerPass> {
                    tr.teacher_pass_after(
                        &mut TeacherPrompts::default(),
                        ex.teacher_context_ids.as_deref().unwrap_or_default(),
                        &ex.answer_ids,
                    )
                };
                let mut teacher = None;
                // A target (own answer or edit) the teacher is not confident in: no distillation
                // here.
                let mut unconfident = false;
                // Per token of the answer distilled on: 0 on doubtful field values
                // (`min_field_logprob`).
                let mut weights = None;
                let own = match &ex.teacher_context_ids {
                    Some(tctx) if w.distill > 0.0 && target != DistillTarget::Logged => {
                        let cacheable = self.caches_teacher_work(ex);
                        let hit = cacheable
                            .then(|| self.cache.get(ex.record_id, &ex.answer_ids).cloned())
                            .flatten();
                        let c = teacher_counts.get_or_insert_with(Default::default);
                        let work = match hit {
                            Some(work) => {
                                c.cached += 1;
                                debug!(record = %ex.record_id, "The frozen teacher's target, from the cache.");
                                work
                            }
                            None => {
                                let work = self.teacher_work(tctx, ex, &s_lp)?;
                                report.tokens += work.tokens;
                                if cacheable {
                                    let cap = self.cfg.teacher_cache_examples;
                                    self.cache
                                        .put(ex.record_id, &ex.answer_ids, work.clone(), cap);
                                }
                                work
                            }
                        };
                        *c += work.counts;
                        teacher = work.pass;
                        weights = work.weights;
                        match (work.confidence, self.cfg.min_target_logprob) {
                            (Some(confidence), Some(min)) if confidence < min => {
                                debug!(record = %ex.record_id, confidence, "Target below the confidence floor; not distilled on.");
                                c.unconfident += 1;
                                unconfident = true;
                                None
                            }
                            _ => work.target,
                        }
                    }
                    _ => None,
                };
                if teacher.is_none()
                    && ex.teacher_context_ids.is_some()
                    && (w.dense > 0.0 || w.distill > 0.0 && own.is_none() && !unconfident)
                {
                    report.tokens += ex.teacher_context_ids.as_ref().map_or(0, Vec::len) + n;
                    teacher = Some(teacher_pass(self)?);
                }

                // Distillation on the teacher's own answer or edit (a second student pass unless
                // it is the logged answer) or on the logged one. A target that is not the logged
                // answer may also be learned as hard targets (`target_ce_weight`).
                let on_own = match &own {
                    Some(a) if a.ids == ex.answer_ids => Some((student.logits.clone(), &a.logits)),
                    Some(a) => {
                        report.tokens += a.ids.len();
                        let pass = self.policy_pass_after(prompt, &ex.context_ids, &a.ids)?;
                        if self.cfg.target_ce_weight > 0.0 && w.distill > 0.0 {
                            let ce = weighted_mean(&pass.logprobs.neg()?, weights.as_deref())?;
                            note("target_ce", ce.to_scalar::<f32>()? as f64);
                            push(&mut total, (ce * self.cfg.target_ce_weight)?)?;
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
                if let (Some((s_logits, t_logits)), true) = (pair, w.distill > 0.0 && !unconfident)
                {
                    let d = weighted_mean(
                        &distill_loss(
                            &s_logits,
                            t_logits,
                            self.cfg.top_k.min(t_logits.dim(1)?),
                            self.cfg.divergence,
                        )?,
                        weights.as_deref(),
                    )?;
                    note("distill", d.to_scalar::<f32>()? as f64);
                    push(&mut total, (d * w.distill)?)?;
                    learned = true;
                }

                if w.dense > 0.0 && (teacher.is_some() || ex.reward.is_some()) {
                    let scalar_adv = match ex.reward {
                        Some(r) => {
                            let b = self.state.baselines.get(&ex.route).copied().unwrap_or(0.0);
                            baseline_updates.push((ex.route.clone(), r));
                            r - b
                        }
                        None => 0.0,
                    };
                    let adv = match &teacher {
                        Some(t) => {
                            let t_lp: Vec<f32> = t.logprobs.to_vec1()?;
                            for (a, b) in t_lp.iter().zip(&s_lp) {
                                gap_sum += (*a - *b) as f64;
                                gap_n += 1;
                            }
                            dense_advantages(&t_lp, &s_lp, scalar_adv, self.cfg.gap_clip)
                        }
                        None => vec![scalar_adv as f32; n],
                    };
                    advs.extend_from_slice(&adv);
                    let behaviour = ex.behaviour_logprobs.as_ref().map(|b| {
                        // Unknown entries (NaN) are treated as on-policy: ratio 1.
                        b.iter()
                            .zip(&s_lp)
                            .map(|(x, s)| if x.is_finite() { *x } else { *s })
                            .collect::<Vec<f32>>()
                    });
                    let behaviour = match behaviour {
                        Some(b) => Some(Tensor::from_vec(b, n, &dev)?),
                        None => None,
                    };
                    let adv = Tensor::from_vec(adv, n, &dev)?;
                    let (pg, stats) = pg_loss(
                        &student.logprobs,
                        behaviour.as_ref(),
                        &adv,
                        self.cfg.ratio_clip,
                    )?;
                    clip_sum += stats.clip_fraction;
                    clip_n += 1;
                    let pg = mean(&pg)?;
                    note("dense", pg.to_scalar::<f32>()? as f64);
                    push(&mut total, (pg * w.dense)?)?;
                    learned = true;
                }

                if let (Some(up), Some(base_lp), true) = (ex.thumbs, &base, w.kto > 0.0) {
                    let seq = student.logprobs.sum_all()?;
                    let reference = base_lp.sum_all()?.to_scalar::<f32>()? as f64;
                    let r = seq.to_scalar::<f32>()? as f64 - reference;
                    z_updates.push(r.max(0.0));
                    let k = kto_loss(&seq, reference, up, self.state.kto_z, &self.cfg.kto)?;
                    note("kto", k.to_scalar::<f32>()? as f64);
                    push(&mut total, (k * w.kto)?)?;
                    learned = true;
                }
            }

            if let (Some(corr), true) = (&ex.correction_ids, w.sft > 0.0) {
                report.tokens += match &student_prompt {
                    Some(_) => corr.len(),
                    None => ex.context_ids.len() + corr.len(),
                };
                let guard_here = !needs_student && self.cfg.kl_penalty > 0.0;
                // A pure-SFT example measures its KL guard at the correction's positions, so its
                // pass keeps the logits (`[n, V]`, a few MB); otherwise the fused cross-entropy.
                let (ce, policy_logits) = if guard_here {
                    let pass = self.policy_pass(&ex.context_ids, corr)?;
                    (pass.logprobs.neg()?, Some(pass.logits))
                } else {
                    let prompt = student_prompt.as_ref();
                    (self.sft_token_ce(prompt, &ex.context_ids, corr)?, None)
                };
                if let Some(policy_logits) = policy_logits {
                    let base_logits = self.base_pass(ex, corr, &mut report.tokens)?.logits;
                    let kl = mean(&kl_exact(&policy_logits, &base_logits)?)?;
                    let kl_val = kl.to_scalar::<f32>()? as f64;
                    kl_sum += kl_val;
                    kl_n += 1;
                    if kl_val > self.cfg.kl_budget {
                        let pen = ((kl - self.cfg.kl_budget)? * self.cfg.kl_penalty)?;
                        note("kl_penalty", pen.to_scalar::<f32>()? as f64);
                        push(&mut total, pen)?;
                    }
                }
                let l = mean(&ce)?;
                note("sft", l.to_scalar::<f32>()? as f64);
                push(&mut total, (l * w.sft)?)?;
                learned = true;
            }

            if !learned {
                report.unlearned.push(ex.record_id);
            }
            if let Some(ex_loss) = total.take() {
                let ex_loss = (ex_loss / nb)?;
                let v = ex_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                loss_sum += v;
                any_loss = true;
                if !v.is_finite() {
                    non_finite = true;
                    continue;
                }
                let mut g = ex_loss.backward()?;
                for (slot, var) in acc.iter_mut().zip(&vars) {
                    if let Some(gv) = g.remove(var.as_tensor()) {
                        *slot = Some(match slot.take() {
                            Some(a) => (a + gv)?,
                            None => gv,
                        });
                    }
                }
            }
        }

        report.kl_to_base = if kl_n > 0 { kl_sum / kl_n as f64 } else { 0.0 };
        report.teacher_student_gap = (gap_n > 0).then(|| gap_sum / gap_n as f64);
        if !advs.is_empty() {
            let m = advs.iter().map(|x| *x as f64).sum::<f64>() / advs.len() as f64;
            let var = advs.iter().map(|x| (*x as f64 - m).powi(2)).sum::<f64>() / advs.len() as f64;
            report.advantage_mean = Some(m);
            report.advantage_std = Some(var.sqrt());
        }
        report.clip_fraction = (clip_n > 0).then(|| clip_sum / clip_n as f64);
        report.teacher_answers = teacher_counts;
        report.terms = term_sums
            .iter()
            .map(|(k, v)| (k.clone(), v / applied[k] as f64))
            .collect();
        report.applied = applied;

        // Running statistics move whether or not the step is applied: they describe the data.
        let rate = self.cfg.baseline_rate;
        for (route, r) in baseline_updates {
            let b = self.state.baselines.entry(route).or_insert(0.0);
            *b = (1.0 - rate) * *b + rate * r;
        }
        for z in z_updates {
            self.state.kto_z = 0.9 * self.state.kto_z + 0.1 * z;
        }
        self.state.examples += batch.len() as u64;
        self.state.tokens += report.tokens as u64;

        if !any_loss {
            // Nothing applied (e.g. only thumbs with KTO off): no step, not an error.
            report.skipped = Some("no objective applied to this batch".into());
            report.step = self.state.steps;
            report.duration_ms = started.elapsed().as_millis() as u64;
            return Ok(report);
        }
        report.loss = loss_sum;
        if non_finite || !report.loss.is_finite() {
            return Ok(self.refuse(report, "non-finite loss", started));
        }
        // A gradient store holding only the adapter's variables (a zero-valued graph over them),
        // then filled with the accumulated gradients.
        let mut zero: Option<Tensor> = None;
        for v in &vars {
            let z = (v.as_tensor().sum_all()? * 0.0)?;
            zero = Some(match zero.take() {
                Some(a) => (a + z)?,
                None => z,
            });
        }
        let mut grads = match zero {
            Some(z) => z.backward()?,
            None => {
                return Err(LearnerError::InvalidAdapter(
                    "adapter without weights".into(),
                ))
            }
        };
        for (slot, var) in acc.into_iter().zip(&vars) {
            match slot {
                Some(g) => {
                    grads.insert(var.as_tensor(), g);
                }
                None => {
                    grads.remove(var.as_tensor());
                }
            }
        }
        report.grad_norm = self
            .policy
            .clip_grad_norm(&mut grads, self.cfg.max_grad_norm)?;
        if !report.grad_norm.is_finite() {
            return Ok(self.refuse(report, "non-finite gradient", started));
        }
        let before = self.policy.snapshot("rollback", self.model.config())?;
        self.opt.step(&self.policy, &grads)?;
        if !all_finite(&self.policy)? {
            // Put the weights back; the optimizer's moments already moved, so rebuild them from
            // a clean slate rather than keep moments that produced non-finite weights.
            restore(&self.policy, &before)?;
            self.opt = AdamW::new(*self.opt.config())?;
            return Ok(self.refuse(report, "non-finite weights after the update", started));
        }
        self.teacher
            .ema_update(&self.policy, self.cfg.teacher_ema_rate)?;
        self.state.steps += 1;
        report.step = self.state.steps;
        report.duration_ms = started.elapsed().as_millis() as u64;
        debug!(
            loss = report.loss,
            kl = report.kl_to_base,
            grad_norm = report.grad_norm,
            "Step."
        );
        Ok(report)
    }

    fn refuse(&mut self, mut report: StepReport, why: &str, started: Instant) -> StepReport {
        warn!(reason = why, "Training step refused; weights unchanged.");
        self.state.skipped_steps += 1;
        report.skipped = Some(why.to_string());
        report.step = self.state.steps;
        report.duration_ms = started.elapsed().as_millis() as u64;
        report
    }

    /// A frozen copy of the policy under `name` (a candidate to publish).
    pub fn snapshot_policy(&self, name: &str) -> Result<Adapter> {
        Ok(self.policy.snapshot(name, self.model.config())?)
    }

    /// Writes policy, teacher and optimizer state into `dir` (which must exist):
    /// `policy.safetensors`, `teacher.safetensors`, `optimizer.safetensors`, `trainer.json`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        candle_core::safetensors::save(&self.policy.tensors()?, dir.join("policy.safetensors"))?;
        candle_core::safetensors::save(&self.teacher.tensors()?, dir.join("teacher.safetensors"))?;
        self.opt.save(&dir.join("optimizer.safetensors"))?;
        let path = dir.join("trainer.json");
        let text = serde_json::to_vec_pretty(&self.state)
            .map_err(|e| LearnerError::json("trainer state", e))?;
        std::fs::write(&path, text).map_err(|e| LearnerError::io(&path, e))?;
        Ok(())
    }

    /// Restores what [`Trainer::save`] wrote (same configuration) into this trainer.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let dev = self.model.device().clone();
        load_into(&self.policy, &dir.join("policy.safetensors"), &dev)?;
        load_into(&self.teacher, &dir.join("teacher.safetensors"), &dev)?;
        self.opt = AdamW::load(self.cfg.optimizer, &dir.join("optimizer.safetensors"), &dev)?;
        let path = dir.join("trainer.json");
        let text = std::fs::read(&path).map_err(|e| LearnerError::io(&path, e))?;
        self.state =
            serde_json::from_slice(&text).map_err(|e| LearnerError::json("trainer state", e))?;
        self.cache.clear();
        Ok(())
    }
}

/// Adds `t` to the running sum in `total`.
fn push(total: &mut Option<Tensor>, t: Tensor) -> Result<()> {
    *total = Some(match total.take() {
        Some(acc) => (acc + t)?,
        None => t,
    });
    Ok(())
}

fn all_finite(a: &Adapter) -> Result<bool> {
    for t in a.tensors()?.values() {
        let s = t
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        if !s.is_finite() {
            return Ok(false);
        }
    }
    Ok(true)
}

fn restore(into: &Adapter, from: &Adapter) -> Result<()> {
    let src = from.tensors()?;
    let data = into
        .varmap()
        .data()
        .lock()
        .map_err(|_| LearnerError::InvalidAdapter("poisoned var map".into()))?;
    for (k, v) in data.iter() {
        let t = src
            .get(k)
            .ok_or_else(|| LearnerError::InvalidAdapter(format!("{k} missing in snapshot")))?;
        v.set(t)?;
    }
    Ok(())
}

fn load_into(adapter: &Adapter, path: &Path, dev: &Device) -> Result<()> {
    let tensors = candle_core::safetensors::load(path, dev)?;
    let data = adapter
        .varmap()
        .data()
        .lock()
        .map_err(|_| LearnerError::InvalidAdapter("poisoned var map".into()))?;
    if tensors.len() != data.len() {
        return Err(LearnerError::InvalidAdapter(format!(
            "{} holds {} tensors, the adapter has {}",
            path.display(),
            tensors.len(),
            data.len()
        )));
    }
    for (k, v) in data.iter() {
        let t = tensors.get(k).ok_or_else(|| {
            LearnerError::InvalidAdapter(format!("{k} missing in {}", path.display()))
        })?;
        if t.dims() != v.dims() {
            return Err(LearnerError::InvalidAdapter(format!(
                "{k} has shape {:?} in {}, expected {:?}",
                t.dims(),
                path.display(),
                v.dims()
            )));
        }
        v.set(&t.to_dtype(v.dtype())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hindsight_model::{Architecture, ModelConfig};

    fn model() -> Arc<Model> {
        let mut cfg = ModelConfig::tiny(Architecture::Llama);
        cfg.vocab_size = 32;
        Arc::new(Model::random(cfg, 3, DType::F32, &Device::Cpu).unwrap())
    }

    fn example(i: u32, correction: bool, teacher: bool, thumbs: Option<bool>) -> TrainExample {
        TrainExample {
            record_id: uuid::Uuid::now_v7(),
            turn: uuid::Uuid::now_v7(),
            route: "default".into(),
            adapter: None,
            context_ids: vec![1, 2, 3 + i % 5, 4],
            answer_ids: vec![7, 8, 9],
            behaviour_logprobs: None,
            teacher_context_ids: teacher.then(|| vec![1, 2, 3 + i % 5, 20, 21, 4]),
            control_context_ids: teacher.then(|| vec![1, 2, 3 + i % 5, 22, 23, 4]),
            correction_ids: correction.then(|| vec![10, 11, 12]),
            answer_format: None,
            thumbs,
            reward: thumbs.map(|t| if t { 1.0 } else { -1.0 }),
            feedback_text: teacher.then(|| "fix it".into()),
            feedback_ids: vec![],
        }
    }

    fn weights(sft: f64, kto: f64, distill: f64, dense: f64) -> TrainerConfig {
        TrainerConfig {
            objectives: ObjectiveWeights {
                sft,
                kto,
                distill,
                dense,
            },
            optimizer: AdamWConfig {
                lr: 1e-2,
                ..Default::default()
            },
            top_k: 8,
            ..Default::default()
        }
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The teacher's logits over `ans` after `ctx` from one full pass (no graph).
    fn teacher_logits(tr: &Trainer, ctx: &[u32], ans: &[u32]) -> Tensor {
        tr.answer_pass(ctx, ans, &AdapterSelection::All(tr.teacher()), false)
            .unwrap()
            .logits
    }

    fn logprob_of(tr: &Trainer, ctx: &[u32], ans: &[u32]) -> f64 {
        logprob_under(tr, tr.policy(), ctx, ans)
    }

    /// Sum of the answer's log-probs after `ctx` under `adapter` (no graph).
    fn logprob_under(tr: &Trainer, adapter: &Adapter, ctx: &[u32], ans: &[u32]) -> f64 {
        tr.answer_pass(ctx, ans, &AdapterSelection::All(adapter), false)
            .unwrap()
            .logprobs
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64
    }

    #[test]
    fn sft_raises_the_likelihood_of_the_correction() {
        let mut tr = Trainer::new(model(), weights(1.0, 0.0, 0.0, 0.0), "p").unwrap();
        let ex = example(0, true, false, Some(false));
        let before = logprob_of(&tr, &ex.context_ids, &[10, 11, 12]);
        for i in 0..5 {
            let r = tr.step(std::slice::from_ref(&ex)).unwrap();
            assert!(r.skipped.is_none(), "{r:?}");
            assert_eq!(r.applied.get("sft"), Some(&1));
            // The correction's pass and the KL guard's base pass over it (the first time; then
            // the base pass comes from the replay cache); no pass over the logged answer.
            let passes = if i == 0 { 2 } else { 1 };
            assert_eq!(r.tokens, passes * (ex.context_ids.len() + 3), "{r:?}");
        }
        let after = logprob_of(&tr, &ex.context_ids, &[10, 11, 12]);
        assert!(
            after > before + 0.5,
            "log p(correction): {before} -> {after}"
        );
        assert_eq!(tr.state().steps, 5);
    }

    #[test]
    fn kto_moves_thumbs_up_answers_up_and_thumbs_down_answers_down() {
        for up in [true, false] {
            let mut cfg = weights(0.0, 1.0, 0.0, 0.0);
            cfg.kto.beta = 1.0;
            cfg.kl_penalty = 0.0;
            let mut tr = Trainer::new(model(), cfg, "p").unwrap();
            let ex = example(1, false, false, Some(up));
            let before = logprob_of(&tr, &ex.context_ids, &ex.answer_ids);
            for _ in 0..5 {
                tr.step(std::slice::from_ref(&ex)).unwrap();
            }
            let after = logprob_of(&tr, &ex.context_ids, &ex.answer_ids);
            assert_eq!(after > before, up, "thumbs {up}: {before} -> {after}");
        }
    }

    #[test]
    fn self_distillation_moves_the_student_towards_the_teacher() {
        // A teacher that differs from the student: give it its own random weights.
        let m = model();
        let mut tr = Trainer::new(m.clone(), weights(0.0, 0.0, 1.0, 0.0), "p").unwrap();
        let ex = example(2, false, true, None);
        let tctx = ex.teacher_context_ids.clone().unwrap();
        let teacher_lp = |tr: &Trainer| -> Vec<f32> {
            tr.answer_pass(
                &tctx,
                &ex.answer_ids,
                &AdapterSelection::All(tr.teacher()),
                false,
            )
            .unwrap()
            .logprobs
            .to_vec1()
            .unwrap()
        };
        let gap = |tr: &Trainer| -> f64 {
            let s: Vec<f32> = tr
                .answer_pass(
                    &ex.context_ids,
                    &ex.answer_ids,
                    &AdapterSelection::All(tr.policy()),
                    false,
                )
                .unwrap()
                .logprobs
                .to_vec1()
                .unwrap();
            teacher_lp(tr)
                .iter()
                .zip(&s)
                .map(|(t, s)| (*t as f64 - *s as f64).abs())
                .sum()
        };
        let d0 = tr.step(std::slice::from_ref(&ex)).unwrap().terms["distill"];
        assert!(
            d0 > 0.0,
            "teacher context differs, so the divergence is positive"
        );
        let g0 = gap(&tr);
        let mut last = d0;
        for _ in 0..10 {
            last = tr.step(std::slice::from_ref(&ex)).unwrap().terms["distill"];
        }
        assert!(last < d0, "divergence {d0} -> {last}");
        assert!(gap(&tr) < g0, "student log-probs approach the teacher's");
    }

    /// The text of `ids` in a test vocabulary (tokens without text dropped).
    fn text_of(vocab: &[Option<String>], ids: &[u32]) -> String {
        ids.iter()
            .filter_map(|&i| vocab[i as usize].clone())
            .collect()
    }

    /// A character-per-token vocabulary for guided decoding with the tiny model (32 tokens; 31
    /// is the end of turn) and a `response_format` over it.
    fn guided() -> (TeacherDecoding, OJson, impl Fn(&[u32]) -> String) {
        let chars = ['{', '}', '"', ':', ' ', ',', 'k', 'a', 'b', 'c'];
        let vocab: Vec<Option<String>> = (0..32)
            .map(|i| chars.get(i).map(|c| c.to_string()))
            .collect();
        let text = {
            let vocab = vocab.clone();
            move |ids: &[u32]| text_of(&vocab, ids)
        };
        let rf: OJson = serde_json::from_str(
            r#"{"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object",
                "properties": {"k": {"type": "string", "enum": ["a", "b", "c"]}}}}}"#,
        )
        .unwrap();
        let dec = TeacherDecoding {
            vocab: Arc::new(vocab),
            end_of_turn: 31,
            tokenizer: None,
        };
        (dec, rf, text)
    }

    /// Token ids of `{"k": "<v>"}` in [`guided`]'s vocabulary, plus the end of turn.
    fn guided_ids(v: char) -> Vec<u32> {
        let v = match v {
            'a' => 7,
            'b' => 8,
            _ => 9,
        };
        vec![0, 2, 6, 2, 3, 4, 2, v, 2, 1, 31]
    }

    #[test]
    fn the_teacher_decodes_its_own_answer_under_the_grammar_with_its_logits() {
        let mut tr = Trainer::new(model(), weights(0.0, 0.0, 1.0, 0.0), "p").unwrap();
        let ex = example(3, false, true, None);
        let tctx = ex.teacher_context_ids.clone().unwrap();
        let (dec, rf, text) = guided();
        assert!(
            tr.teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
                .is_err(),
            "decoding without the vocabulary is an error, not a silent fallback"
        );
        tr.set_decoding(dec);
        let own = tr
            .teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
            .unwrap()
            .unwrap();
        assert_eq!(own.ids.last(), Some(&31), "closed with the end of turn");
        let doc = text(&own.ids);
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        assert!(["a", "b", "c"].contains(&v["k"].as_str().unwrap()), "{doc}");
        assert_eq!(doc.len() + 1, own.ids.len(), "{doc}: one char per token");
        // The decoding's logits are the teacher's at the positions that predict the answer.
        let full = teacher_logits(&tr, &tctx, &own.ids);
        let diff = max_abs_diff(&full, &own.logits);
        assert!(diff < 1e-3, "decode vs full-pass logits differ by {diff}");
        // A limit too short to close the document falls back (None), it does not truncate.
        tr.cfg.teacher_answer_max_tokens = 5;
        assert!(tr
            .teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
            .unwrap()
            .is_none());
    }

    /// Distillation alone on `target`, forward KL, frozen teacher, no KL guard.
    fn distill_on(target: DistillTarget) -> TrainerConfig {
        let mut cfg = weights(0.0, 0.0, 1.0, 0.0);
        cfg.distill_target = target;
        cfg.divergence = Divergence::ForwardKl;
        cfg.teacher_ema_rate = 0.0;
        cfg.kl_penalty = 0.0;
        cfg
    }

    /// A trainer distilling on the teacher's own answer over [`guided`]'s vocabulary, an
    /// example with its response format, the example's teacher prompt, the format and
    /// [`guided`]'s ids-to-text function.
    fn teacher_on_guided() -> (
        Trainer,
        TrainExample,
        Vec<u32>,
        OJson,
        impl Fn(&[u32]) -> String,
    ) {
        let mut tr = Trainer::new(model(), distill_on(DistillTarget::Teacher), "p").unwrap();
        let (dec, rf, text) = guided();
        tr.set_decoding(dec);
        let mut ex = example(4, false, true, None);
        ex.answer_format = Some(rf.clone());
        let tctx = ex.teacher_context_ids.clone().unwrap();
        (tr, ex, tctx, rf, text)
    }

    #[test]
    fn distilling_on_the_teachers_answer_moves_the_student_to_it() {
        let (mut tr, mut ex, tctx, rf, text) = teacher_on_guided();
        let own = tr
            .teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
            .unwrap()
            .unwrap()
            .ids;
        // The logged answer is a different decision than the teacher's.
        let theirs = text(&own);
        let other = ['a', 'b', 'c']
            .into_iter()
            .find(|c| !theirs.contains(&format!("\"{c}\"")))
            .unwrap();
        ex.answer_ids = guided_ids(other);
        assert_ne!(ex.answer_ids, own);
        let lp = |tr: &Trainer, ans: &[u32]| logprob_of(tr, &ex.context_ids, ans);
        let (own0, logged0) = (lp(&tr, &own), lp(&tr, &ex.answer_ids));
        for i in 0..8 {
            let r = tr.step(std::slice::from_ref(&ex)).unwrap();
            assert!(r.skipped.is_none(), "{r:?}");
            // The frozen teacher decodes once; the repeats take its answer from the cache.
            assert_eq!(
                r.teacher_answers,
                Some(TeacherAnswerCounts {
                    decoded: 1,
                    changed: 1,
                    fallback: 0,
                    edited_fields: 0,
                    unconfident: 0,
                    masked_fields: 0,
                    cached: usize::from(i > 0),
                })
            );
        }
        let (own1, logged1) = (lp(&tr, &own), lp(&tr, &ex.answer_ids));
        assert!(
            own1 > own0 + 0.5,
            "log p(teacher's answer) {own0} -> {own1}"
        );
        // How much more likely the teacher finds its decision than the logged one, in
        // hindsight; the student's preference moves to it (the two answers differ in one token).
        let t_lp = |ans: &[u32]| logprob_under(&tr, tr.teacher(), &tctx, ans);
        let teacher_pref = t_lp(&own) - t_lp(&ex.answer_ids);
        let (miss0, miss1) = (
            (own0 - logged0 - teacher_pref).abs(),
            (own1 - logged1 - teacher_pref).abs(),
        );
        assert!(
            miss1 < 0.5 * miss0,
            "student preference {} -> {} vs the teacher's {teacher_pref}",
            own0 - logged0,
            own1 - logged1
        );
    }

    #[test]
    fn a_confidence_floor_keeps_the_teachers_unlikely_answers_out_of_distillation() {
        let (mut tr, ex, tctx, _, _) = teacher_on_guided();
        let work = tr.teacher_work(&tctx, &ex, &[]).unwrap();
        let own = work.target.unwrap().ids;
        let confidence = work.confidence.unwrap();
        // The joint log-probability of the answer's value tokens: below 0, and at least that of
        // the whole answer (a subset of its tokens) in a separate teacher pass.
        let whole = logprob_under(&tr, tr.teacher(), &tctx, &own);
        assert!(
            confidence < 0.0 && confidence >= whole - 1e-3,
            "{confidence} vs whole answer {whole}"
        );
        tr.cfg.min_target_logprob = Some(confidence + 0.1);
        let before = logprob_of(&tr, &ex.context_ids, &own);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 1, "{r:?}");
        assert_eq!(r.unlearned, vec![ex.record_id], "{r:?}");
        assert!(r.terms.is_empty() && r.skipped.is_some(), "{r:?}");
        assert_eq!(logprob_of(&tr, &ex.context_ids, &own), before);
        tr.cfg.min_target_logprob = Some(confidence - 0.1);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 0, "{r:?}");
        assert!(
            r.terms.contains_key("distill") && r.skipped.is_none(),
            "{r:?}"
        );
        assert_ne!(
            logprob_of(&tr, &ex.context_ids, &own),
            before,
            "the step trained"
        );
    }

    #[test]
    fn decision_confidence_is_the_values_probability_among_the_allowed_ones() {
        let (mut tr, ex, tctx, _, _) = teacher_on_guided();
        tr.cfg.confidence = Confidence::Decision;
        let work = tr.teacher_work(&tctx, &ex, &[]).unwrap();
        let own = work.target.clone().unwrap();
        let confidence = work.confidence.unwrap();
        let choices = own.choices.clone().unwrap();
        assert_eq!(choices.len(), own.ids.len());
        // At the value's token the grammar allows exactly a, b and c (ids 7–9): the choice is
        // their softmax, from the teacher's logits in a separate full pass.
        let at = own.ids.iter().position(|id| (7..=9).contains(id)).unwrap();
        let row: Vec<f32> = teacher_logits(&tr, &tctx, &own.ids)
            .get(at)
            .unwrap()
            .to_vec1()
            .unwrap();
        let l = |i: usize| f64::from(row[i]);
        let want = l(own.ids[at] as usize) - (l(7).exp() + l(8).exp() + l(9).exp()).ln();
        assert!(
            (choices[at] - want).abs() < 1e-3,
            "{} vs {want}",
            choices[at]
        );
        // The closing quote and the end of turn are forced: certain choices.
        assert_eq!(choices[at + 1], 0.0);
        assert_eq!(choices.last(), Some(&0.0));
        // The field's confidence sums its value's choices (the quotes and the value): at most
        // the value token's, and well above the same tokens' log-probability over the whole
        // 32-token vocabulary.
        let vocabulary: f64 =
            value_confidence(tr.decoding().unwrap(), &own.ids, &own.logprobs().unwrap())
                .iter()
                .map(|(_, lp)| lp)
                .sum();
        assert!(
            confidence <= choices[at] + 1e-9 && confidence > vocabulary + 0.5,
            "decision {confidence}, value token {}, vocabulary {vocabulary}",
            choices[at]
        );
        // The floor reads it.
        tr.cfg.min_target_logprob = Some(confidence + 0.01);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 1, "{r:?}");
        tr.cfg.min_target_logprob = Some(confidence - 0.01);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 0, "{r:?}");
        assert!(r.terms.contains_key("distill"), "{r:?}");
        // Only a decoded answer has decisions: edits are refused at start-up.
        let mut cfg = distill_on(DistillTarget::Edit);
        cfg.confidence = Confidence::Decision;
        let e = cfg.check().unwrap_err().to_string();
        assert!(e.contains("decision") && e.contains("teacher"), "{e}");
        cfg.distill_target = DistillTarget::Teacher;
        cfg.check().unwrap();
    }

    /// [`guided`]'s vocabulary plus `j` (token 10) and a two-field `response_format`
    /// (`{"j": a|b|c, "k": a|b|c}`), with a function from text to token ids.
    fn guided_pair() -> (TeacherDecoding, OJson, impl Fn(&str) -> Vec<u32>) {
        let (mut dec, _, _) = guided();
        let mut vocab = (*dec.vocab).clone();
        vocab[10] = Some("j".into());
        dec.vocab = Arc::new(vocab.clone());
        let rf: OJson = serde_json::from_str(
            r#"{"type": "json_schema", "json_schema": {"name": "d", "schema": {"type": "object",
                "properties": {"j": {"type": "string", "enum": ["a", "b", "c"]},
                               "k": {"type": "string", "enum": ["a", "b", "c"]}}}}}"#,
        )
        .unwrap();
        let ids = move |text: &str| -> Vec<u32> {
            text.chars()
                .map(|c| {
                    vocab
                        .iter()
                        .position(|v| v.as_deref() == Some(c.to_string().as_str()))
                        .unwrap() as u32
                })
                .chain([31])
                .collect()
        };
        (dec, rf, ids)
    }

    /// A trainer distilling on the edit at margin 0 with `target_ce` hard targets, over
    /// [`guided_pair`]'s vocabulary (with its response format and text-to-ids helper).
    fn edit_trainer(target_ce: f64) -> (Trainer, OJson, impl Fn(&str) -> Vec<u32>) {
        let mut cfg = distill_on(DistillTarget::Edit);
        cfg.edit_margin_nats = 0.0;
        cfg.target_ce_weight = target_ce;
        pair_trainer(cfg)
    }

    /// A trainer with `cfg` decoding over [`guided_pair`]'s vocabulary (with its response
    /// format and text-to-ids helper).
    fn pair_trainer(cfg: TrainerConfig) -> (Trainer, OJson, impl Fn(&str) -> Vec<u32>) {
        let mut tr = Trainer::new(model(), cfg, "p").unwrap();
        let (dec, rf, ids) = guided_pair();
        tr.set_decoding(dec);
        (tr, rf, ids)
    }

    #[test]
    fn the_target_floors_older_name_is_still_read() {
        let cfg: TrainerConfig =
            serde_json::from_value(serde_json::json!({"edit_min_target_logprob": -1.5})).unwrap();
        assert_eq!(cfg.min_target_logprob, Some(-1.5));
        let cfg: TrainerConfig =
            serde_json::from_value(serde_json::json!({"min_field_logprob": -2.5})).unwrap();
        assert_eq!(cfg.min_field_logprob, Some(-2.5));
        assert!(cfg.check().is_ok());
    }

    #[test]
    fn the_field_mask_zeroes_only_the_tokens_of_doubtful_values() {
        let (dec, _, ids) = guided_pair();
        // `{"j": "b", "k": "c"}` is one token per character; `"c"` is characters 16..19.
        let answer = ids(r#"{"j": "b", "k": "c"}"#);
        let per_field = [("j".to_string(), -1.0), ("k".to_string(), -3.0)];
        let (w, masked) = field_mask(&dec, &answer, &per_field, -2.0).unwrap();
        let zeros: Vec<usize> = (0..w.len()).filter(|&i| w[i] == 0.0).collect();
        assert_eq!((zeros, masked), (vec![16, 17, 18], 1));
        assert!(w.iter().all(|&x| x == 0.0 || x == 1.0));
        assert_eq!(field_mask(&dec, &answer, &per_field, -0.5).unwrap().1, 2);
        let (w, masked) = field_mask(&dec, &answer, &per_field, -5.0).unwrap();
        assert!(masked == 0 && w.iter().all(|&x| x == 1.0));
        // Not a JSON object: nothing to mask by field.
        assert!(field_mask(&dec, &ids("ab"), &per_field, -2.0).is_none());
    }

    #[test]
    fn a_field_floor_masks_doubtful_values_out_of_distillation_and_target_ce() {
        let step = |floor: Option<f64>| {
            let mut cfg = distill_on(DistillTarget::Teacher);
            cfg.target_ce_weight = 1.0;
            cfg.min_field_logprob = floor;
            let (mut tr, rf, ids) = pair_trainer(cfg);
            let mut ex = example(6, false, true, None);
            ex.answer_format = Some(rf);
            let tctx = ex.teacher_context_ids.clone().unwrap();
            let own = tr
                .teacher_work(&tctx, &ex, &[])
                .unwrap()
                .target
                .unwrap()
                .ids;
            // A logged answer that differs from the teacher's, so its own is a second pass.
            ex.answer_ids = ["a", "b", "c"]
                .iter()
                .map(|v| ids(&format!(r#"{{"j": "{v}", "k": "{v}"}}"#)))
                .find(|a| *a != own)
                .unwrap();
            tr.step(std::slice::from_ref(&ex)).unwrap()
        };
        let (all, masked) = (step(None), step(Some(0.0)));
        // A floor of 0 doubts every value: both fields masked, their tokens' losses gone from
        // both terms (the rest — braces, keys, the end of turn — still learned).
        assert_eq!(all.teacher_answers.unwrap().masked_fields, 0, "{all:?}");
        assert_eq!(
            masked.teacher_answers.unwrap().masked_fields,
            2,
            "{masked:?}"
        );
        for term in ["distill", "target_ce"] {
            let (a, m) = (all.terms[term], masked.terms[term]);
            assert!(m > 0.0 && m < a, "{term}: {a} unmasked, {m} masked");
        }
    }

    #[test]
    fn the_teachers_passes_after_one_prompt_run_it_once_and_match_a_full_pass() {
        let tr = Trainer::new(model(), weights(0.0, 0.0, 1.0, 0.0), "p").unwrap();
        let ex = example(2, false, true, None);
        let tctx = ex.teacher_context_ids.clone().unwrap();
        let other: Vec<u32> = ex.answer_ids.iter().rev().copied().collect();
        let mut prompts = TeacherPrompts::default();
        let first = tr
            .teacher_pass_after(&mut prompts, &tctx, &ex.answer_ids)
            .unwrap();
        let second = tr.teacher_pass_after(&mut prompts, &tctx, &other).unwrap();
        assert_eq!(prompts.caches.len(), 1, "one cache for one prompt");
        assert_eq!(
            prompts.tokens,
            (tctx.len() - 1) + ex.answer_ids.len() + other.len(),
            "the prompt ran once, then each answer after its last token"
        );
        // The same numbers as one full pass over prompt and answer.
        for (shared, answer) in [(&first, &ex.answer_ids), (&second, &other)] {
            let full = teacher_logits(&tr, &tctx, answer);
            let diff = max_abs_diff(&full, &shared.logits);
            assert!(
                diff < 1e-3,
                "shared-prompt vs full-pass logits differ by {diff}"
            );
        }
        // Another prompt gets a cache of its own.
        let cctx = ex.context_ids.clone();
        let third = tr.teacher_pass_after(&mut prompts, &cctx, &other).unwrap();
        assert_eq!(prompts.caches.len(), 2);
        let diff = max_abs_diff(&teacher_logits(&tr, &cctx, &other), &third.logits);
        assert!(diff < 1e-3, "{diff}");
        assert!(
            tr.teacher_pass_after(&mut prompts, &[], &other).is_err()
                && tr.teacher_pass_after(&mut prompts, &tctx, &[]).is_err(),
            "an empty prompt or answer is an error"
        );
    }

    /// [`Trainer::teacher_edit`] with prompt caches of its own.
    fn edit_of(
        tr: &Trainer,
        tctx: &[u32],
        ex: &TrainExample,
        t_lp: &[f32],
        r_lp: &[f32],
        counts: &mut TeacherAnswerCounts,
    ) -> EditOutcome {
        tr.teacher_edit(&mut TeacherPrompts::default(), tctx, ex, t_lp, r_lp, counts)
            .unwrap()
    }

    #[test]
    fn the_teacher_spells_a_given_text_with_its_logits() {
        let mut tr = Trainer::new(model(), weights(0.0, 0.0, 1.0, 0.0), "p").unwrap();
        let (dec, _, ids) = guided_pair();
        tr.set_decoding(dec);
        let tctx = example(1, false, true, None).teacher_context_ids.unwrap();
        let text = r#"{"j": "c", "k": "a"}"#;
        let spelled = tr
            .teacher_spells(&mut TeacherPrompts::default(), &tctx, text)
            .unwrap()
            .unwrap();
        assert_eq!(
            spelled.ids,
            ids(text),
            "one char per token, then the end of turn"
        );
        let full = teacher_logits(&tr, &tctx, &spelled.ids);
        let diff = max_abs_diff(&full, &spelled.logits);
        assert!(diff < 1e-3, "spelling vs full-pass logits differ by {diff}");
        assert!(
            tr.teacher_spells(&mut TeacherPrompts::default(), &tctx, "{x}")
                .unwrap()
                .is_none(),
            "a character without a token gives up"
        );
    }

    #[test]
    fn with_a_tokenizer_the_edit_is_its_own_tokens_scored_by_the_teacher() {
        // guided_pair's vocabulary plus one token per quoted value (`"a"`, …) and the merges
        // that make it: the tokenizer writes a value as one token, the teacher could spell it
        // character by character.
        let (mut dec, rf, ids) = guided_pair();
        let mut vocab = (*dec.vocab).clone();
        let mut merges = Vec::new();
        for (i, v) in ["a", "b", "c"].into_iter().enumerate() {
            vocab[11 + 2 * i] = Some(format!("\"{v}"));
            vocab[12 + 2 * i] = Some(format!("\"{v}\""));
            merges.push(format!("\" {v}"));
            merges.push(format!("\"{v} \""));
        }
        let map: serde_json::Map<String, serde_json::Value> = vocab
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((t.clone()?, serde_json::json!(i))))
            .collect();
        let tokenizer: Tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "vocab": map, "merges": merges}
        })
        .to_string()
        .parse()
        .unwrap();
        dec.vocab = Arc::new(vocab);
        dec.tokenizer = Some(Arc::new(tokenizer.clone()));
        let mut tr = Trainer::new(model(), distill_on(DistillTarget::Edit), "p").unwrap();
        tr.set_decoding(dec);
        let mut ex = example(7, false, true, None);
        ex.answer_format = Some(rf.clone());
        let tctx = ex.teacher_context_ids.clone().unwrap();
        // Logged: the teacher's own answer with both values changed; `j` is spoken against.
        let own = tr
            .teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
            .unwrap()
            .unwrap();
        let own = text_of(&tr.decoding().unwrap().vocab, &own.ids);
        let own: serde_json::Value = serde_json::from_str(&own).unwrap();
        let other = |f: &str| ["a", "b", "c"].into_iter().find(|v| own[f] != *v).unwrap();
        let logged = format!(r#"{{"j": "{}", "k": "{}"}}"#, other("j"), other("k"));
        ex.answer_ids = ids(&logged);
        let s_lp = vec![-1.0f32; ex.answer_ids.len()];
        let mut t_lp = s_lp.clone();
        t_lp[7] -= 1.0;
        let outcome = edit_of(
            &tr,
            &tctx,
            &ex,
            &t_lp,
            &s_lp,
            &mut TeacherAnswerCounts::default(),
        );
        let edited = outcome.preview.edited.clone().unwrap();
        assert_eq!(
            edited,
            logged.replacen(other("j"), own["j"].as_str().unwrap(), 1)
        );
        let target = outcome.target.unwrap();
        let mut want = encode(&tokenizer, &edited).unwrap();
        want.push(31);
        assert_eq!(
            target.ids, want,
            "the tokenizer's tokens, then the end of turn"
        );
        assert!(
            target.ids.len() < ids(&edited).len(),
            "each quoted value is one token: {:?}",
            target.ids
        );
        let diff = max_abs_diff(&teacher_logits(&tr, &tctx, &target.ids), &target.logits);
        assert!(
            diff < 1e-4,
            "edit logits vs a teacher pass differ by {diff}"
        );
        let conf = outcome.preview.confidence;
        assert_eq!(conf.len(), 2, "{conf:?}");
    }

    #[test]
    fn the_teachers_edit_changes_only_the_fields_the_feedback_speaks_against() {
        let mut cfg = weights(0.0, 0.0, 1.0, 0.0);
        cfg.distill_target = DistillTarget::Edit;
        let mut tr = Trainer::new(model(), cfg, "p").unwrap();
        let (dec, rf, ids) = guided_pair();
        let vocab = dec.vocab.clone();
        let text = move |ids: &[u32]| text_of(&vocab, ids);
        tr.set_decoding(dec);
        let mut ex = example(2, false, true, None);
        ex.answer_format = Some(rf.clone());
        let tctx = ex.teacher_context_ids.clone().unwrap();
        // The teacher's own answer; the logged one disagrees with it on both fields.
        let own = text(
            &tr.teacher_answer(&mut TeacherPrompts::default(), &tctx, None, Some(&rf))
                .unwrap()
                .unwrap()
                .ids,
        );
        let own: serde_json::Value = serde_json::from_str(&own).unwrap();
        let other = |f: &str| ["a", "b", "c"].into_iter().find(|v| own[f] != *v).unwrap();
        let logged = format!(r#"{{"j": "{}", "k": "{}"}}"#, other("j"), other("k"));
        ex.answer_ids = ids(&logged);
        let n = ex.answer_ids.len();
        // The feedback lowers the logged `j` value by 1 nat (its letter is token 7 of
        // `{"j": "x", …`) and leaves `k` alone.
        let s_lp = vec![-1.0f32; n];
        let mut t_lp = s_lp.clone();
        t_lp[7] -= 1.0;
        let mut counts = TeacherAnswerCounts::default();
        let outcome = edit_of(&tr, &tctx, &ex, &t_lp, &s_lp, &mut counts);
        let edit = outcome.target.unwrap();
        assert_eq!(outcome.preview.flagged, vec!["j".to_string()]);
        assert_eq!(
            outcome.preview.edited.as_deref(),
            Some(text(&edit.ids).as_str())
        );
        assert!(
            (outcome.preview.shifts[0].1 + 1.0).abs() < 1e-6,
            "{:?}",
            outcome.preview
        );
        let edited: serde_json::Value = serde_json::from_str(&text(&edit.ids)).unwrap();
        assert_eq!(
            edited["j"], own["j"],
            "the field spoken against takes the teacher's value"
        );
        assert_eq!(
            edited["k"],
            other("k"),
            "the other keeps the logged value, not the teacher's"
        );
        assert_eq!(
            text(&edit.ids),
            logged.replacen(other("j"), own["j"].as_str().unwrap(), 1),
            "laid out as the logged answer"
        );
        assert_eq!(edit.ids.last(), Some(&31));
        assert_eq!(
            counts,
            TeacherAnswerCounts {
                decoded: 1,
                changed: 1,
                fallback: 0,
                edited_fields: 1,
                unconfident: 0,
                masked_fields: 0,
                cached: 0,
            }
        );
        // The confidence in each value of the edit: the teacher's log-probs of its tokens, from
        // a full pass over the edit (one character per token: token i is byte i).
        let confidence_of = |doc: &str, lps: &[f32]| -> Vec<(String, f64)> {
            object_value_spans(doc)
                .unwrap()
                .into_iter()
                .map(|(k, span)| (k, span.map(|i| f64::from(lps[i])).sum()))
                .collect()
        };
        let full: Vec<f32> = tr
            .answer_pass(
                &tctx,
                &edit.ids,
                &AdapterSelection::All(tr.teacher()),
                false,
            )
            .unwrap()
            .logprobs
            .to_vec1()
            .unwrap();
        let want = confidence_of(&text(&edit.ids), &full);
        let got = &outcome.preview.confidence;
        assert_eq!(got.len(), 2, "{got:?}");
        for ((k, x), (wk, wx)) in got.iter().zip(&want) {
            assert_eq!(k, wk);
            assert!((x - wx).abs() < 1e-3, "{k}: {x} vs {wx}");
        }
        let sum: f64 = want.iter().map(|(_, x)| x).sum();
        assert!((outcome.preview.target_logprob() - sum).abs() < 1e-3);
        // Within the margin: nothing is decoded, the logged answer stays the target, and the
        // confidence is the teacher's log-probs of the logged values.
        t_lp[7] = s_lp[7] - 0.4;
        let mut counts = TeacherAnswerCounts::default();
        let outcome = edit_of(&tr, &tctx, &ex, &t_lp, &s_lp, &mut counts);
        assert!(outcome.target.is_none() && outcome.preview.flagged.is_empty());
        assert_eq!(counts, TeacherAnswerCounts::default());
        let want = confidence_of(&logged, &t_lp);
        assert!(
            (want[0].1 + 3.4).abs() < 1e-5,
            "the quoted value's three tokens, one lowered: {want:?}"
        );
        assert_eq!(outcome.preview.confidence, want);
        // An answer that is not a JSON object is not edited.
        ex.answer_ids = ids("abc");
        let short = vec![-2.0f32; ex.answer_ids.len()];
        let outcome = edit_of(&tr, &tctx, &ex, &short, &s_lp[..4], &mut counts);
        assert!(outcome.target.is_none() && outcome.preview.shifts.is_empty());
    }

    #[test]
    fn the_teachers_answer_can_be_contrasted_with_the_control_critique() {
        let mut cfg = weights(0.0, 0.0, 1.0, 0.0);
        cfg.teacher_contrast = 1.5;
        let mut tr = Trainer::new(model(), cfg, "p").unwrap();
        let (dec, rf, text) = guided();
        tr.set_decoding(dec);
        let ex = example(3, false, true, None);
        let tctx = ex.teacher_context_ids.clone().unwrap();
        let cctx = ex.control_context_ids.clone().unwrap();
        let own = tr
            .teacher_answer(
                &mut TeacherPrompts::default(),
                &tctx,
                Some(&cctx),
                Some(&rf),
            )
            .unwrap()
            .unwrap();
        let doc = text(&own.ids);
        assert!(
            serde_json::from_str::<serde_json::Value>(&doc).is_ok(),
            "{doc}"
        );
        // The decoding's logits are 2.5·teacher − 1.5·control, both teacher passes over the
        // answer after their own prompts.
        let full = |ctx: &[u32]| teacher_logits(&tr, ctx, &own.ids);
        let want = ((full(&tctx) * 2.5).unwrap() - (full(&cctx) * 1.5).unwrap()).unwrap();
        let diff = max_abs_diff(&want, &own.logits);
        assert!(
            diff < 2e-3,
            "contrasted decode vs full passes differ by {diff}"
        );
        let plain_logits = full(&tctx);
        assert!(
            max_abs_diff(&plain_logits, &own.logits) > 1e-2,
            "the control changes the logits"
        );
        // Without a control prompt, or with α = 0, the decoding is the teacher's alone.
        for alpha in [1.5, 0.0] {
            tr.cfg.teacher_contrast = alpha;
            let ctl = (alpha == 0.0).then_some(cctx.as_slice());
            let plain = tr
                .teacher_answer(&mut TeacherPrompts::default(), &tctx, ctl, Some(&rf))
                .unwrap()
                .unwrap();
            let full = teacher_logits(&tr, &tctx, &plain.ids);
            assert!(max_abs_diff(&full, &plain.logits) < 1e-3, "α = {alpha}");
        }
    }

    #[test]
    fn the_edit_measures_the_feedback_against_the_student_or_the_control() {
        let (mut tr, rf, ids) = edit_trainer(0.0);
        let mut ex = example(5, false, true, None);
        ex.answer_format = Some(rf);
        ex.answer_ids = ids(r#"{"j": "a", "k": "b"}"#);
        let lp = |ctx: &[u32], adapter: &Adapter| -> Vec<f32> {
            tr.answer_pass(ctx, &ex.answer_ids, &AdapterSelection::All(adapter), false)
                .unwrap()
                .logprobs
                .to_vec1()
                .unwrap()
        };
        let t = lp(ex.teacher_context_ids.as_deref().unwrap(), tr.teacher());
        let c = lp(ex.control_context_ids.as_deref().unwrap(), tr.teacher());
        let s = lp(&ex.context_ids, tr.policy());
        // One character per token: token i is byte i of the logged text.
        let spans = object_value_spans(r#"{"j": "a", "k": "b"}"#).unwrap();
        let shift = |r: &[f32], field: usize| -> f64 {
            spans[field]
                .1
                .clone()
                .map(|i| f64::from(t[i]) - f64::from(r[i]))
                .sum()
        };
        for (baseline, reference) in [(EditBaseline::Student, &s), (EditBaseline::Control, &c)] {
            tr.cfg.edit_baseline = baseline;
            let preview = tr.edit_preview(&ex).unwrap().unwrap();
            assert_eq!(preview.logged, r#"{"j": "a", "k": "b"}"#);
            for (field, (key, got)) in preview.shifts.iter().enumerate() {
                assert_eq!(key, &spans[field].0);
                let want = shift(reference, field);
                assert!(
                    (got - want).abs() < 1e-4,
                    "{baseline:?} {key}: {got} vs {want}"
                );
            }
            let below: Vec<String> = preview
                .shifts
                .iter()
                .filter(|(_, x)| *x < 0.0)
                .map(|(k, _)| k.clone())
                .collect();
            assert_eq!(preview.flagged, below, "{baseline:?}");
            assert_eq!(preview.teacher.is_some(), !below.is_empty());
        }
        assert!(
            (shift(&s, 0) - shift(&c, 0)).abs() > 1e-3,
            "the two references differ, so the test tells them apart"
        );
    }

    #[test]
    fn an_edit_target_below_the_confidence_floor_is_not_distilled_on() {
        let (mut tr, rf, ids) = edit_trainer(1.0);
        let mut ex = example(6, false, true, None);
        ex.answer_format = Some(rf);
        ex.answer_ids = ids(r#"{"j": "b", "k": "c"}"#);
        let confidence = tr.edit_preview(&ex).unwrap().unwrap().target_logprob();
        assert!(confidence < -0.5, "{confidence}");
        // Just above the target's confidence: the example is counted and not distilled on.
        tr.cfg.min_target_logprob = Some(confidence + 0.1);
        let before = logprob_of(&tr, &ex.context_ids, &ex.answer_ids);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 1, "{r:?}");
        assert_eq!(r.unlearned, vec![ex.record_id], "nothing to replay: {r:?}");
        assert!(r.terms.is_empty(), "{r:?}");
        assert!(r.skipped.is_some(), "nothing to learn: {r:?}");
        assert_eq!(logprob_of(&tr, &ex.context_ids, &ex.answer_ids), before);
        // Just below: the same example is distilled on.
        tr.cfg.min_target_logprob = Some(confidence - 0.1);
        let r = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert_eq!(r.teacher_answers.unwrap().unconfident, 0, "{r:?}");
        assert!(r.unlearned.is_empty(), "{r:?}");
        assert!(
            r.terms.contains_key("distill") && r.skipped.is_none(),
            "{r:?}"
        );
        // The floor is a log-probability.
        for floor in [0.5, f64::NAN, f64::NEG_INFINITY] {
            let cfg = TrainerConfig {
                min_target_logprob: Some(floor),
                ..TrainerConfig::default()
            };
            let err = cfg.check().unwrap_err().to_string();
            assert!(err.contains("min_target_logprob"), "{floor}: {err}");
        }
    }

    /// Step `i` of a trainer with a replay cache (`a`) and one without (`b`): the same loss and
    /// terms; fewer tokens run on a replay, the same otherwise.
    fn assert_same_step_fewer_tokens_on_replay(
        a: &StepReport,
        b: &StepReport,
        i: usize,
        replay: bool,
    ) {
        assert_eq!(a.loss, b.loss, "step {i}");
        assert_eq!(a.terms, b.terms, "step {i}");
        if replay {
            assert!(
                a.tokens < b.tokens,
                "step {i}: {} vs {}",
                a.tokens,
                b.tokens
            );
        } else {
            assert_eq!(a.tokens, b.tokens, "step {i}");
        }
    }

    #[test]
    fn a_frozen_teachers_work_is_reused_on_replay_with_the_same_result() {
        // The edit against the control critique with a frozen teacher reads the teacher alone:
        // a replayed example takes it from the cache, and the step is the one recomputing
        // would have made (same loss and terms, same weights), at fewer tokens.
        let make = |cache: usize| {
            let (mut tr, rf, ids) = edit_trainer(1.0);
            tr.cfg.edit_baseline = EditBaseline::Control;
            tr.cfg.teacher_cache_examples = cache;
            (tr, rf, ids)
        };
        let (mut cached, rf, ids) = make(64);
        let (mut plain, _, _) = make(0);
        let mut ex = example(5, false, true, None);
        ex.answer_format = Some(rf);
        ex.answer_ids = ids(r#"{"j": "a", "k": "b"}"#);
        let other = example(6, false, true, None);
        for (i, batch) in [&ex, &ex, &other, &ex].into_iter().enumerate() {
            let a = cached.step(std::slice::from_ref(batch)).unwrap();
            let b = plain.step(std::slice::from_ref(batch)).unwrap();
            let replay = i == 1 || i == 3;
            assert_same_step_fewer_tokens_on_replay(&a, &b, i, replay);
            let (ca, cb) = (a.teacher_answers.unwrap(), b.teacher_answers.unwrap());
            assert_eq!(ca.cached, usize::from(replay), "step {i}: {ca:?}");
            assert_eq!(cb.cached, 0);
            assert_eq!(TeacherAnswerCounts { cached: 0, ..ca }, cb, "step {i}");
            if batch.record_id == ex.record_id {
                assert_eq!(cb.changed, 1, "the example is edited: {cb:?}");
            }
        }
        let (wa, wb) = (
            cached.policy().tensors().unwrap(),
            plain.policy().tensors().unwrap(),
        );
        for (k, v) in &wa {
            assert_eq!(max_abs_diff(v, &wb[k]), 0.0, "{k}");
        }
        // A cache of one holds only the latest example; the same record id with other answer
        // tokens is not a hit.
        let (mut one, _, _) = make(1);
        let cached_of = |tr: &mut Trainer, ex: &TrainExample| {
            tr.step(std::slice::from_ref(ex))
                .unwrap()
                .teacher_answers
                .unwrap()
                .cached
        };
        assert_eq!(cached_of(&mut one, &ex), 0);
        assert_eq!(cached_of(&mut one, &ex), 1);
        assert_eq!(cached_of(&mut one, &other), 0);
        assert_eq!(cached_of(&mut one, &ex), 0, "evicted by `other`");
        let mut changed = ex.clone();
        changed.answer_ids = ids(r#"{"j": "b", "k": "b"}"#);
        assert_eq!(cached_of(&mut one, &changed), 0);
        // Work that reads the student (the edit against it) or a moving teacher is not cached.
        for (baseline, ema) in [(EditBaseline::Student, 0.0), (EditBaseline::Control, 0.05)] {
            let (mut tr, _, _) = make(64);
            tr.cfg.edit_baseline = baseline;
            tr.cfg.teacher_ema_rate = ema;
            for _ in 0..2 {
                let r = tr.step(std::slice::from_ref(&ex)).unwrap();
                assert_eq!(
                    r.teacher_answers.unwrap().cached,
                    0,
                    "{baseline:?}, ema {ema}"
                );
            }
        }
    }

    #[test]
    fn the_contrast_must_be_finite_and_not_negative() {
        for alpha in [-0.5, f64::NAN, f64::INFINITY] {
            let cfg = TrainerConfig {
                teacher_contrast: alpha,
                ..TrainerConfig::default()
            };
            let err = cfg.check().unwrap_err().to_string();
            assert!(err.contains("teacher_contrast"), "{err}");
        }
        assert!(TrainerConfig::default().check().is_ok());
    }

    #[test]
    fn a_step_on_the_teachers_edit_learns_it_with_hard_targets_too() {
        let (mut tr, rf, ids) = edit_trainer(1.0);
        // Logged answers on every combination of values: with margin 0 some field of some
        // answer is always spoken against (the teacher's context differs from the student's).
        let mut changed = 0;
        for (j, k) in [("a", "a"), ("b", "c"), ("c", "b"), ("a", "c"), ("c", "a")] {
            let mut ex = example(3, false, true, None);
            ex.answer_format = Some(rf.clone());
            ex.answer_ids = ids(&format!(r#"{{"j": "{j}", "k": "{k}"}}"#));
            let r = tr.step(std::slice::from_ref(&ex)).unwrap();
            assert!(r.skipped.is_none(), "{r:?}");
            let c = r.teacher_answers.unwrap();
            assert_eq!(c.fallback, 0);
            assert!(r.terms.contains_key("distill"));
            assert_eq!(r.terms.contains_key("target_ce"), c.changed == 1, "{r:?}");
            changed += c.changed;
        }
        assert!(changed > 0, "some logged answer was edited");
    }

    /// Sum of the answer's log-probs after `ctx` with the prompt's keys and values taken from
    /// `prefix_adapter` and the answer positions run under `tail_adapter` (no graph).
    fn split_logprob(
        tr: &Trainer,
        ctx: &[u32],
        ans: &[u32],
        prefix_adapter: &Adapter,
        tail_adapter: &Adapter,
    ) -> f64 {
        let dev = Device::Cpu;
        let head = ctx.len() - 1;
        let mut cache = KvCache::new();
        let input = Tensor::from_slice(&ctx[..head], (1, head), &dev).unwrap();
        tr.model
            .hidden(
                &input,
                &BatchLayout::dense(1, head, 0),
                Some(&mut cache),
                &AdapterSelection::All(prefix_adapter),
                false,
            )
            .unwrap();
        let tail: Vec<u32> = ctx[head..]
            .iter()
            .chain(&ans[..ans.len() - 1])
            .copied()
            .collect();
        let n = tail.len();
        let input = Tensor::from_vec(tail, (1, n), &dev).unwrap();
        let h = tr
            .model
            .hidden(
                &input,
                &BatchLayout::dense(1, n, head),
                Some(&mut cache),
                &AdapterSelection::All(tail_adapter),
                false,
            )
            .unwrap()
            .squeeze(0)
            .unwrap();
        let logits = tr.model.logits(&h).unwrap();
        let targets = Tensor::from_slice(ans, ans.len(), &dev).unwrap();
        token_logprobs(&logits, &targets)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64
    }

    /// An SFT trainer after a few exact steps on an example with a correction (so that the
    /// adapter is not zero: B starts at zero), and that example.
    fn sft_trained() -> (Trainer, TrainExample) {
        let mut tr = Trainer::new(model(), weights(1.0, 0.0, 0.0, 0.0), "p").unwrap();
        let ex = example(4, true, false, None);
        for _ in 0..3 {
            tr.step(std::slice::from_ref(&ex)).unwrap();
        }
        (tr, ex)
    }

    #[test]
    fn a_detached_prefix_keeps_the_forward_and_its_gradient_matches_finite_differences() {
        let (mut tr, ex) = sft_trained();
        let (ctx, ans) = (ex.context_ids.clone(), vec![7u32, 8, 9, 10, 11]);
        let pass = |tr: &Trainer| {
            tr.answer_pass(&ctx, &ans, &AdapterSelection::All(tr.policy()), true)
                .unwrap()
        };
        let exact = pass(&tr);
        tr.cfg.prefix_grad = false;
        let detached = pass(&tr);
        let diff = max_abs_diff(&exact.logits, &detached.logits);
        assert!(
            diff < 1e-4,
            "the KV-cached prompt changes the logits by {diff}"
        );

        // The detached gradient is the derivative with the prompt's keys and values held at the
        // current weights: check it along its own direction against central differences.
        let vars = tr.policy().vars();
        let mut grads = detached.logprobs.sum_all().unwrap().backward().unwrap();
        let g: Vec<Option<Tensor>> = vars.iter().map(|v| grads.remove(v.as_tensor())).collect();
        let norm = g
            .iter()
            .flatten()
            .map(|t| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            })
            .sum::<f64>()
            .sqrt();
        assert!(
            norm > 1e-3,
            "the answer positions carry a gradient ({norm})"
        );
        let frozen = tr.policy().snapshot("frozen", tr.model.config()).unwrap();
        let originals: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().copy().unwrap()).collect();
        let eps = 1e-2;
        let at = |sign: f64| {
            for ((v, o), gv) in vars.iter().zip(&originals).zip(&g) {
                let moved = match gv {
                    Some(gv) => (o + (gv * (sign * eps / norm)).unwrap()).unwrap(),
                    None => o.clone(),
                };
                v.set(&moved).unwrap();
            }
            split_logprob(&tr, &ctx, &ans, &frozen, tr.policy())
        };
        let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
        for (v, o) in vars.iter().zip(&originals) {
            v.set(o).unwrap();
        }
        let rel = (numeric - norm).abs() / norm;
        assert!(
            rel < 2e-2,
            "directional derivative: analytic {norm}, numeric {numeric} (relative error {rel})"
        );

        // And it learns: SFT with a detached prefix from the start raises log p(correction).
        let mut cfg = weights(1.0, 0.0, 0.0, 0.0);
        cfg.prefix_grad = false;
        let mut tr = Trainer::new(model(), cfg, "p").unwrap();
        let before = logprob_of(&tr, &ex.context_ids, &[10, 11, 12]);
        for _ in 0..5 {
            tr.step(std::slice::from_ref(&ex)).unwrap();
        }
        let after = logprob_of(&tr, &ex.context_ids, &[10, 11, 12]);
        assert!(
            after > before + 0.5,
            "log p(correction): {before} -> {after}"
        );
    }

    #[test]
    fn the_policys_passes_after_one_prompt_match_separate_passes_and_their_gradients() {
        // One step's passes over two answers (the logged one and the teacher's target) share
        // the policy's prompt: the same logits and the same gradient as two full passes, with
        // the prompt's graph (exact prefix) and without it (detached prefix).
        let (mut tr, ex) = sft_trained();
        let ctx = ex.context_ids.clone();
        let answers = [vec![7u32, 8, 9], vec![10u32, 11, 12, 13]];
        let grads_of = |tr: &Trainer, passes: &[AnswerPass]| -> Vec<Option<Tensor>> {
            let mut loss: Option<Tensor> = None;
            for p in passes {
                push(&mut loss, p.logprobs.sum_all().unwrap()).unwrap();
            }
            let mut g = loss.unwrap().backward().unwrap();
            tr.policy()
                .vars()
                .iter()
                .map(|v| g.remove(v.as_tensor()))
                .collect()
        };
        for prefix_grad in [true, false] {
            tr.cfg.prefix_grad = prefix_grad;
            let separate: Vec<AnswerPass> = answers
                .iter()
                .map(|a| tr.policy_pass(&ctx, a).unwrap())
                .collect();
            let prompt = tr.policy_prompt(&ctx).unwrap();
            let shared: Vec<AnswerPass> = answers
                .iter()
                .map(|a| tr.policy_pass_after(&prompt, &ctx, a).unwrap())
                .collect();
            for (a, b) in separate.iter().zip(&shared) {
                let diff = max_abs_diff(&a.logits, &b.logits);
                assert!(
                    diff < 1e-4,
                    "prefix_grad {prefix_grad}: logits differ by {diff}"
                );
            }
            let (ga, gb) = (grads_of(&tr, &separate), grads_of(&tr, &shared));
            let mut compared = 0;
            for (a, b) in ga.iter().zip(&gb) {
                match (a, b) {
                    (Some(a), Some(b)) => {
                        let scale = a.abs().unwrap().max_keepdim(0).unwrap();
                        let scale = scale.max_keepdim(1).unwrap().flatten_all().unwrap();
                        let scale = scale.to_vec1::<f32>().unwrap()[0].max(1e-6);
                        let rel = max_abs_diff(a, b) / scale;
                        assert!(
                            rel < 1e-3,
                            "prefix_grad {prefix_grad}: gradient off by {rel}"
                        );
                        compared += 1;
                    }
                    (None, None) => {}
                    _ => panic!("prefix_grad {prefix_grad}: a gradient on one side only"),
                }
            }
            assert!(
                compared > 0,
                "prefix_grad {prefix_grad}: no gradient compared"
            );
        }
        assert!(tr.policy_prompt(&[]).is_err(), "an empty prompt is refused");
        let prompt = tr.policy_prompt(&ctx).unwrap();
        assert!(tr.policy_pass_after(&prompt, &ctx, &[]).is_err());
        assert!(tr.policy_pass_after(&prompt, &ctx[..2], &[7]).is_err());
    }

    #[test]
    fn the_base_models_pass_is_reused_on_replay_with_the_same_result() {
        // The base model never changes: a replayed example's base pass (the KL guard's and
        // KTO's reference) comes from the cache and the step is the one recomputing it would
        // have made, at fewer tokens. Every objective on, a KL budget of 0 so the penalty reads
        // the base logits; and a pure-SFT trainer, whose guard reads the base over the correction.
        let make = |mut cfg: TrainerConfig, cache: usize| {
            cfg.kl_budget = 0.0;
            cfg.base_cache_examples = cache;
            Trainer::new(model(), cfg, "p").unwrap()
        };
        let cases = [
            (weights(1.0, 1.0, 1.0, 1.0), (true, true, Some(false))),
            (weights(1.0, 0.0, 0.0, 0.0), (true, false, None)),
        ];
        for (cfg, (corr, teacher, thumbs)) in cases {
            let mut cached = make(cfg.clone(), 64);
            let mut plain = make(cfg, 0);
            let ex = example(5, corr, teacher, thumbs);
            let other = example(6, corr, teacher, thumbs.map(|t| !t));
            for (i, batch) in [&ex, &ex, &other, &ex].into_iter().enumerate() {
                let a = cached.step(std::slice::from_ref(batch)).unwrap();
                let b = plain.step(std::slice::from_ref(batch)).unwrap();
                assert_same_step_fewer_tokens_on_replay(&a, &b, i, i == 1 || i == 3);
                // (The adapter starts as the base: KL 0 at the first step.)
                let penalised = a.terms.contains_key("kl_penalty");
                assert!(i == 0 || penalised, "step {i}: {:?}", a.terms);
            }
            let (wa, wb) = (
                cached.policy().tensors().unwrap(),
                plain.policy().tensors().unwrap(),
            );
            for (k, v) in &wa {
                assert_eq!(max_abs_diff(v, &wb[k]), 0.0, "{k}");
            }
        }
    }

    #[test]
    fn dense_rewards_follow_the_sign_of_the_feedback() {
        for up in [true, false] {
            let mut cfg = weights(0.0, 0.0, 0.0, 1.0);
            cfg.kl_penalty = 0.0;
            let mut tr = Trainer::new(model(), cfg, "p").unwrap();
            let ex = example(3, false, false, Some(up));
            let before = logprob_of(&tr, &ex.context_ids, &ex.answer_ids);
            for _ in 0..5 {
                let r = tr.step(std::slice::from_ref(&ex)).unwrap();
                assert!(r.advantage_mean.is_some());
            }
            let after = logprob_of(&tr, &ex.context_ids, &ex.answer_ids);
            assert_eq!(after > before, up, "reward sign {up}: {before} -> {after}");
            assert!(
                tr.state().baselines["default"] != 0.0,
                "the baseline tracks rewards"
            );
        }
    }

    #[test]
    fn non_finite_losses_are_refused_and_leave_weights_untouched() {
        let mut tr = Trainer::new(model(), weights(0.0, 0.0, 0.0, 1.0), "p").unwrap();
        let mut ex = example(4, false, false, Some(true));
        ex.reward = Some(f64::NAN);
        let before = tr.snapshot_policy("b").unwrap().tensors().unwrap();
        let r = tr.step(&[ex]).unwrap();
        assert!(r.skipped.is_some(), "{r:?}");
        assert_eq!(tr.state().skipped_steps, 1);
        for (k, t) in tr.policy().tensors().unwrap() {
            let d = (t - &before[&k]).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k} changed");
        }
    }

    #[test]
    fn kl_budget_penalty_applies_only_above_the_budget() {
        let mut cfg = weights(1.0, 0.0, 0.0, 0.0);
        cfg.kl_budget = 0.0;
        cfg.kl_penalty = 1.0;
        let mut tr = Trainer::new(model(), cfg.clone(), "p").unwrap();
        let ex = example(5, true, false, Some(false));
        let first = tr.step(std::slice::from_ref(&ex)).unwrap();
        assert!(
            first.kl_to_base.abs() < 1e-6,
            "a fresh adapter is the base model"
        );
        let mut later = first.clone();
        for _ in 0..4 {
            later = tr.step(std::slice::from_ref(&ex)).unwrap();
        }
        assert!(later.kl_to_base > 0.0);
        assert!(later.terms.contains_key("kl_penalty"), "{later:?}");
        cfg.kl_budget = 1e9;
        let mut tr = Trainer::new(model(), cfg, "p").unwrap();
        for _ in 0..5 {
            let r = tr.step(std::slice::from_ref(&ex)).unwrap();
            assert!(!r.terms.contains_key("kl_penalty"));
        }
    }

    #[test]
    fn save_and_load_resume_identically() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = weights(1.0, 1.0, 1.0, 1.0);
        let batch = vec![
            example(6, true, true, Some(false)),
            example(7, false, true, Some(true)),
        ];
        let mut a = Trainer::new(model(), cfg.clone(), "p").unwrap();
        for _ in 0..3 {
            a.step(&batch).unwrap();
        }
        a.save(dir.path()).unwrap();
        let mut b = Trainer::new(model(), cfg, "p").unwrap();
        b.load(dir.path()).unwrap();
        assert_eq!(a.state(), b.state());
        let ra = a.step(&batch).unwrap();
        let rb = b.step(&batch).unwrap();
        assert_eq!(ra.loss, rb.loss);
        for (k, t) in a.policy().tensors().unwrap() {
            let d = (t - &b.policy().tensors().unwrap()[&k])
                .unwrap()
                .abs()
                .unwrap();
            assert_eq!(d.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "{k}");
        }
    }
}
