//! Learning curves: the whole loop (serve → proxy → Kafka → joiner → learner → registry →
//! hot-swap) on the default model, driven by the simulated support environment, once per
//! objective configuration; `hindsight eval` exact match on the held-out split after every K
//! feedback events.
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench learning_curve
//! ```
//! With no settings this is the headline run: the learner's defaults (the measured recipe) on
//! the default scenario (64 feedback events, every wrong answer corrected, eval on 60
//! held-out tickets after 32 and 64 events, seed 0). Settings come the way every Hindsight
//! process reads them: `CONFIG=<file.toml>` with `[scenario]` ([`Scenario`]) and `[learner]`
//! (the section `hindsight learner` reads, e.g. deploy/learner.example.toml), then
//! `HINDSIGHT_SCENARIO__<KEY>` and `HINDSIGHT_LEARNER__<KEY>[__<SUBKEY>]` overrides; an unknown
//! key or a bad value stops the run naming the key. Two more: `OBJECTIVES=default,kto,…`
//! (`default` = the configured objective mix; `none`, `sft`, `kto`, `dense`, `distill`,
//! `distill-dense` = that objective alone, for comparisons on the same events) and
//! `OUT=target/bench-results/learning_curve`. For example, the realistic stream on seed 1
//! beside KTO with the prompt detached:
//! ```sh
//! HINDSIGHT_SCENARIO__CORRECTION_RATE=0.3 HINDSIGHT_SCENARIO__SEED=1 OBJECTIVES=default \
//!   cargo bench -p hindsight-bench --bench learning_curve
//! HINDSIGHT_LEARNER__TRAINER__PREFIX_GRAD=false OBJECTIVES=kto \
//!   cargo bench -p hindsight-bench --bench learning_curve
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

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::ValueEnum;
use hindsight_bench::learning::{
    plot, run_learning, BenchFile, CurvePoint, LearningConfig, LearningReport, Objective,
    HISTORY_EVAL_ITEMS,
};

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
        .unwrap_or_else(|_| "default".into())
        .split(',')
        .map(|s| Objective::from_str(s.trim(), true).map_err(anyhow::Error::msg))
        .collect::<anyhow::Result<_>>()
        .context("OBJECTIVES")?;
    let out = PathBuf::from(
        std::env::var("OUT").unwrap_or_else(|_| "target/bench-results/learning_curve".into()),
    );
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let config = std::env::var_os("CONFIG").map(PathBuf::from);
    let file = BenchFile::load(config.as_deref(), std::env::vars()).with_context(|| {
        format!("reading the bench's config ({config:?} and HINDSIGHT_* overrides)")
    })?;
    let work = tempfile::tempdir()?;
    let mut reports: Vec<LearningReport> = Vec::new();
    for objective in objectives {
        let cfg = LearningConfig::from_file(
            objective,
            file.clone(),
            work.path().join(objective.as_str()),
        );
        eprintln!(
            "[learning_curve] {}: {} events, eval every {} on {} items ({})",
            objective.as_str(),
            cfg.scenario.events,
            cfg.scenario.eval_every,
            cfg.scenario.eval_items,
            cfg.label(),
        );
        let report = run_learning(cfg).await?;
        print_report(objective, &report);
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
    print_table(&reports, &out);
    Ok(())
}

