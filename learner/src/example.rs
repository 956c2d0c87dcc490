//! From a joined episode turn (`hindsight.episodes`) to a training example: the context
//! exactly as the model saw it (chat template), the answer tokens the behaviour policy sampled,
//! their behaviour log-probs, the hindsight teacher's context (the same context plus a message
//! carrying the text feedback), the correction's tokens, and the scalar signals.

use hindsight_feedback::{Correction, EpisodeRecord, FeedbackEvent, FeedbackValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokenizers::Tokenizer;
use uuid::Uuid;

use crate::error::{LearnerError, Result};
use crate::teacher_prompt::{hindsight_messages, HindsightPlacement};
use hindsight_model::encode;
use hindsight_model::grammar::{with_answer_key_order, OJson};
use hindsight_model::{prompt_tools, ChatInputError, ChatTemplate};

/// How examples are built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExampleConfig {
    /// Where the teacher sees the feedback. `user-note` (the critique appended to the user's
    /// message) is the placement under which the default model does best in hindsight.
    #[serde(default = "default_placement")]
    pub placement: HindsightPlacement,
    /// Longest context (tokens) trained on; longer ones are skipped and counted.
    #[serde(default = "default_max_context_tokens")]
    pub max_context_tokens: usize,
    /// Longest answer (tokens) trained on.
    #[serde(default = "default_max_answer_tokens")]
    pub max_answer_tokens: usize,
    /// The range of `score` feedback, mapped linearly onto [-1, 1].
    #[serde(default = "default_score_range")]
    pub score_range: [f64; 2],
    /// A critique that says nothing about the answer's content. The teacher shown it in place
    /// of the real feedback is the counterfactual control read only by the experimental
    /// knobs (`trainer.experimental.edit_baseline = "control"`,
    /// `trainer.experimental.teacher_contrast`): what the real critique changes beyond "there
    /// is a complaint" is what its content says. Empty: no control context is built.
    #[serde(default = "default_control_feedback")]
    pub control_feedback: String,
}

fn default_placement() -> HindsightPlacement {
    HindsightPlacement::UserNote
}
fn default_max_context_tokens() -> usize {
    1536
}
fn default_max_answer_tokens() -> usize {
    512
}
fn default_score_range() -> [f64; 2] {
    [0.0, 1.0]
}
fn default_control_feedback() -> String {
    "That answer is not right.".into()
}

impl Default for ExampleConfig {
    fn default() -> Self {
        Self {
            placement: default_placement(),
            max_context_tokens: default_max_context_tokens(),
            max_answer_tokens: default_max_answer_tokens(),
            score_range: default_score_range(),
            control_feedback: default_control_feedback(),
        }
    }
}

/// One training example.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainExample {
    /// The episode record's deterministic id.
    pub record_id: Uuid,
    /// The turn (interaction id).
    pub turn: Uuid,
    /// Route that served it (baselines are kept per route).
    pub route: String,
    /// Adapter name and version that produced the answer (`None` = base model).
    pub adapter: Option<(String, u64)>,
    /// The prompt tokens (chat template with the generation prompt).
    pub context_ids: Vec<u32>,
    /// The logged answer's tokens, ending with the end-of-turn token.
    pub answer_ids: Vec<u32>,
    /// Behaviour log-prob per answer token (NaN where unknown, e.g. the appended end token).
    pub behaviour_logprobs: Option<Vec<f32>>,
    /// How the logged answer was sampled, as far as the request tells: the distribution the
    /// behaviour log-probs of `hindsight serve` describe.
    pub sampling: Sampling,
    /// The teacher's prompt tokens (context + hindsight feedback), when there is text feedback.
    pub teacher_context_ids: Option<Vec<u32>>,
    /// The teacher's prompt with the content-free critique
    /// ([`ExampleConfig::control_feedback`]) in place of the feedback, when there is a teacher
    /// prompt and a control critique is configured.
    pub control_context_ids: Option<Vec<u32>>,
    /// A corrected answer's tokens (ending with the end-of-turn token), if any.
    pub correction_ids: Option<Vec<u32>>,
    /// The request's `response_format` (schema properties in the logged answer's key order),
    /// when it asked for one: the teacher's own answer is decoded under the same grammar, so it
    /// has the layout the serve gives answers ([`crate::trainer::DistillTarget::Teacher`]).
    pub answer_format: Option<OJson>,
    /// The last thumbs, if any.
    pub thumbs: Option<bool>,
    /// The scalar reward in [-1, 1] (mean of thumbs, scores and tool outcomes), if any.
    pub reward: Option<f64>,
    /// The text the teacher was shown.
    pub feedback_text: Option<String>,
    /// Feedback ids this example carries.
    pub feedback_ids: Vec<Uuid>,
}

