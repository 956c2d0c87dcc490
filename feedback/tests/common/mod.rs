//! Helpers shared by the feedback integration tests (real broker and Redis).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use hindsight_feedback::{
    feedback_router, FeedbackConfig, FeedbackState, LogConfig, LogHandle, RecordLog, Secret, Topic,
    TopicReader, ValidatedLogConfig,
};
use http_body_util::BodyExt;
use tower::ServiceExt;
use uuid::Uuid;

pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub fn unique(what: &str) -> String {
    format!("test-{what}-{}", Uuid::now_v7().simple())
}

/// Logs to stderr when RUST_LOG is set (e.g. `RUST_LOG=hindsight_feedback=debug`).
pub fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A record log on fresh topics (unique prefix) with its spill in a temp dir.
pub async fn log() -> (RecordLog, LogHandle, ValidatedLogConfig, tempfile::TempDir) {
    init_tracing();
    let spill = tempfile::tempdir().unwrap();
    let cfg = LogConfig {
        brokers: brokers(),
        topic_prefix: unique("fb"),
        spill_dir: spill.path().to_path_buf(),
        message_timeout_ms: 5_000,
        probe_interval_ms: 200,
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (log, handle) = RecordLog::start(cfg.clone()).await.unwrap();
    (log, handle, cfg, spill)
}

pub fn feedback_config(secrets: &[&str]) -> FeedbackConfig {
    let mut cfg = FeedbackConfig {
        redis_url: redis_url(),
        redis_key_prefix: format!("{}:", unique("idem")),
        max_body_bytes: 64 * 1024,
        max_batch_events: 10,
        ..FeedbackConfig::default()
    };
    cfg.signing.secrets = secrets.iter().map(|s| Secret::new(*s)).collect();
    cfg
}

pub fn app(cfg: FeedbackConfig, handle: LogHandle) -> Router {
    feedback_router(FeedbackState::new(cfg.validate().unwrap(), handle).unwrap())
}

pub struct Answer {
    pub status: u16,
    pub json: serde_json::Value,
    pub headers: http::HeaderMap,
}

pub async fn post(
    app: &Router,
    path: &str,
    body: impl Into<Vec<u8>>,
    headers: &[(&str, String)],
) -> Answer {
    let mut req = http::Request::post(path).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::from(body.into())).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Answer {
        status,
        json,
        headers,
    }
}

pub fn signed(secret: &str, body: &[u8], ts: i64) -> Vec<(&'static str, String)> {
    vec![
        ("x-hindsight-timestamp", ts.to_string()),
        (
            "x-hindsight-signature",
            format!(
                "v1={}",
                hindsight_feedback::sign(&Secret::new(secret), ts, body)
            ),
        ),
    ]
}

pub fn now_s() -> i64 {
    hindsight_feedback::now_ms() / 1000
}

/// Reads a topic (new consumer group) until `done` says so or 90 s pass; returns payloads by id.
pub async fn read_until(
    cfg: &ValidatedLogConfig,
    topic: Topic,
    mut done: impl FnMut(&[(Uuid, Option<String>, serde_json::Value)]) -> bool,
) -> Vec<(Uuid, Option<String>, serde_json::Value)> {
    let reader = TopicReader::new(cfg, &unique("g"), &[topic]).unwrap();
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(90);
    while !done(&out) {
        assert!(
            Instant::now() < until,
            "timed out reading {topic:?}; got {}",
            out.len()
        );
        if let Some(rec) = reader.recv_timeout(Duration::from_secs(1)).await.unwrap() {
            let v: serde_json::Value = serde_json::from_slice(&rec.payload).unwrap();
            out.push((rec.id.unwrap(), rec.key.clone(), v));
        }
    }
    out
}

pub fn by_id(
    recs: &[(Uuid, Option<String>, serde_json::Value)],
) -> HashMap<Uuid, serde_json::Value> {
    recs.iter().map(|(id, _, v)| (*id, v.clone())).collect()
}
