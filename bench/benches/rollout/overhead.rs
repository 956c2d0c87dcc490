//! Part 2: what routing costs per request, routing off vs a rollout at weight 0.5, in the same
//! run, sequentially and concurrently.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use hindsight_control::rollout::{self, Op};
use hindsight_routing::{RoutingConfig, RoutingStore};
use serde_json::{json, Value};
use tokio::runtime::Handle;

use crate::figures::{histogram, mean, ms, sd, t_975};
use crate::services::{request, routing_config, store, unique, Proxy, Redis};
use crate::settings::Settings;
use crate::{CANARY, ROUTE, STABLE};

/// One arm's measurements in one mode.
pub(crate) struct ArmStats {
    pub(crate) all: Histogram<u64>,
    pub(crate) block_p50_ms: Vec<f64>,
    pub(crate) sum_us: f64,
    pub(crate) wall: Duration,
    pub(crate) errors: u64,
    pub(crate) canary: u64,
}

impl ArmStats {
    pub(crate) fn new() -> anyhow::Result<Self> {
        Ok(Self {
            all: histogram()?,
            block_p50_ms: Vec::new(),
            sum_us: 0.0,
            wall: Duration::ZERO,
            errors: 0,
            canary: 0,
        })
    }

    pub(crate) fn json(&self) -> Value {
        let n = self.all.len();
        json!({
            "requests": n, "errors": self.errors, "canary_answers": self.canary,
            "p50_ms": ms(&self.all, 0.5), "p99_ms": ms(&self.all, 0.99),
            "p999_ms": ms(&self.all, 0.999), "max_ms": ms(&self.all, 1.0),
            "mean_ms": self.sum_us / n.max(1) as f64 / 1000.0,
            "requests_per_s": n as f64 / self.wall.as_secs_f64(),
        })
    }
}

/// A chat call body for request `i`: a fixed system prompt and a user message that differs per
/// request (a different conversation each time, as real traffic is).
pub(crate) fn chat_body(i: usize) -> String {
    json!({
        "model": ROUTE,
        "messages": [
            {"role": "system", "content": "You are a support agent. Answer with a JSON decision."},
            {"role": "user", "content": format!("Order A-{i:07} arrived broken. I want my money back.")}
        ],
        "temperature": 0.2
    })
    .to_string()
}

/// Sends requests `first..first + n` to `proxy`, `concurrency` at a time, and records them.
pub(crate) async fn run_block(
    client: &reqwest::Client,
    proxy: SocketAddr,
    first: usize,
    n: usize,
    concurrency: usize,
    arm: &mut ArmStats,
) -> anyhow::Result<()> {
    let url = Arc::new(format!("http://{proxy}/v1/chat/completions"));
    let mut block = histogram()?;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..concurrency {
        let (client, url) = (client.clone(), url.clone());
        workers.spawn(async move {
            let mut out: Vec<(u64, bool, bool)> = Vec::new();
            for i in (first + w..first + n).step_by(concurrency) {
                let body = chat_body(i);
                let sent = Instant::now();
                let resp = client
                    .post(url.as_str())
                    .header("content-type", "application/json")
                    .header("x-hindsight-user", format!("user-{i}"))
                    .body(body)
                    .send()
                    .await;
                let (ok, canary) = match resp {
                    Ok(r) => {
                        let ok = r.status().is_success();
                        let canary = r
                            .headers()
                            .get("x-hindsight-adapter")
                            .is_some_and(|v| v == CANARY);
                        (r.bytes().await.is_ok() && ok, canary)
                    }
                    Err(_) => (false, false),
                };
                out.push((sent.elapsed().as_micros() as u64, ok, canary));
            }
            out
        });
    }
    while let Some(done) = workers.join_next().await {
        for (us, ok, canary) in done? {
            block.record(us.max(1))?;
            arm.sum_us += us as f64;
            arm.errors += u64::from(!ok);
            arm.canary += u64::from(canary);
        }
    }
    arm.wall += started.elapsed();
    arm.all.add(&block)?;
    arm.block_p50_ms.push(ms(&block, 0.5));
    Ok(())
}

