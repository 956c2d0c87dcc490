//! The hindsight teacher's own work: decoding its answer under the request's grammar, editing
//! the logged answer where the feedback speaks against it, and how confident it is in each
//! value; cached for replays while the teacher is frozen.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;
use tracing::debug;

use super::*;

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
pub(super) struct TeacherAnswer {
    pub(super) ids: Vec<u32>,
    pub(super) logits: Tensor,
    /// For a decoded answer: per token, its log-probability among the tokens the decoding
    /// allowed at that step ([`choice_logprob`]); `None` for a target the teacher was given.
    pub(super) choices: Option<Vec<f64>>,
}

impl TeacherAnswer {
    /// The log-probability of each of the answer's tokens under its logits.
    pub(super) fn logprobs(&self) -> Result<Vec<f64>> {
        let ids = Tensor::from_slice(&self.ids, self.ids.len(), self.logits.device())?;
        let lps: Vec<f32> = token_logprobs(&self.logits.to_dtype(DType::F32)?, &ids)?.to_vec1()?;
        Ok(lps.into_iter().map(f64::from).collect())
    }
}

/// Per top-level field of the JSON-object answer `ids` (empty for any other answer): the sum
/// of `lps` (one per token) over the field value's tokens ([`EditPreview::confidence`]).
pub(super) fn value_confidence(
    dec: &TeacherDecoding,
    ids: &[u32],
    lps: &[f64],
) -> Vec<(String, f64)> {
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
    /// ([`ExperimentalTrainer::edit_baseline`]), summed over the value's tokens (nats).
    pub shifts: Vec<(String, f64)>,
    /// The fields whose shift is below `-experimental.edit_margin_nats`.
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
    /// that is not a JSON object): how confident the teacher is in the target as a whole.
    pub fn target_logprob(&self) -> f64 {
        self.confidence.iter().map(|(_, lp)| lp).sum()
    }
}

