//! Re-plots learning curves from the benchmark's JSON files, e.g. to put configurations from
//! separate runs on one chart.
//!
//! ```sh
//! cargo run --release -p hindsight-bench --example plot_curves -- OUT.png "title" \
//!     a.json b.json[:distill,kto] ...
//! ```
//! Writes OUT.png and, beside it, OUT.json with the plotted curves. A `:list` suffix keeps only
//! those objectives from that file. It reads result files of the bench's current format (a
//! `scenario` and the `learner` config); files written before 2026-12-05 are read by this
//! tool as of their own commit.
use std::path::PathBuf;

use anyhow::Context;
use hindsight_bench::learning::{plot, LearningReport};

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
