//! `cargo run --example agent_client -- --base-url http://127.0.0.1:8080/v1 --secret s3cret`
//!
//! The Rust twin of `examples/agent/agent.py` (see its README): one tool-call turn and one
//! answer through the Hindsight proxy, then signed feedback; prints a JSON summary.

mod agent;

use clap::Parser;

#[derive(Parser)]
struct Args {
    /// The proxy's OpenAI base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080/v1")]
    base_url: String,
    /// The proxy's origin, for `/hindsight/v1/feedback` (default: --base-url without `/v1`).
    #[arg(long)]
    feedback_url: Option<String>,
    /// Webhook signing secret.
    #[arg(long, env = "HINDSIGHT_SECRET")]
    secret: Option<String>,
    /// Model (default: the first one the server lists).
    #[arg(long)]
    model: Option<String>,
    /// The customer's message.
    #[arg(
        long,
        default_value = "Hi, where is my order A-1001? My email is ana@example.com."
    )]
    ticket: String,
    #[arg(long, default_value_t = 96)]
    max_tokens: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let feedback_url = a.feedback_url.unwrap_or_else(|| {
        let base = a.base_url.trim_end_matches('/');
        base.strip_suffix("/v1").unwrap_or(base).to_string()
    });
    let summary = agent::run(&agent::Options {
        base_url: a.base_url,
        feedback_url,
        secret: a.secret,
        model: a.model,
        ticket: a.ticket,
        max_tokens: a.max_tokens,
    })
    .await?;
    println!("{summary}");
    let status = summary["feedback"]["status"].as_u64().unwrap_or(0);
    anyhow::ensure!((200..300).contains(&status), "feedback refused: {summary}");
    Ok(())
}