/// Plain (routing off) vs routed (rollout at 0.5) in alternating blocks at `concurrency`.
pub(crate) async fn compare(
    s: &Settings,
    client: &reqwest::Client,
    plain: SocketAddr,
    routed: SocketAddr,
    concurrency: usize,
    first: usize,
) -> anyhow::Result<Value> {
    let (mut a, mut b) = (ArmStats::new()?, ArmStats::new()?);
    let per_block = s.requests / s.blocks;
    for j in 0..s.blocks {
        // The same requests to both arms; A B, then B A, so a linear drift cancels.
        let start = first + j * per_block;
        let order = if j % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for is_routed in order {
            let (addr, arm) = if is_routed {
                (routed, &mut b)
            } else {
                (plain, &mut a)
            };
            run_block(client, addr, start, per_block, concurrency, arm).await?;
        }
    }
    let diffs: Vec<f64> = a
        .block_p50_ms
        .iter()
        .zip(&b.block_p50_ms)
        .map(|(x, y)| y - x)
        .collect();
    let half_width = t_975(diffs.len() - 1) * sd(&diffs) / (diffs.len() as f64).sqrt();
    let (ja, jb) = (a.json(), b.json());
    let d = |k: &str| jb[k].as_f64().unwrap_or(f64::NAN) - ja[k].as_f64().unwrap_or(f64::NAN);
    let out = json!({
        "concurrency": concurrency,
        "routing_off": ja,
        "routing_on_weight_0_5": jb,
        "difference_on_minus_off": {
            "p50_ms": d("p50_ms"), "p99_ms": d("p99_ms"), "mean_ms": d("mean_ms"),
            "requests_per_s": d("requests_per_s"),
            "paired_block_p50_ms": {"mean": mean(&diffs), "ci95_half_width": half_width, "pairs": diffs.len()},
        },
    });
    let row = |label: &str, j: &Value| {
        let g = |k: &str| j[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{label:<22} n {:>6} err {:>3}  p50 {:>7.3} ms  p99 {:>7.3} ms  mean {:>7.3} ms  {:>8.0} req/s  canary answers {}",
            j["requests"], j["errors"], g("p50_ms"), g("p99_ms"), g("mean_ms"), g("requests_per_s"), j["canary_answers"]
        );
    };
    println!(
        "-- concurrency {concurrency}, {} blocks of {per_block} per proxy, upstream answers after {:?}",
        s.blocks, s.upstream_latency
    );
    row("routing off", &ja);
    row("routing on (w 0.5)", &jb);
    println!(
        "{:<22} p50 {:+.3} ms  p99 {:+.3} ms  mean {:+.3} ms  {:+.0} req/s;  paired block p50: {:+.3} ± {:.3} ms (95%, {} pairs)",
        "on - off",
        d("p50_ms"),
        d("p99_ms"),
        d("mean_ms"),
        d("requests_per_s"),
        mean(&diffs),
        half_width,
        diffs.len()
    );
    if a.errors + b.errors > 0 {
        bail!("{} requests failed", a.errors + b.errors);
    }
    Ok(out)
}

/// Users with identical opening messages: how many reach the canary, against what hashing
/// each user alone would give (the proxy keys episode memory by the conversation's opening).
pub(crate) async fn same_opening_split(
    client: &reqwest::Client,
    routed: SocketAddr,
    store: &RoutingStore,
) -> anyhow::Result<Value> {
    let route = store
        .get(ROUTE)
        .await?
        .context("the route vanished from the store")?;
    let users = 400;
    let (mut observed, mut by_user_hash) = (0u64, 0u64);
    for i in 0..users {
        let user = format!("opener-{i}");
        by_user_hash += u64::from(
            hindsight_routing::assign(&route, Some(&user), &user).arm
                == hindsight_routing::Arm::Canary,
        );
        let resp = client
            .post(format!("http://{routed}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-hindsight-user", &user)
            .body(chat_body(usize::MAX))
            .send()
            .await?;
        observed += u64::from(
            resp.headers()
                .get("x-hindsight-adapter")
                .is_some_and(|v| v == CANARY),
        );
        resp.bytes().await?;
    }
    println!(
        "-- {users} distinct users (x-hindsight-user), identical messages, weight 0.5: {observed} reached the canary; hashing each user alone gives {by_user_hash}"
    );
    Ok(json!({"users": users, "canary_observed": observed, "canary_by_user_hash": by_user_hash}))
}

pub(crate) async fn overhead(
    s: &Settings,
    servers: &Handle,
    upstream: SocketAddr,
    redis: &Redis,
) -> anyhow::Result<Value> {
    let prefix = format!("hindsight:bench:{}", unique());
    let topics = format!("bench-{}", unique());
    let off = RoutingConfig {
        enabled: false,
        ..RoutingConfig::default()
    };
    let plain = Proxy::start(servers, upstream, off, &s.brokers, &topics).await?;
    let routing = routing_config(&redis.url(), &prefix);
    let routed = Proxy::start(servers, upstream, routing, &s.brokers, &topics).await?;
    let store = store(&redis.url(), &prefix)?;
    let set = Op::SetStable {
        stable: STABLE.into(),
    };
    rollout::execute(&store, &request("bench: the route"), &set).await?;
    let start = Op::Start {
        canary: CANARY.into(),
        stages: vec![0.5, 1.0],
        rollout_id: None,
    };
    let (route, _) = rollout::execute(&store, &request("bench: start at 0.5"), &start).await?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(s.concurrency.max(16))
        .build()?;
    routed
        .wait_for(&client, route.generation, Duration::from_secs(10))
        .await?;
    println!(
        "\n== 2. overhead of routing: {} requests per proxy per mode, mock upstream answering after {:?}, Kafka logging on in both",
        s.requests, s.upstream_latency
    );
    // Warm both (connection pools, the producer, the allocator); not recorded.
    let mut warm = ArmStats::new()?;
    for p in [plain.addr, routed.addr] {
        run_block(&client, p, 10_000_000, 400, s.concurrency, &mut warm).await?;
    }
    let sequential = compare(s, &client, plain.addr, routed.addr, 1, 20_000_000).await?;
    let concurrent = compare(
        s,
        &client,
        plain.addr,
        routed.addr,
        s.concurrency,
        30_000_000,
    )
    .await?;
    let split = same_opening_split(&client, routed.addr, &store).await?;
    let log = json!({"routing_off": plain.stop().await?, "routing_on": routed.stop().await?});
    println!("-- Kafka log at shutdown: {log}");
    Ok(
        json!({"sequential": sequential, "concurrent": concurrent, "same_opening_split": split,
        "kafka_log": log}),
    )
}
