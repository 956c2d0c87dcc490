//! Proxy overhead, open loop: a fixed-latency mock upstream, then a constant request rate sent
//! directly and through `hindsight proxy` (Kafka logging ON, to the local broker), back to back
//! at each rate. Prints p50/p99/p99.9 of both, the added latency, and the proxy's RSS and CPU
//! per request.
//!
//!     cargo bench -p hindsight-bench --bench proxy_overhead
//!
//! Knobs (env): RATES="500 2000" DURATION_S=20 WARMUP_S=3 UPSTREAM_LATENCY_MS=10
//! PROXY_THREADS=2 MAX_IN_FLIGHT=512 KAFKA_BROKERS=127.0.0.1:9092
//!
//! The mock and the proxy run as child processes (this same binary, re-executed with a role)
//! so the proxy's memory and CPU are its own.

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use hindsight_bench::child::{metric_sum, run_role, ChildProc};
use hindsight_bench::knobs::{knob, knob_list};
use hindsight_bench::load::{open_loop, LoadResult, Target};

fn main() -> anyhow::Result<()> {
    if let Some(role) = run_role() {
        return role;
    }
    parent()
}

fn body() -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "mock-model",
            "messages": [
                {"role": "system", "content": "You are a support agent. Answer with a JSON decision."},
                {"role": "user", "content": "Order A-1042 arrived broken. I want my money back."}
            ],
            "temperature": 0.2
        })
        .to_string(),
    )
}

fn row(label: &str, r: &LoadResult) -> String {
    format!(
        "{label:<8} sent {:>6} ok {:>6} err {:>4}  p50 {:>7.3} ms  p99 {:>7.3} ms  p99.9 {:>7.3} ms  max {:>8.3} ms",
        r.sent,
        r.ok,
        r.errors,
        r.quantile_ms(0.5),
        r.quantile_ms(0.99),
        r.quantile_ms(0.999),
        r.latency_us.max() as f64 / 1000.0
    )
}

/// The upper bound of the histogram bucket holding quantile `q` (NaN when absent).
async fn bucket_quantile(admin: &str, name: &str, q: f64) -> f64 {
    let Ok(resp) = reqwest::get(format!("http://{admin}/metrics")).await else {
        return f64::NAN;
    };
    let text = resp.text().await.unwrap_or_default();
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            Some((le.parse().unwrap_or(f64::INFINITY), count.parse().ok()?))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets
        .iter()
        .find(|(_, c)| total > 0.0 && *c >= q * total)
        .map_or(f64::NAN, |(le, _)| *le)
}

