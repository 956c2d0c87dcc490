//! `hindsight`: one binary, one subcommand per process role. Each subcommand parses its flags
//! and calls into a library crate, where the behaviour (and its tests) live.

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "hindsight", version, about = "Online continual learning for deployed LLM agents.")]
struct Cli {
    /// Log format: `text` for people, `json` for log pipelines. Filter with RUST_LOG.
    #[arg(long, global = true, env = "HINDSIGHT_LOG_FORMAT", default_value = "text")]
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
    /// Transparent capturing proxy in front of an OpenAI-compatible endpoint.
    Proxy(hindsight_proxy::ProxyArgs),
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match cli.command {
        Command::Proxy(args) => run_proxy(args).await,
    }
}
