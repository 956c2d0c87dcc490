//! Re-plots learning curves from the benchmark's JSON files, e.g. to put configurations from
//! separate runs on one chart.
//!
//! ```sh
//! cargo run --release -p hindsight-bench --example plot_curves -- OUT.png "title" \
//!     a.json b.json[:distill,kto] ...
//! ```
//! Writes OUT.png and, beside it, OUT.json with the plotted curves. A `:list` suffix keeps only
//! those objectives from that file. With `FILL_BASELINE=1`, result
//! files written before the constant-answer baseline was measured get it computed from their
//! settings (only for runs of the current task: the world changed with the task redesign).
use std::path::PathBuf;

use anyhow::Context;
use hindsight_bench::learning::{plot, ConstantBaseline, LearningReport};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(
        args.next()
            .context("usage: OUT.png TITLE FILE[:objectives]...")?,
    );
    let title = args.next().context("title")?;
    let mut reports: Vec<LearningReport> = Vec::new();
    for spec in args {
        let (file, only) = match spec.split_once(':') {
            Some((f, o)) => (
                f.to_string(),
                Some(o.split(',').map(str::to_string).collect::<Vec<_>>()),
            ),
            None => (spec.clone(), None),
        };
        let text = std::fs::read_to_string(&file).with_context(|| file.clone())?;
        let all: Vec<LearningReport> = serde_json::from_str(&text).with_context(|| file.clone())?;
        reports.extend(all.into_iter().filter(|r| {
            only.as_ref()
                .is_none_or(|o| o.iter().any(|x| x == r.config.objective.as_str()))
        }));
    }
    anyhow::ensure!(!reports.is_empty(), "no curves selected");
    if std::env::var("FILL_BASELINE").is_ok_and(|v| v == "1") {
        for r in reports.iter_mut().filter(|r| r.constant_baseline.is_none()) {
            r.constant_baseline = Some(ConstantBaseline::for_config(&r.config)?);
        }
    }
    plot(&reports, &out, &title)?;
    // The plotted curves (baselines filled in) next to the picture, as one file.
    let json = out.with_extension("json");
    std::fs::write(&json, serde_json::to_vec_pretty(&reports)?)?;
    println!(
        "wrote {} and {} ({} curves)",
        out.display(),
        json.display(),
        reports.len()
    );
    Ok(())
}
