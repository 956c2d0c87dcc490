//! Canary rollouts, measured in one process:
//!
//! 1. **Propagation**: a private `redis-server`, two in-process proxies watching the routing
//!    table in it, then `CHANGES` weight changes through `rollout::execute`; for each, the time
//!    from issuing the change until both proxies' admin `/routing` shows the new generation
//!    (polled about every millisecond).
//! 2. **Overhead of routing**: one proxy with `routing.enabled = false` and one with a rollout
//!    at weight 0.5 on the route every request names, both logging to Kafka, in front of the
//!    same mock upstream (answering at once, or after `UPSTREAM_LATENCY_US`); `REQUESTS` sequential and `REQUESTS` concurrent requests per
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

mod figures;
mod overhead;
mod propagation;
mod services;
mod settings;
mod statistics;

use std::io::Write;
use std::time::Duration;

use serde_json::{json, Value};

use crate::overhead::overhead;
use crate::propagation::propagation;
use crate::services::{start_upstream, Redis};
use crate::settings::Settings;
use crate::statistics::statistics;

/// The route every request names; its stable and canary versions.
const ROUTE: &str = "support";
const STABLE: &str = "support@1";
const CANARY: &str = "support@2";

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
        let upstream = servers.block_on(start_upstream(s.upstream_latency))?;
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
