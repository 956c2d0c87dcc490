// Adapter hot-swap under load on `hindsight serve` with the default model (SmolLM2-135M-Instruct).
//
// `cargo bench -p hindsight-bench --bench serve_swap` (run deploy/fetch-model.sh first).
// Starts the real server on a local socket, loads a random LoRA adapter (r=8 on q,k,v,o) as
// "live", then 4 clients send steady traffic to "live" (max_tokens 8, half streamed) while the
// adapter is replaced `HINDSIGHT_BENCH_SWAPS` times (default 100) with load_inplace. Prints the
// load call latency and the swap latency (load call start -> first request completed by the new
// version) p50/p99, and the failed requests (must be 0).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use hindsight_model::candle_core::{DType, Device};
use hindsight_model::{Adapter, LoraConfig, LoraInit, LoraTarget, ModelBundle};
use hindsight_serve::{run_serve, ServeArgs, ServeError};
use serde_json::json;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn main() -> Result<()> {
    // Not `#[tokio::main]`: the thread count is settled before the runtime's threads exist.
    hindsight_model::run_settled(run())?
}

async fn run() -> Result<()> {
    let model = hindsight_model::testing::default_model_path()?;
    // Not hindsight_bench::knobs: serve/examples/ includes this file. A bad value stops.
    let swaps: usize = match std::env::var("HINDSIGHT_BENCH_SWAPS") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("HINDSIGHT_BENCH_SWAPS={v:?}"))?,
        Err(_) => 100,
    };
    // Two adapter directories to alternate between.
    let tmp = tempfile::tempdir()?;
    let dirs = adapter_dirs(&model, tmp.path())?;
    let (base, stop_tx, server) = start_server(&model, &dirs[0]).await?;
    let http = reqwest::Client::new();

    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let ok = Arc::new(AtomicUsize::new(0));
    // (completion instant, adapter tag) of every request.
    let log: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let mut clients = Vec::new();
    for c in 0..4 {
        let (http, base, stop, failed, ok, log) = (
            http.clone(),
            base.clone(),
            stop.clone(),
            failed.clone(),
            ok.clone(),
            log.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let body = json!({"model": "live", "messages": [{"role": "user", "content": format!("Say something nice #{c}-{i}")}],
                                  "max_tokens": 8, "temperature": 0.7, "seed": i, "stream": c % 2 == 0});
                let res = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await;
                match res {
                    Ok(r) if r.status().is_success() => {
                        let tag = r.headers().get("x-hindsight-adapter").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                        match r.text().await {
                            Ok(t) if t.contains("\"choices\"") => {
                                log.lock().unwrap_or_else(|p| p.into_inner()).push((Instant::now(), tag));
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {
                                failed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    _ => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut load_ms = Vec::new();
    let mut swap_ms = Vec::new();
    for s in 0..swaps {
        let start = Instant::now();
        let r = http
            .post(format!("{base}/v1/load_lora_adapter"))
            .json(
                &json!({"lora_name": "live", "lora_path": dirs[(s + 1) % 2], "load_inplace": true}),
            )
            .send()
            .await?;
        ensure!(r.status().is_success(), "load failed: {}", r.text().await?);
        let tag = r
            .headers()
            .get("x-hindsight-adapter")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        load_ms.push(start.elapsed().as_secs_f64() * 1e3);
        // First request completed by the new version.
        let served = loop {
            let found = log
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .find(|(t, g)| *t >= start && *g == tag)
                .map(|(t, _)| *t);
            if let Some(t) = found {
                break t;
            }
            ensure!(
                start.elapsed() < Duration::from_secs(60),
                "version {tag} never served"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        swap_ms.push((served - start).as_secs_f64() * 1e3);
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await?;
    }
    let _ = stop_tx.send(());
    server.await??;
    println!("serve_swap: {swaps} swaps of a r=8 q,k,v,o adapter under 4-client load (max_tokens 8), SmolLM2-135M Q4_1 on CPU");
    println!(
        "  load call latency    p50 {:8.1} ms   p99 {:8.1} ms",
        pct(&mut load_ms, 0.5),
        pct(&mut load_ms, 0.99)
    );
    println!("  swap latency         p50 {:8.1} ms   p99 {:8.1} ms   (load call start -> first request completed on the new version)", pct(&mut swap_ms, 0.5), pct(&mut swap_ms, 0.99));
    println!(
        "  requests ok {}   failed {}",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    ensure!(
        failed.load(Ordering::Relaxed) == 0,
        "failed requests during swaps"
    );
    Ok(())
}

/// Writes two random r=8 q,k,v,o adapters for `model` under `tmp` (`v0`, `v1`) to alternate
/// between.
fn adapter_dirs(model: &Path, tmp: &Path) -> Result<Vec<PathBuf>> {
    let bundle = ModelBundle::load(model, DType::F32, &Device::Cpu)?;
    let dirs: Vec<PathBuf> = (0..2)
        .map(|i| -> Result<PathBuf> {
            let cfg = LoraConfig {
                rank: 8,
                alpha: 16.0,
                targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O],
                ..LoraConfig::default()
            };
            let a = Adapter::new(
                "live",
                cfg,
                &bundle.config,
                LoraInit::RandomB(0.01),
                i,
                &Device::Cpu,
            )?;
            let dir = tmp.join(format!("v{i}"));
            a.save_peft(&dir, "SmolLM2-135M-Instruct")?;
            Ok(dir)
        })
        .collect::<Result<_>>()?;
    drop(bundle);
    Ok(dirs)
}

/// Starts `hindsight serve` on a local socket with `first` loaded as "live" and waits until it
/// answers; returns its base URL, its stopper and its task.
async fn start_server(
    model: &Path,
    first: &Path,
) -> Result<(
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), ServeError>>,
)> {
    use clap::Parser;
    let args = Cli::parse_from([
        "x",
        "--model",
        model.to_str().context("path")?,
        "--adapter",
        &format!("live={}", first.display()),
    ])
    .serve;
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
    println!("server ready in {:.2} s", t0.elapsed().as_secs_f64());
    Ok((base, stop_tx, server))
}
