//! Canary rollouts, measured in one process:
//!
//! 1. **Propagation**: a private `redis-server`, two in-process proxies watching the routing
//!    table in it, then `CHANGES` weight changes through `rollout::execute`; for each, the time
//!    from issuing the change until both proxies' admin `/routing` shows the new generation
//!    (polled about every millisecond).
//! 2. **Overhead of routing**: one proxy with `routing.enabled = false` and one with a rollout
//!    at weight 0.5 on the route every request names, both logging to Kafka, in front of the
//!    same immediate mock upstream; `REQUESTS` sequential and `REQUESTS` concurrent requests per
//!    proxy, in alternating blocks (A B B A ...) so drift cancels. Reports p50 / p99 / mean and
//!    throughput of each and their difference, with the spread of the paired block medians.
//! 3. **Exposures to roll back a harmful canary**: the controller's sequential guard
//!    (`HarmSimulation`) against the fixed-horizon z-test's planned n at the same alpha and
//!    power, over `SEEDS` simulated rollouts, plus the guard's false-alarm rate on an equal
//!    canary (checked against alpha; the bench fails when it is above alpha beyond noise).
//!
//!     cargo bench -p hindsight-bench --bench rollout
//!
//! Knobs (env; a value that does not parse or is out of range stops the bench naming it):
//! PARTS=propagation,overhead,stats CHANGES=200 POLL_US=1000 REQUESTS=2000 CONCURRENCY=8 BLOCKS=20
//! SERVER_THREADS=2 SEEDS=1000 P_STABLE=0.10 P_CANARY="0.15 0.20 0.30" CANARY_SHARE=0.05
//! ALPHA=0.05 MARGIN=0.0 POWER=0.8 MAX_CANARY_EXPOSURES=20000 FALSE_ALARM_HORIZON=2000
//! KAFKA_BROKERS=127.0.0.1:9092. Needs `redis-server` on PATH and the broker
//! (`deploy/services.sh up`). Writes `target/bench-results/rollout.json` and ends with the
//! summary as one JSON line.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use axum::routing::post;
use axum::Router;
use hdrhistogram::Histogram;
use hindsight_control::rollout::stats::{
    fixed_horizon_canary_n, two_proportion_z_test, Alpha, HarmSimulation, RateArm, SplitMix64,
};
use hindsight_control::rollout::{self, Op};
use hindsight_routing::{FallbackRoute, RoutingConfig, RoutingStore, StoreConfig};
use serde_json::{json, Value};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The route every request names; its stable and canary versions.
const ROUTE: &str = "support";
const STABLE: &str = "support@1";
const CANARY: &str = "support@2";

const CHAT_BODY: &str = r#"{"id":"chatcmpl-mock","object":"chat.completion","created":1700000000,"model":"mock-model","choices":[{"index":0,"message":{"role":"assistant","content":"The refund goes to billing; priority high."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":9,"total_tokens":51}}"#;

// ---------------------------------------------------------------- settings

/// `name` from the environment, `default` when unset; anything unparseable is an error naming
/// the variable (a silently ignored typo would publish a figure for the wrong setting).
fn setting<T: FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => bail!("{name}: {e}"),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| anyhow!("{name}={v:?} is not valid: {e}")),
    }
}

fn check(ok: bool, name: &str, value: impl std::fmt::Display, rule: &str) -> anyhow::Result<()> {
    if ok {
        Ok(())
    } else {
        bail!("{name}={value}: {rule}")
    }
}

struct Settings {
    parts: Vec<String>,
    changes: usize,
    poll: Duration,
    requests: usize,
    concurrency: usize,
    blocks: usize,
    server_threads: usize,
    seeds: usize,
    p_stable: f64,
    p_canary: Vec<f64>,
    canary_share: f64,
    alpha: Alpha,
    margin: f64,
    power: f64,
    max_canary_exposures: u64,
    false_alarm_horizon: u64,
    brokers: String,
}

