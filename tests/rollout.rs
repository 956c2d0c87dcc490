//! Canary rollouts end to end on real parts: `hindsight proxy` processes, a real Redis (a
//! private `redis-server` per test, so it can be SIGKILLed without disturbing other tests), the
//! real Kafka-protocol broker for the interaction log, and a mock upstream (outside the system)
//! whose two versions behave differently.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use hindsight_control::rollout::{self, Controller, Op, RolloutConfig};
use hindsight_feedback::{
    FeedbackRecord, FeedbackTarget, FeedbackValue, LogConfig, Topic, FEEDBACK_SCHEMA,
};
use hindsight_routing::{RoutingStore, StoreConfig};
use serde_json::{json, Value};

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private Redis; dropped = SIGKILLed.
struct Redis {
    port: u16,
    child: Child,
    dir: tempfile::TempDir,
}

impl Redis {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self::start_on(free_port(), dir)
    }

    fn start_on(port: u16, dir: tempfile::TempDir) -> Self {
        let child = Command::new("redis-server")
            .args([
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "yes",
                // Every write on disk before Redis answers: a SIGKILL loses no decision. (The
                // control plane's Redis wants the same in production: control/README.md.)
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (deploy/services.sh install puts it on PATH)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { port, child, dir }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL (no clean shutdown), keeping the data directory for a restart.
    fn kill(mut self) -> (u16, tempfile::TempDir) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        (self.port, dir)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mock upstream: `support@1` answers a dozen words (calling a tool first in `notools`
/// mode); `support@2` (the canary) answers per `canary_mode` (`error`: 500s, `short`: one word,
/// `notools`: the same words without the tool call, `good`: like stable); anything else
/// echoes its model.
async fn start_upstream(canary_mode: &'static str) -> SocketAddr {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::body::Bytes| async move {
            let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let model = req["model"].as_str().unwrap_or("").to_string();
            let (status, content) = match (model.as_str(), canary_mode) {
                ("support@2", "error") => (500, "boom"),
                ("support@2", "short") => (200, "ok"),
                ("support@2", _) | ("support@1", _) => {
                    (200, "a full answer with several words in it for the customer")
                }
                _ => (200, "other"),
            };
            // In `notools` mode the stable version looks an order up with a tool before
            // answering; the canary answers the same words without it.
            let mut message = json!({"role": "assistant", "content": content});
            if canary_mode == "notools" && model == "support@1" {
                message["tool_calls"] = json!([{"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": "{}"}}]);
            }
            let body = json!({"id": "x", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]});
            (
                axum::http::StatusCode::from_u16(status).unwrap(),
                [("content-type", "application/json")],
                body.to_string(),
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A `hindsight proxy` process.
struct Proxy {
    child: Child,
    port: u16,
    admin: u16,
    _dir: tempfile::TempDir,
}

impl Proxy {
    fn start(upstream: SocketAddr, redis_url: &str, prefix: &str, topic_prefix: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (port, admin) = (free_port(), free_port());
        let cfg = dir.path().join("proxy.toml");
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
[routing]
redis_url = "{redis_url}"
key_prefix = "{prefix}"
[[routing.routes]]
model = "support"
stable = "support@1"
"#,
                brokers = brokers(),
                spill = dir.path().join("spill").display(),
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["proxy", "--config"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
            assert!(Instant::now() < deadline, "proxy did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            child,
            port,
            admin,
            _dir: dir,
        }
    }

    async fn table(&self, client: &reqwest::Client) -> Value {
        client
            .get(format!("http://127.0.0.1:{}/routing", self.admin))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn generation(&self, client: &reqwest::Client) -> u64 {
        let t = self.table(client).await;
        t["routes"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["route"] == "support"))
            .and_then(|r| r["generation"].as_u64())
            .unwrap_or(0)
    }

    /// One chat call for `user`; returns (status, version in x-hindsight-adapter).
    async fn call(&self, client: &reqwest::Client, user: &str) -> (u16, String) {
        self.call_in(client, user, "hi").await
    }

    /// One chat call for `user` in conversation `conversation` (a new conversation is a new
    /// episode; an episode keeps its version while its rollout runs).
    async fn call_in(
        &self,
        client: &reqwest::Client,
        user: &str,
        conversation: &str,
    ) -> (u16, String) {
        let resp = client
            .post(format!("http://127.0.0.1:{}/v1/chat/completions", self.port))
            .header("x-hindsight-user", user)
            .json(&json!({"model": "support", "messages": [{"role": "user", "content": format!("{conversation} from {user}")}]}))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let version = resp
            .headers()
            .get("x-hindsight-adapter")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        (status, version)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn store(redis_url: &str, prefix: &str) -> RoutingStore {
    RoutingStore::new(StoreConfig {
        redis_url: redis_url.into(),
        key_prefix: prefix.into(),
        retry_for_ms: 30_000,
    })
    .unwrap()
}

fn req<'a>(by: &'a str, reason: &'a str) -> rollout::Request<'a> {
    rollout::Request {
        route: "support",
        by,
        reason,
        expected_generation: None,
        stats: json!({}),
    }
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Two proxy processes; 100 weight changes; the time until both hold each one. Then a user's
/// requests stay on one arm while the weight rises, and the split matches the weight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_changes_reach_two_proxies_within_a_second_and_assignment_is_sticky() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("good").await;
    let p1 = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let p2 = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: (1..=100)
                .map(|i| f64::from(i) / 101.0)
                .chain([1.0])
                .collect(),
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    // Let both proxies pick up the start.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut lags_ms = Vec::new();
    for i in 0..100 {
        let (route, _) = if i < 99 {
            rollout::execute(&s, &req("test", "advance"), &Op::Advance)
                .await
                .unwrap()
        } else {
            rollout::execute(&s, &req("test", "rollback"), &Op::Rollback)
                .await
                .unwrap()
        };
        let written = Instant::now();
        for p in [&p1, &p2] {
            loop {
                if p.generation(&client).await >= route.generation {
                    break;
                }
                assert!(
                    written.elapsed() < Duration::from_secs(5),
                    "change {i} not applied in 5 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        lags_ms.push(written.elapsed().as_secs_f64() * 1e3);
    }
    let (p50, p99) = (quantile(&mut lags_ms, 0.5), quantile(&mut lags_ms, 0.99));
    println!("propagation to both proxies over 100 changes: p50 {p50:.1} ms, p99 {p99:.1} ms");
    assert!(p99 < 1000.0, "p99 {p99} ms");

    // Stickiness and split: a new rollout at 10%, then 50%.
    rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: vec![0.1, 0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let users: Vec<String> = (0..400).map(|i| format!("user-{i}")).collect();
    let mut first: HashMap<String, String> = HashMap::new();
    for u in &users {
        let (status, v) = p1.call(&client, u).await;
        assert_eq!(status, 200);
        // The same user through the other proxy lands on the same version.
        assert_eq!(
            p2.call(&client, u).await.1,
            v,
            "{u} changed arm between proxies"
        );
        first.insert(u.clone(), v);
    }
    let canary_10 = first.values().filter(|v| *v == "support@2").count() as f64;
    rollout::execute(&s, &req("test", "advance"), &Op::Advance)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut canary_50 = 0.0;
    for u in &users {
        // The same conversation keeps its version while the rollout runs ...
        assert_eq!(
            p1.call(&client, u).await.1,
            first[u],
            "{u}'s episode changed version mid-way"
        );
        // ... and a new one follows the new weight, monotonically.
        let v = p1.call_in(&client, u, "a new question").await.1;
        if first[u] == "support@2" {
            assert_eq!(v, "support@2", "{u} left the canary when the weight rose");
        }
        canary_50 += f64::from(v == "support@2");
    }
    // Chi-square (1 dof) of the observed split against the weight: below 10.83 (p = 0.001).
    let chi = |k: f64, p: f64| {
        let n = users.len() as f64;
        (k - n * p).powi(2) / (n * p) + ((n - k) - n * (1.0 - p)).powi(2) / (n * (1.0 - p))
    };
    println!("split at 10%: {canary_10}/400, at 50%: {canary_50}/400");
    assert!(chi(canary_10, 0.1) < 10.83, "10% split: {canary_10}/400");
    assert!(chi(canary_50, 0.5) < 10.83, "50% split: {canary_50}/400");
    // Users who open their conversations identically still get their own arms.
    let mut same_opening = 0.0;
    for u in &users {
        let resp = client
            .post(format!("http://127.0.0.1:{}/v1/chat/completions", p1.port))
            .header("x-hindsight-user", u.as_str())
            .json(&json!({"model": "support", "messages": [{"role": "system", "content": "You are support."}, {"role": "user", "content": "Hi"}]}))
            .send()
            .await
            .unwrap();
        same_opening += f64::from(resp.headers()["x-hindsight-adapter"] == "support@2");
    }
    println!("identical openings at 50%: {same_opening}/400 on the canary");
    assert!(
        chi(same_opening, 0.5) < 10.83,
        "identical openings: {same_opening}/400"
    );
}

/// Redis SIGKILLed during traffic: no client error, the last table kept (canary users stay on
/// the canary), and changes made after Redis returns reach the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_costs_no_request_and_the_proxy_catches_up() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("good").await;
    let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let (route, _) = rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: vec![0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    while p.generation(&client).await < route.generation {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before: Vec<(u16, String)> = futures_join(&p, &client, 100).await;
    let (port, dir) = redis.kill();
    let mut errors = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let during = futures_join(&p, &client, 100).await;
        errors += during.iter().filter(|(s, _)| *s != 200).count();
        assert_eq!(
            during.iter().map(|x| &x.1).collect::<Vec<_>>(),
            before.iter().map(|x| &x.1).collect::<Vec<_>>(),
            "the table held during the outage changed"
        );
    }
    assert_eq!(errors, 0, "client errors during the Redis outage");
    assert_eq!(p.table(&client).await["stale"], true);
    let redis = Redis::start_on(port, dir);
    let s = store(&redis.url(), &prefix);
    let (route, _) = rollout::execute(&s, &req("test", "kill"), &Op::Kill)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.generation(&client).await < route.generation {
        assert!(
            Instant::now() < deadline,
            "the proxy did not catch up after Redis returned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(p.table(&client).await["stale"], false);
    let after = futures_join(&p, &client, 100).await;
    assert!(
        after.iter().all(|(s, v)| *s == 200 && v == "support@1"),
        "kill did not send everyone to stable"
    );
    // A malformed entry written behind the control plane's back: counted, logged, ignored; the
    // proxy keeps the last good route.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:table"))
        .arg("support")
        .arg("{not json")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .unwrap();
    let _: () = redis::cmd("PUBLISH")
        .arg(format!("{prefix}:changes"))
        .arg("support")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        p.generation(&client).await,
        route.generation,
        "the proxy dropped its last good route"
    );
    assert!(futures_join(&p, &client, 20)
        .await
        .iter()
        .all(|(s, v)| *s == 200 && v == "support@1"));
    let metrics = client
        .get(format!("http://127.0.0.1:{}/metrics", p.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("hindsight_routing_invalid_entries_total"),
        "{metrics}"
    );
}

async fn futures_join(p: &Proxy, client: &reqwest::Client, n: usize) -> Vec<(u16, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(p.call(client, &format!("u{i}")).await);
    }
    out
}

/// An operator and the controller writing at once: every write lands or is refused, none is
/// lost (compare-and-set on the generation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_lose_no_update() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let s = Arc::new(store(&redis.url(), &prefix));
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let mut tasks = Vec::new();
    for w in 0..2 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..40 {
                let user = format!("w{w}-u{i}");
                rollout::execute(
                    &s,
                    &req("w", "pin"),
                    &Op::Pin {
                        user,
                        version: "support@1".into(),
                    },
                )
                .await
                .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let r = s.get("support").await.unwrap().unwrap();
    assert_eq!(r.pins.len(), 80, "a concurrent write was lost");
    assert_eq!(r.generation, 81);
    assert_eq!(s.audit("support", 1000).await.unwrap().len(), 81);
    // A command based on an old generation is refused and changes nothing.
    let mut stale = req("op", "late");
    stale.expected_generation = Some(3);
    let err = rollout::execute(
        &s,
        &stale,
        &Op::Unpin {
            user: "w0-u0".into(),
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("changed since"), "{err}");
    assert_eq!(s.get("support").await.unwrap().unwrap().generation, 81);
}

/// The controller on simulated traffic through a proxy process: a harmful canary (errors and
/// complaints) is rolled back by itself; a good one is promoted through every stage; a canary
/// whose answers are much shorter, or that stops calling tools, freezes on the drift alarm
/// though its feedback is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_rolls_back_harm_promotes_good_and_freezes_on_drift() {
    for (mode, expect) in [
        ("error", "rolled_back"),
        ("good", "promoted"),
        ("short", "frozen"),
        ("notools", "frozen"),
    ] {
        let redis = Redis::start();
        let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
        let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
        let upstream = start_upstream(mode).await;
        let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
        let s = store(&redis.url(), &prefix);
        let client = reqwest::Client::new();
        rollout::execute(
            &s,
            &req("test", "init"),
            &Op::SetStable {
                stable: "support@1".into(),
            },
        )
        .await
        .unwrap();
        let cfg = RolloutConfig {
            stages: vec![0.2, 0.5, 1.0],
            min_stage_ms: 0,
            min_exposures: 50,
            min_matured_feedback: 20,
            maturation_ms: 0,
            length_ratio: 1.5,
            // Answers here are a dozen words; a tight honest bound keeps the drift test quick.
            length_bound_tokens: 16.0,
            tool_calls_bound: 2.0,
            ..RolloutConfig::default()
        };
        cfg.validate().unwrap();
        let (route, _) = rollout::execute(
            &s,
            &req("operator:test", "start"),
            &Op::Start {
                canary: "support@2".into(),
                stages: cfg.stages.clone(),
                rollout_id: None,
            },
        )
        .await
        .unwrap();
        while p.generation(&client).await < route.generation {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = LogConfig {
            brokers: brokers(),
            topic_prefix: topics.clone(),
            spill_dir: tempfile::tempdir().unwrap().keep(),
            ..LogConfig::default()
        }
        .validate()
        .unwrap();
        let (audit_log, handle) = rollout::controller::audit_log(log.clone()).await.unwrap();
        let mut controller =
            Controller::new(cfg.clone(), store(&redis.url(), &prefix), handle).unwrap();
        let reader = hindsight_feedback::TopicReader::new(
            &log,
            &format!("t-{}", uuid::Uuid::now_v7()),
            &[Topic::Interactions],
        )
        .unwrap();
        let mut served_by_canary = 0;
        let mut state = String::new();
        for round in 0..60 {
            for i in 0..20 {
                p.call(&client, &format!("r{round}-u{i}")).await;
            }
            // Read what the proxy logged, answer as the simulated users would, feed both.
            while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(300)).await {
                controller.observe(Topic::Interactions, &rec.payload);
                let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
                let a = ir.assignment.clone().unwrap();
                served_by_canary += usize::from(a.arm == "canary");
                let bad = ir.status != 200;
                let fb = FeedbackRecord {
                    schema: FEEDBACK_SCHEMA.into(),
                    feedback_id: uuid::Uuid::now_v7(),
                    target: FeedbackTarget::Interaction(ir.interaction_id),
                    value: FeedbackValue::Thumbs(!bad),
                    metric: None,
                    source: None,
                    rater: None,
                    tags: vec![],
                    retracts: None,
                    event_time_ms: hindsight_feedback::now_ms(),
                };
                controller.observe(Topic::Feedback, &serde_json::to_vec(&fb).unwrap());
            }
            controller.tick().await.unwrap();
            let r = s.get("support").await.unwrap().unwrap();
            state = r.rollout.as_ref().unwrap().state.to_string();
            if state != "running" {
                break;
            }
        }
        audit_log.shutdown(Duration::from_secs(10)).await;
        let trail = s.audit("support", 100).await.unwrap();
        println!(
            "{mode}: {state} after {served_by_canary} canary requests; audit trail (newest first):"
        );
        for a in &trail {
            println!(
                "  gen {} {} by {} at weight {}: {}",
                a.generation, a.action, a.by, a.weight, a.reason
            );
        }
        assert_eq!(state, expect, "{mode} canary");
        assert!(
            trail.iter().any(|a| a.by == "controller"),
            "no controller decision audited"
        );
    }
}

/// The whole control plane as processes: `hindsight rollout run` (the controller, reading the
/// proxy's records and the users' feedback from Kafka) rolls back a harmful canary by itself;
/// its admin API refuses commands without the token and kills a rollout with it; the CLI
/// prints the status and the audit trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_process_rolls_back_from_kafka_and_answers_operators() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("error").await;
    let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    let dir = tempfile::tempdir().unwrap();
    let admin_port = free_port();
    let token = "test-token-0123456789abcdef";
    let cfg = dir.path().join("rollout.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[routing]
redis_url = "{url}"
key_prefix = "{prefix}"
[registry]
redis_url = "{url}"
key_prefix = "{prefix}:registry"
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[rollout]
stages = [0.3, 1.0]
min_stage_ms = 0
min_exposures = 1000
maturation_ms = 0
admin_addr = "127.0.0.1:{admin_port}"
eval_interval_ms = 200
"#,
            url = redis.url(),
            brokers = brokers(),
            spill = dir.path().join("spill").display(),
        ),
    )
    .unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["rollout", "--config"])
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = cli(&["set-stable", "support", "support@1"]);
    assert!(ok, "{text}");
    let (ok, text) = cli(&[
        "--reason",
        "bad input",
        "start",
        "support",
        "support@2",
        "--stages",
        "0.5,0.25,1.0",
    ]);
    assert!(
        !ok && text.contains("increase"),
        "stages that do not increase: {text}"
    );
    let (ok, text) = cli(&["start", "nope", "support@2"]);
    assert!(!ok && text.contains("no route"), "unknown route: {text}");
    let (ok, text) = cli(&["start", "support", "support@2"]);
    assert!(ok, "{text}");

    let mut controller = Command::new(env!("CARGO_BIN_EXE_hindsight"))
        .env("HINDSIGHT_ROLLOUT__ADMIN_TOKEN", token)
        .args(["rollout", "--config"])
        .arg(&cfg)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: dir.path().join("spill-feedback"),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (feedback_log, feedback) = hindsight_feedback::RecordLog::start(log.clone())
        .await
        .unwrap();
    let reader = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Interactions],
    )
    .unwrap();
    let started = Instant::now();
    let mut canary_requests = 0;
    let mut state = String::new();
    while started.elapsed() < Duration::from_secs(60) {
        for i in 0..10 {
            p.call(&client, &format!("u{}-{i}", started.elapsed().as_millis()))
                .await;
        }
        // The simulated users: a thumbs-down for every failed answer, a thumbs-up otherwise.
        while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(200)).await {
            let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
            canary_requests +=
                usize::from(ir.assignment.as_ref().is_some_and(|a| a.arm == "canary"));
            let fb = FeedbackRecord {
                schema: FEEDBACK_SCHEMA.into(),
                feedback_id: uuid::Uuid::now_v7(),
                target: FeedbackTarget::Interaction(ir.interaction_id),
                value: FeedbackValue::Thumbs(ir.status == 200),
                metric: None,
                source: None,
                rater: None,
                tags: vec![],
                retracts: None,
                event_time_ms: hindsight_feedback::now_ms(),
            };
            feedback.submit(
                Topic::Feedback,
                fb.target.key(),
                fb.feedback_id,
                serde_json::to_vec(&fb).unwrap().into(),
            );
        }
        state = s
            .get("support")
            .await
            .unwrap()
            .unwrap()
            .rollout
            .unwrap()
            .state
            .to_string();
        if state != "running" {
            break;
        }
    }
    println!(
        "controller process: {state} after {canary_requests} canary requests, {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(state, "rolled_back");
    let (ok, history) = cli(&["history", "support"]);
    assert!(
        ok && history.contains("rollback")
            && history.contains("controller")
            && history.contains("harm"),
        "{history}"
    );
    println!("{history}");
    // Every decision, the operator's included, is in Kafka's hindsight.rollouts, in order.
    let rollouts = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Rollouts],
    )
    .unwrap();
    let mut in_kafka: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while in_kafka.len() < 3 && Instant::now() < deadline {
        if let Ok(Some(rec)) = rollouts.recv_timeout(Duration::from_millis(500)).await {
            let a: hindsight_routing::AuditRecord = rec.decode().unwrap();
            in_kafka.push(format!("{} by {}", a.action, a.by));
        }
    }
    assert_eq!(
        in_kafka,
        [
            "set_stable by operator:operator",
            "start by operator:operator",
            "rollback by controller"
        ],
        "the audit trail in Kafka"
    );
    let (ok, status) = cli(&["status"]);
    assert!(
        ok && status.contains("support@2") && status.contains("rolled_back"),
        "{status}"
    );

    // The admin API: 401 without the token; with it, a new rollout is started and killed.
    let api = format!("http://127.0.0.1:{admin_port}/v1/rollouts/support");
    let r = client
        .post(&api)
        .json(&json!({"action": "kill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .post(&api)
        .bearer_auth("wrong-token-0123456789")
        .json(&json!({"action": "kill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "start", "version": "support@3", "stages": [1.5]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "{}", r.text().await.unwrap());
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "start", "version": "support@3", "stages": [0.5, 1.0]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "pause", "generation": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409, "a command on an old generation");
    let killed_at = Instant::now();
    let r: Value = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "kill", "by": "oncall", "reason": "test"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let generation = r["route"]["generation"].as_u64().unwrap();
    while p.generation(&client).await < generation {
        assert!(
            killed_at.elapsed() < Duration::from_secs(1),
            "kill took over a second to reach the proxy"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(futures_join(&p, &client, 20)
        .await
        .iter()
        .all(|(_, v)| v == "support@1"));
    let metrics = client
        .get(format!("http://127.0.0.1:{admin_port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("hindsight_rollout_exposures"), "{metrics}");
    feedback_log.shutdown(Duration::from_secs(5)).await;
    let _ = controller.kill();
    let _ = controller.wait();
}

async fn audit_handle(
    topics: &str,
) -> (hindsight_feedback::RecordLog, hindsight_feedback::LogHandle) {
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.to_string(),
        spill_dir: tempfile::tempdir().unwrap().keep(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    rollout::controller::audit_log(log).await.unwrap()
}

/// A new candidate while a canary runs: queued (it starts when the running one ends), or, with
/// `on_new_candidate = "supersede"`, the running canary is rolled back and the new one started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_candidate_waits_in_the_queue_or_supersedes_the_running_canary() {
    use hindsight_control::rollout::commands::{self, Actor, Command, Outcome};
    use hindsight_control::rollout::CandidatePolicy;
    for policy in [CandidatePolicy::Queue, CandidatePolicy::Supersede] {
        let redis = Redis::start();
        let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
        let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
        let s = store(&redis.url(), &prefix);
        let cfg = RolloutConfig {
            on_new_candidate: policy,
            ..RolloutConfig::default()
        };
        let actor = Actor {
            by: "operator:test",
            reason: "",
            generation: None,
        };
        commands::run(
            &s,
            None,
            &cfg,
            "support",
            &actor,
            Command::SetStable {
                version: "support@1".into(),
            },
        )
        .await
        .unwrap();
        let start = |v: &str| Command::Start {
            version: v.into(),
            stages: None,
            policy: None,
            endpoints: vec![],
        };
        commands::run(&s, None, &cfg, "support", &actor, start("support@2"))
            .await
            .unwrap();
        // The learner's hand-over: the candidate goes into the route's queue slot.
        rollout::queue::enqueue(&s, "support", "support@3")
            .await
            .unwrap();
        let (audit_log, handle) = audit_handle(&topics).await;
        let mut controller =
            Controller::new(cfg.clone(), store(&redis.url(), &prefix), handle).unwrap();
        controller.tick().await.unwrap();
        let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
        match policy {
            CandidatePolicy::Queue => {
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@2", "running"),
                    "a queued candidate displaced the running canary"
                );
                // An operator's `start` while it runs is queued too, not refused.
                let out = commands::run(&s, None, &cfg, "support", &actor, start("support@4"))
                    .await
                    .unwrap();
                assert!(
                    matches!(out, Outcome::Queued { ref version, .. } if version == "support@4"),
                    "{out:?}"
                );
                commands::run(&s, None, &cfg, "support", &actor, Command::Rollback)
                    .await
                    .unwrap();
                controller.tick().await.unwrap();
                let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@4", "running"),
                    "the newest queued candidate starts when the rollout ends"
                );
            }
            CandidatePolicy::Supersede => {
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@2", "rolled_back")
                );
                controller.tick().await.unwrap();
                let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@3", "running")
                );
                let trail = s.audit("support", 10).await.unwrap();
                assert!(
                    trail.iter().any(|a| a.action == "rollback"
                        && a.reason
                            .contains("superseded by the newer candidate support@3")),
                    "{trail:#?}"
                );
            }
        }
        audit_log.shutdown(Duration::from_secs(5)).await;
    }
}

/// Redis SIGKILLed in the middle of a rollout: the controller's decisions wait and resume
/// (nothing is lost: the table, its audit trail and the rollout's progress survive), and the
/// rollout still ends promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_kill_during_a_rollout_loses_no_decision() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("good").await;
    let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let cfg = RolloutConfig {
        stages: vec![0.2, 0.4, 0.6, 1.0],
        min_stage_ms: 0,
        min_exposures: 15,
        min_matured_feedback: 10,
        maturation_ms: 0,
        ..RolloutConfig::default()
    };
    rollout::execute(
        &s,
        &req("operator:test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: cfg.stages.clone(),
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    let (audit_log, handle) = audit_handle(&topics).await;
    let mut controller = Controller::new(cfg, store(&redis.url(), &prefix), handle).unwrap();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: tempfile::tempdir().unwrap().keep(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let reader = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Interactions],
    )
    .unwrap();
    let mut redis = Some(redis);
    let mut killed: Option<(u16, tempfile::TempDir)> = None;
    let mut tick_errors = 0;
    let mut state = String::new();
    for round in 0..80 {
        for i in 0..20 {
            let (status, _) = p.call(&client, &format!("r{round}-u{i}")).await;
            assert_eq!(status, 200, "a client error");
        }
        while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(300)).await {
            controller.observe(Topic::Interactions, &rec.payload);
            let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
            let fb = FeedbackRecord {
                schema: FEEDBACK_SCHEMA.into(),
                feedback_id: uuid::Uuid::now_v7(),
                target: FeedbackTarget::Interaction(ir.interaction_id),
                value: FeedbackValue::Thumbs(true),
                metric: None,
                source: None,
                rater: None,
                tags: vec![],
                retracts: None,
                event_time_ms: hindsight_feedback::now_ms(),
            };
            controller.observe(Topic::Feedback, &serde_json::to_vec(&fb).unwrap());
        }
        // Kill Redis once the rollout is past its first stage; bring it back two rounds later.
        let stage = if redis.is_some() {
            s.get("support")
                .await
                .unwrap()
                .unwrap()
                .rollout
                .unwrap()
                .stage
        } else {
            0
        };
        if stage >= 1 && killed.is_none() && redis.is_some() {
            killed = Some(redis.take().unwrap().kill());
            println!("redis killed at stage {stage}");
        } else if let (Some(_), None) = (&killed, &redis) {
            if tick_errors >= 2 {
                let (port, dir) = killed.take().unwrap();
                redis = Some(Redis::start_on(port, dir));
                println!("redis back after {tick_errors} failed ticks");
                killed = Some((0, tempfile::tempdir().unwrap())); // only once
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), controller.tick()).await {
            Ok(Ok(())) => {}
            _ => tick_errors += 1,
        }
        if let Some(r) = &redis {
            let _ = r;
            state = s
                .get("support")
                .await
                .unwrap()
                .unwrap()
                .rollout
                .unwrap()
                .state
                .to_string();
            if state == "promoted" {
                break;
            }
        }
    }
    audit_log.shutdown(Duration::from_secs(5)).await;
    assert!(tick_errors >= 2, "Redis was never away for the controller");
    assert_eq!(state, "promoted");
    let trail = s.audit("support", 100).await.unwrap();
    let actions: Vec<&str> = trail.iter().rev().map(|a| a.action.as_str()).collect();
    println!("audit after the Redis kill: {actions:?}");
    assert_eq!(
        actions,
        ["set_stable", "start", "advance", "advance", "advance"],
        "a decision was lost or repeated"
    );
}
