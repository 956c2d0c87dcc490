//! Trainer tests: gradient checks, objectives, guards, caches, snapshots.

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
    cfg.experimental.edit_target = target == DistillTarget::Edit;
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
fn the_teachers_choices_are_each_tokens_probability_among_the_allowed_ones() {
    let (tr, ex, tctx, _, _) = teacher_on_guided();
    let work = tr.teacher_work(&tctx, &ex, &[]).unwrap();
    let own = work.target.clone().unwrap();
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
    cfg.experimental.edit_margin_nats = 0.0;
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
    cfg.experimental.edit_target = true;
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
    cfg.experimental.teacher_contrast = 1.5;
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
        tr.cfg.experimental.teacher_contrast = alpha;
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
        tr.cfg.experimental.edit_baseline = baseline;
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

#[test]
fn a_frozen_teachers_work_is_reused_on_replay_with_the_same_result() {
    // The edit against the control critique with a frozen teacher reads the teacher alone:
    // a replayed example takes it from the cache, and the step is the one recomputing
    // would have made (same loss and terms, same weights), at fewer tokens.
    let make = |cache: usize| {
        let (mut tr, rf, ids) = edit_trainer(1.0);
        tr.cfg.experimental.edit_baseline = EditBaseline::Control;
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
        tr.cfg.experimental.edit_baseline = baseline;
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
        let mut cfg = TrainerConfig::default();
        cfg.experimental.teacher_contrast = alpha;
        let err = cfg.check().unwrap_err().to_string();
        assert!(err.contains("experimental.teacher_contrast"), "{err}");
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
