//! Shared test helpers: a tiny random model behind the real server, request helpers. The tiny
//! tokenizer and config and the real model's path come from `hindsight_model::testing`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use hindsight_model::candle_core::Device;
use hindsight_model::{
    testing, Adapter, Architecture, ChatTemplate, LoraConfig, LoraInit, Model, ModelBundle,
    ModelConfig,
};
use hindsight_serve::{app, EngineConfig, ServeConfig, ServeState};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The shared tiny Llama config, with room for longer conversations than the model crate's tests.
pub fn tiny_config() -> ModelConfig {
    let mut cfg = testing::tiny_config(Architecture::Llama);
    cfg.max_position_embeddings = 2048;
    cfg
}

pub fn tiny_bundle() -> ModelBundle {
    let config = tiny_config();
    ModelBundle {
        model: Model::random(
            config.clone(),
            7,
            hindsight_model::candle_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap(),
        tokenizer: testing::tiny_tokenizer().unwrap(),
        chat_template: Some(ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap()),
        config,
        eos_token_ids: vec![2],
    }
}

pub fn engine(queue: usize, active: usize, batch: usize) -> EngineConfig {
    EngineConfig {
        queue_capacity: queue,
        max_active_sequences: active,
        max_group_size: batch,
    }
}

pub fn tiny_config_for(engine: EngineConfig) -> ServeConfig {
    ServeConfig {
        model: PathBuf::from("tiny"),
        listen: "127.0.0.1:0".parse().unwrap(),
        adapters: vec![],
        served_model_name: "tiny".into(),
        engine,
        default_max_tokens: 32,
        keep_adapter_versions: 2,
        device: Default::default(),
        dtype: Default::default(),
    }
}

pub fn tiny_state() -> ServeState {
    ServeState::new(tiny_bundle(), &tiny_config_for(engine(64, 32, 16))).unwrap()
}

/// Writes a random PEFT adapter for the tiny model and returns its directory.
pub fn write_adapter(root: &Path, name: &str, seed: u64) -> PathBuf {
    write_adapter_for(root, name, seed, &tiny_config())
}

pub fn write_adapter_for(root: &Path, name: &str, seed: u64, cfg: &ModelConfig) -> PathBuf {
    let lcfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    };
    let a = Adapter::new(name, lcfg, cfg, LoraInit::RandomB(1.0), seed, &Device::Cpu).unwrap();
    let dir = root.join(format!("{name}-{seed}"));
    a.save_peft(&dir, "tiny").unwrap();
    dir
}

pub struct Resp {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub text: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }
}

pub async fn call(app: &Router, path: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
    let mut req = Request::builder()
        .method(if body.is_empty() { "GET" } else { "POST" })
        .uri(path)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app
        .clone()
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Resp {
        status,
        headers,
        text: String::from_utf8_lossy(&bytes).to_string(),
    }
}

pub async fn post(app: &Router, path: &str, body: Value) -> Resp {
    call(app, path, &body.to_string(), &[]).await
}

pub fn tiny_app() -> (ServeState, Router) {
    let s = tiny_state();
    let a = app(s.clone());
    (s, a)
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.trim().to_string())
        .collect()
}

pub fn arc<T>(t: T) -> Arc<T> {
    Arc::new(t)
}
