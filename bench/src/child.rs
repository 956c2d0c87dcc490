//! The bench's child processes: the bench binary re-executed in a role (`HINDSIGHT_BENCH_ROLE`),
//! so each part of the loop has its own process, memory and CPU figures, and stops when the
//! parent drops its stdin (no signals).
//!
//! Roles: `mock` (the fixed-latency upstream, `UPSTREAM_LATENCY_MS`), `proxy` (`hindsight
//! proxy` configured from `HINDSIGHT_*` variables, `PROXY_THREADS` workers) and `joiner` (one
//! `hindsight join` with the default batch settings on the topics `BENCH_PREFIX`.*, with
//! `PARTITIONS` partitions). Each prints `READY <addresses…>` on stdout once it serves.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use hindsight_feedback::{run_joiner, JoinerConfig, LogConfig};

use crate::knobs::knob;
use crate::procfs::Proc;

/// Resolves when stdin closes: the parent's signal to a child role to stop (dropping the
/// child's stdin pipe), without signals.
pub async fn wait_stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut buf = String::new();
        while std::io::stdin()
            .read_line(&mut buf)
            .map(|n| n > 0)
            .unwrap_or(false)
        {}
    })
    .await;
}

/// In a child, runs its role to the end and returns `Some(outcome)`; in the parent (no role
/// set), `None`. A bench's `main` starts with `if let Some(r) = run_role() { return r; }`.
pub fn run_role() -> Option<anyhow::Result<()>> {
    let role = std::env::var("HINDSIGHT_BENCH_ROLE").ok()?;
    Some(match role.as_str() {
        "mock" => role_mock(),
        "proxy" => role_proxy(),
        "joiner" => role_joiner(),
        other => Err(anyhow::anyhow!("unknown HINDSIGHT_BENCH_ROLE {other:?}")),
    })
}

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?)
}

/// Mock upstream. Prints `READY addr`.
fn role_mock() -> anyhow::Result<()> {
    runtime(1)?.block_on(async {
        let delay = Duration::from_micros((knob("UPSTREAM_LATENCY_MS", 10.0f64)? * 1000.0) as u64);
        let addr = crate::mock_upstream::spawn(delay).await?;
        println!("READY {addr}");
        wait_stdin_closed().await;
        Ok(())
    })
}

/// The proxy, configured from `HINDSIGHT_PROXY__*` / `HINDSIGHT_LOG__*` /
/// `HINDSIGHT_FEEDBACK__*`. Prints `READY addr admin_addr`.
fn role_proxy() -> anyhow::Result<()> {
    runtime(knob("PROXY_THREADS", 2usize)?)?.block_on(async {
        let config = hindsight_proxy::RawConfig::load(None, std::env::vars())?.validate()?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("READY {} {}", listener.local_addr()?, admin.local_addr()?);
        let report = hindsight_proxy::run(
            config,
            listener,
            admin,
            hindsight_proxy::Extensions::default(),
            wait_stdin_closed(),
        )
        .await?;
        eprintln!("proxy stopped: {report:?}");
        Ok(())
    })
}

/// The broker list the benches use (`KAFKA_BROKERS`, default the local broker).
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The Redis the benches use (`REDIS_URL`, default the local one).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

/// The record log settings of a bench's topic set `prefix`.*.
pub fn log_config(prefix: &str, partitions: i32, spill: &std::path::Path) -> LogConfig {
    LogConfig {
        brokers: brokers(),
        topic_prefix: prefix.into(),
        topic_partitions: partitions,
        spill_dir: spill.into(),
        ..LogConfig::default()
    }
}

/// One joiner with the default batch settings. Prints `READY`.
fn role_joiner() -> anyhow::Result<()> {
    runtime(2)?.block_on(async {
        let prefix = std::env::var("BENCH_PREFIX").context("BENCH_PREFIX")?;
        let partitions: i32 = knob("PARTITIONS", 6)?;
        let spill = tempfile::tempdir()?;
        let log = log_config(&prefix, partitions, spill.path()).validate()?;
        let cfg = JoinerConfig {
            group_id: format!("{prefix}-group"),
            redis_url: redis_url(),
            redis_key_prefix: format!("{prefix}:"),
            ..JoinerConfig::default()
        }
        .validate()?;
        println!("READY");
        let stats = run_joiner(cfg, log, wait_stdin_closed()).await?;
        eprintln!("joiner stopped: {stats:?}");
        Ok(())
    })
}

/// A child role started by the parent.
pub struct ChildProc {
    child: Child,
    /// The addresses on its `READY` line.
    pub ready: Vec<String>,
}

impl ChildProc {
    /// Starts this binary as `role` with `envs` and waits for its `READY` line.
    pub fn start(role: &str, envs: &[(&str, String)]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.arg("--bench")
            .env("HINDSIGHT_BENCH_ROLE", role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let Some(rest) = line.trim().strip_prefix("READY") else {
            bail!("{role} did not start: {line:?}");
        };
        let ready = rest.split_whitespace().map(str::to_string).collect();
        Ok(Self { child, ready })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory (current, peak) in MiB.
    pub fn rss_mib(&self) -> (f64, f64) {
        let p = Proc::Pid(self.pid());
        (p.rss_mib(), p.peak_rss_mib())
    }

    /// User + system CPU seconds so far.
    pub fn cpu_seconds(&self) -> f64 {
        Proc::Pid(self.pid()).cpu_seconds()
    }

    /// Closes its stdin and waits for it to exit.
    pub fn stop(self) {
        Self::stop_all(vec![self]);
    }

    /// Closes every child's stdin first, then waits for each (members of one consumer group
    /// leave together instead of rebalancing after each).
    pub fn stop_all(mut children: Vec<ChildProc>) {
        for c in &mut children {
            drop(c.child.stdin.take());
        }
        for c in &mut children {
            let _ = c.child.wait();
        }
    }
}

/// The sum of every series of the counter or gauge `name` on a process's Prometheus endpoint
/// (`http://{admin}/metrics`); NaN when it does not answer.
pub async fn metric_sum(admin: &str, name: &str) -> f64 {
    let Ok(resp) = reqwest::get(format!("http://{admin}/metrics")).await else {
        return f64::NAN;
    };
    let text = resp.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        // + 0.0: an empty float sum is -0.0, which would print as "-0".
        .sum::<f64>()
        + 0.0
}