/// Prints what one configuration's run measured (to stderr, as it goes).
fn print_report(objective: Objective, report: &LearningReport) {
    eprintln!(
        "[learning_curve] {}: exact match {} (gain {:+.1} points), field accuracy {}, in {:.0} s, trainer {:.0} tokens/s",
        objective.as_str(),
        percents(report, |p| Some(p.exact_match)),
        report.gain() * 100.0,
        percents(report, |p| p.field_accuracy),
        report.wall_s,
        report.train_tokens_per_s
    );
    eprintln!(
        "[learning_curve] {}: exact match on the held-out tickets whose decision is not the constant answer (which scores 0 there) {}",
        objective.as_str(),
        percents(report, |p| p.exact_beyond_constant),
    );
    eprintln!(
        "[learning_curve] {}: distinct decisions among the {} held-out answers {}",
        objective.as_str(),
        report.config.scenario.eval_items,
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
    if report.config.scenario.train_eval_items > 0 {
        eprintln!(
            "[learning_curve] {}: on the first {} trained tickets: exact match {}, field accuracy {}",
            objective.as_str(),
            report.config.scenario.train_eval_items,
            percents(report, |p| p.train_exact_match),
            percents(report, |p| p.train_field_accuracy),
        );
    }
    if report.config.scenario.eval_items > HISTORY_EVAL_ITEMS {
        eprintln!(
            "[learning_curve] {}: exact match on the first {} held-out tickets (the older runs' set) {}",
            objective.as_str(),
            HISTORY_EVAL_ITEMS,
            percents(report, |p| Some(p.exact_on_first(HISTORY_EVAL_ITEMS))),
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
    if let Some(change) = report.config.scenario.rule_change {
        print_rule_change(objective, report, change.after_events);
    }
    if let Some(d) = &report.capability_drift {
        eprintln!(
            "[learning_curve] {}: the base model's capability answers, mean log p per token: {:.3} (base) -> {:.3} (last point), {:+.3} on {} items (the eval gate allows -{:.2})",
            objective.as_str(),
            d.base,
            d.candidate,
            d.change(),
            d.items,
            hindsight_control::guard::GuardConfig::default().max_logprob_drop
        );
    }
    if let Some(c) = &report.capability_vs_base {
        let margin = hindsight_control::guard::GuardConfig::default().capability_margin;
        eprintln!(
            "[learning_curve] {}: capability set (never trained on), last point vs base on {} items (paired): {} — {}",
            objective.as_str(),
            c.items,
            c.exact_match,
            if c.exact_match.diff < -margin {
                "forgetting beyond the eval gate's margin"
            } else {
                "within the eval gate's margin"
            },
        );
    }
}

/// The changing-rule scenario's figures: the affected tickets by the new and the old rule,
/// the others' exact match, and how long the new rule took.
fn print_rule_change(objective: Objective, report: &LearningReport, after_events: u64) {
    let Some(first) = report.points.iter().find_map(|p| p.rule_change.as_ref()) else {
        return;
    };
    let name = objective.as_str();
    eprintln!(
        "[learning_curve] {name}: the rule changes after {after_events} events; {} held-out tickets affected, {} not",
        first.affected, first.unaffected
    );
    eprintln!(
        "[learning_curve] {name}: events {}",
        report
            .points
            .iter()
            .map(|p| p.events.to_string())
            .collect::<Vec<_>>()
            .join(" → ")
    );
    eprintln!(
        "[learning_curve] {name}: affected fields answered by the new rule {}, by the old rule {}; affected tickets exact {}",
        percents(report, |p| p.rule_change.as_ref().map(|r| r.new_rule)),
        percents(report, |p| p.rule_change.as_ref().map(|r| r.old_rule)),
        percents(report, |p| p.rule_change.as_ref().map(|r| r.affected_exact)),
    );
    eprintln!(
        "[learning_curve] {name}: unaffected tickets exact (retention) {}",
        percents(report, |p| p
            .rule_change
            .as_ref()
            .map(|r| r.unaffected_exact)),
    );
    eprintln!(
        "[learning_curve] {name}: events after the change until the new rule holds to the end (half the affected fields, more than the old rule): {}",
        report
            .events_to_new_rule
            .map_or_else(|| "not within the run".to_string(), |e| e.to_string())
    );
    if let Some(c) = &report.retention_since_change {
        eprintln!(
            "[learning_curve] {name}: unaffected tickets, last version vs the version at the change ({} items, paired): {}",
            c.items, c.exact_match
        );
    }
}

/// Prints the summary table of every configuration and where the files went.
fn print_table(reports: &[LearningReport], out: &Path) {
    println!(
        "\nobjective       exact match per eval point                gain   wall s  train tok/s"
    );
    for r in reports {
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
}
