//! Helpers shared by the integration tests: tiny tokenizers and models, the real model's path.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use hindsight_model::candle_core::{DType, Device, Tensor};
use hindsight_model::tokenizers::Tokenizer;
use hindsight_model::{
    Adapter, AdapterSelection, Architecture, BatchLayout, GgufTokenizerSpec, LoraConfig, LoraInit,
    Model, ModelConfig,
};

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

/// A byte-level BPE spec: 3 special tokens, the 256 bytes and a few merges.
pub fn tiny_tokenizer_spec() -> GgufTokenizerSpec {
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
}

pub fn tiny_tokenizer() -> Tokenizer {
    tiny_tokenizer_spec().build().unwrap()
}

/// Tiny config whose vocabulary covers the tiny tokenizer.
pub fn tiny_config(arch: Architecture) -> ModelConfig {
    let mut cfg = ModelConfig::tiny(arch);
    cfg.vocab_size = tiny_tokenizer_spec().tokens.len();
    cfg
}

pub fn tiny_model(arch: Architecture, dtype: DType) -> Model {
    Model::random(tiny_config(arch), 7, dtype, &Device::Cpu).unwrap()
}

pub fn random_adapter(name: &str, cfg: &ModelConfig, seed: u64) -> Adapter {
    let lcfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    };
    Adapter::new(name, lcfg, cfg, LoraInit::RandomB(0.3), seed, &Device::Cpu).unwrap()
}

pub fn ids(rows: &[&[u32]], dev: &Device) -> Tensor {
    let t = rows[0].len();
    let flat: Vec<u32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), t), dev).unwrap()
}

pub fn logits(model: &Model, rows: &[&[u32]], adapters: &AdapterSelection) -> Tensor {
    let x = ids(rows, model.device());
    let layout = BatchLayout::dense(rows.len(), rows[0].len(), 0);
    model.forward(&x, &layout, None, adapters).unwrap()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
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
