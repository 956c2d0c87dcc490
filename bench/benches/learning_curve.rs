//! Learning curves: the whole loop (serve → proxy → Kafka → joiner → learner → registry →
//! hot-swap) on the default model, driven by the simulated support environment, once per
//! objective configuration; `hindsight eval` exact match on the held-out split after every K
//! feedback events.
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench learning_curve
//! # knobs (env): OBJECTIVES=none,sft,kto,dense,distill,distill-dense  EVENTS=64  EVAL_EVERY=16
//! #   EVAL_ITEMS=20  LR=3e-3  RANK=8  BATCH=1  SEED=0  CORRECTION_RATE=0.3  NOISE_RATE=0
//! #   CRITIQUE=rule-and-value|rule  OUT=target/bench-results/learning_curve
//! #   PLACEMENT=user-note|system-no-answer|user-turn|system  (where the self-teacher sees the feedback)
//! #   REPLAY=0  (replay steps on earlier examples after each new micro-batch)
//! #   REPLAY_UNLEARNED=0  (1: replay also examples a step learned nothing from)
//! #   KL_BUDGET=<nats per position>  (default: the learner's)
//! #   PREFIX_GRAD=1  (0: the trainer back-propagates through the answer positions only)
//! #   TEACHER_EMA=<rate>  (the teacher's EMA rate towards the policy; 0 = frozen base teacher)
//! #   TRAIN_EVAL=0  (also score the first N training tickets at every point: fit vs generalization)
//! #   DIVERGENCE=reverse_kl|forward_kl|jsd  (self-distillation's divergence; default: the learner's)
//! #   DISTILL_TARGET=logged|teacher|edit  (self-distillation on the logged answer, on the answer
//! #     the hindsight teacher decodes itself under the request's grammar, or on the logged
//! #     answer with the fields the feedback speaks against set to the teacher's values)
//! #   TARGET_CE=0  (weight of cross-entropy on a teacher/edit target that differs from the logged answer)
//! #   EDIT_MARGIN=<nats>  (the edit's margin; default: the learner's)
//! #   EDIT_BASELINE=student|control  (what the edit compares the teacher shown the feedback with:
//! #     the student, or the teacher shown a content-free critique)
//! #   CONTRAST=0  (α of the teacher's decoding contrasted with the content-free critique)
//! #   MIN_TARGET_LOGPROB=<nats>  (distil only on targets — the teacher's own answer or edit —
//! #     whose values the teacher gives at least this joint log-probability; default: every
//! #     target; EDIT_MIN_LOGPROB is the older name)
//! #   MIN_FIELD_LOGPROB=<nats>  (per field of the target: its value's tokens are not learned
//! #     when the teacher gives the value less than this log-probability; default: all learned)
//! #   CONFIDENCE=vocabulary|decision  (how the two floors read the teacher's confidence: over
//! #     the whole vocabulary, or each decoding choice among the tokens the grammar allowed;
//! #     decision needs DISTILL_TARGET=teacher)
//! #   PROBE=1  (0: skip the likelihood probe of learning beyond the prior)
//! #   RECORDS=json|compact  (compact: the order and customer records in one line each, ~30% shorter prompts)
//! #   ORDERED=1  (feedback sent in episode order after each chunk's answers, so the learner's
//! #     training order is the same on every run of a seed; 0: as the answers finish)
//! ```
//! Writes `<OUT>.json` (every point, wall time, trainer tokens/s) and `<OUT>.png`, and prints a
//! table. Each curve is printed and plotted beside the constant-answer baseline (always the
//! training split's most common decision): a student that learns only that prior reaches it
//! without learning any rule. Each point also counts the distinct decisions among the
//! held-out answers (1 = the same answer to every ticket) and runs the prior probe (mean
//! log p(correct) − log p(constant answer) on the tickets whose decision is not the constant
//! one: down = the prior learned, up = tickets told apart). The last point is compared with the
//! base model ticket by ticket (paired difference with 95% intervals, on the held-out and, with
//! TRAIN_EVAL, the trained tickets). Each configuration starts from the base model with fresh
//! topics, keys and adapters.

use std::path::PathBuf;
use std::str::FromStr;

use anyhow::Context;
use clap::ValueEnum;
use hindsight_bench::learning::{
    plot, run_learning, CurvePoint, LearningConfig, LearningReport, Objective, HISTORY_EVAL_ITEMS,
};
use hindsight_sim::CritiqueStyle;

fn env<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One metric along the curve as "0% → 10% → …" ("-" where a point lacks it).
fn percents(report: &LearningReport, metric: impl Fn(&CurvePoint) -> Option<f64>) -> String {
    report
        .points
        .iter()
        .map(|p| metric(p).map_or_else(|| "-".to_string(), |f| format!("{:.0}%", f * 100.0)))
        .collect::<Vec<_>>()
        .join(" → ")
}

