//! The objectives one at a time (SFT, KTO, self-distillation, dense rewards) and the step's
//! guards (non-finite losses, the KL budget).

use super::*;

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
