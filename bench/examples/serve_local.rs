//! Runs `hindsight serve` in-process (for measuring baselines before the `hindsight` binary
//! wires the subcommand): `cargo run --release -p hindsight-bench --example serve_local -- --listen 127.0.0.1:8000`.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: hindsight_serve::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    // Not `#[tokio::main]`: the thread count is settled before the runtime's threads exist.
    hindsight_model::run_settled(run())?
}

async fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let config = cli.serve.load()?;
    let listener = tokio::net::TcpListener::bind(config.listen).await?;
    hindsight_serve::run_serve(config, listener, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
