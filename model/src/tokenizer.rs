//! Tokenizers: an HF `tokenizer.json`, or one rebuilt from GGUF metadata
//! (`tokenizer.ggml.*`) in the same `tokenizers::Tokenizer` form.

use std::str::FromStr;

use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::error::{ModelError, Result};

/// Token types as llama.cpp stores them in `tokenizer.ggml.token_type`.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Tokenizer metadata read from a GGUF file.
#[derive(Debug, Clone, Default)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer variant (`smollm`, `llama-bpe`, `qwen2`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`.
    pub token_types: Vec<i64>,
    /// `tokenizer.ggml.merges` (`"a b"` each).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece only).
    pub scores: Vec<f32>,
}

// Split patterns of the common byte-level BPE pre-tokenizers (from their HF tokenizer.json).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

impl GgufTokenizerSpec {
    /// Builds the tokenizer.
    pub fn build(&self) -> Result<Tokenizer> {
        let added: Vec<Value> = self
            .tokens
            .iter()
            .enumerate()
            .filter_map(|(id, tok)| {
                let ty = self.token_types.get(id).copied().unwrap_or(1);
                (ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED).then(|| {
                    json!({"id": id, "content": tok, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false,
                           "special": ty == TOKEN_TYPE_CONTROL})
                })
            })
            .collect();
        let doc = match self.model.as_str() {
            "gpt2" => {
                let vocab: serde_json::Map<String, Value> = self
                    .tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.clone(), json!(i)))
                    .collect();
                let pre = match self.pre.as_deref().unwrap_or("default") {
                    "smollm" | "starcoder" | "refact" | "codeshell" => json!({"type": "Sequence",
                        "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
                    "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" => json!({"type": "Sequence",
                        "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]}),
                    "qwen2" | "deepseek-r1-qwen" => json!({"type": "Sequence",
                        "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]}),
                    _ => byte_level(true),
                };
                json!({
                    "version": "1.0", "truncation": null, "padding": null,
                    "added_tokens": added, "normalizer": null, "pre_tokenizer": pre,
                    "post_processor": null, "decoder": byte_level(true),
                    "model": {"type": "BPE", "dropout": null, "unk_token": null,
                              "continuing_subword_prefix": null, "end_of_word_suffix": null,
                              "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                              "vocab": vocab, "merges": self.merges}
                })
            }
            "llama" => {
                // SentencePiece vocabularies: a Unigram model over the same pieces and scores
                // with byte fallback (close to, but not guaranteed identical with, SPM-BPE).
                let vocab: Vec<Value> = self
                    .tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| json!([t, self.scores.get(i).copied().unwrap_or(0.0)]))
                    .collect();
                json!({
                    "version": "1.0", "truncation": null, "padding": null,
                    "added_tokens": added, "normalizer": null,
                    "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}",
                                      "prepend_scheme": "first", "split": false},
                    "post_processor": null,
                    "decoder": {"type": "Sequence", "decoders": [
                        {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                        {"type": "ByteFallback"}, {"type": "Fuse"},
                        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
                    "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": true}
                })
            }
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "GGUF tokenizer model {other:?} is not supported (gpt2 and llama are)"
                )))
            }
        };
        let text = serde_json::to_string(&doc)
            .map_err(|e| ModelError::json("generated tokenizer.json", e))?;
        Tokenizer::from_str(&text).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }
}

/// Loads an HF `tokenizer.json`.
pub fn tokenizer_from_file(path: &std::path::Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Encodes text without adding special tokens (chat templates already contain them).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tokenizer
        .encode(text, false)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?
        .get_ids()
        .to_vec())
}

/// Decodes ids, dropping special tokens when asked.
pub fn decode(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> Result<String> {
    tokenizer
        .decode(ids, skip_special)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))
}