fn parent() -> anyhow::Result<()> {
    let rates: Vec<f64> = knob_list("RATES", vec![500.0, 2000.0])?;
    let duration = Duration::from_secs(knob("DURATION_S", 20u64)?);
    let warmup = Duration::from_secs(knob("WARMUP_S", 3u64)?);
    let max_in_flight = knob("MAX_IN_FLIGHT", 512usize)?;
    let brokers = hindsight_bench::child::brokers();
    let latency_ms: f64 = knob("UPSTREAM_LATENCY_MS", 10.0)?;
    let spill = tempfile_dir()?;

    let mock = ChildProc::start("mock", &[("UPSTREAM_LATENCY_MS", latency_ms.to_string())])?;
    let upstream = mock.ready[0].clone();
    let prefix = format!("bench-{}", uuid::Uuid::now_v7().simple());
    let proxy = ChildProc::start(
        "proxy",
        &[
            (
                "HINDSIGHT_PROXY__UPSTREAM_URL",
                format!("http://{upstream}"),
            ),
            ("HINDSIGHT_LOG__BROKERS", brokers.clone()),
            ("HINDSIGHT_LOG__TOPIC_PREFIX", prefix.clone()),
            ("HINDSIGHT_LOG__SPILL_DIR", spill.clone()),
            ("RUST_LOG", "warn".into()),
        ],
    )?;
    let proxy_addr = proxy.ready[0].clone();
    let admin_addr = proxy.ready[1].clone();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "proxy_overhead: upstream latency {latency_ms} ms, {}s per run (+{}s warm-up), open loop, max {max_in_flight} in flight; Kafka logging ON ({brokers}, topics {prefix}.*); {} cores",
        duration.as_secs(),
        warmup.as_secs(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let mut results = Vec::new();
    rt.block_on(async {
        let direct = Target {
            url: format!("http://{upstream}/v1/chat/completions"),
            body: body(),
            headers: vec![
                ("content-type".into(), "application/json".into()),
                ("authorization".into(), "Bearer sk-bench".into()),
            ],
        };
        let via = Target {
            url: format!("http://{proxy_addr}/v1/chat/completions"),
            ..direct.clone()
        };
        for &rate in &rates {
            // Warm both paths (connection pools, allocator) before measuring.
            open_loop(&direct, rate, warmup, max_in_flight).await?;
            let d = open_loop(&direct, rate, duration, max_in_flight).await?;
            open_loop(&via, rate, warmup, max_in_flight).await?;
            let cpu0 = proxy.cpu_seconds();
            let p = open_loop(&via, rate, duration, max_in_flight).await?;
            let cpu = proxy.cpu_seconds() - cpu0;
            let (rss, peak) = proxy.rss_mib();
            println!("\n== {rate} requests/s");
            println!("{}", row("direct", &d));
            println!("{}", row("proxy", &p));
            let added = |q: f64| p.quantile_ms(q) - d.quantile_ms(q);
            println!(
                "added    p50 {:+.3} ms  p99 {:+.3} ms  p99.9 {:+.3} ms   proxy RSS {rss:.1} MiB (peak {peak:.1})  proxy CPU {:.1} µs/request",
                added(0.5),
                added(0.99),
                added(0.999),
                cpu / p.sent.max(1) as f64 * 1e6
            );
            results.push(serde_json::json!({
                "rate": rate,
                "direct_ms": {"p50": d.quantile_ms(0.5), "p99": d.quantile_ms(0.99), "p999": d.quantile_ms(0.999)},
                "proxy_ms": {"p50": p.quantile_ms(0.5), "p99": p.quantile_ms(0.99), "p999": p.quantile_ms(0.999)},
                "added_ms": {"p50": added(0.5), "p99": added(0.99), "p999": added(0.999)},
                "errors": {"direct": d.errors, "proxy": p.errors},
                "proxy_rss_mib": rss, "proxy_peak_rss_mib": peak,
                "proxy_cpu_us_per_request": cpu / p.sent.max(1) as f64 * 1e6,
            }));
        }
        // Let the log catch up, then report what reached Kafka.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let delivered = metric_sum(&admin_addr, "hindsight_log_delivered_records_total").await;
        let spilled = metric_sum(&admin_addr, "hindsight_log_spilled_records_total").await;
        let dropped = metric_sum(&admin_addr, "hindsight_log_dropped_records_total").await;
        println!("\nKafka log: {delivered} records delivered, {spilled} spilled, {dropped} dropped");
        // How long a record lived only in the proxy's memory before Kafka acknowledged it: what
        // a crash with a healthy broker can lose (bucket upper bounds of the histogram).
        let ack = "hindsight_log_ack_seconds";
        let ack_p50 = bucket_quantile(&admin_addr, ack, 0.5).await * 1e3;
        let ack_p99 = bucket_quantile(&admin_addr, ack, 0.99).await * 1e3;
        println!("Kafka acknowledgement after dispatch: p50 <= {ack_p50} ms, p99 <= {ack_p99} ms");
        results.push(serde_json::json!({"kafka": {"delivered": delivered, "spilled": spilled, "dropped": dropped,
            "ack_ms_upper_bound": {"p50": ack_p50, "p99": ack_p99}}}));
        anyhow::Ok(())
    })?;
    proxy.stop();
    mock.stop();
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-results");
    std::fs::create_dir_all(&out)?;
    let file = out.join("proxy_overhead.json");
    let mut f = std::fs::File::create(&file)?;
    writeln!(f, "{}", serde_json::to_string_pretty(&results)?)?;
    println!("results written to {}", file.display());
    let _ = std::fs::remove_dir_all(&spill);
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<String> {
    let dir = std::env::temp_dir().join(format!("hindsight-bench-spill-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir.display().to_string())
}
