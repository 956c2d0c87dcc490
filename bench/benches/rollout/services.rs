//! What the measured parts run against: a private `redis-server`, the mock upstream and
//! in-process proxies, and the routing store the bench writes the table through.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use axum::routing::post;
use axum::Router;
use hindsight_control::rollout;
use hindsight_routing::{FallbackRoute, RoutingConfig, RoutingStore, StoreConfig};
use serde_json::{json, Value};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::{ROUTE, STABLE};

/// What the mock upstream answers to every chat completion.
const CHAT_BODY: &str = r#"{"id":"chatcmpl-mock","object":"chat.completion","created":1700000000,"model":"mock-model","choices":[{"index":0,"message":{"role":"assistant","content":"The refund goes to billing; priority high."},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":9,"total_tokens":51}}"#;

/// A private `redis-server` for the routing table; killed when dropped.
pub(crate) struct Redis {
    pub(crate) port: u16,
    pub(crate) child: Child,
    pub(crate) _dir: tempfile::TempDir,
}

impl Redis {
    pub(crate) fn start() -> anyhow::Result<Self> {
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

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mock upstream: answers every chat completion with a fixed small body after `latency`.
pub(crate) async fn start_upstream(latency: Duration) -> anyhow::Result<SocketAddr> {
    let app = Router::new().route(
        "/v1/chat/completions",
        // Taking the body reads it, as a real server would, so connections stay reusable.
        post(move |_body: axum::body::Bytes| async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
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
pub(crate) struct Proxy {
    pub(crate) addr: SocketAddr,
    pub(crate) admin: SocketAddr,
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) task: tokio::task::JoinHandle<anyhow::Result<hindsight_proxy::ShutdownReport>>,
    pub(crate) _spill: tempfile::TempDir,
}

/// The `[routing]` of a proxy watching `prefix` in `redis_url`, serving `support@1` for
/// `support` until the table says otherwise.
pub(crate) fn routing_config(redis_url: &str, prefix: &str) -> RoutingConfig {
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
    pub(crate) async fn start(
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
    pub(crate) async fn generation(&self, client: &reqwest::Client) -> anyhow::Result<(u64, bool)> {
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
    pub(crate) async fn wait_for(
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
    pub(crate) async fn stop(mut self) -> anyhow::Result<Value> {
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

pub(crate) fn store(redis_url: &str, prefix: &str) -> anyhow::Result<RoutingStore> {
    Ok(RoutingStore::new(StoreConfig {
        redis_url: redis_url.into(),
        key_prefix: prefix.into(),
        retry_for_ms: 30_000,
    })?)
}

pub(crate) fn request<'a>(reason: &'a str) -> rollout::Request<'a> {
    rollout::Request {
        route: ROUTE,
        by: "operator:bench",
        reason,
        expected_generation: None,
        stats: json!({}),
    }
}

/// A unique suffix for keys and topics, so runs never see each other's state.
pub(crate) fn unique() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}
