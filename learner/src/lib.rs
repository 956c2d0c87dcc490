//! The model side: a Llama-family model with trainable LoRA in candle, tokenizer and chat templates, adapters in PEFT format.

mod chat;
mod config;
mod device;
mod error;
mod generate;
mod loader;
mod lora;
mod model;
pub mod ops;
pub mod publish;
pub mod registry;
mod tokenizer;

pub mod checkpoint;
pub mod example;
pub mod grammar;
pub mod objectives;
pub mod online;
pub mod optim;
pub mod trainer;

pub use chat::{content_text, prompt_tools, tool_instructions, ChatInputError, ChatTemplate};
pub use config::{Architecture, HfConfig, ModelConfig};
pub use device::{run_settled, settle_cpu_threads, DeviceSpec, WeightDType, CPU_THREADS_VAR};
pub use error::{LearnerError, Result};
pub use generate::{
    generate, generate_greedy, generate_stream, log_softmax, sample_token,
    sample_token_with_logprob, GenerateOptions, GeneratedToken, Sampling,
};
pub use loader::{load_gguf, load_hf_dir, save_hf_weights, ModelBundle};
pub use lora::{peft_key, Adapter, AdapterSelection, AdapterSet, LoraConfig, LoraInit, LoraTarget};
pub use model::{argmax_rows, BatchLayout, KvCache, Model, PaddingSide};
pub use tokenizer::{decode, encode, tokenizer_from_file, GgufTokenizerSpec};

/// Re-exported so callers use the same candle and tokenizers versions.
pub use candle_core;
pub use candle_nn;
pub use tokenizers;
