//! Feedback ingestion: signed events accepted per second with Kafka on (the local broker), over a
//! real socket, closed loop with 1 connection and with 64 concurrent ones (plus a batch and an
//! Idempotency-Key variant). Every accepted event is checked to have reached Kafka at the end.
//!
//!     cargo bench -p hindsight-bench --bench feedback_ingest
//!
//! Knobs (env): DURATION_S=10 WARMUP_S=2 SERVER_THREADS=2 KAFKA_BROKERS=127.0.0.1:9092
//! REDIS_URL=redis://127.0.0.1:6379 DRAIN_S=600

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use hindsight_bench::knobs::knob;
use hindsight_feedback::{
    feedback_router, sign, FeedbackConfig, FeedbackState, LogConfig, RecordLog, Secret,
};
use uuid::Uuid;

const SECRET: &str = "bench-secret";

struct Case {
    name: &'static str,
    connections: usize,
    batch: usize,
    idempotency: bool,
}

struct Outcome {
    events: u64,
    requests: u64,
    secs: f64,
    hist: Histogram<u64>,
    errors: u64,
}

fn main() -> anyhow::Result<()> {
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(knob("SERVER_THREADS", 2usize)?)
        .thread_name("server")
        .enable_all()
        .build()?;
    let spill = std::env::temp_dir().join(format!("hindsight-bench-spill-{}", Uuid::now_v7()));
    let log_cfg = LogConfig {
        topic_prefix: format!("bench-feedback-{}", Uuid::now_v7().simple()),
        spill_dir: spill.clone(),
        ..LogConfig::default()
    }
    .validate()?;
    let mut fb_cfg = FeedbackConfig {
        redis_key_prefix: format!("bench-idem-{}:", Uuid::now_v7().simple()),
        max_batch_events: 100,
        ..FeedbackConfig::default()
    };
    fb_cfg.signing.secrets = vec![Secret::new(SECRET)];
    let fb_cfg = fb_cfg.validate()?;

    let (log, handle, addr) = server_rt.block_on(async {
        let (log, handle) = RecordLog::start(log_cfg).await?;
        let app = feedback_router(FeedbackState::new(fb_cfg, handle.clone())?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        anyhow::Ok((log, handle, addr))
    })?;

    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("client")
        .enable_all()
        .build()?;
    let duration = Duration::from_secs(knob("DURATION_S", 10u64)?);
    let warmup = Duration::from_secs(knob("WARMUP_S", 2u64)?);
    let cases = [
        Case {
            name: "1 connection",
            connections: 1,
            batch: 1,
            idempotency: false,
        },
        Case {
            name: "64 concurrent",
            connections: 64,
            batch: 1,
            idempotency: false,
        },
        Case {
            name: "64 concurrent + Idempotency-Key (Redis)",
            connections: 64,
            batch: 1,
            idempotency: true,
        },
        Case {
            name: "64 concurrent, batches of 20",
            connections: 64,
            batch: 20,
            idempotency: false,
        },
    ];
    println!(
        "feedback_ingest: signed (HMAC-SHA256), Kafka on, {} s per case after {} s warm-up",
        duration.as_secs(),
        warmup.as_secs()
    );
    println!("| case | events/s | requests/s | p50 ms | p99 ms | errors |");
    println!("|---|---|---|---|---|---|");
    let mut accepted = 0u64;
    for case in &cases {
        let out = client_rt.block_on(run_case(addr, case, warmup, duration))?;
        accepted += out.events;
        println!(
            "| {} | {:.0} | {:.0} | {:.2} | {:.2} | {} |",
            case.name,
            out.events as f64 / out.secs,
            out.requests as f64 / out.secs,
            out.hist.value_at_quantile(0.5) as f64 / 1000.0,
            out.hist.value_at_quantile(0.99) as f64 / 1000.0,
            out.errors,
        );
    }
    // Kafka must end up with every accepted event: what the broker could not take at once went
    // to the spill and is replayed now. The drain time shows the broker's sustained rate.
    let stats_before = handle.stats();
    let drain_start = Instant::now();
    let report = server_rt.block_on(log.shutdown(Duration::from_secs(knob("DRAIN_S", 600u64)?)));
    let drain_s = drain_start.elapsed().as_secs_f64();
    println!(
        "kafka: delivered {} records (accepted incl. warm-up >= {accepted}); {} went through the spill; \
         drain after the load took {drain_s:.1} s; left in spill {}, dropped {}",
        report.delivered_records, stats_before.spilled_records, report.left_in_spill, report.dropped_records
    );
    let _ = std::fs::remove_dir_all(&spill);
    if report.dropped_records > 0 || report.left_in_spill > 0 || report.delivered_records < accepted
    {
        bail!("not every accepted event reached Kafka");
    }
    Ok(())
}

fn body_for(batch: usize) -> Vec<u8> {
    let event = |k: usize| {
        serde_json::json!({
            "interaction_id": Uuid::now_v7(),
            "kind": if k.is_multiple_of(2) { "thumbs" } else { "score" },
            "value": if k.is_multiple_of(2) { serde_json::json!(true) } else { serde_json::json!(0.5) },
            "metric": if k.is_multiple_of(2) { serde_json::Value::Null } else { serde_json::json!("quality") },
            "source": "bench",
        })
    };
    let v = if batch == 1 {
        event(0)
    } else {
        serde_json::json!({"events": (0..batch).map(event).collect::<Vec<_>>()})
    };
    serde_json::to_vec(&v).unwrap_or_default()
}

async fn run_case(
    addr: std::net::SocketAddr,
    case: &Case,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Outcome> {
    let path = if case.batch == 1 {
        "/hindsight/v1/feedback"
    } else {
        "/hindsight/v1/feedback/batch"
    };
    let url = format!("http://{addr}{path}");
    let secret = Secret::new(SECRET);
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let events = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..case.connections {
        // One client per worker: one keep-alive connection each.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()?;
        let (url, secret) = (url.clone(), secret.clone());
        let (measuring, stop, events, requests, errors) = (
            measuring.clone(),
            stop.clone(),
            events.clone(),
            requests.clone(),
            errors.clone(),
        );
        let (batch, idem) = (case.batch, case.idempotency);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            while !stop.load(Ordering::Relaxed) {
                let body = body_for(batch);
                let ts = hindsight_feedback::now_ms() / 1000;
                let sig = sign(&secret, ts, &body);
                let mut req = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-hindsight-timestamp", ts.to_string())
                    .header("x-hindsight-signature", format!("v1={sig}"));
                if idem {
                    req = req.header("idempotency-key", Uuid::now_v7().to_string());
                }
                let t0 = Instant::now();
                let resp = req.body(body).send().await;
                let us = t0.elapsed().as_micros() as u64;
                let ok = matches!(&resp, Ok(r) if r.status().as_u16() == 202);
                if let Ok(r) = resp {
                    let _ = r.bytes().await;
                }
                if measuring.load(Ordering::Relaxed) {
                    if ok {
                        events.fetch_add(batch as u64, Ordering::Relaxed);
                        requests.fetch_add(1, Ordering::Relaxed);
                        hist.record(us.max(1))?;
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            anyhow::Ok(hist)
        }));
    }
    tokio::time::sleep(warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(duration).await;
    measuring.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    for t in tasks {
        hist.add(t.await.context("worker")??)?;
    }
    Ok(Outcome {
        events: events.load(Ordering::Relaxed),
        requests: requests.load(Ordering::Relaxed),
        secs,
        hist,
        errors: errors.load(Ordering::Relaxed),
    })
}