impl Settings {
    fn from_env() -> anyhow::Result<Self> {
        let parts: Vec<String> = setting("PARTS", "propagation,overhead,stats".to_string())?
            .split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        for p in &parts {
            check(
                ["propagation", "overhead", "stats"].contains(&p.as_str()),
                "PARTS",
                p,
                "each part is propagation, overhead or stats",
            )?;
        }
        let p_canary = setting("P_CANARY", "0.15 0.20 0.30".to_string())?
            .split_whitespace()
            .map(|v| {
                v.parse::<f64>()
                    .map_err(|e| anyhow!("P_CANARY: {v:?} is not a number: {e}"))
            })
            .collect::<anyhow::Result<Vec<f64>>>()?;
        let s = Self {
            parts,
            changes: setting("CHANGES", 200)?,
            poll: Duration::from_micros(setting("POLL_US", 1000)?),
            requests: setting("REQUESTS", 2000)?,
            concurrency: setting("CONCURRENCY", 8)?,
            blocks: setting("BLOCKS", 20)?,
            server_threads: setting("SERVER_THREADS", 2)?,
            seeds: setting("SEEDS", 1000)?,
            p_stable: setting("P_STABLE", 0.10)?,
            p_canary,
            canary_share: setting("CANARY_SHARE", 0.05)?,
            alpha: Alpha::new(setting("ALPHA", 0.05)?).map_err(|e| anyhow!("ALPHA: {e}"))?,
            margin: setting("MARGIN", 0.0)?,
            power: setting("POWER", 0.8)?,
            max_canary_exposures: setting("MAX_CANARY_EXPOSURES", 20_000)?,
            false_alarm_horizon: setting("FALSE_ALARM_HORIZON", 2_000)?,
            brokers: setting("KAFKA_BROKERS", "127.0.0.1:9092".to_string())?,
        };
        let unit = |p: f64| p > 0.0 && p < 1.0;
        check(s.changes >= 1, "CHANGES", s.changes, "at least 1")?;
        check(
            s.poll >= Duration::from_micros(10),
            "POLL_US",
            s.poll.as_micros(),
            "at least 10",
        )?;
        check(
            s.concurrency >= 1,
            "CONCURRENCY",
            s.concurrency,
            "at least 1",
        )?;
        check(
            s.blocks >= 2 && s.blocks.is_multiple_of(2),
            "BLOCKS",
            s.blocks,
            "an even number >= 2 (blocks alternate A B B A)",
        )?;
        check(
            s.requests >= s.blocks * s.concurrency,
            "REQUESTS",
            s.requests,
            "at least BLOCKS x CONCURRENCY",
        )?;
        check(
            s.server_threads >= 1,
            "SERVER_THREADS",
            s.server_threads,
            "at least 1",
        )?;
        check(s.seeds >= 10, "SEEDS", s.seeds, "at least 10")?;
        check(unit(s.p_stable), "P_STABLE", s.p_stable, "in (0, 1)")?;
        check(
            !s.p_canary.is_empty() && s.p_canary.iter().all(|&p| unit(p) && p != s.p_stable),
            "P_CANARY",
            format!("{:?}", s.p_canary),
            "values in (0, 1), none equal to P_STABLE",
        )?;
        check(
            unit(s.canary_share),
            "CANARY_SHARE",
            s.canary_share,
            "in (0, 1)",
        )?;
        check(
            s.margin.is_finite() && s.margin >= 0.0,
            "MARGIN",
            s.margin,
            "finite and >= 0",
        )?;
        check(unit(s.power), "POWER", s.power, "in (0, 1)")?;
        check(
            s.max_canary_exposures >= 10,
            "MAX_CANARY_EXPOSURES",
            s.max_canary_exposures,
            "at least 10",
        )?;
        check(
            s.false_alarm_horizon >= 10,
            "FALSE_ALARM_HORIZON",
            s.false_alarm_horizon,
            "at least 10",
        )?;
        Ok(s)
    }

    fn runs(&self, part: &str) -> bool {
        self.parts.iter().any(|p| p == part)
    }
}

// ---------------------------------------------------------------- services

