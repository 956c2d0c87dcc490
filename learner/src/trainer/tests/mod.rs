//! Trainer tests: gradient checks, objectives, guards, caches, snapshots. The fixtures shared
//! by every concern are here (the tiny model, examples, objective mixes, the guided test
//! vocabulary); the tests are one file per concern.

mod behaviour;
mod checkpoint;
mod objectives;
mod prefix_passes;
mod teacher_answer;
mod teacher_edit;

use super::teacher::EditOutcome;
use super::*;
use crate::objectives::Divergence;
use crate::optim::AdamWConfig;
use hindsight_model::{Architecture, ModelConfig};
use tokenizers::Tokenizer;

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
        sampling: Default::default(),
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

/// A trainer of the given objective mix on the logged answer (the tiny models here have no
/// tokenizer for the teacher to decode with), per-token terms only, the old EMA teacher and
/// reverse KL: what these unit tests pin down, whatever the shipped defaults are.
fn weights(sft: f64, kto: f64, distill: f64, dense: f64) -> TrainerConfig {
    TrainerConfig {
        distill_target: DistillTarget::Logged,
        target_ce_weight: 0.0,
        teacher_ema_rate: 0.05,
        divergence: Divergence::ReverseKl,
        kl_budget: 0.5,
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
    hindsight_model::testing::max_abs_diff(a, b).unwrap()
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

/// Distillation alone on `target`, forward KL, frozen teacher, no KL guard.
fn distill_on(target: DistillTarget) -> TrainerConfig {
    let mut cfg = weights(0.0, 0.0, 1.0, 0.0);
    cfg.distill_target = target;
    cfg.experimental.edit_target = target == DistillTarget::Edit;
    cfg.divergence = Divergence::ForwardKl;
    cfg.teacher_ema_rate = 0.0;
    cfg.kl_penalty = 0.0;
    cfg
}

/// Step `i` of a trainer with a replay cache (`a`) and one without (`b`): the same loss and
/// terms; fewer tokens run on a replay, the same otherwise.
fn assert_same_step_fewer_tokens_on_replay(a: &StepReport, b: &StepReport, i: usize, replay: bool) {
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
