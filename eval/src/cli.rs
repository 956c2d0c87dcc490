//! `hindsight eval`: the command-line face of the runner (the lead's binary flattens
//! [`EvalArgs`] into its subcommand and calls [`run_eval_cli`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::compare::{compare_runs, Comparison};
use crate::error::EvalError;
use crate::runner::{evaluate, RunConfig, RunReport};
use crate::set::{EvalSet, ScorerKind};

/// Schema tag of the results file.
pub const REPORT_SCHEMA: &str = "hindsight.eval.report/v1";

/// Arguments of `hindsight eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// Eval set (JSONL: one item per line, see eval/README.md).
    #[arg(long)]
    pub set: PathBuf,
    /// OpenAI-compatible API base; requests go to `{endpoint}/chat/completions`.
    #[arg(
        long,
        env = "HINDSIGHT_EVAL_ENDPOINT",
        default_value = "http://127.0.0.1:8080/v1"
    )]
    pub endpoint: String,
    /// Model or adapter name to evaluate (required unless --compare is given).
    #[arg(long, required_unless_present = "compare")]
    pub model: Option<String>,
    /// Evaluate two models on the same items and report B − A with a 95% confidence interval.
    #[arg(long, num_args = 2, value_names = ["A", "B"], conflicts_with = "model")]
    pub compare: Option<Vec<String>>,
    /// API base for model B of --compare (default: --endpoint).
    #[arg(long, requires = "compare")]
    pub endpoint_b: Option<String>,
    /// Samples per item (n of pass@k).
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// pass@k values to report, comma separated (default: 1 and --samples).
    #[arg(long, value_delimiter = ',')]
    pub k: Vec<usize>,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Base seed (sample i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// max_tokens per request.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Retries per request on 429/502/503/504 (Retry-After honoured).
    #[arg(long, default_value_t = 5)]
    pub max_retries: u32,
    /// Per-request timeout, milliseconds.
    #[arg(long, default_value_t = 120_000)]
    pub timeout_ms: u64,
    /// Tool-call rounds per item before it counts as `tool_turn_limit`.
    #[arg(long, default_value_t = 4)]
    pub max_tool_turns: usize,
    /// Score every item with this scorer instead of the item's own.
    #[arg(long, value_enum)]
    pub scorer: Option<ScorerKind>,
    /// Evaluate only the first N items.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Results file (JSON). Default: eval-results/<set>-<model>-<ms>.json.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Bearer token for the endpoint.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Let a Hindsight proxy log the eval traffic (off by default: eval items must never
    /// become training data).
    #[arg(long)]
    pub log_traffic: bool,
    /// Leave the answer texts out of the results file.
    #[arg(long)]
    pub no_content: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Ask for each answer's log-probs with K alternatives per token (1..=20) and report the
    /// mean chosen-token log-prob and next-token entropy (what the eval gate's collapse guard
    /// compares).
    #[arg(long, value_name = "K")]
    pub top_logprobs: Option<u32>,
    /// Bootstrap resamples for --compare.
    #[arg(long, default_value_t = 10_000)]
    pub bootstrap_resamples: usize,
}

impl EvalArgs {
    /// The run settings for `model` at `endpoint`.
    pub fn run_config(&self, endpoint: &str, model: &str) -> RunConfig {
        let mut k = if self.k.is_empty() {
            vec![1, self.samples]
        } else {
            self.k.clone()
        };
        k.sort_unstable();
        k.dedup();
        let mut cfg = RunConfig::new(endpoint, model);
        cfg.api_key = self.api_key.clone();
        cfg.samples = self.samples;
        cfg.pass_k = k;
        cfg.temperature = self.temperature;
        cfg.top_p = self.top_p;
        cfg.seed = self.seed;
        cfg.max_tokens = self.max_tokens;
        cfg.concurrency = self.concurrency;
        cfg.max_retries = self.max_retries;
        cfg.request_timeout_ms = self.timeout_ms;
        cfg.max_tool_turns = self.max_tool_turns;
        cfg.no_log = !self.log_traffic;
        cfg.scorer_override = self.scorer;
        cfg.progress = !self.no_progress;
        cfg.keep_content = !self.no_content;
        cfg.top_logprobs = self.top_logprobs;
        cfg
    }
}

/// Everything `hindsight eval` produced: one run, or two runs and their comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// `hindsight.eval.report/v1`.
    pub schema: String,
    /// The runs (one, or A then B).
    pub runs: Vec<RunReport>,
    /// B against A, for --compare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Comparison>,
    /// Where the results were written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results_path: Option<PathBuf>,
}