/// A private `redis-server` for the routing table; killed when dropped.
struct Redis {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server (deploy/services.sh install puts it on PATH)")?;
        let redis = Self {
            port,
            child,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("redis-server did not accept connections on {port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(redis)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mock upstream: answers every chat completion at once with a fixed small body.
async fn start_upstream() -> anyhow::Result<SocketAddr> {
    let app = Router::new().route(
        "/v1/chat/completions",
        // Taking the body reads it, as a real server would, so connections stay reusable.
        post(|_body: axum::body::Bytes| async {
            (
                [(http::header::CONTENT_TYPE, "application/json")],
                CHAT_BODY,
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("mock upstream stopped: {e}");
        }
    });
    Ok(addr)
}

/// A proxy running in this process on the server runtime.
struct Proxy {
    addr: SocketAddr,
    admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<hindsight_proxy::ShutdownReport>>,
    _spill: tempfile::TempDir,
}

/// The `[routing]` of a proxy watching `prefix` in `redis_url`, serving `support@1` for
/// `support` until the table says otherwise.
fn routing_config(redis_url: &str, prefix: &str) -> RoutingConfig {
    RoutingConfig {
        redis_url: redis_url.to_string(),
        key_prefix: prefix.to_string(),
        routes: vec![FallbackRoute {
            model: ROUTE.into(),
            stable: STABLE.into(),
        }],
        ..RoutingConfig::default()
    }
}

impl Proxy {
    /// Starts a proxy in front of `upstream` with `routing` (`enabled = false` turns it off),
    /// logging to the broker under `topic_prefix`; returns once `/readyz` answers ready.
    async fn start(
        servers: &Handle,
        upstream: SocketAddr,
        routing: RoutingConfig,
        brokers: &str,
        topic_prefix: &str,
    ) -> anyhow::Result<Self> {
        let spill = tempfile::tempdir()?;
        let mut raw = hindsight_proxy::RawConfig::default();
        raw.proxy.upstream_url = format!("http://{upstream}");
        raw.proxy.listen_addr = "127.0.0.1:0".into();
        raw.proxy.admin_addr = "127.0.0.1:0".into();
        raw.proxy.feedback_api = false;
        raw.log = hindsight_feedback::LogConfig {
            brokers: brokers.to_string(),
            topic_prefix: topic_prefix.to_string(),
            spill_dir: spill.path().to_path_buf(),
            ..hindsight_feedback::LogConfig::default()
        };
        raw.routing = routing;
        let config = raw.validate()?;
        let (ready_tx, ready_rx) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = servers.spawn(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let _ = ready_tx.send((listener.local_addr()?, admin.local_addr()?));
            let shutdown = async {
                let _ = stopped.await;
            };
            let ext = hindsight_proxy::Extensions::default();
            anyhow::Ok(hindsight_proxy::run(config, listener, admin, ext, shutdown).await?)
        });
        let Ok((addr, admin)) = ready_rx.await else {
            return Err(match task.await {
                Ok(Err(e)) => e.context("proxy did not start"),
                other => anyhow!("proxy did not start: {other:?}"),
            });
        };
        let proxy = Self {
            addr,
            admin,
            stop: Some(stop),
            task,
            _spill: spill,
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = client
                .get(format!("http://{}/readyz", proxy.admin))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                return Ok(proxy);
            }
            if Instant::now() > deadline {
                bail!("proxy on {addr} not ready within 30 s (is the broker up? deploy/services.sh up)");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The generation of `support` in this proxy's table and whether the table is stale.
    async fn generation(&self, client: &reqwest::Client) -> anyhow::Result<(u64, bool)> {
        let table: Value = client
            .get(format!("http://{}/routing", self.admin))
            .send()
            .await?
            .json()
            .await?;
        let generation = table["routes"]
            .as_array()
            .and_then(|routes| routes.iter().find(|r| r["route"] == ROUTE))
            .and_then(|r| r["generation"].as_u64())
            .unwrap_or(0);
        Ok((generation, table["stale"] == true))
    }

    /// Waits until this proxy holds `generation` (or newer) from Redis.
    async fn wait_for(
        &self,
        client: &reqwest::Client,
        generation: u64,
        within: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let (held, stale) = self.generation(client).await?;
            if held >= generation && !stale {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "proxy {} holds generation {held} (stale {stale}) after {within:?}; wanted {generation}",
                    self.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Graceful shutdown (drains the log to Kafka); what the log delivered.
    async fn stop(mut self) -> anyhow::Result<Value> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let log = self.task.await??.log;
        if !log.complete || log.dropped_records > 0 {
            eprintln!(
                "proxy {}: the log did not drain cleanly: {log:?}",
                self.addr
            );
        }
        Ok(
            json!({"delivered": log.delivered_records, "left_in_spill": log.left_in_spill,
            "dropped": log.dropped_records}),
        )
    }
}

fn store(redis_url: &str, prefix: &str) -> anyhow::Result<RoutingStore> {
    Ok(RoutingStore::new(StoreConfig {
        redis_url: redis_url.into(),
        key_prefix: prefix.into(),
        retry_for_ms: 30_000,
    })?)
}

fn request<'a>(reason: &'a str) -> rollout::Request<'a> {
    rollout::Request {
        route: ROUTE,
        by: "operator:bench",
        reason,
        expected_generation: None,
        stats: json!({}),
    }
}

/// A unique suffix for keys and topics, so runs never see each other's state.
fn unique() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

// ---------------------------------------------------------------- helpers

/// The `q` quantile (nearest rank) of `v`, sorting it.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn sd(v: &[f64]) -> f64 {
    let m = mean(v);
    (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len().max(2) - 1) as f64).sqrt()
}

/// Two-sided 95% Student t critical value for `df` degrees of freedom.
fn t_975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.max(1) - 1).copied().unwrap_or(1.96)
}

fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

fn ms(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

// ---------------------------------------------------------------- 1. propagation

async fn propagation(
    s: &Settings,
    servers: &Handle,
    upstream: SocketAddr,
    redis: &Redis,
) -> anyhow::Result<Value> {
    let prefix = format!("hindsight:bench:{}", unique());
    let topics = format!("bench-{}", unique());
    let routing = routing_config(&redis.url(), &prefix);
    let p1 = Proxy::start(servers, upstream, routing.clone(), &s.brokers, &topics).await?;
    let p2 = Proxy::start(servers, upstream, routing, &s.brokers, &topics).await?;
    let store = store(&redis.url(), &prefix)?;
    let client = reqwest::Client::new();
    let set = Op::SetStable {
        stable: STABLE.into(),
    };
    rollout::execute(&store, &request("bench: the route"), &set).await?;
    // N + 1 stages below 1.0: N advances are N weight changes, none of them a promotion.
    let n = s.changes;
    let stages: Vec<f64> = (1..=n + 1)
        .map(|i| i as f64 / (n + 2) as f64)
        .chain([1.0])
        .collect();
    let start = Op::Start {
        canary: CANARY.into(),
        stages,
        rollout_id: None,
    };
    let (route, _) = rollout::execute(&store, &request("bench: start"), &start).await?;
    for p in [&p1, &p2] {
        p.wait_for(&client, route.generation, Duration::from_secs(10))
            .await?;
    }

    let (mut both_ms, mut write_ms, mut after_write_ms, mut each_ms) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut polls = 0u64;
    let mut last = route;
    for i in 0..n {
        let issued = Instant::now();
        let (route, _) = rollout::execute(&store, &request("bench: advance"), &Op::Advance).await?;
        let written = issued.elapsed();
        let mut seen = [None::<Duration>; 2];
        while seen.iter().any(Option::is_none) {
            for (k, p) in [&p1, &p2].into_iter().enumerate() {
                if seen[k].is_none() {
                    polls += 1;
                    if p.generation(&client).await?.0 >= route.generation {
                        seen[k] = Some(issued.elapsed());
                    }
                }
            }
            if issued.elapsed() > Duration::from_secs(5) {
                bail!(
                    "change {i} (generation {}) not on both proxies within 5 s",
                    route.generation
                );
            }
            if seen.iter().any(Option::is_none) {
                // A thread sleep, not tokio's timer (1 ms ticks, so ~2 ms a sleep): nothing
                // else runs on the driver thread, and the proxies run on their own runtime.
                std::thread::sleep(s.poll);
            }
        }
        let both = issued.elapsed();
        both_ms.push(both.as_secs_f64() * 1e3);
        write_ms.push(written.as_secs_f64() * 1e3);
        after_write_ms.push(both.saturating_sub(written).as_secs_f64() * 1e3);
        each_ms.extend(seen.iter().flatten().map(|d| d.as_secs_f64() * 1e3));
        last = route;
    }
    // The last weight both proxies hold is the one written.
    let table: Value = client
        .get(format!("http://{}/routing", p2.admin))
        .send()
        .await?
        .json()
        .await?;
    let held = table["routes"][0]["rollout"]["weight"].as_f64();
    let written = last.rollout.as_ref().map(|r| r.weight);
    if held != written {
        bail!("proxy holds weight {held:?}, the store {written:?}");
    }
    p1.stop().await?;
    p2.stop().await?;

    let summary = |v: &mut Vec<f64>| json!({"p50": quantile(v, 0.5), "p99": quantile(v, 0.99), "max": quantile(v, 1.0), "mean": mean(v)});
    let out = json!({
        "changes": n,
        "issue_to_both_proxies_ms": summary(&mut both_ms),
        "write_returned_ms": summary(&mut write_ms),
        "write_returned_to_both_ms": summary(&mut after_write_ms),
        "issue_to_each_proxy_ms": summary(&mut each_ms),
        "admin_polls": polls,
        "poll_interval_us": s.poll.as_micros() as u64,
    });
    let f = |k: &str, q: &str| out[k][q].as_f64().unwrap_or(f64::NAN);
    println!("\n== 1. propagation: {n} weight changes through rollout::execute, 2 in-process proxies, private redis-server");
    for (label, key) in [
        ("issue -> both proxies hold it", "issue_to_both_proxies_ms"),
        ("issue -> write returned", "write_returned_ms"),
        (
            "write returned -> both hold it",
            "write_returned_to_both_ms",
        ),
        (
            "issue -> each proxy (2 per change)",
            "issue_to_each_proxy_ms",
        ),
    ] {
        println!(
            "{label:<36} p50 {:>7.3} ms  p99 {:>7.3} ms  max {:>7.3} ms",
            f(key, "p50"),
            f(key, "p99"),
            f(key, "max")
        );
    }
    println!(
        "(each proxy's /routing polled every {} µs until it showed the change: {polls} polls; the figures include that resolution)",
        s.poll.as_micros()
    );
    Ok(out)
}

// ---------------------------------------------------------------- 2. overhead

/// One arm's measurements in one mode.
struct ArmStats {
    all: Histogram<u64>,
    block_p50_ms: Vec<f64>,
    sum_us: f64,
    wall: Duration,
    errors: u64,
    canary: u64,
}

impl ArmStats {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            all: histogram()?,
            block_p50_ms: Vec::new(),
            sum_us: 0.0,
            wall: Duration::ZERO,
            errors: 0,
            canary: 0,
        })
    }

    fn json(&self) -> Value {
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
fn chat_body(i: usize) -> String {
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
async fn run_block(
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
async fn compare(
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
        "-- concurrency {concurrency}, {} blocks of {per_block} per proxy",
        s.blocks
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
async fn same_opening_split(
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

async fn overhead(
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
        "\n== 2. overhead of routing: {} requests per proxy per mode, immediate mock upstream, Kafka logging on in both",
        s.requests
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

// ---------------------------------------------------------------- 3. statistics

/// Runs `f(seed)` for `seeds` seeds drawn from `base` on every core; results in seed order.
fn par_seeds<T: Send>(
    seeds: usize,
    base: u64,
    f: impl Fn(u64) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    let mut rng = SplitMix64(base);
    let list: Vec<u64> = (0..seeds).map(|_| rng.next_u64()).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = list.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = list
            .chunks(chunk)
            .map(|part| {
                let f = &f;
                scope.spawn(move || {
                    part.iter()
                        .map(|&s| f(s))
                        .collect::<anyhow::Result<Vec<T>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(seeds);
        for h in handles {
            out.extend(
                h.join()
                    .map_err(|_| anyhow!("a simulation thread panicked"))??,
            );
        }
        Ok(out)
    })
}

/// The fixed-horizon z-test run as planned: `n_c` canary and `k n_c` stable exposures, one
/// look; whether it rejects with the canary worse. Checks the planned n has its power.
fn z_test_rejects(
    seed: u64,
    n_canary: u64,
    stable_per_canary: f64,
    p_stable: f64,
    p_canary: f64,
    alpha: Alpha,
) -> bool {
    let mut rng = SplitMix64(seed);
    let (mut c, mut s) = (RateArm::default(), RateArm::default());
    for _ in 0..n_canary {
        c.record(rng.next_f64() < p_canary);
    }
    for _ in 0..(n_canary as f64 * stable_per_canary).round() as u64 {
        s.record(rng.next_f64() < p_stable);
    }
    two_proportion_z_test(&c, &s, alpha).is_some_and(|z| z.reject && z.z > 0.0)
}

/// The same z-test looked at after every exposure (as a controller would), equal arms: whether
/// it ever rejects with the canary worse before `horizon` canary exposures. Looks start at 30
/// canary exposures, the usual rule of thumb for the normal approximation.
fn peeking_z_test_alarms(seed: u64, horizon: u64, share: f64, p: f64, alpha: Alpha) -> bool {
    let mut rng = SplitMix64(seed);
    let (mut c, mut s) = (RateArm::default(), RateArm::default());
    while c.exposures < horizon {
        if rng.next_f64() < share {
            c.record(rng.next_f64() < p);
        } else {
            s.record(rng.next_f64() < p);
        }
        if c.exposures >= 30
            && two_proportion_z_test(&c, &s, alpha).is_some_and(|z| z.reject && z.z > 0.0)
        {
            return true;
        }
    }
    false
}

fn statistics(s: &Settings) -> anyhow::Result<Value> {
    let k = (1.0 - s.canary_share) / s.canary_share;
    let sim = |p_canary: f64, max: u64| HarmSimulation {
        p_stable: s.p_stable,
        p_canary,
        canary_share: s.canary_share,
        alpha: s.alpha,
        margin: s.margin,
        max_canary_exposures: max,
    };
    println!(
        "\n== 3. canary exposures until rollback: p_stable {}, canary share {}, alpha {}, margin {}, {} seeds",
        s.p_stable, s.canary_share, s.alpha.get(), s.margin, s.seeds
    );
    println!(
        "{:>8} | {:>11} {:>11} {:>9} | {:>12} {:>10} | {:>12}",
        "p_canary", "seq median", "seq p90", "censored", "fixed n_c", "z power", "seq <= n_c"
    );
    let mut rows = Vec::new();
    for (g, &p_canary) in s.p_canary.iter().enumerate() {
        let started = Instant::now();
        let model = sim(p_canary, s.max_canary_exposures);
        let hits = par_seeds(s.seeds, 0x5EED_0000 + g as u64, |seed| {
            Ok(model.exposures_to_harm(seed)?)
        })?;
        let censored = hits.iter().filter(|h| h.is_none()).count();
        // A run that never said Harm counts as beyond the budget (+inf) in the quantiles.
        let mut x: Vec<f64> = hits
            .iter()
            .map(|h| h.map_or(f64::INFINITY, |n| n as f64))
            .collect();
        let (median, p90) = (quantile(&mut x, 0.5), quantile(&mut x, 0.9));
        let fixed = fixed_horizon_canary_n(s.alpha, s.power, s.p_stable, p_canary, k)?;
        let within = hits
            .iter()
            .filter(|h| h.is_some_and(|n| n <= fixed))
            .count();
        let rejects = par_seeds(s.seeds, 0x2_7E57_0000 + g as u64, |seed| {
            Ok(z_test_rejects(
                seed, fixed, k, s.p_stable, p_canary, s.alpha,
            ))
        })?;
        let power = rejects.iter().filter(|r| **r).count() as f64 / s.seeds as f64;
        let show = |v: f64| {
            if v.is_finite() {
                format!("{v:.0}")
            } else {
                format!(">{}", s.max_canary_exposures)
            }
        };
        println!(
            "{p_canary:>8.2} | {:>11} {:>11} {:>9} | {fixed:>12} {power:>10.3} | {:>11.1}%   ({:.1} s)",
            show(median),
            show(p90),
            censored,
            100.0 * within as f64 / s.seeds as f64,
            started.elapsed().as_secs_f64()
        );
        rows.push(json!({
            "p_canary": p_canary,
            "sequential_median": median.is_finite().then_some(median),
            "sequential_p90": p90.is_finite().then_some(p90),
            "sequential_censored": censored,
            "fixed_horizon_n_canary": fixed,
            "fixed_horizon_empirical_power": power,
            "sequential_within_fixed_n_share": within as f64 / s.seeds as f64,
        }));
    }

    let started = Instant::now();
    let equal = sim(s.p_stable, s.false_alarm_horizon);
    let alarms = par_seeds(s.seeds, 0xFA15E, |seed| {
        Ok(equal.exposures_to_harm(seed)?.is_some())
    })?;
    let rate = alarms.iter().filter(|a| **a).count() as f64 / s.seeds as f64;
    let sequential_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let peeking = par_seeds(s.seeds, 0xFA15E, |seed| {
        Ok(peeking_z_test_alarms(
            seed,
            s.false_alarm_horizon,
            s.canary_share,
            s.p_stable,
            s.alpha,
        ))
    })?;
    let peek_rate = peeking.iter().filter(|a| **a).count() as f64 / s.seeds as f64;
    let alpha = s.alpha.get();
    let tolerance = 3.0 * (alpha * (1.0 - alpha) / s.seeds as f64).sqrt();
    println!(
        "false alarms, p_canary = p_stable = {}, {} canary exposures each: sequential guard {:.4} (alpha {alpha}; {sequential_s:.1} s); z-test looked at after every exposure {:.4} ({:.1} s)",
        s.p_stable,
        s.false_alarm_horizon,
        rate,
        peek_rate,
        started.elapsed().as_secs_f64()
    );
    let out = json!({
        "p_stable": s.p_stable, "canary_share": s.canary_share, "alpha": alpha, "margin": s.margin,
        "power": s.power, "seeds": s.seeds, "max_canary_exposures": s.max_canary_exposures,
        "harm": rows,
        "false_alarm": {"horizon_canary_exposures": s.false_alarm_horizon, "sequential_rate": rate,
            "peeking_z_test_rate": peek_rate, "tolerance": tolerance},
    });
    if rate > alpha + tolerance {
        bail!("the sequential guard's false-alarm rate {rate} is above alpha {alpha} beyond noise ({tolerance:.4})");
    }
    Ok(out)
}

// ---------------------------------------------------------------- main

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    json!({"cores": cores, "cpu": cpu})
}

fn main() -> anyhow::Result<()> {
    let s = Settings::from_env()?;
    let machine = machine();
    println!(
        "rollout bench: parts {:?}; {} cores, {}",
        s.parts, machine["cores"], machine["cpu"]
    );
    let mut results = json!({"bench": "rollout", "machine": machine});
    if s.runs("propagation") || s.runs("overhead") {
        // Proxies and the mock upstream on their own runtime; the driver on this thread, as a
        // client in another process would be.
        let servers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(s.server_threads)
            .thread_name("servers")
            .enable_all()
            .build()?;
        let driver = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let redis = Redis::start()?;
        let upstream = servers.block_on(start_upstream())?;
        driver.block_on(async {
            if s.runs("propagation") {
                results["propagation"] =
                    propagation(&s, servers.handle(), upstream, &redis).await?;
            }
            if s.runs("overhead") {
                results["overhead"] = overhead(&s, servers.handle(), upstream, &redis).await?;
            }
            anyhow::Ok(())
        })?;
        servers.shutdown_timeout(Duration::from_secs(5));
    }
    if s.runs("stats") {
        results["stats"] = statistics(&s)?;
    }

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("rollout.json");
    let mut f = std::fs::File::create(&file)?;
    writeln!(f, "{}", serde_json::to_string_pretty(&results)?)?;
    println!("\nresults written to {}", file.display());
    println!("{}", serde_json::to_string(&summary(&results))?);
    Ok(())
}

/// The headline figures, for the one-line summary.
fn summary(r: &Value) -> Value {
    let p = &r["propagation"]["issue_to_both_proxies_ms"];
    let o = |mode: &str| {
        let d = &r["overhead"][mode]["difference_on_minus_off"];
        json!({"requests": r["overhead"][mode]["routing_off"]["requests"],
            "p50_ms": d["p50_ms"], "p99_ms": d["p99_ms"], "requests_per_s": d["requests_per_s"]})
    };
    let harm: Vec<Value> = r["stats"]["harm"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|h| {
                    json!({"p_canary": h["p_canary"], "seq_median": h["sequential_median"],
                    "seq_p90": h["sequential_p90"], "fixed_n": h["fixed_horizon_n_canary"]})
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "bench": "rollout",
        "cores": r["machine"]["cores"],
        "propagation_ms": {"changes": r["propagation"]["changes"], "p50": p["p50"], "p99": p["p99"], "max": p["max"]},
        "routing_overhead_on_minus_off": {"sequential": o("sequential"), "concurrent": o("concurrent")},
        "harm_exposures": harm,
        "false_alarm_rate": r["stats"]["false_alarm"]["sequential_rate"],
    })
}
