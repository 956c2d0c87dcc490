// Generation throughput of `hindsight serve` at 1, 4 and 16 concurrent streams on the default
// model (SmolLM2-135M-Instruct Q4_1, CPU).
//
// `cargo bench -p hindsight-bench --bench serve_throughput` (run deploy/fetch-model.sh first).
// Each stream sends `HINDSIGHT_BENCH_REQUESTS` (default 2) streamed chat requests in a row
// (temperature 0.8, max_tokens 64); tokens/s = completion tokens of all streams / wall time.
// Then `n > 1` on a ~500-token prompt: one request with n = 4 (its choices share one prefill)
// against 4 concurrent single-choice requests with the same seeds (4 prefills, what n = 4 cost
// before the choices shared it), max_tokens 16, median wall time of 3 rounds each.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use hindsight_serve::{run_serve, ServeArgs};
use serde_json::{json, Value};

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

async fn one(http: &reqwest::Client, base: &str, i: usize) -> Result<usize> {
    let body = json!({"model": "base", "messages": [{"role": "user", "content": format!("Write a long story about a robot named R{i}.")}],
                      "max_tokens": 64, "temperature": 0.8, "seed": i, "stream": true, "stream_options": {"include_usage": true}});
    let text = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    let mut tokens = None;
    for line in text.lines() {
        if let Some(d) = line.strip_prefix("data: ") {
            if let Ok(v) = serde_json::from_str::<Value>(d) {
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    tokens = Some(n as usize);
                }
            }
        }
    }
    tokens.context("no usage chunk")
}

fn main() -> Result<()> {
    // Not `#[tokio::main]`: the thread count is settled before the runtime's threads exist.
    hindsight_model::run_settled(run())?
}

async fn run() -> Result<()> {
    let model = hindsight_model::testing::default_model_path()?;
    // Not hindsight_bench::knobs: serve/examples/ includes this file. A bad value stops.
    let per_stream: usize = match std::env::var("HINDSIGHT_BENCH_REQUESTS") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("HINDSIGHT_BENCH_REQUESTS={v:?}"))?,
        Err(_) => 2,
    };
    use clap::Parser;
    let args = Cli::parse_from(["x", "--model", model.to_str().context("path")?]).serve;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run_serve(args.load()?, listener, async {
        let _ = stop_rx.await;
    }));
    let http = reqwest::Client::new();
    let t0 = Instant::now();
    while http
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .map(|r| r.status().is_success())
        .ok()
        != Some(true)
    {
        ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "server did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    one(&http, &base, 0).await?; // warm-up
    println!(
        "serve_throughput: SmolLM2-135M-Instruct Q4_1, CPU, {} threads available",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    for streams in [1usize, 4, 16] {
        let start = Instant::now();
        let tasks: Vec<_> = (0..streams)
            .map(|s| {
                let (http, base) = (http.clone(), base.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    for r in 0..per_stream {
                        n += one(&http, &base, s * 100 + r).await?;
                    }
                    anyhow::Ok(n)
                })
            })
            .collect();
        let mut tokens = 0;
        for t in tasks {
            tokens += t.await??;
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "  {streams:2} concurrent streams: {tokens:5} tokens in {secs:6.1} s = {:7.1} tokens/s",
            tokens as f64 / secs
        );
    }
    choices(&http, &base).await?;
    let _ = stop_tx.send(());
    server.await??;
    Ok(())
}

/// One chat request on the long prompt; returns the number of choices answered.
async fn long_prompt(http: &reqwest::Client, base: &str, n: usize, seed: usize) -> Result<usize> {
    let facts: String = (0..40)
        .map(|i| {
            format!(
                "Order {i} shipped on day {} to warehouse {}. ",
                i % 28 + 1,
                i % 7
            )
        })
        .collect();
    let body = json!({"model": "base", "messages": [{"role": "user", "content": format!("{facts}Which order shipped last?")}],
                      "max_tokens": 16, "temperature": 0.8, "seed": seed, "n": n});
    let v: Value = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().context("usage")?;
    ensure!(
        prompt_tokens >= 400,
        "the long prompt has {prompt_tokens} tokens"
    );
    Ok(v["choices"].as_array().map_or(0, Vec::len))
}

async fn choices(http: &reqwest::Client, base: &str) -> Result<()> {
    const N: usize = 4;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut shared, mut separate) = (Vec::new(), Vec::new());
    for round in 0..3 {
        let start = Instant::now();
        ensure!(long_prompt(http, base, N, round * 10).await? == N);
        shared.push(start.elapsed().as_secs_f64());
        let start = Instant::now();
        let futs = (0..N).map(|i| long_prompt(http, base, 1, round * 10 + i));
        for answered in futures::future::join_all(futs).await {
            ensure!(answered? == 1);
        }
        separate.push(start.elapsed().as_secs_f64());
    }
    let (a, b) = (median(shared), median(separate));
    println!(
        "  n = {N} on a ~500-token prompt, 16 new tokens: {a:5.2} s one request (shared prefill) vs {b:5.2} s {N} concurrent requests ({:.2}x)",
        b / a
    );
    Ok(())
}
