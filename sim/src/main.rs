//! `hindsight-sim`: the simulated production environment from the command line (eval sets,
//! traffic with simulated feedback through the proxy). The hindsight baselines measured on it
//! are a bench: `cargo bench -p hindsight-bench --bench baselines`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use hindsight_eval::to_jsonl;
use hindsight_sim::{
    eval_items_under, run_env, CritiqueStyle, EnvRunConfig, FeedbackConfig, PromptOptions, Records,
    Sop, Split, UserConfig, Variant, World,
};

#[derive(Parser)]
#[command(
    name = "hindsight-sim",
    about = "The simulated production environment: tickets, traffic, feedback"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write the held-out eval split as a `hindsight eval` JSONL set.
    EvalSet(SetArgs),
    /// Write train-split tickets in the same format (for offline experiments; never eval items).
    TrainSet(SetArgs),
    /// Drive production-like traffic through the proxy, with simulated user feedback.
    Run(Box<RunArgs>),
    /// Print the hidden SOP (what `--with-rules` puts in the system prompt).
    Rules,
    /// Print one ticket, its prompt and its SOP resolution.
    Show {
        /// Ticket index.
        #[arg(long, default_value_t = 0)]
        index: u64,
        /// World seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// How the user message writes the records.
        #[arg(long, value_enum, default_value = "compact")]
        records: Records,
    },
}

#[derive(Args)]
struct PromptArgs {
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
}

#[derive(Args)]
struct SetArgs {
    /// World seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of tickets.
    #[arg(long, default_value_t = 100)]
    n: usize,
    #[command(flatten)]
    prompt: PromptArgs,
    /// Put the SOP in the system prompt (baseline (b)).
    #[arg(long)]
    with_rules: bool,
    /// The SOP's retention window in days (a changed rule: expected decisions under it).
    #[arg(long, default_value_t = hindsight_sim::RETENTION_AFTER_DAYS)]
    retention_after_days: u32,
    /// Output file (stdout when absent).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct RunArgs {
    /// Agent API base (the proxy), e.g. http://127.0.0.1:8080/v1.
    #[arg(long)]
    agent: String,
    /// Model name sent.
    #[arg(long, default_value = "base")]
    model: String,
    /// Episodes started per second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Episodes to run.
    #[arg(long, default_value_t = 20)]
    episodes: u64,
    /// First episode / train ticket index (continue where an earlier run stopped).
    #[arg(long, default_value_t = 0)]
    first_episode: u64,
    /// Episodes in flight at most.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// World seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    prompt: PromptArgs,
    /// Share of tool calls that fail.
    #[arg(long, default_value_t = 0.1)]
    tool_failure_rate: f64,
    /// Model calls per episode at most.
    #[arg(long, default_value_t = 6)]
    max_turns: usize,
    /// The SOP's retention window in days the user judges by (a changed rule).
    #[arg(long, default_value_t = hindsight_sim::RETENTION_AFTER_DAYS)]
    retention_after_days: u32,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// Feedback webhook base URL (default: the agent URL's origin, i.e. the proxy).
    #[arg(long)]
    feedback_endpoint: Option<String>,
    /// HMAC secret for signing feedback.
    #[arg(long, env = "HINDSIGHT_FEEDBACK_SECRET", hide_env_values = true)]
    secret: Option<String>,
    /// Send no feedback.
    #[arg(long)]
    no_feedback: bool,
    /// Delay between an answer and its feedback, ms.
    #[arg(long, default_value_t = 1000)]
    feedback_delay_ms: u64,
    /// Send feedback in episode order, each episode's once it and every earlier one are
    /// answered (reproducible training order downstream), instead of each
    /// `feedback_delay_ms` after its answer.
    #[arg(long)]
    feedback_in_order: bool,
    /// Share of deliberately wrong feedback.
    #[arg(long, default_value_t = 0.1)]
    noise_rate: f64,
    /// Share of wrong answers that also get a corrected answer.
    #[arg(long, default_value_t = 0.3)]
    correction_rate: f64,
    /// How explicit the simulated user's critiques are.
    #[arg(long, value_enum, default_value = "rule-and-value")]
    critique_style: CritiqueStyle,
    /// Episode id prefix (default: bench-<ms>).
    #[arg(long)]
    run_id: Option<String>,
    /// Bearer token for the agent endpoint.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Write every episode's outcome as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn prompt_options(p: &PromptArgs, with_rules: bool) -> PromptOptions {
    PromptOptions {
        variant: p.variant,
        records: p.records,
        with_rules,
        response_format: !p.no_response_format,
    }
}

