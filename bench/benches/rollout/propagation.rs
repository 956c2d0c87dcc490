//! Part 1: how long a weight change takes to reach two proxies watching the routing table.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use hindsight_control::rollout::{self, Op};
use serde_json::{json, Value};
use tokio::runtime::Handle;

use crate::figures::{mean, quantile};
use crate::services::{request, routing_config, store, unique, Proxy, Redis};
use crate::settings::Settings;
use crate::{CANARY, STABLE};

pub(crate) async fn propagation(
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