/// The text of `ids` and each token's byte range in it (the end-of-turn token is empty).
pub(super) fn answer_text(
    dec: &TeacherDecoding,
    ids: &[u32],
) -> (String, Vec<std::ops::Range<usize>>) {
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
pub(super) struct AnswerField {
    pub(super) key: String,
    /// The value's byte range in the answer's text.
    pub(super) value: std::ops::Range<usize>,
    /// The answer's tokens (indices) that overlap the value.
    pub(super) tokens: Vec<usize>,
}

/// The text of `ids` and its top-level fields, each with its value's tokens; `None` for an
/// answer that is not a JSON object. The one place a field's value is mapped to tokens: the
/// edit's shifts and the per-field confidence sum over these.
pub(super) fn answer_fields(
    dec: &TeacherDecoding,
    ids: &[u32],
) -> (String, Option<Vec<AnswerField>>) {
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
pub(super) fn field_sums(fields: &[AnswerField], values: &[f64]) -> Vec<(String, f64)> {
    fields
        .iter()
        .map(|f| {
            let sum = f.tokens.iter().filter_map(|&i| values.get(i)).sum();
            (f.key.clone(), sum)
        })
        .collect()
}

/// An edit and the teacher's spelling of it (the distillation target).
#[derive(Clone)]
pub(super) struct EditOutcome {
    pub(super) preview: EditPreview,
    pub(super) target: Option<TeacherAnswer>,
}

/// The teacher's work on one example that depends on the teacher alone: with a frozen teacher
/// it is the same every time the example is trained.
#[derive(Clone)]
pub(super) struct TeacherWork {
    /// The teacher's pass over the logged answer ([`DistillTarget::Edit`]).
    pub(super) pass: Option<AnswerPass>,
    /// The target: the teacher's own answer or the edit (`None`: the logged answer).
    pub(super) target: Option<TeacherAnswer>,
    /// The counts the work added when it was made.
    pub(super) counts: TeacherAnswerCounts,
    /// The tokens its passes cost when it was made.
    pub(super) tokens: usize,
}

/// The teacher's keys and values for the prompts of one example's teacher work (the hindsight
/// prompt, the control prompt). Each prompt but its last token runs through the teacher once
/// ([`Trainer::prompt_cache`]); every pass after it — over the logged answer, the decoding, the
/// edit's scoring pass — starts from a copy, so a prompt of hundreds of tokens is not run three
/// times for one example. Counts the tokens its passes ran. Made per example (it is valid for
/// one teacher).
#[derive(Default)]
pub(super) struct TeacherPrompts {
    pub(super) caches: Vec<(Vec<u32>, KvCache)>,
    pub(super) tokens: usize,
}

impl Trainer {
    /// The decoding vocabulary, or an error naming what sets it.
    pub(super) fn decoding(&self) -> Result<&TeacherDecoding> {
        self.decoding.as_ref().ok_or_else(|| {
            LearnerError::InvalidArgument(
                "distill_target = teacher (or experimental.edit_target) needs the tokenizer's vocabulary (Trainer::set_decoding)"
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
    pub(super) fn teacher_decode(
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
            // Detached: the teacher's weights are variables, and a kept row would otherwise
            // keep the decoding's whole graph (its KV cache included) alive in the cache.
            rows.push(logits.detach());
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
    /// with the teacher after `control` when `experimental.teacher_contrast > 0` and a control prompt is
    /// given. Returns the answer and the logits at the positions that predict it (the
    /// decoding's own forward passes), or `None` when it does not finish within the token
    /// limit.
    pub(super) fn teacher_answer(
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
        let alpha = self.cfg.experimental.teacher_contrast;
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
    pub(super) fn teacher_spells(
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
    pub(super) fn edit_tokens(
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
    pub(super) fn edit_reference(
        &self,
        prompts: &mut TeacherPrompts,
        ex: &TrainExample,
        student: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Vec<f32>> {
        match (
            self.cfg.experimental.edit_baseline,
            ex.control_context_ids.as_deref(),
        ) {
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
    pub(super) fn teacher_edit(
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
    pub(super) fn edit_target(
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
            .filter(|(_, (_, shift))| *shift < -self.cfg.experimental.edit_margin_nats)
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

    /// The teacher's work on `ex` for [`DistillTarget::Teacher`] (its own answer) or
    /// [`DistillTarget::Edit`] (its pass over the logged answer, the edit and the confidence
    /// in it); `s_lp` are the student's log-probs of the logged tokens (the edit's default
    /// reference).
    pub(super) fn teacher_work(
        &self,
        tctx: &[u32],
        ex: &TrainExample,
        s_lp: &[f32],
    ) -> Result<TeacherWork> {
        let mut counts = TeacherAnswerCounts::default();
        let mut prompts = TeacherPrompts::default();
        if self.cfg.target() == DistillTarget::Teacher {
            let control = ex.control_context_ids.as_deref();
            let own =
                self.teacher_answer(&mut prompts, tctx, control, ex.answer_format.as_ref())?;
            counts.decoded += 1;
            match &own {
                Some(a) => {
                    counts.changed += usize::from(a.ids != ex.answer_ids);
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        // The teacher's confidence in its values, per field: over the whole
                        // vocabulary and among the choices the grammar allowed (read by
                        // bench/python/edit_diagnostic.py).
                        let dec = self.decoding()?;
                        let fields = answer_fields(dec, &a.ids).1.unwrap_or_default();
                        let vocabulary = field_sums(&fields, &a.logprobs()?);
                        let decision = a
                            .choices
                            .as_deref()
                            .map(|c| field_sums(&fields, c))
                            .unwrap_or_default();
                        let joint = vocabulary.iter().map(|(_, lp)| lp).sum::<f64>();
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
        debug!(record = %ex.record_id, per_field = ?edit.preview.confidence, confidence, "The teacher's confidence in the target's values (log p, nats).");
        Ok(TeacherWork {
            pass: Some(pass),
            target: edit.target,
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

    /// The teacher's side of one example's distillation and dense reward: with
    /// `distill_target = teacher` (or the experimental edit) the teacher's own target (from the
    /// cache while the teacher is frozen); and the teacher's pass over the
    /// logged answer where distillation on it or the dense reward needs it.
    pub(super) fn teacher_target(
        &mut self,
        ex: &TrainExample,
        s_lp: &[f32],
        counts: &mut Option<TeacherAnswerCounts>,
        tokens: &mut usize,
    ) -> Result<TeacherTarget> {
        let w = self.cfg.objectives;
        let mut teacher = None;
        let own = match &ex.teacher_context_ids {
            Some(tctx) if w.distill > 0.0 && self.cfg.target() != DistillTarget::Logged => {
                let cacheable = self.caches_teacher_work(ex);
                let hit = cacheable
                    .then(|| self.cache.get(ex.record_id, &ex.answer_ids).cloned())
                    .flatten();
                let c = counts.get_or_insert_with(Default::default);
                let work = match hit {
                    Some(work) => {
                        c.cached += 1;
                        debug!(record = %ex.record_id, "The frozen teacher's target, from the cache.");
                        work
                    }
                    None => {
                        let work = self.teacher_work(tctx, ex, s_lp)?;
                        *tokens += work.tokens;
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
                work.target
            }
            _ => None,
        };
        if teacher.is_none()
            && ex.teacher_context_ids.is_some()
            && (w.dense > 0.0 || w.distill > 0.0 && own.is_none())
        {
            *tokens += ex.teacher_context_ids.as_ref().map_or(0, Vec::len) + ex.answer_ids.len();
            teacher = Some(self.teacher_pass_after(
                &mut TeacherPrompts::default(),
                ex.teacher_context_ids.as_deref().unwrap_or_default(),
                &ex.answer_ids,
            )?);
        }
        Ok(TeacherTarget { own, teacher })
    }
}

/// The teacher's side of one example ([`Trainer::teacher_target`]).
pub(super) struct TeacherTarget {
    /// The teacher's own target (answer or edit); `None`: distil on the logged answer.
    pub(super) own: Option<TeacherAnswer>,
    /// The teacher's pass over the logged answer, where one ran.
    pub(super) teacher: Option<AnswerPass>,
}
