//! Model hyper-parameters: read from an HF `config.json` or from GGUF metadata, validated once
//! into [`ModelConfig`].

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The architecture variants of the Llama family that differ in weights layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Llama 2/3, SmolLM/SmolLM2 (Llama layout, possibly tied embeddings).
    Llama,
    /// Mistral (Llama layout; the sliding window is not applied: model/README.md, known gaps).
    Mistral,
    /// Qwen2 (Llama layout plus biases on q, k and v).
    Qwen2,
}

/// HF `config.json` as written by `transformers` for Llama-family models. Unknown fields are
/// ignored on purpose: this is an external format with many fields we do not need.
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// `llama`, `mistral`, `qwen2` (others are refused).
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Longest sequence the position tables cover.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Llama's flag for biases on the attention projections (Qwen2 always has q/k/v biases).
    #[serde(default)]
    pub attention_bias: bool,
    /// Begin-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    /// End-of-sequence token id(s).
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_model_type() -> String {
    "llama".to_string()
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_position_embeddings() -> usize {
    4096
}

/// The validated model configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// Weight layout variant.
    pub architecture: Architecture,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Longest sequence the position tables cover.
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q, k and v carry biases.
    pub qkv_bias: bool,
    /// Whether o carries a bias.
    pub o_bias: bool,
    /// End-of-sequence token ids (generation stops on any).
    pub eos_token_ids: Vec<u32>,
    /// Begin-of-sequence token id, if the model has one.
    pub bos_token_id: Option<u32>,
}

fn token_ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl HfConfig {
    /// Parses `config.json` text.
    pub fn from_json(text: &str) -> Result<Self> {
        serde_json::from_str(text).map_err(|e| ModelError::json("config.json", e))
    }

    /// Validates into a [`ModelConfig`].
    pub fn validate(&self) -> Result<ModelConfig> {
        let architecture = match self.model_type.as_str() {
            "llama" | "smollm" | "smollm2" => Architecture::Llama,
            "mistral" => Architecture::Mistral,
            "qwen2" => Architecture::Qwen2,
            other => {
                return Err(ModelError::InvalidModel(format!(
                    "model_type {other:?} is not a supported Llama-family layout"
                )))
            }
        };
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        let cfg = ModelConfig {
            architecture,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            qkv_bias: architecture == Architecture::Qwen2 || self.attention_bias,
            o_bias: self.attention_bias,
            eos_token_ids: token_ids(&self.eos_token_id),
            bos_token_id: token_ids(&self.bos_token_id).first().copied(),
        };
        cfg.check()?;
        Ok(cfg)
    }
}

impl ModelConfig {
    /// Checks the invariants the model relies on.
    pub fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(ModelError::InvalidModel(m.to_string()));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return bad("heads and layers must be positive");
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad("num_heads must be a multiple of num_kv_heads");
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad("head_dim must be even and positive");
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return bad("sizes must be positive");
        }
        Ok(())
    }

    /// Writes an HF `config.json` equivalent of this configuration.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let model_type = match self.architecture {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
        };
        serde_json::json!({
            "model_type": model_type,
            "architectures": [match self.architecture {
                Architecture::Llama => "LlamaForCausalLM",
                Architecture::Mistral => "MistralForCausalLM",
                Architecture::Qwen2 => "Qwen2ForCausalLM",
            }],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias,
            "eos_token_id": self.eos_token_ids,
            "bos_token_id": self.bos_token_id,
            "hidden_act": "silu",
        })
    }

    /// A tiny random-weight-sized configuration for tests and examples.
    pub fn tiny(architecture: Architecture) -> Self {
        Self {
            architecture,
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 48,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 128,
            tie_word_embeddings: architecture == Architecture::Llama,
            qkv_bias: architecture == Architecture::Qwen2,
            o_bias: false,
            eos_token_ids: vec![2],
            bos_token_id: Some(1),
        }
    }
}
