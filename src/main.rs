//! `hindsight`: one binary, one subcommand per process role. Each subcommand parses its flags
//! and calls into a library crate, where the behaviour (and its tests) live.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use hindsight_feedback::{FeedbackFile, JoinFile};

mod adapters;
mod rollout;

#[derive(Debug, Parser)]
#[command(
    name = "hindsight",
    version,
    about = "Online continual learning for deployed LLM agents."
)]
struct Cli {
    /// Log format: `text` for people, `json` for log pipelines. Filter with RUST_LOG.
    #[arg(
        long,
        global = true,
        env = "HINDSIGHT_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Transparent capturing proxy in front of an OpenAI-compatible endpoint (also serves the
    /// feedback API under /hindsight/v1/feedback).
    Proxy(hindsight_proxy::ProxyArgs),
    /// OpenAI-compatible model server with per-request LoRA adapters and hot-swap.
    Serve(hindsight_serve::ServeArgs),
    /// The feedback API on its own (when it should not share the proxy's port).
    Feedback(FeedbackArgs),
    /// Join interactions with their feedback into training episodes (hindsight.episodes).
    Join(JoinArgs),
    /// Run an evaluation set against an OpenAI-compatible endpoint.
    Eval(hindsight_eval::EvalArgs),
    /// Print records of a Hindsight topic as JSON lines.
    Tail(TailArgs),
    /// The online learner: trains a LoRA adapter from hindsight.episodes, registers
    /// candidates and publishes them through the eval gate.
    Learner(LearnerCliArgs),
    /// Read the adapter registry: list, show and diff versions.
    Adapters(adapters::AdaptersArgs),
    /// Canary rollouts: run the controller, or start, inspect, pause, promote, roll back, kill,
    /// pin and audit a route's rollout.
    Rollout(rollout::RolloutArgs),
}

/// `hindsight learner`.
#[derive(Debug, clap::Args)]
struct LearnerCliArgs {
    #[command(flatten)]
    args: hindsight_learner::online::LearnerArgs,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. 127.0.0.1:9465.
    #[arg(long)]
    metrics_listen: Option<String>,
}

/// `hindsight feedback`: config sections `[log]` and `[feedback]`.
#[derive(Debug, clap::Args)]
struct FeedbackArgs {
    /// TOML config file with `[log]` and `[feedback]` sections (env: HINDSIGHT_LOG__*,
    /// HINDSIGHT_FEEDBACK__*).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: String,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. 127.0.0.1:9468.
    #[arg(long)]
    metrics_listen: Option<String>,
}

/// `hindsight join`: config sections `[log]` and `[joiner]`.
#[derive(Debug, clap::Args)]
struct JoinArgs {
    /// TOML config file with `[log]` and `[joiner]` sections (env: HINDSIGHT_LOG__*,
    /// HINDSIGHT_JOINER__*).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. 127.0.0.1:9467.
    #[arg(long)]
    metrics_listen: Option<String>,
}