/// How a logged answer was sampled, from its request (OpenAI's defaults where it is silent).
/// `hindsight serve` reports the log-probability of each sampled token under exactly this
/// distribution: the logits divided by `temperature`, renormalised over the tokens the
/// request's grammar allowed (and over the nucleus when `top_p < 1`). The dense term's
/// importance ratio compares the policy with that distribution
/// ([`crate::trainer::BehaviourLogprobs::Sampled`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Sampling temperature; 0 is greedy decoding (a deterministic policy).
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// The serve constrained the answer with a grammar the learner does not rebuild (a tool
    /// call forced by `tool_choice`), so its behaviour log-probs are not comparable.
    pub unknown_grammar: bool,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            unknown_grammar: false,
        }
    }
}

impl Sampling {
    /// The sampling of a logged request's context.
    pub fn of(context: &hindsight_feedback::EpisodeContext) -> Self {
        let forced_tool = context
            .tools
            .as_ref()
            .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
            && match &context.tool_choice {
                Some(Value::String(s)) => s == "required",
                Some(Value::Object(_)) => true,
                _ => false,
            };
        Self {
            temperature: context.temperature.unwrap_or(1.0),
            top_p: context.top_p.unwrap_or(1.0),
            unknown_grammar: forced_tool,
        }
    }
}

impl TrainExample {
    /// Tokens this example costs to train on (student pass; teacher and correction included).
    pub fn cost_tokens(&self) -> usize {
        let student = self.context_ids.len() + self.answer_ids.len();
        let teacher = self
            .teacher_context_ids
            .as_ref()
            .map_or(0, |t| t.len() + self.answer_ids.len());
        let correction = self
            .correction_ids
            .as_ref()
            .map_or(0, |c| self.context_ids.len() + c.len());
        student + teacher + correction
    }
}

/// Why an episode record yields no example (counted per reason in metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// The call failed: there is no answer to learn from.
    NoAnswer,
    /// No usable feedback (all retracted, or only kinds the learner does not use).
    NoFeedback,
    /// The context or answer is longer than configured.
    TooLong,
    /// The messages could not be rendered or tokenized.
    Unrenderable,
    /// The answer was produced by an adapter version too far behind the live one.
    Stale,
}

impl SkipReason {
    /// snake_case name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::NoAnswer => "no_answer",
            SkipReason::NoFeedback => "no_feedback",
            SkipReason::TooLong => "too_long",
            SkipReason::Unrenderable => "unrenderable",
            SkipReason::Stale => "stale",
        }
    }
}

/// Parses a served adapter label `name@version` (anything else, e.g. `base`, is `None`).
pub fn parse_adapter(label: Option<&str>) -> Option<(String, u64)> {
    let (name, version) = label?.rsplit_once('@')?;
    Some((name.to_string(), version.parse().ok()?))
}

/// Text of an assistant message: its content plus its tool calls as JSON (how the model
/// emits them in the default template is model specific; the content is what we score).
fn message_text(answer: &Value) -> Option<String> {
    let content = answer.get("content").and_then(Value::as_str).unwrap_or("");
    let calls = answer.get("tool_calls").and_then(Value::as_array);
    match calls {
        Some(c) if !c.is_empty() => Some(format!(
            "{content}{}",
            c.iter()
                .map(|call| format!(
                    "<tool_call>\n{}\n</tool_call>",
                    serde_json::json!({
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    })
                ))
                .collect::<String>()
        )),
        _ if answer.get("content").is_some_and(Value::is_string) => Some(content.to_string()),
        _ => None,
    }
}

/// What an example learns from its feedback events: feedback texts for the teacher (comments,
/// corrections, failed tool steps), rewards in [-1, 1], the last thumbs, the last non-empty
/// correction.
struct Signals {
    texts: Vec<String>,
    rewards: Vec<f64>,
    thumbs: Option<bool>,
    correction: Option<String>,
}

