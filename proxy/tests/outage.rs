//! Broker outage during traffic: clients see no error, and once the broker is back every
//! interaction is in Kafka (checked by id). Stops and restarts the real local broker through
//! `deploy/services.sh`, so it lives in its own test binary (cargo runs binaries one by one).
//! Here the proxy lives through the outage and replays once the broker is back; the proxy
//! SIGKILLed during an outage is `tests/outage.rs` at the workspace root.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::support::{broker_port_open, metric_sum, require_local_broker, services, BrokerGuard};
use common::*;
use serde_json::json;

async fn send(proxy: &TestProxy, i: usize, phase: &str) -> (String, Duration) {
    let started = Instant::now();
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-hindsight-episode", format!("outage-{}", i % 7))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": format!("{phase} {i}")}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "client error during {phase}");
    let id = r.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    r.bytes().await.unwrap();
    (id, started.elapsed())
}

async fn metric(proxy: &TestProxy, name: &str) -> f64 {
    metric_sum(proxy.admin, name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_loses_no_record_and_fails_no_request() {
    require_local_broker();
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |c| {
        c.log.message_timeout_ms = 2_000;
        c.log.probe_interval_ms = 500;
    })
    .await;
    let mut ids = HashSet::new();
    for i in 0..30 {
        ids.insert(send(&proxy, i, "before").await.0);
    }

    let guard = BrokerGuard;
    services("kafka-stop");
    assert!(
        !broker_port_open(),
        "the broker still accepts connections after kafka-stop: the outage would not be real"
    );
    let mut worst = Duration::ZERO;
    for i in 0..150 {
        let (id, took) = send(&proxy, i, "outage").await;
        worst = worst.max(took);
        ids.insert(id);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The writer notices the refused connection and spills what it holds (within a tick, or
    // `spill_after_ms` at worst); wait for that, with room for a loaded machine.
    let waited = Instant::now();
    let mut spilled = 0.0;
    while waited.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        spilled = metric(&proxy, "hindsight_log_spilled_records_total").await;
        if spilled > 0.0 && waited.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    assert!(
        !broker_port_open(),
        "something restarted the broker during the outage"
    );
    drop(guard); // broker back
    for i in 0..20 {
        ids.insert(send(&proxy, i, "after").await.0);
    }
    println!("worst client latency during the outage: {worst:?}; records spilled: {spilled}");
    assert_eq!(ids.len(), 200);

    let reader = proxy.reader();
    let recs = read_interactions(&reader, ids.len(), Duration::from_secs(180)).await;
    let got: HashSet<String> = recs.iter().map(|r| r.interaction_id.to_string()).collect();
    let missing: Vec<_> = ids.difference(&got).collect();
    assert!(
        missing.is_empty(),
        "{} records lost, e.g. {:?}",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(got.len(), ids.len(), "no foreign records");
    assert!(
        spilled > 0.0,
        "the outage should have sent records to the spill"
    );
    let replayed = metric(&proxy, "hindsight_log_replayed_records_total").await;
    assert!(replayed > 0.0, "spilled records are replayed");
    let report = proxy.stop().await;
    assert_eq!(report.log.dropped_records, 0, "{report:?}");
}
