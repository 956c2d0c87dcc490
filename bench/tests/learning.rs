//! The learning test (small configuration of the learning-curve benchmark): the whole loop on
//! the real model, broker and Redis — serve, proxy, joiner, learner, registry, hot-swap — fed
//! by the simulated environment, must raise the held-out eval exact match beyond noise.
//!
//! "Beyond noise": the eval is greedy on a fixed set, so the same weights always score the same;
//! what varies between runs is the sampled traffic the learner trains on. The test asks for at
//! least two more items right out of the set (a single flipped item would not count).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use hindsight_bench::learning::{run_learning, LearningConfig, Objective};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn learning_from_feedback_raises_eval_exact_match() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let work = tempfile::tempdir().unwrap();
    let mut cfg = LearningConfig::new(Objective::Sft, work.path());
    cfg.model_path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        cfg.model_path.is_file(),
        "{} is missing: run deploy/fetch-model.sh",
        cfg.model_path.display()
    );
    cfg.events = 12;
    cfg.eval_every = 12;
    cfg.eval_items = 8;
    cfg.correction_rate = 1.0;
    cfg.noise_rate = 0.0;
    let report = run_learning(cfg).await.unwrap();
    let before = report.points.first().unwrap();
    let after = report.points.last().unwrap();
    let items = report.config.eval_items as f64;
    println!(
        "exact match {:.0}% -> {:.0}% ({} examples, {:.0} s, trainer {:.0} tokens/s)",
        before.exact_match * 100.0,
        after.exact_match * 100.0,
        after.examples,
        report.wall_s,
        report.train_tokens_per_s
    );
    assert!(after.examples > 0, "the learner trained on nothing: {report:?}");
    assert!(
        (after.exact_match - before.exact_match) * items >= 2.0 - 1e-9,
        "eval exact match {} -> {} on {items} items: not beyond noise",
        before.exact_match,
        after.exact_match
    );
}