/// The [`Signals`] of a turn's feedback events, in order.
fn signals(feedback: &[FeedbackEvent], cfg: &ExampleConfig) -> Signals {
    let mut texts = Vec::new();
    let mut rewards = Vec::new();
    let mut thumbs = None;
    let mut correction: Option<String> = None;
    for f in feedback {
        match &f.value {
            FeedbackValue::Thumbs(up) => {
                thumbs = Some(*up);
                rewards.push(if *up { 1.0 } else { -1.0 });
            }
            FeedbackValue::Score(s) => {
                let [lo, hi] = cfg.score_range;
                if hi > lo {
                    rewards.push(((s - lo) / (hi - lo) * 2.0 - 1.0).clamp(-1.0, 1.0));
                }
            }
            FeedbackValue::Comment(c) if !c.trim().is_empty() => texts.push(c.trim().to_string()),
            FeedbackValue::Comment(_) => {}
            FeedbackValue::Correction(c) => {
                let text = match c {
                    Correction::Text(t) => Some(t.clone()),
                    Correction::Message(m) => message_text(&serde_json::json!({
                        "content": m.content.clone().unwrap_or_default(),
                        "tool_calls": m.tool_calls.clone().unwrap_or_default(),
                    })),
                };
                if let Some(t) = text.filter(|t| !t.trim().is_empty()) {
                    texts.push(format!("A correct answer would be: {t}"));
                    correction = Some(t);
                }
            }
            FeedbackValue::ToolOutcome(o) => {
                rewards.push(if o.success { 1.0 } else { -1.0 });
                if !o.success {
                    texts.push(format!("A tool step failed: {}", o.detail.trim()));
                }
            }
            FeedbackValue::Retraction => {}
        }
    }
    Signals {
        texts,
        rewards,
        thumbs,
        correction,
    }
}

/// The answer's token ids and their behaviour log-probs (when logged), ending with
/// `end_of_turn`.
fn answer_tokens(
    rec: &EpisodeRecord,
    tokenizer: &Tokenizer,
    answer_text: &str,
    end_of_turn: u32,
) -> std::result::Result<(Vec<u32>, Option<Vec<f32>>), SkipReason> {
    // Answer tokens: the sampled ids when logged (exactly what the policy produced), else the
    // answer re-tokenized; then the end-of-turn token the model must also learn to emit.
    let (mut answer_ids, mut behaviour) = match &rec.behaviour {
        Some(b)
            if b.token_ids
                .as_ref()
                .is_some_and(|ids| ids.len() == b.logprobs.len()) =>
        {
            (
                b.token_ids.clone().unwrap_or_default(),
                Some(b.logprobs.clone()),
            )
        }
        _ => (
            encode(tokenizer, answer_text).map_err(|_| SkipReason::Unrenderable)?,
            None,
        ),
    };
    if answer_ids.last() != Some(&end_of_turn) {
        answer_ids.push(end_of_turn);
        if let Some(b) = behaviour.as_mut() {
            b.push(f32::NAN);
        }
    }
    Ok((answer_ids, behaviour))
}

