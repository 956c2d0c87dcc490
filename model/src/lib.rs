//! The candle model core: a Llama-family model with trainable LoRA, fused ops with gradients,
//! loading (GGUF, HF directories), tokenizer, chat templates, guided-decoding grammar,
//! generation, adapters in PEFT format. No Kafka, Redis or HTTP: `serve` and the learner build
//! on it.

mod chat;
mod config;
mod device;
mod error;
mod generate;
mod kv_cache;
mod loader;
mod lora;
mod model;
mod quant;
mod tokenizer;

pub mod grammar;
pub mod ops;
#[cfg(feature = "testing")]
pub mod testing;

pub use chat::{content_text, prompt_tools, tool_instructions, ChatInputError, ChatTemplate};
pub use config::{Architecture, HfConfig, ModelConfig};
pub use device::{run_settled, settle_cpu_threads, DeviceSpec, WeightDType, CPU_THREADS_VAR};
pub use error::{ModelError, Result};
pub use generate::{
    generate, generate_greedy, generate_stream, log_softmax, sample_token,
    sample_token_with_logprob, GenerateOptions, GeneratedToken, Sampling,
};
pub use kv_cache::KvCache;
pub use loader::{load_gguf, load_hf_dir, save_hf_weights, ModelBundle};
pub use lora::{peft_key, Adapter, AdapterSelection, AdapterSet, LoraConfig, LoraInit, LoraTarget};
pub use model::{argmax_rows, BatchLayout, Model, PaddingSide};
pub use quant::{QuantKind, QuantWeight};
pub use tokenizer::{decode, encode, tokenizer_from_file, GgufTokenizerSpec};

/// Re-exported so callers use the same candle and tokenizers versions.
pub use candle_core;
pub use candle_nn;
pub use tokenizers;

/// The default model as `deploy/fetch-model.sh` installs it, relative to the repository root.
pub const DEFAULT_MODEL_FILE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model for tests, benches and examples: `$HINDSIGHT_MODEL` when set, else
/// [`DEFAULT_MODEL_FILE`] in this checkout.
pub fn default_model_path() -> std::path::PathBuf {
    std::env::var_os("HINDSIGHT_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join(DEFAULT_MODEL_FILE)
        })
}
