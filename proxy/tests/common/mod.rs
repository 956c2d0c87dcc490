//! Test support: a mock OpenAI-compatible upstream (the one thing outside the system we may
//! mock), an in-process proxy wired to the real local Kafka, and a Kafka reader.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::Router;
use futures::StreamExt;
use hindsight_feedback::{InteractionRecord, LogConfig, Topic, TopicReader};
use hindsight_proxy::{Extensions, RawConfig, ShutdownReport};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// What the workspace's cross-component tests share (the broker's stop/start, `/metrics`).
#[path = "../../../tests/support/mod.rs"]
pub mod support;
pub use support::brokers;

// ---------------------------------------------------------------- mock upstream

/// Behaviour is chosen by the request's `model`:
/// - `echo-error`: 400 with an OpenAI error body;
/// - `slow`: streams 40 chunks 50 ms apart;
/// - `hang`: waits 30 s before answering;
/// - `tools`: answers with a tool call;
/// - anything else: "Hello from mock" (+ logprobs when asked).
pub async fn start_mock_upstream() -> SocketAddr {
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(any(echo));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    addr
}

/// Echoes what arrived so tests can check the proxy changed nothing.
async fn echo(headers: HeaderMap, req: Request) -> Response {
    let method = req.method().to_string();
    let uri = req.uri().to_string();
    let body = axum::body::to_bytes(req.into_body(), usize::MAX)
        .await
        .unwrap();
    let hdrs: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(v.to_str().unwrap_or(""))))
        .collect();
    (
        StatusCode::IM_A_TEAPOT,
        [("x-mock", "echo"), ("content-type", "application/json")],
        json!({"method": method, "uri": uri, "headers": hdrs, "body": String::from_utf8_lossy(&body)}).to_string(),
    )
        .into_response()
}

fn chunk(model: &str, delta: Value, finish: Value, logprobs: Option<Value>) -> String {
    // OpenAI sends `"logprobs": null` in every choice when none were asked for.
    let choice = json!({"index": 0, "delta": delta, "finish_reason": finish,
        "logprobs": logprobs.unwrap_or(Value::Null)});
    let c = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1700000000, "model": model, "choices": [choice]});
    format!("data: {c}\n\n")
}