/// Builds the example for `rec`, or says why there is none. `end_of_turn` is the token that
/// closes an assistant turn in the chat template (e.g. `<|im_end|>`).
pub fn build_example(
    rec: &EpisodeRecord,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    end_of_turn: u32,
    cfg: &ExampleConfig,
) -> std::result::Result<TrainExample, SkipReason> {
    let answer = rec.answer.as_ref().ok_or(SkipReason::NoAnswer)?;
    let answer_text = message_text(answer).ok_or(SkipReason::NoAnswer)?;
    let messages = rec
        .context
        .messages
        .as_array()
        .ok_or(SkipReason::Unrenderable)?;

    // Signals.
    let Signals {
        texts,
        rewards,
        thumbs,
        correction,
    } = signals(&rec.feedback, cfg);
    if texts.is_empty() && rewards.is_empty() {
        return Err(SkipReason::NoFeedback);
    }
    let reward = (!rewards.is_empty()).then(|| rewards.iter().sum::<f64>() / rewards.len() as f64);

    // The prompt exactly as `hindsight serve` built it (tool block, `<tool_call>` and
    // `<tool_response>` text for templates without native tools), so the student's log-probs
    // and the logged behaviour log-probs describe the same prompt.
    let tools = prompt_tools(rec.context.tools.as_ref(), rec.context.tool_choice.as_ref());
    let render = |msgs: &[Value]| -> Result<Vec<u32>> {
        let text = template.render_chat(msgs, &tools).map_err(|e| match e {
            ChatInputError::Template(e) => LearnerError::Model(e),
            e => LearnerError::InvalidArgument(e.to_string()),
        })?;
        Ok(encode(tokenizer, &text)?)
    };
    let context_ids = render(messages).map_err(|_| SkipReason::Unrenderable)?;

    let (answer_ids, behaviour) = answer_tokens(rec, tokenizer, &answer_text, end_of_turn)?;
    if answer_ids.len() < 2 {
        return Err(SkipReason::NoAnswer);
    }

    let feedback_text = (!texts.is_empty()).then(|| texts.join(" "));
    let teacher_context_ids = match &feedback_text {
        Some(fb) => {
            let msgs = hindsight_messages(cfg.placement, messages, &answer_text, fb);
            Some(render(&msgs).map_err(|_| SkipReason::Unrenderable)?)
        }
        None => None,
    };
    let control = cfg.control_feedback.trim();
    let control_context_ids = match &feedback_text {
        Some(_) if !control.is_empty() => {
            let msgs = hindsight_messages(cfg.placement, messages, &answer_text, control);
            Some(render(&msgs).map_err(|_| SkipReason::Unrenderable)?)
        }
        _ => None,
    };
    let correction_ids = match &correction {
        Some(c) => {
            let mut ids = encode(tokenizer, c).map_err(|_| SkipReason::Unrenderable)?;
            ids.push(end_of_turn);
            Some(ids)
        }
        None => None,
    };

    let answer_format = rec.context.response_format.as_ref().map(|rf| {
        let rf = OJson::from(rf);
        match serde_json::from_str::<OJson>(&answer_text) {
            Ok(answer) => with_answer_key_order(&rf, &answer),
            Err(_) => rf,
        }
    });

    let longest_context = context_ids
        .len()
        .max(teacher_context_ids.as_ref().map_or(0, Vec::len))
        .max(control_context_ids.as_ref().map_or(0, Vec::len));
    let longest_answer = answer_ids
        .len()
        .max(correction_ids.as_ref().map_or(0, Vec::len));
    if longest_context > cfg.max_context_tokens || longest_answer > cfg.max_answer_tokens {
        return Err(SkipReason::TooLong);
    }

    Ok(TrainExample {
        record_id: rec.record_id,
        turn: rec.turn,
        route: rec.route.clone(),
        adapter: parse_adapter(rec.adapter.as_deref()),
        context_ids,
        answer_ids,
        behaviour_logprobs: behaviour,
        sampling: Sampling::of(&rec.context),
        teacher_context_ids,
        control_context_ids,
        correction_ids,
        answer_format,
        thumbs,
        reward,
        feedback_text,
        feedback_ids: rec.feedback.iter().map(|f| f.feedback_id).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hindsight_feedback::{
        Behaviour, EpisodeContext, FeedbackRecord, FeedbackTarget, FEEDBACK_SCHEMA,
    };
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;

    fn tokenizer() -> Tokenizer {
        let words = [
            "<|im_start|>",
            "<|im_end|>",
            "system",
            "user",
            "assistant",
            "hello",
            "hi",
            "wrong",
            "fix",
            "it",
            "Feedback",
            "[UNK]",
        ];
        let vocab = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Whitespace {}));
        t.add_special_tokens(&[
            tokenizers::AddedToken::from("<|im_start|>", true),
            tokenizers::AddedToken::from("<|im_end|>", true),
        ]);
        t
    }

    fn template() -> ChatTemplate {
        ChatTemplate::new(
            "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}",
            "",
            "<|im_end|>",
        )
        .unwrap()
    }

    fn feedback(value: FeedbackValue) -> FeedbackRecord {
        FeedbackRecord {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target: FeedbackTarget::Episode("e".into()),
            value,
            metric: None,
            source: None,
            rater: None,
            tags: vec![],
            retracts: None,
            event_time_ms: 0,
        }
    }

    fn record(feedback: Vec<FeedbackRecord>, behaviour: Option<Behaviour>) -> EpisodeRecord {
        let context = EpisodeContext {
            messages: serde_json::json!([{"role": "user", "content": "hello"}]),
            ..Default::default()
        };
        let answer = serde_json::json!({"role": "assistant", "content": "hi"});
        EpisodeRecord {
            behaviour,
            adapter: Some("support@3".into()),
            ..EpisodeRecord::turn("e", context, Some(answer), feedback)
        }
    }

    #[test]
    fn builds_context_answer_teacher_and_correction() {
        let rec = record(
            vec![
                feedback(FeedbackValue::Thumbs(false)),
                feedback(FeedbackValue::Comment("wrong".into())),
                feedback(FeedbackValue::Correction(Correction::Text("hello".into()))),
            ],
            None,
        );
        let ex = build_example(
            &rec,
            &tokenizer(),
            &template(),
            1,
            &ExampleConfig::default(),
        )
        .unwrap();
        // <|im_start|> user hello <|im_end|> <|im_start|> assistant
        assert_eq!(ex.context_ids, vec![0, 3, 5, 1, 0, 4]);
        assert_eq!(ex.answer_ids, vec![6, 1], "answer then end of turn");
        assert_eq!(ex.correction_ids, Some(vec![5, 1]));
        assert_eq!(ex.thumbs, Some(false));
        assert_eq!(ex.reward, Some(-1.0));
        assert_eq!(ex.adapter, Some(("support".into(), 3)));
        let teacher = ex.teacher_context_ids.clone().unwrap();
        assert!(
            teacher.len() > ex.context_ids.len(),
            "the teacher sees the feedback"
        );
        assert!(ex.feedback_text.unwrap().contains("wrong"));
        assert_eq!(ex.feedback_ids.len(), 3);
    }

    #[test]
    fn the_control_context_carries_the_content_free_critique_in_place_of_the_feedback() {
        let rec = record(vec![feedback(FeedbackValue::Comment("wrong".into()))], None);
        let cfg = ExampleConfig {
            control_feedback: "fix it".into(),
            ..ExampleConfig::default()
        };
        let ex = build_example(&rec, &tokenizer(), &template(), 1, &cfg).unwrap();
        let teacher = ex.teacher_context_ids.clone().unwrap();
        let control = ex.control_context_ids.clone().unwrap();
        assert!(teacher.contains(&7) && !teacher.contains(&8), "{teacher:?}");
        assert!(control.contains(&8) && control.contains(&9), "{control:?}");
        assert!(!control.contains(&7), "the control never sees the feedback");
        // Same placement: the two prompts differ only where the critiques differ.
        let common = teacher.iter().zip(&control).take_while(|(a, b)| a == b);
        assert!(common.count() > ex.context_ids.len() - 2);

        let off = ExampleConfig {
            control_feedback: "  ".into(),
            ..ExampleConfig::default()
        };
        let ex = build_example(&rec, &tokenizer(), &template(), 1, &off).unwrap();
        assert_eq!(ex.control_context_ids, None, "an empty control builds none");

        let thumbs = record(vec![feedback(FeedbackValue::Thumbs(true))], None);
        let ex = build_example(&thumbs, &tokenizer(), &template(), 1, &cfg).unwrap();
        assert_eq!(ex.control_context_ids, None, "no feedback text, no control");
    }

    #[test]
    fn logged_token_ids_and_logprobs_are_used_as_sampled() {
        let b = Behaviour {
            tokens: vec!["hi".into()],
            token_ids: Some(vec![6]),
            logprobs: vec![-0.25],
        };
        let rec = record(vec![feedback(FeedbackValue::Thumbs(true))], Some(b));
        let ex = build_example(
            &rec,
            &tokenizer(),
            &template(),
            1,
            &ExampleConfig::default(),
        )
        .unwrap();
        assert_eq!(ex.answer_ids, vec![6, 1]);
        let lp = ex.behaviour_logprobs.unwrap();
        assert_eq!(lp[0], -0.25);
        assert!(
            lp[1].is_nan(),
            "the appended end token has no logged log-prob"
        );
        assert_eq!(ex.teacher_context_ids, None, "thumbs alone give no teacher");
    }

    #[test]
    fn records_without_answer_or_feedback_are_skipped_with_a_reason() {
        let mut rec = record(vec![feedback(FeedbackValue::Thumbs(true))], None);
        rec.answer = None;
        let cfg = ExampleConfig::default();
        assert_eq!(
            build_example(&rec, &tokenizer(), &template(), 1, &cfg),
            Err(SkipReason::NoAnswer)
        );
        let rec = record(vec![], None);
        assert_eq!(
            build_example(&rec, &tokenizer(), &template(), 1, &cfg),
            Err(SkipReason::NoFeedback)
        );
        let rec = record(vec![feedback(FeedbackValue::Thumbs(true))], None);
        let tight = ExampleConfig {
            max_context_tokens: 3,
            ..Default::default()
        };
        assert_eq!(
            build_example(&rec, &tokenizer(), &template(), 1, &tight),
            Err(SkipReason::TooLong)
        );
    }

    #[test]
    fn scores_map_onto_the_reward_range() {
        let rec = record(vec![feedback(FeedbackValue::Score(0.75))], None);
        let ex = build_example(
            &rec,
            &tokenizer(),
            &template(),
            1,
            &ExampleConfig::default(),
        )
        .unwrap();
        assert_eq!(ex.reward, Some(0.5));
    }

    #[test]
    fn adapter_labels_parse() {
        assert_eq!(parse_adapter(Some("a@b@7")), Some(("a@b".into(), 7)));
        assert_eq!(parse_adapter(Some("base")), None);
        assert_eq!(parse_adapter(None), None);
    }
}
