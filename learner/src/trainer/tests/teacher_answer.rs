//! The teacher decoding its own answer under the response format, and distillation on it.

use super::*;

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
