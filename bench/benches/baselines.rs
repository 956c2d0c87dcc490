//! Does the model do better in hindsight? Baselines (a) as deployed, (b) rules in the system
//! prompt and (c) hindsight, per teacher-prompt placement, on the simulated environment's eval
//! split, against any OpenAI-compatible endpoint (`hindsight serve`, or the in-process
//! `serve_local` example):
//!
//! ```sh
//! cargo bench -p hindsight-bench --bench baselines -- --endpoint http://127.0.0.1:8000/v1 \
//!   --tickets 40 --samples 4 --temperature 0.7 --out baselines.json
//! ```
//!
//! `-- --help` documents every flag. Prints a Markdown table; the figures are in
//! bench/README.md.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use hindsight_bench::baselines::{render_table, run_baselines, BaselineConfig};
use hindsight_learner::teacher_prompt::HindsightPlacement;
use hindsight_sim::{CritiqueStyle, Records, Variant};

#[derive(Parser)]
#[command(
    name = "baselines",
    about = "Measure baselines (a) as deployed, (b) rules in the system prompt, (c) hindsight"
)]
struct Cli {
    /// API base of the model (e.g. `hindsight serve`), e.g. http://127.0.0.1:8000/v1.
    #[arg(long)]
    endpoint: String,
    /// Model name.
    #[arg(long, default_value = "base")]
    model: String,
    /// World seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Eval tickets.
    #[arg(long, default_value_t = 40)]
    tickets: usize,
    /// Samples per ticket (pass@samples is reported).
    #[arg(long, default_value_t = 4)]
    samples: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// max_tokens per request.
    #[arg(long, default_value_t = 200)]
    max_tokens: u32,
    /// Requests in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// single: ticket + records in one message; multi: the agent calls lookup tools.
    #[arg(long, value_enum, default_value = "single")]
    variant: Variant,
    /// How single-turn tickets write the order and customer records: json (as the tools return
    /// them) or compact (one line each, no recent orders: ~30% shorter prompts).
    #[arg(long, value_enum, default_value = "compact")]
    records: Records,
    /// Ask for `<final_output>` tags instead of sending a response_format JSON schema.
    #[arg(long)]
    no_response_format: bool,
    /// How explicit the critiques in (c) are.
    #[arg(long, value_enum, default_value = "rule-and-value")]
    critique_style: CritiqueStyle,
    /// Reuse runs (a) and (b) from an earlier `--out` report (same seed, tickets, samples).
    #[arg(long)]
    reuse: Option<PathBuf>,
    /// Hindsight placements for (c), comma separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "user-turn,user-note,system,system-no-answer"
    )]
    hindsight: Vec<HindsightPlacement>,
    /// Per-request timeout, ms.
    #[arg(long, default_value_t = 300_000)]
    timeout_ms: u64,
    /// Bearer token.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Write the full report (all runs, per-item outcomes) as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Cli {
    fn config(&self) -> anyhow::Result<BaselineConfig> {
        let reuse = match &self.reuse {
            Some(path) => Some(
                serde_json::from_slice(
                    &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
                )
                .with_context(|| format!("parsing {}", path.display()))?,
            ),
            None => None,
        };
        Ok(BaselineConfig {
            endpoint: self.endpoint.clone(),
            model: self.model.clone(),
            api_key: self.api_key.clone(),
            seed: self.seed,
            tickets: self.tickets,
            samples: self.samples,
            temperature: self.temperature,
            max_tokens: Some(self.max_tokens),
            concurrency: self.concurrency,
            variant: self.variant,
            records: self.records,
            response_format: !self.no_response_format,
            placements: self.hindsight.clone(),
            critique_style: self.critique_style,
            reuse,
            timeout_ms: self.timeout_ms,
            progress: !self.no_progress,
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Without RUST_LOG: each baseline as it is measured, and warnings, so a long run read
        // from a log file is not silent.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,hindsight_bench=info")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let report = run_baselines(&cli.config()?).await?;
    print!("{}", render_table(&report));
    if let Some(path) = &cli.out {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