/// Runs `hindsight eval`: loads the set, evaluates (or compares), prints a summary to stdout
/// and writes the results JSON.
pub async fn run_eval_cli(args: EvalArgs) -> Result<EvalReport, EvalError> {
    let mut set = EvalSet::load(&args.set)?;
    if let Some(limit) = args.limit {
        set.truncate(limit);
    }
    let mut runs = Vec::new();
    let mut comparison = None;
    match (&args.compare, &args.model) {
        (Some(models), _) if models.len() == 2 => {
            let a = evaluate(&set, &args.run_config(&args.endpoint, &models[0])).await?;
            let endpoint_b = args.endpoint_b.as_deref().unwrap_or(&args.endpoint);
            let b = evaluate(&set, &args.run_config(endpoint_b, &models[1])).await?;
            comparison = Some(compare_runs(&a, &b, args.bootstrap_resamples, args.seed)?);
            runs.push(a);
            runs.push(b);
        }
        (None, Some(model)) => {
            runs.push(evaluate(&set, &args.run_config(&args.endpoint, model)).await?)
        }
        _ => {
            return Err(EvalError::InvalidConfig {
                field: "model",
                reason: "give --model M or --compare A B".into(),
            })
        }
    }
    let mut report = EvalReport {
        schema: REPORT_SCHEMA.to_string(),
        runs,
        comparison,
        results_path: None,
    };
    let path = args
        .out
        .clone()
        .unwrap_or_else(|| default_results_path(&report, &set));
    write_report(&report, &path)?;
    report.results_path = Some(path);
    print!("{}", render_summary(&report));
    Ok(report)
}

fn default_results_path(report: &EvalReport, set: &EvalSet) -> PathBuf {
    let models: Vec<String> = report.runs.iter().map(|r| sanitize(&r.model)).collect();
    let started = report.runs.first().map(|r| r.started_at_ms).unwrap_or(0);
    PathBuf::from("eval-results").join(format!(
        "{}-{}-{started}.json",
        sanitize(&set.name),
        models.join("-vs-")
    ))
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Writes the report as pretty JSON, creating parent folders.
pub fn write_report(report: &EvalReport, path: &Path) -> Result<(), EvalError> {
    let io = |source| EvalError::WriteResults {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    let json = serde_json::to_vec_pretty(report)?;
    std::fs::write(path, json).map_err(io)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// A human summary: one block per run, then the comparison.
pub fn render_summary(report: &EvalReport) -> String {
    let mut out = String::new();
    for run in &report.runs {
        let m = &run.metrics;
        let _ = writeln!(
            out,
            "model {} @ {} (adapter {}), set {} [{}…], {} items × {} samples, temperature {}, seed {}",
            run.model,
            run.endpoint,
            if run.adapter_versions.is_empty() { "-".to_string() } else { run.adapter_versions.join(",") },
            run.set.name,
            run.set.sha256.get(..12).unwrap_or(&run.set.sha256),
            m.items,
            run.samples,
            run.temperature,
            run.seed
        );
        let _ = write!(out, "  exact match {}", pct(m.exact_match));
        if let Some(f) = m.field_accuracy {
            let _ = write!(out, "  field accuracy {}", pct(f));
        }
        for (k, v) in &m.pass_at_k {
            let _ = write!(out, "  {k} {}", pct(*v));
        }
        let _ = writeln!(out);
        if !m.unparseable.is_empty() {
            let reasons: Vec<String> = m
                .unparseable
                .iter()
                .map(|(r, n)| format!("{r}={n}"))
                .collect();
            let _ = writeln!(out, "  unparseable: {}", reasons.join(" "));
        }
        let _ = writeln!(
            out,
            "  mean latency {:.0} ms, tool calls/answer {:.2}, took {:.1} s",
            m.mean_latency_ms,
            m.tool_calls_per_sample,
            run.duration_ms as f64 / 1000.0
        );
        if let (Some(lp), Some(h)) = (m.mean_token_logprob, m.mean_token_entropy) {
            let _ = writeln!(
                out,
                "  answer tokens: mean log-prob {lp:.3}, mean entropy {h:.3} nats"
            );
        }
    }
    if let Some(c) = &report.comparison {
        let _ = writeln!(
            out,
            "{} − {} over {} paired items: exact match {}",
            c.b, c.a, c.items, c.exact_match
        );
        if let Some(f) = &c.field_accuracy {
            let _ = writeln!(
                out,
                "  field accuracy {:+.1} pts (95% CI {:+.1} … {:+.1})",
                100.0 * f.diff,
                100.0 * f.ci95[0],
                100.0 * f.ci95[1]
            );
        }
    }
    if let Some(p) = &report.results_path {
        let _ = writeln!(out, "results: {}", p.display());
    }
    out
}
