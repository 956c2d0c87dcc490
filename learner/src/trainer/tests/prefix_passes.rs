//! The policy's and the base model's passes after one prompt (detached prefix, prompt
//! caches): the same forward and gradients as separate passes, checked by finite differences,
//! and reused on replay.

use super::*;

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