/// `hindsight tail`.
#[derive(Debug, clap::Args)]
struct TailArgs {
    /// Which topic: interactions, feedback, episodes or deadletter.
    #[arg(value_parser = ["interactions", "feedback", "episodes", "deadletter", "rollouts"])]
    topic: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Topic prefix (`<prefix>.interactions`, ...).
    #[arg(long, default_value = "hindsight")]
    topic_prefix: String,
    /// Print only the last N records (0 = all). Reads from N records before each partition's
    /// end, not the whole topic.
    #[arg(long, short = 'n', default_value_t = 0)]
    last: usize,
    /// Keep printing new records until interrupted.
    #[arg(long, short = 'f')]
    follow: bool,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr (stdout carries data: `tail` records, the learner's summary), with
    // colours only on a terminal.
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Resolves on Ctrl-C or SIGTERM: the start of graceful shutdown.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

async fn run_proxy(args: hindsight_proxy::ProxyArgs) -> anyhow::Result<()> {
    let config = args.load()?;
    let listener = tokio::net::TcpListener::bind(config.proxy.listen_addr)
        .await
        .with_context(|| format!("binding proxy.listen_addr {}", config.proxy.listen_addr))?;
    let admin = tokio::net::TcpListener::bind(config.proxy.admin_addr)
        .await
        .with_context(|| format!("binding proxy.admin_addr {}", config.proxy.admin_addr))?;
    let report = hindsight_proxy::run(
        config,
        listener,
        admin,
        hindsight_proxy::Extensions::default(),
        shutdown_signal(),
    )
    .await?;
    tracing::info!(?report, "Bye.");
    Ok(())
}

async fn run_serve(args: hindsight_serve::ServeArgs) -> anyhow::Result<()> {
    let config = args.load()?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("binding --listen {}", config.listen))?;
    hindsight_serve::run_serve(config, listener, shutdown_signal()).await?;
    Ok(())
}

async fn run_feedback(args: FeedbackArgs) -> anyhow::Result<()> {
    let file: FeedbackFile = hindsight_core::load_toml(
        args.config.as_deref(),
        std::env::vars(),
        FeedbackFile::SECTIONS,
    )?;
    let log = file.log.validate()?;
    let feedback = file.feedback.validate()?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    if let Some(addr) = &args.metrics_listen {
        serve_metrics(addr).await?;
    }
    let report =
        hindsight_feedback::serve_feedback(feedback, log, listener, shutdown_signal()).await?;
    tracing::info!(?report, "Bye.");
    Ok(())
}

async fn run_join(args: JoinArgs) -> anyhow::Result<()> {
    let file: JoinFile =
        hindsight_core::load_toml(args.config.as_deref(), std::env::vars(), JoinFile::SECTIONS)?;
    if let Some(addr) = &args.metrics_listen {
        serve_metrics(addr).await?;
    }
    let stats = hindsight_feedback::run_joiner(
        file.joiner.validate()?,
        file.log.validate()?,
        shutdown_signal(),
    )
    .await?;
    tracing::info!(?stats, "Joiner stopped.");
    Ok(())
}

async fn run_tail(args: TailArgs) -> anyhow::Result<()> {
    use hindsight_feedback::{LogConfig, Topic, TopicReader};
    let topic = match args.topic.as_str() {
        "interactions" => Topic::Interactions,
        "feedback" => Topic::Feedback,
        "episodes" => Topic::Episodes,
        "rollouts" => Topic::Rollouts,
        _ => Topic::DeadLetter,
    };
    let log = LogConfig {
        brokers: args.brokers,
        topic_prefix: args.topic_prefix,
        ..LogConfig::default()
    }
    .validate()?;
    // A fresh group that commits nothing: from the beginning, or with `--last N` from N records
    // before each partition's end (a long-running broker's topic is not read to find the end).
    let group = format!("hindsight-tail-{}", std::process::id());
    let reader = if args.last == 0 {
        TopicReader::new(&log, &group, &[topic])?
    } else {
        let timeout = Duration::from_secs(10);
        let name = log.topics().get(topic).to_string();
        let (client, last) = (log.client_config(), args.last as i64);
        let ends = tokio::task::spawn_blocking(move || {
            hindsight_feedback::end_offsets(&client, &[name], timeout)
        })
        .await??;
        let start = ends
            .into_iter()
            .map(|(tp, end)| (tp, (end - last).max(0)))
            .collect();
        TopicReader::assigned(&log, &group, &[topic], &start, timeout)?
    };
    let mut kept = std::collections::VecDeque::new();
    let idle = Duration::from_secs(3);
    loop {
        match reader.recv_timeout(idle).await? {
            Some(rec) => {
                let line = String::from_utf8_lossy(&rec.payload).into_owned();
                if args.last == 0 {
                    println!("{line}");
                } else {
                    kept.push_back(line);
                    if kept.len() > args.last {
                        kept.pop_front();
                    }
                }
            }
            None if args.follow => {
                for line in kept.drain(..) {
                    println!("{line}");
                }
            }
            None => break,
        }
    }
    for line in kept {
        println!("{line}");
    }
    Ok(())
}

/// Serves the process's Prometheus metrics at `/metrics` on `addr`, for the processes that have
/// no admin listener of their own (joiner, feedback API, learner).
async fn serve_metrics(addr: &str) -> anyhow::Result<()> {
    let handle = hindsight_proxy::prometheus()
        .context("another metrics recorder is installed; cannot export metrics")?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let h = handle.clone();
            async move { h.render() }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(())
}

async fn run_learner(cli: LearnerCliArgs) -> anyhow::Result<()> {
    use hindsight_learner::online::{run_learner, LearnerFile, LearnerSetup};
    let file: LearnerFile = hindsight_core::load_toml(
        cli.args.config.as_deref(),
        std::env::vars(),
        LearnerFile::SECTIONS,
    )?;
    if let Some(addr) = &cli.metrics_listen {
        serve_metrics(addr).await?;
    }
    let setup = LearnerSetup {
        learner: file.learner,
        log: file.log.validate()?,
        registry: file.registry,
        publish: file.publish,
        routing: file.routing,
    };
    let summary = run_learner(setup, shutdown_signal(), None, None).await?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

async fn run_eval(args: hindsight_eval::EvalArgs) -> anyhow::Result<()> {
    hindsight_eval::run_eval_cli(args).await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // Not `#[tokio::main]`: the thread count is settled before the runtime's threads exist.
    hindsight_model::run_settled(run())?
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match cli.command {
        Command::Proxy(args) => run_proxy(args).await,
        Command::Serve(args) => run_serve(args).await,
        Command::Feedback(args) => run_feedback(args).await,
        Command::Join(args) => run_join(args).await,
        Command::Eval(args) => run_eval(args).await,
        Command::Tail(args) => run_tail(args).await,
        Command::Learner(args) => run_learner(args).await,
        Command::Adapters(args) => adapters::run(args).await,
        Command::Rollout(args) => rollout::run(args, shutdown_signal()).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// deploy/hindsight.example.toml holds every process's sections; each process reads its
    /// own from it and ignores the others'.
    #[test]
    fn every_process_reads_its_sections_from_the_shared_example_file() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/hindsight.example.toml");
        let join: JoinFile =
            hindsight_core::load_toml(Some(&path), Vec::new(), JoinFile::SECTIONS).unwrap();
        join.joiner.clone().validate().unwrap();
        let shown = hindsight_feedback::JoinerConfig {
            redis_url: String::new(),
            ..join.joiner
        };
        let default = hindsight_feedback::JoinerConfig {
            redis_url: String::new(),
            ..hindsight_feedback::JoinerConfig::default()
        };
        assert_eq!(
            format!("{shown:?}"),
            format!("{default:?}"),
            "the example's [joiner] drifted from the defaults"
        );
        let feedback: FeedbackFile =
            hindsight_core::load_toml(Some(&path), Vec::new(), FeedbackFile::SECTIONS).unwrap();
        feedback.log.validate().unwrap();
        let serve = hindsight_serve::ServeArgs {
            config: Some(path.clone()),
            ..Default::default()
        };
        serve.load().unwrap();
        use hindsight_control::rollout::RolloutFile;
        let rollout: RolloutFile =
            hindsight_core::load_toml(Some(&path), Vec::new(), RolloutFile::SECTIONS).unwrap();
        rollout.routing.validate().unwrap();
        rollout.rollout.validate().unwrap();
        assert_eq!(
            rollout.routing,
            hindsight_routing::RoutingConfig::default(),
            "[routing] drifted from the defaults"
        );
        assert_eq!(
            rollout.rollout,
            hindsight_control::rollout::RolloutConfig::default(),
            "[rollout] drifted from the defaults"
        );
        hindsight_proxy::RawConfig::load(Some(&path), Vec::new())
            .unwrap()
            .validate()
            .unwrap();
    }
}
