//! A broker outage and a proxy crash together, as they come in real life (a node failure, an
//! OOM kill during a Kafka incident). A `hindsight proxy` process runs in front of a mock
//! upstream; the real local broker is SIGKILLed (`deploy/services.sh kafka-kill`); 300 requests
//! go through the proxy, which is SIGKILLed one second later. Then the broker and a new proxy on
//! the same spill directory start. Checked: no client saw an error or waited on Kafka, and every
//! interaction — before, during and after the outage — is in Kafka (by id).
//!
//! It kills the shared local broker, so it lives alone in its own test binary (cargo runs test
//! binaries one after another).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_feedback::{InteractionRecord, LogConfig, Topic, TopicReader};
use serde_json::json;
use support::{
    broker_port_open, brokers, free_port, metric_sum, require_local_broker, services,
    start_chat_upstream, BrokerGuard,
};

/// A `hindsight proxy` process with its record log spilling into `dir/spill`.
struct ProxyProcess {
    child: Child,
    port: u16,
    admin: u16,
}

impl ProxyProcess {
    fn start(upstream: SocketAddr, dir: &Path, topic_prefix: &str) -> Self {
        let (port, admin) = (free_port(), free_port());
        let cfg = dir.join("proxy.toml");
        std::fs::write(
            &cfg,
            format!(
                r#"[proxy]
listen_addr = "127.0.0.1:{port}"
admin_addr = "127.0.0.1:{admin}"
upstream_url = "http://{upstream}"
feedback_api = false
[log]
brokers = "{brokers}"
topic_prefix = "{topic_prefix}"
spill_dir = "{spill}"
probe_interval_ms = 500
"#,
                brokers = brokers(),
                spill = dir.join("spill").display(),
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["proxy", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
            assert!(Instant::now() < deadline, "proxy did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port, admin }
    }

    /// SIGKILL: no flush, no shutdown hook.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Sum of a metric's samples, from the admin listener.
    async fn metric(&self, name: &str) -> f64 {
        metric_sum(format!("127.0.0.1:{}", self.admin), name).await
    }

    /// One chat request; returns the interaction id and how long the client waited.
    async fn send(&self, client: &reqwest::Client, text: &str) -> (String, Duration) {
        let started = Instant::now();
        let r = client
            .post(format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                self.port
            ))
            .header("x-hindsight-episode", format!("outage-{}", text.len() % 7))
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": text}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "client error on {text:?}");
        let id = r.headers()["x-hindsight-interaction-id"]
            .to_str()
            .unwrap()
            .to_string();
        r.bytes().await.unwrap();
        (id, started.elapsed())
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Interaction ids in the topic, read until `want` are seen or `timeout` passes.
async fn interaction_ids(
    topic_prefix: &str,
    want: &HashSet<String>,
    timeout: Duration,
) -> HashSet<String> {
    let cfg = LogConfig {
        brokers: brokers(),
        topic_prefix: topic_prefix.into(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let group = format!("outage-check-{}", uuid::Uuid::now_v7().simple());
    let reader = TopicReader::new(&cfg, &group, &[Topic::Interactions]).unwrap();
    let mut got = HashSet::new();
    let deadline = Instant::now() + timeout;
    while !want.is_subset(&got) && Instant::now() < deadline {
        match reader.recv_timeout(Duration::from_millis(500)).await {
            Ok(Some(raw)) => {
                let rec: InteractionRecord = raw.decode().unwrap();
                got.insert(rec.interaction_id.to_string());
            }
            Ok(None) => {}
            // A broker that just restarted answers with transient errors for a while.
            Err(e) => {
                eprintln!("reader: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_then_proxy_killed_loses_no_record_and_fails_no_request() {
    require_local_broker();
    let client = reqwest::Client::new();
    let upstream = start_chat_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("test-outage-{}", uuid::Uuid::now_v7().simple());
    let proxy = ProxyProcess::start(upstream, dir.path(), &prefix);

    let mut ids = HashSet::new();
    for i in 0..20 {
        ids.insert(proxy.send(&client, &format!("before {i}")).await.0);
    }

    let guard = BrokerGuard;
    services("kafka-kill");
    assert!(
        !broker_port_open(),
        "the broker still answers after kafka-kill"
    );
    let mut worst = Duration::ZERO;
    for i in 0..300 {
        let (id, took) = proxy.send(&client, &format!("outage {i}")).await;
        worst = worst.max(took);
        ids.insert(id);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spilled = proxy.metric("hindsight_log_spilled_records_total").await;
    let unreachable = proxy.metric("hindsight_log_broker_unreachable").await;
    proxy.kill();
    assert!(
        !broker_port_open(),
        "something restarted the broker during the outage"
    );
    println!(
        "outage: worst client latency {worst:?}; spilled {spilled} records before the proxy was killed; broker_unreachable={unreachable}"
    );
    assert_eq!(
        unreachable, 1.0,
        "the proxy did not notice the broker was gone"
    );

    drop(guard); // broker back
    let proxy = ProxyProcess::start(upstream, dir.path(), &prefix);
    for i in 0..20 {
        ids.insert(proxy.send(&client, &format!("after {i}")).await.0);
    }
    assert_eq!(ids.len(), 340);
    let got = interaction_ids(&prefix, &ids, Duration::from_secs(180)).await;
    let missing: Vec<_> = ids.difference(&got).collect();
    assert!(
        missing.is_empty(),
        "{} of {} interactions lost, e.g. {:?}",
        missing.len(),
        ids.len(),
        missing.iter().take(3).collect::<Vec<_>>()
    );
    assert_eq!(got.len(), ids.len(), "no foreign records");
    let replayed = proxy.metric("hindsight_log_replayed_records_total").await;
    let dropped = proxy.metric("hindsight_log_dropped_records_total").await;
    println!("after restart: replayed {replayed} records from the spill, dropped {dropped}");
    assert!(
        replayed >= 300.0,
        "the restarted proxy replays the spill: {replayed}"
    );
    assert_eq!(dropped, 0.0);
}
