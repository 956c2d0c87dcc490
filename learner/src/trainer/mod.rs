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
use tracing::{debug, info_span, warn};

use crate::error::{LearnerError, Result};
use crate::example::TrainExample;
use crate::objectives::{
    dense_advantages, distill_loss, kl_exact, kto_loss, mean, pg_loss, token_logprobs,
};
use crate::optim::AdamW;
use hindsight_model::encode;

mod behaviour;
mod config;
mod loss;
mod teacher;
mod terms;
#[cfg(test)]
mod tests;

pub use config::{
    BehaviourLogprobs, DistillTarget, EditBaseline, ExperimentalTrainer, ObjectiveWeights,
    TrainerConfig,
};
use hindsight_model::grammar::{
    allowed_by_grammar, best_allowed, choice_logprob, object_value_spans, response_format_grammar,
    JsonState, OJson,
};
use hindsight_model::ops;
use hindsight_model::{Adapter, AdapterSelection, LoraInit};
use hindsight_model::{BatchLayout, KvCache, Model};
pub use teacher::{EditPreview, TeacherAnswerCounts, TeacherDecoding};
use teacher::{TeacherPrompts, TeacherTarget, TeacherWork};
use terms::StepStats;

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
    /// With [`DistillTarget::Teacher`] (or the experimental edit): examples whose teacher
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
    /// Examples of the batch that no objective learned from (the KL guard alone does not
    /// count). The online loop keeps them out of its replay buffer, where they would only
    /// cost passes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unlearned: Vec<uuid::Uuid>,
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
            && match self.cfg.target() {
                DistillTarget::Teacher => true,
                DistillTarget::Edit => {
                    self.cfg.experimental.edit_baseline == EditBaseline::Control
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
        // Without `train` nothing back-propagates through these rows, but the adapters' weights
        // are variables (the teacher's too), so the rows would carry the whole forward graph
        // (every layer's activations over the prompt and the answer) for as long as they are
        // kept: the teacher's cached work held ~150 MB an example that way.
        let rows = hidden.squeeze(0)?;
        Ok(if train { rows } else { rows.detach() })
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
        let mut stats = StepStats::default();

        for ex in batch {
            let Some(ex_loss) = self.example_loss(ex, &mut report, &mut stats)? else {
                continue;
            };
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

        // Running statistics move whether or not the step is applied: they describe the data.
        let (baseline_updates, z_updates) = stats.into_report(&mut report);
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
        self.apply_update(report, acc, &vars, started)
    }

    /// The update of a step whose loss is finite: the accumulated per-example gradients,
    /// clipped, through AdamW, the weights checked (a non-finite result is rolled back), then the
    /// teacher's EMA move.
    fn apply_update(
        &mut self,
        mut report: StepReport,
        acc: Vec<Option<Tensor>>,
        vars: &[candle_core::Var],
        started: Instant,
    ) -> Result<StepReport> {
        // A gradient store holding only the adapter's variables (a zero-valued graph over them),
        // then filled with the accumulated gradients.
        let mut zero: Option<Tensor> = None;
        for v in vars {
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
        for (slot, var) in acc.into_iter().zip(vars) {
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
