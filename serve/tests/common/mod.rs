//! Shared test helpers: a tiny random model behind the real server, request helpers, the real
//! model's path.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use hindsight_model::candle_core::Device;
use hindsight_model::tokenizers::Tokenizer;
use hindsight_model::{
    Adapter, Architecture, ChatTemplate, GgufTokenizerSpec, LoraConfig, LoraInit, Model,
    ModelBundle, ModelConfig,
};
use hindsight_serve::{app, EngineConfig, ServeConfig, ServeState};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

/// GPT-2's byte-to-unicode table: the byte-level BPE alphabet.
pub fn byte_alphabet() -> Vec<String> {
    let mut bs: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut pairs: Vec<(u32, u32)> = bs.into_iter().zip(cs).collect();
    pairs.sort();
    pairs
        .into_iter()
        .map(|(_, c)| char::from_u32(c).unwrap().to_string())
        .collect()
}

/// A byte-level BPE: 3 special tokens, the 256 bytes and a few merges.
pub fn tiny_tokenizer() -> Tokenizer {
    let mut tokens = vec![
        "<|endoftext|>".to_string(),
        "<|im_start|>".to_string(),
        "<|im_end|>".to_string(),
    ];
    let mut types = vec![3i64, 3, 3];
    for b in byte_alphabet() {
        tokens.push(b);
        types.push(1);
    }
    let merges = vec!["h e".to_string(), "l l".to_string(), "he ll".to_string()];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    GgufTokenizerSpec {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens,
        token_types: types,
        merges,
        scores: vec![],
    }
    .build()
    .unwrap()
}

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub fn tiny_config() -> ModelConfig {
    let mut cfg = ModelConfig::tiny(Architecture::Llama);
    cfg.vocab_size = 3 + 256 + 3;
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
        tokenizer: tiny_tokenizer(),
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

/// The real default model ([`hindsight_model::default_model_path`]), which must exist.
pub fn default_model_path() -> PathBuf {
    let p = hindsight_model::default_model_path();
    assert!(
        p.exists(),
        "default model not found at {} - run deploy/fetch-model.sh first (or set HINDSIGHT_MODEL)",
        p.display()
    );
    p
}

pub fn arc<T>(t: T) -> Arc<T> {
    Arc::new(t)
}
