//! Independent check of the PEFT files and the forward pass: model/python/check_peft.py (numpy +
//! the `safetensors` package, written without this crate) reads what the Rust code wrote and
//! recomputes the logits with the adapter merged.
// Test code: helpers outside #[test] fns may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::*;
use hindsight_model::candle_core::{DType, Device, Tensor};
use hindsight_model::{
    save_hf_weights, Adapter, AdapterSelection, Architecture, LoraConfig, LoraInit, LoraTarget,
};

#[test]
fn numpy_forward_with_merged_peft_adapter_matches_candle() {
    for (arch, rslora) in [(Architecture::Llama, false), (Architecture::Qwen2, true)] {
        let model = tiny_model(arch, DType::F32);
        let lcfg = LoraConfig {
            rank: 4,
            alpha: 8.0,
            use_rslora: rslora,
            dropout: 0.0,
            targets: vec![
                LoraTarget::Q,
                LoraTarget::K,
                LoraTarget::O,
                LoraTarget::Up,
                LoraTarget::Down,
            ],
        };
        let adapter = Adapter::new(
            "x",
            lcfg,
            model.config(),
            LoraInit::RandomB(0.3),
            11,
            &Device::Cpu,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        let adapter_dir = dir.path().join("adapter");
        save_hf_weights(&model, &model_dir).unwrap();
        adapter.save_peft(&adapter_dir, "tiny").unwrap();
        let tokens: Vec<u32> = vec![5, 17, 42, 9, 33, 100, 250, 3];
        let logits = logits(&model, &[&tokens], &AdapterSelection::All(&adapter));
        let logits_path = dir.path().join("candle_logits.safetensors");
        let ids = Tensor::new(tokens.as_slice(), &Device::Cpu).unwrap();
        hindsight_model::candle_core::safetensors::save(
            &[
                ("logits".to_string(), logits.squeeze(0).unwrap()),
                ("input_ids".to_string(), ids),
            ]
            .into_iter()
            .collect(),
            &logits_path,
        )
        .unwrap();
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/check_peft.py");
        let out = Command::new("python3")
            .arg(&script)
            .arg(&model_dir)
            .arg(&adapter_dir)
            .arg(&logits_path)
            .output()
            .expect("python3 is required for the independent check (install Python 3, then `pip install numpy safetensors`)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "check_peft.py failed ({arch:?}); it needs `pip install numpy safetensors`.\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert!(stdout.contains("OK"), "{stdout}");
    }
}
