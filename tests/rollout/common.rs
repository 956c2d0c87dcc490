//! What the rollout tests share: a private Redis, `hindsight proxy` processes, the mock
//! upstream whose versions behave differently, and small builders.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use hindsight_control::rollout;
use hindsight_feedback::{
    FeedbackRecord, FeedbackTarget, FeedbackValue, LogConfig, FEEDBACK_SCHEMA,
};
use hindsight_routing::{RoutingStore, StoreConfig};
use serde_json::{json, Value};

pub use crate::support::{brokers, free_port};

/// A private Redis; dropped = SIGKILLed.
pub struct Redis {
    pub port: u16,
    pub child: Child,
    pub dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self::start_on(free_port(), dir)
    }

    pub fn start_on(port: u16, dir: tempfile::TempDir) -> Self {
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// SIGKILL (no clean shutdown), keeping the data directory for a restart.
    pub fn kill(mut self) -> (u16, tempfile::TempDir) {
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
pub async fn start_upstream(canary_mode: &'static str) -> SocketAddr {
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
pub struct Proxy {
    pub child: Child,
    pub port: u16,
    pub admin: u16,
    pub _dir: tempfile::TempDir,
}

impl Proxy {
    pub fn start(upstream: SocketAddr, redis_url: &str, prefix: &str, topic_prefix: &str) -> Self {
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

    pub async fn table(&self, client: &reqwest::Client) -> Value {
        client
            .get(format!("http://127.0.0.1:{}/routing", self.admin))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn generation(&self, client: &reqwest::Client) -> u64 {
        let t = self.table(client).await;
        t["routes"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["route"] == "support"))
            .and_then(|r| r["generation"].as_u64())
            .unwrap_or(0)
    }

    /// One chat call for `user`; returns (status, version in x-hindsight-adapter).
    pub async fn call(&self, client: &reqwest::Client, user: &str) -> (u16, String) {
        self.call_in(client, user, "hi").await
    }

    /// One chat call for `user` in conversation `conversation` (a new conversation is a new
    /// episode; an episode keeps its version while its rollout runs).
    pub async fn call_in(
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

pub fn store(redis_url: &str, prefix: &str) -> RoutingStore {
    RoutingStore::new(StoreConfig {
        redis_url: redis_url.into(),
        key_prefix: prefix.into(),
        retry_for_ms: 30_000,
    })
    .unwrap()
}

/// The state of `route`'s rollout (`running`, `promoted`, ...).
pub async fn rollout_state(s: &RoutingStore, route: &str) -> String {
    let route = s.get(route).await.unwrap().unwrap();
    route.rollout.unwrap().state.to_string()
}

pub fn req<'a>(by: &'a str, reason: &'a str) -> rollout::Request<'a> {
    rollout::Request {
        route: "support",
        by,
        reason,
        expected_generation: None,
        stats: json!({}),
    }
}

pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

pub async fn futures_join(p: &Proxy, client: &reqwest::Client, n: usize) -> Vec<(u16, String)> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(p.call(client, &format!("u{i}")).await);
    }
    out
}

pub async fn audit_handle(
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

/// A simulated user's thumbs on one interaction, now.
pub fn thumbs(interaction_id: uuid::Uuid, up: bool) -> FeedbackRecord {
    FeedbackRecord {
        schema: FEEDBACK_SCHEMA.into(),
        feedback_id: uuid::Uuid::now_v7(),
        target: FeedbackTarget::Interaction(interaction_id),
        value: FeedbackValue::Thumbs(up),
        metric: None,
        source: None,
        rater: None,
        tags: vec![],
        retracts: None,
        event_time_ms: hindsight_feedback::now_ms(),
    }
}
