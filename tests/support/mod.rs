//! What the cross-component tests share (and the proxy crate's outage tests, through a
//! `#[path]` include): where the services are, free ports, the mock model server, the local
//! broker's stop/kill/start, and reading a process's `/metrics`. Each test binary uses a part.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

/// Runs a checker (promtool, kubernetes-validate, check-jsonschema, ...) in the workspace root
/// to completion and returns what it said; its output in the panic message when it fails.
pub fn check(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {program} ({e}): deploy/services.sh install and pip install -r deploy/requirements-test.txt provide it")
        });
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{program} {}:\n{said}",
        args.join(" ")
    );
    said
}

pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The customer's model server: answers every chat request at once.
pub async fn start_chat_upstream() -> SocketAddr {
    async fn chat(Json(_): Json<Value>) -> Json<Value> {
        Json(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        }))
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new().route("/v1/chat/completions", post(chat));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Sum of a metric's samples over its label sets, read from the `/metrics` at `admin`.
pub async fn metric_sum(admin: impl std::fmt::Display, name: &str) -> f64 {
    let text = reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Runs `deploy/services.sh <action>` (the local broker and Redis), failing the test if it fails.
pub fn services(action: &str) {
    // The including crate's directory, or a parent of it: the workspace root holds deploy/.
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("deploy/services.sh"))
        .find(|s| s.exists())
        .expect("deploy/services.sh in the workspace");
    let out = Command::new("bash")
        .arg(&script)
        .arg(action)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("services.sh {action}: {said}");
    assert!(out.status.success(), "services.sh {action} failed:\n{said}");
}

/// Whether anything accepts connections on the broker's port.
pub fn broker_port_open() -> bool {
    let first = brokers().split(',').next().unwrap_or_default().to_string();
    std::net::TcpStream::connect_timeout(&first.parse().unwrap(), Duration::from_millis(500))
        .is_ok()
}

/// Refuses to run a test that stops the broker anywhere but on the local one.
pub fn require_local_broker() {
    if !brokers().starts_with("127.0.0.1:9092") {
        panic!("this test stops the local broker; it needs KAFKA_BROKERS=127.0.0.1:9092");
    }
}

/// Starts the broker again even when the test fails half-way, so later tests find it up.
pub struct BrokerGuard;

impl Drop for BrokerGuard {
    fn drop(&mut self) {
        services("kafka-start");
    }
}
