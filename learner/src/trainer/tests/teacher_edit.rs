//! The teacher's edit of the logged answer: its passes and prompt caches, the edit's tokens
//! and fields, its contrast with the control critique, and reuse of a frozen teacher's work
//! on replay.

use super::*;

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