fn origin(url: &str) -> String {
    // scheme://host[:port] of an http(s) URL.
    let (scheme, rest) = url.split_once("://").unwrap_or(("http", url));
    let host = rest.split('/').next().unwrap_or(rest);
    format!("{scheme}://{host}")
}

fn write_or_print(out: Option<&PathBuf>, text: &str) -> anyhow::Result<()> {
    match out {
        Some(path) => {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
        }
        None => {
            print!("{text}");
            Ok(())
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Without RUST_LOG: our progress lines (traffic summaries) and warnings, so a long run read from a log file is not silent.
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,hindsight_sim=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let cmd = cli.command;
    match cmd {
        Command::EvalSet(a) | Command::TrainSet(a)
            if a.with_rules && a.retention_after_days != hindsight_sim::RETENTION_AFTER_DAYS =>
        {
            anyhow::bail!(
                "--with-rules states the default SOP; it cannot be combined with --retention-after-days"
            )
        }
        Command::EvalSet(a) => {
            let items = eval_items_under(
                &World::new(a.seed),
                Split::Eval,
                a.n,
                prompt_options(&a.prompt, a.with_rules),
                &Sop {
                    retention_after_days: a.retention_after_days,
                },
            );
            write_or_print(a.out.as_ref(), &to_jsonl(&items)?)?;
        }
        Command::TrainSet(a) => {
            let items = eval_items_under(
                &World::new(a.seed),
                Split::Train,
                a.n,
                prompt_options(&a.prompt, a.with_rules),
                &Sop {
                    retention_after_days: a.retention_after_days,
                },
            );
            write_or_print(a.out.as_ref(), &to_jsonl(&items)?)?;
        }
        Command::Run(a) => {
            let mut cfg = EnvRunConfig::new(&a.agent, &a.model);
            cfg.api_key = a.api_key.clone();
            cfg.episodes = a.episodes;
            cfg.first_episode = a.first_episode;
            cfg.rate_per_s = a.rate;
            cfg.concurrency = a.concurrency;
            cfg.seed = a.seed;
            cfg.options = prompt_options(&a.prompt, false);
            cfg.tool_failure_rate = a.tool_failure_rate;
            cfg.max_turns = a.max_turns;
            cfg.sop = Sop {
                retention_after_days: a.retention_after_days,
            };
            cfg.temperature = a.temperature;
            if let Some(id) = &a.run_id {
                cfg.run_id = id.clone();
            }
            cfg.user = UserConfig {
                noise_rate: a.noise_rate,
                correction_rate: a.correction_rate,
                critique_style: a.critique_style,
                ..UserConfig::default()
            };
            if !a.no_feedback {
                cfg.feedback = Some(FeedbackConfig {
                    endpoint: a
                        .feedback_endpoint
                        .clone()
                        .unwrap_or_else(|| origin(&a.agent)),
                    secret: a.secret.clone(),
                    delay_ms: a.feedback_delay_ms,
                    in_episode_order: a.feedback_in_order,
                });
            }
            let summary = run_env(cfg).await?;
            println!(
                "run {}: {} episodes ({} failed), exact match {:.1}%, feedback events {} ({} episodes failed to send), noisy reactions {}, tool calls {} ({} injected failures), {:.1} s",
                summary.run_id,
                summary.episodes,
                summary.failed,
                100.0 * summary.exact_match,
                summary.feedback_events,
                summary.feedback_failures,
                summary.noisy_reactions,
                summary.tool_calls,
                summary.tool_failures,
                summary.duration_ms as f64 / 1000.0
            );
            if let Some(out) = &a.out {
                write_or_print(Some(out), &serde_json::to_string_pretty(&summary)?)?;
            }
        }
        Command::Rules => print!("{}", hindsight_sim::rules_text()),
        Command::Show {
            index,
            seed,
            records,
        } => {
            let world = World::new(seed);
            let ticket = world.ticket(index);
            let resolution = hindsight_sim::resolve(&ticket);
            println!("{}", serde_json::to_string_pretty(&ticket)?);
            println!(
                "--- system prompt ---\n{}",
                hindsight_sim::system_prompt(PromptOptions::default())
            );
            println!(
                "--- user message ---\n{}",
                hindsight_sim::user_message(&ticket, Variant::Single, records)
            );
            println!(
                "--- resolution ---\n{}",
                serde_json::to_string_pretty(&resolution)?
            );
        }
    }
    Ok(())
}