async fn chat(headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(_) => {
            return (
                StatusCode::BAD_REQUEST,
                "{\"error\":{\"message\":\"bad json\"}}",
            )
                .into_response()
        }
    };
    let model = req["model"].as_str().unwrap_or("mock").to_string();
    let auth_seen = headers.contains_key("authorization");
    let stream = req["stream"].as_bool().unwrap_or(false);
    // Like `hindsight serve`: behaviour log-probs when asked by the client or by the proxy.
    let want_logprobs =
        req["logprobs"].as_bool().unwrap_or(false) || headers.contains_key("x-hindsight-behaviour");
    match model.as_str() {
        "echo-error" => {
            return (
                StatusCode::BAD_REQUEST,
                [("content-type", "application/json")],
                json!({"error": {"message": "model echo-error says no", "type": "invalid_request_error", "param": "model", "code": null}}).to_string(),
            )
                .into_response()
        }
        "hang" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        _ => {}
    }
    let tools = model == "tools";
    if stream {
        let mut parts: Vec<String> = vec![chunk(
            &model,
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            None,
        )];
        if tools {
            parts.push(chunk(&model, json!({"tool_calls": [{"index": 0, "id": "call_abc", "type": "function", "function": {"name": "lookup_order", "arguments": ""}}]}), Value::Null, None));
            for piece in ["{\"order", "_id\": ", "\"A-1", "7\"}"] {
                parts.push(chunk(
                    &model,
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                    Value::Null,
                    None,
                ));
            }
            parts.push(chunk(&model, json!({}), json!("tool_calls"), None));
        } else {
            let n = if model == "slow" { 40 } else { 3 };
            let words = ["Hello", " from", " mock"];
            for i in 0..n {
                let w = words[i % 3];
                let lp = want_logprobs.then(|| json!({"content": [{"token": w, "logprob": -0.5, "token_id": 100 + i, "bytes": null, "top_logprobs": []}]}));
                parts.push(chunk(&model, json!({"content": w}), Value::Null, lp));
            }
            parts.push(chunk(&model, json!({}), json!("stop"), None));
        }
        parts.push(format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1700000000, "model": model, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})
        ));
        parts.push("data: [DONE]\n\n".into());
        let slow = model == "slow";
        let s = futures::stream::iter(parts).then(move |p| async move {
            if slow {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok::<_, std::convert::Infallible>(p)
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-hindsight-adapter", "mock-adapter@3")
            .header("x-mock-auth-seen", auth_seen.to_string())
            .body(Body::from_stream(s))
            .unwrap();
    }
    let message = if tools {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_abc", "type": "function", "function": {"name": "lookup_order", "arguments": "{\"order_id\": \"A-17\"}"}}]})
    } else {
        json!({"role": "assistant", "content": "Hello from mock"})
    };
    let logprobs = if want_logprobs {
        json!({"content": [
            {"token": "Hello", "logprob": -0.1, "token_id": 100, "bytes": null, "top_logprobs": []},
            {"token": " from", "logprob": -0.2, "token_id": 101, "bytes": null, "top_logprobs": []},
            {"token": " mock", "logprob": -0.3, "token_id": 102, "bytes": null, "top_logprobs": []}]})
    } else {
        Value::Null
    };
    let body = json!({
        "id": "chatcmpl-mock", "object": "chat.completion", "created": 1700000000, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": if tools {"tool_calls"} else {"stop"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    });
    Response::builder()
        .header("content-type", "application/json")
        .header("x-mock-auth-seen", auth_seen.to_string())
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn completions(body: axum::body::Bytes) -> Response {
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let model = req["model"].as_str().unwrap_or("mock").to_string();
    if req["stream"].as_bool().unwrap_or(false) {
        let mut s = String::new();
        for w in ["Par", "is"] {
            let c = json!({"id": "cmpl-mock", "object": "text_completion", "created": 1700000000, "model": model, "choices": [{"index": 0, "text": w, "logprobs": null, "finish_reason": null}]});
            s.push_str(&format!("data: {c}\n\n"));
        }
        let c = json!({"id": "cmpl-mock", "object": "text_completion", "created": 1700000000, "model": model, "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "stop"}]});
        s.push_str(&format!("data: {c}\n\ndata: [DONE]\n\n"));
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(s))
            .unwrap();
    }
    let body = json!({"id": "cmpl-mock", "object": "text_completion", "created": 1700000000, "model": model,
        "choices": [{"index": 0, "text": "Paris", "logprobs": null, "finish_reason": "stop"}]});
    ([("content-type", "application/json")], body.to_string()).into_response()
}

// ---------------------------------------------------------------- proxy under test

pub struct TestProxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub topic_prefix: String,
    pub spill_dir: tempfile::TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<ShutdownReport>>,
    pub log_config: hindsight_feedback::ValidatedLogConfig,
}

impl TestProxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Graceful shutdown; returns what the proxy reported.
    pub async fn stop(mut self) -> ShutdownReport {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().unwrap().await.unwrap()
    }

    /// A reader of this proxy's interaction topic in a fresh consumer group.
    pub fn reader(&self) -> TopicReader {
        TopicReader::new(
            &self.log_config,
            &format!("test-{}", uuid::Uuid::now_v7()),
            &[Topic::Interactions],
        )
        .unwrap()
    }
}

/// Starts a proxy in front of `upstream` with a unique topic prefix; `tweak` edits the raw
/// config first.
pub async fn start_proxy(upstream: SocketAddr, tweak: impl FnOnce(&mut RawConfig)) -> TestProxy {
    let spill_dir = tempfile::tempdir().unwrap();
    let topic_prefix = format!("test-{}", uuid::Uuid::now_v7().simple());
    let mut raw = RawConfig::default();
    raw.proxy.upstream_url = format!("http://{upstream}");
    raw.proxy.listen_addr = "127.0.0.1:0".into();
    raw.proxy.admin_addr = "127.0.0.1:0".into();
    raw.proxy.shutdown_grace_ms = 30_000;
    raw.log = LogConfig {
        brokers: brokers(),
        topic_prefix: topic_prefix.clone(),
        spill_dir: spill_dir.path().to_path_buf(),
        ..LogConfig::default()
    };
    tweak(&mut raw);
    let config = raw.validate().unwrap();
    let log_config = config.log.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        hindsight_proxy::run(config, listener, admin, Extensions::default(), async {
            let _ = rx.await;
        })
        .await
        .unwrap()
    });
    TestProxy {
        addr,
        admin: admin_addr,
        topic_prefix,
        spill_dir,
        shutdown: Some(tx),
        task: Some(task),
        log_config,
    }
}

/// Reads interaction records until `want` distinct interaction ids have arrived (duplicates
/// from at-least-once delivery are collapsed) or `timeout` passes.
pub async fn read_interactions(
    reader: &TopicReader,
    want: usize,
    timeout: Duration,
) -> Vec<InteractionRecord> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut out: Vec<InteractionRecord> = Vec::new();
    while out.len() < want && tokio::time::Instant::now() < deadline {
        // Transient client errors (a broker just restarted, a topic still being created) are
        // retried until the deadline.
        let raw = match reader.recv_timeout(Duration::from_millis(500)).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("reader: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
        };
        if let Some(raw) = raw {
            let rec: InteractionRecord = raw.decode().unwrap();
            assert_eq!(
                raw.key.as_deref(),
                Some(rec.episode_id.as_str()),
                "record keyed by episode"
            );
            assert_eq!(
                raw.id,
                Some(rec.interaction_id),
                "hindsight-id header carries the id"
            );
            if !out.iter().any(|r| r.interaction_id == rec.interaction_id) {
                out.push(rec);
            }
        }
    }
    out
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(16)
        .build()
        .unwrap()
}