fn main() -> anyhow::Result<()> {
    // Not `#[tokio::main]`: the thread count is settled before the runtime's threads exist.
    hindsight_model::run_settled(run())?
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,learning_curve=info,hindsight_bench=info")
            }),
        )
        .init();
    // `cargo bench` passes `--bench`; nothing else is expected.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::set_current_dir(&root)?;
    let objectives: Vec<Objective> = std::env::var("OBJECTIVES")
        .unwrap_or_else(|_| "none,sft,kto,dense,distill,distill-dense".into())
        .split(',')
        .map(|s| Objective::from_str(s.trim(), true).map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<_>>()
        .context("OBJECTIVES")?;
    let out = PathBuf::from(env(
        "OUT",
        "target/bench-results/learning_curve".to_string(),
    ));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let critique = CritiqueStyle::from_str(
        &std::env::var("CRITIQUE").unwrap_or_else(|_| "rule-and-value".into()),
        true,
    )
    .map_err(anyhow::Error::msg)?;
    let work = tempfile::tempdir()?;
    let mut reports: Vec<LearningReport> = Vec::new();
    for objective in objectives {
        let mut cfg = LearningConfig::new(objective, work.path().join(objective.as_str()));
        cfg.events = env("EVENTS", cfg.events);
        cfg.eval_every = env("EVAL_EVERY", cfg.eval_every);
        cfg.eval_items = env("EVAL_ITEMS", cfg.eval_items);
        cfg.train_eval_items = env("TRAIN_EVAL", cfg.train_eval_items);
        cfg.lr = env("LR", cfg.lr);
        cfg.rank = env("RANK", cfg.rank);
        cfg.batch_examples = env("BATCH", cfg.batch_examples);
        cfg.seed = env("SEED", cfg.seed);
        cfg.correction_rate = env("CORRECTION_RATE", cfg.correction_rate);
        cfg.noise_rate = env("NOISE_RATE", cfg.noise_rate);
        cfg.critique_style = critique;
        cfg.replay_steps_per_batch = env("REPLAY", cfg.replay_steps_per_batch);
        cfg.replay_unlearned = env("REPLAY_UNLEARNED", 0u8) == 1;
        cfg.feedback_in_episode_order = env::<u8>("ORDERED", 1) != 0;
        cfg.kl_budget = std::env::var("KL_BUDGET").ok().and_then(|v| v.parse().ok());
        cfg.prefix_grad = env::<u8>("PREFIX_GRAD", 1) != 0;
        cfg.teacher_ema_rate = std::env::var("TEACHER_EMA")
            .ok()
            .and_then(|v| v.parse().ok());
        cfg.prior_probe = env::<u8>("PROBE", 1) != 0;
        if let Ok(r) = std::env::var("RECORDS") {
            cfg.records = serde_json::from_value(serde_json::Value::String(r.clone()))
                .with_context(|| format!("RECORDS={r}: json or compact"))?;
        }
        if let Ok(d) = std::env::var("DIVERGENCE") {
            cfg.divergence = Some(
                serde_json::from_value(serde_json::Value::String(d.clone()))
                    .with_context(|| format!("DIVERGENCE={d}: reverse_kl, forward_kl or jsd"))?,
            );
        }
        if let Ok(t) = std::env::var("DISTILL_TARGET") {
            cfg.distill_target = serde_json::from_value(serde_json::Value::String(t.clone()))
                .with_context(|| format!("DISTILL_TARGET={t}: logged, teacher or edit"))?;
        }
        cfg.target_ce_weight = env("TARGET_CE", cfg.target_ce_weight);
        if let Ok(b) = std::env::var("EDIT_BASELINE") {
            cfg.edit_baseline = serde_json::from_value(serde_json::Value::String(b.clone()))
                .with_context(|| format!("EDIT_BASELINE={b}: student or control"))?;
        }
        cfg.teacher_contrast = env("CONTRAST", cfg.teacher_contrast);
        // MIN_TARGET_LOGPROB; EDIT_MIN_LOGPROB is its older name (edits only, then).
        cfg.min_target_logprob = std::env::var("MIN_TARGET_LOGPROB")
            .or_else(|_| std::env::var("EDIT_MIN_LOGPROB"))
            .ok()
            .map(|v| v.parse())
            .transpose()
            .context("MIN_TARGET_LOGPROB: a log-probability in nats (<= 0)")?;
        cfg.min_field_logprob = std::env::var("MIN_FIELD_LOGPROB")
            .ok()
            .map(|v| v.parse())
            .transpose()
            .context("MIN_FIELD_LOGPROB: a log-probability in nats (<= 0)")?;
        if let Ok(c) = std::env::var("CONFIDENCE") {
            cfg.confidence = serde_json::from_value(serde_json::Value::String(c.clone()))
                .with_context(|| format!("CONFIDENCE={c}: vocabulary or decision"))?;
        }
        cfg.edit_margin_nats = std::env::var("EDIT_MARGIN")
            .ok()
            .and_then(|v| v.parse().ok());
        if let Ok(p) = std::env::var("PLACEMENT") {
            cfg.placement = hindsight_eval::HindsightPlacement::from_str(&p, true)
                .map_err(anyhow::Error::msg)
                .context("PLACEMENT")?;
        }
        eprintln!(
            "[learning_curve] {}: {} events, eval every {} on {} items, replay {}, teacher {}",
            objective.as_str(),
            cfg.events,
            cfg.eval_every,
            cfg.eval_items,
            cfg.replay_steps_per_batch,
            cfg.placement.as_str()
        );
        let report = run_learning(cfg).await?;
        eprintln!(
            "[learning_curve] {}: exact match {} (gain {:+.1} points), field accuracy {}, in {:.0} s, trainer {:.0} tokens/s",
            objective.as_str(),
            percents(&report, |p| Some(p.exact_match)),
            report.gain() * 100.0,
            percents(&report, |p| p.field_accuracy),
            report.wall_s,
            report.train_tokens_per_s
        );
        eprintln!(
            "[learning_curve] {}: exact match on the held-out tickets whose decision is not the constant answer (which scores 0 there) {}",
            objective.as_str(),
            percents(&report, |p| p.exact_beyond_constant),
        );
        eprintln!(
            "[learning_curve] {}: distinct decisions among the {} held-out answers {}",
            objective.as_str(),
            report.config.eval_items,
            report
                .points
                .iter()
                .map(|p| p
                    .distinct_answers
                    .map_or("-".to_string(), |d| d.to_string()))
                .collect::<Vec<_>>()
                .join(" → "),
        );
        if let Some(b) = &report.constant_baseline {
            eprintln!(
                "[learning_curve] always answering the training split's most common decision {} \
                 ({:.0}% of {} training tickets) scores {:.0}% exact, {:.0}% fields here{}",
                b.answer,
                b.train_share * 100.0,
                hindsight_bench::learning::CONSTANT_BASELINE_TICKETS,
                b.exact_match * 100.0,
                b.field_accuracy * 100.0,
                match (b.train_exact_match, b.train_field_accuracy) {
                    (Some(e), Some(f)) => format!(
                        " ({:.0}% / {:.0}% on the trained tickets)",
                        e * 100.0,
                        f * 100.0
                    ),
                    _ => String::new(),
                }
            );
        }
        if report.points.iter().any(|p| p.prior_margin.is_some()) {
            let nats = |metric: fn(&CurvePoint) -> Option<f64>| {
                report
                    .points
                    .iter()
                    .map(|p| metric(p).map_or_else(|| "-".to_string(), |m| format!("{m:+.2}")))
                    .collect::<Vec<_>>()
                    .join(" → ")
            };
            eprintln!(
                "[learning_curve] {}: prior margin (nats; log p(correct) − log p(constant) where they differ) held-out {}, trained {}",
                objective.as_str(),
                nats(|p| p.prior_margin),
                nats(|p| p.train_prior_margin),
            );
        }
        if report.config.train_eval_items > 0 {
            eprintln!(
                "[learning_curve] {}: on the first {} trained tickets: exact match {}, field accuracy {}",
                objective.as_str(),
                report.config.train_eval_items,
                percents(&report, |p| p.train_exact_match),
                percents(&report, |p| p.train_field_accuracy),
            );
        }
        if report.config.eval_items > HISTORY_EVAL_ITEMS {
            eprintln!(
                "[learning_curve] {}: exact match on the first {} held-out tickets (the older runs' set) {}",
                objective.as_str(),
                HISTORY_EVAL_ITEMS,
                percents(&report, |p| Some(p.exact_on_first(HISTORY_EVAL_ITEMS))),
            );
        }
        for (what, c) in [
            ("held-out", &report.held_out_vs_base),
            ("trained", &report.trained_vs_base),
            ("first held-out", &report.history_vs_base),
        ] {
            if let Some(c) = c {
                eprintln!(
                    "[learning_curve] {}: last point vs base on the {} {} tickets (paired): {} — {}",
                    objective.as_str(),
                    c.items,
                    what,
                    c.exact_match,
                    if c.exact_match.clearly_positive() {
                        "a gain beyond noise"
                    } else {
                        "no gain beyond noise"
                    },
                );
            }
        }
        reports.push(report);
        // Write after every configuration so a long run keeps what it measured.
        std::fs::write(
            out.with_extension("json"),
            serde_json::to_vec_pretty(&reports)?,
        )?;
        plot(
            &reports,
            &out.with_extension("png"),
            "Hindsight on SmolLM2-135M: held-out eval vs feedback events",
        )?;
    }
    println!(
        "\nobjective       exact match per eval point                gain   wall s  train tok/s"
    );
    for r in &reports {
        println!(
            "{:<15} {:<40} {:+5.1}  {:7.0}  {:11.0}",
            r.config.objective.as_str(),
            r.points
                .iter()
                .map(|p| format!("{:.0}", p.exact_match * 100.0))
                .collect::<Vec<_>>()
                .join(" "),
            r.gain() * 100.0,
            r.wall_s,
            r.train_tokens_per_s
        );
    }
    println!(
        "\nwrote {} and {}",
        out.with_extension("json").display(),
        out.with_extension("png").display()
    );
    Ok(())
}
