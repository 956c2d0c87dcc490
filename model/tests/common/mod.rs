//! Helpers shared by the integration tests: tiny models and adapters, logits and their
//! differences. The tiny tokenizer and config and the real model's path come from
//! `hindsight_model::testing`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use hindsight_model::candle_core::{DType, Device, Tensor};
use hindsight_model::testing::tiny_config;
use hindsight_model::{
    Adapter, AdapterSelection, Architecture, BatchLayout, LoraConfig, LoraInit, Model, ModelConfig,
};

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
    hindsight_model::testing::max_abs_diff(a, b).unwrap()
}
