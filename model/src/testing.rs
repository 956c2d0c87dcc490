//! Fixtures for the tests of this crate and of the crates built on it (`serve`, ...): a tiny
//! byte-level BPE tokenizer, a tiny model config whose vocabulary covers it, the real default
//! model's path when it is installed, and the element-wise comparison the numeric tests share.
//!
//! Compiled only with the `testing` feature, which crates enable from their
//! `[dev-dependencies]`; nothing here is part of the production surface.

use std::io;
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use tokenizers::Tokenizer;

use crate::config::{Architecture, ModelConfig};
use crate::error::{ModelError, Result};
use crate::tokenizer::GgufTokenizerSpec;

/// GPT-2's byte-to-unicode table, the byte-level BPE alphabet: entry `b` is the one-character
/// string byte `b` is written as. Printable bytes stand for themselves; the others, in byte
/// order, take the characters from U+0100 on (so a space is `Ġ`, U+0120).
pub fn byte_alphabet() -> Vec<String> {
    let printable = |b: &u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let kept = (0..=u8::MAX).filter(printable).map(|b| (b, char::from(b)));
    // The 68 unprintable bytes take U+0100..=U+0143, in order.
    let shifted = (0..=u8::MAX).filter(|b| !printable(b)).zip('\u{100}'..);
    let mut pairs: Vec<(u8, char)> = kept.chain(shifted).collect();
    pairs.sort_unstable();
    pairs.into_iter().map(|(_, c)| c.to_string()).collect()
}

/// A byte-level BPE spec (`gpt2`, `smollm` pre-tokenizer): 3 special tokens
/// (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2), the 256 bytes and 3 merges
/// (`h e`, `l l`, `he ll`), 262 tokens in all.
pub fn tiny_tokenizer_spec() -> GgufTokenizerSpec {
    let mut tokens = vec![
        "<|endoftext|>".to_string(),
        "<|im_start|>".to_string(),
        "<|im_end|>".to_string(),
    ];
    let mut token_types = vec![3i64, 3, 3];
    for b in byte_alphabet() {
        tokens.push(b);
        token_types.push(1);
    }
    let merges = vec!["h e".to_string(), "l l".to_string(), "he ll".to_string()];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        token_types.push(1);
    }
    GgufTokenizerSpec {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens,
        token_types,
        merges,
        scores: vec![],
    }
}

/// The tokenizer of [`tiny_tokenizer_spec`].
pub fn tiny_tokenizer() -> Result<Tokenizer> {
    tiny_tokenizer_spec().build()
}

/// [`ModelConfig::tiny`] with a vocabulary that covers [`tiny_tokenizer`].
pub fn tiny_config(architecture: Architecture) -> ModelConfig {
    let mut cfg = ModelConfig::tiny(architecture);
    cfg.vocab_size = tiny_tokenizer_spec().tokens.len();
    cfg
}

/// The real default model ([`crate::default_model_path`]), or an error saying how to fetch it
/// when it is not installed.
pub fn default_model_path() -> Result<PathBuf> {
    let path = crate::default_model_path();
    if path.is_file() {
        Ok(path)
    } else {
        Err(ModelError::io(
            path,
            io::Error::new(
                io::ErrorKind::NotFound,
                "default model not found - run deploy/fetch-model.sh first (or set HINDSIGHT_MODEL)",
            ),
        ))
    }
}

/// The largest absolute element-wise difference between two tensors of one shape (any float
/// dtype, read as f32): how the tests compare two computations of the same values.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok((a - b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s_table() {
        let a = byte_alphabet();
        assert_eq!(a.len(), 256);
        assert_eq!(a[usize::from(b'a')], "a");
        assert_eq!(a[usize::from(b' ')], "Ġ");
        assert_eq!(a[usize::from(b'\n')], "Ċ");
        assert_eq!(a[0], "Ā");
        let distinct: std::collections::HashSet<&String> = a.iter().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn tiny_tokenizer_fits_the_tiny_config() {
        let tok = tiny_tokenizer().unwrap();
        let cfg = tiny_config(Architecture::Llama);
        assert_eq!(tok.get_vocab_size(true), cfg.vocab_size);
        let ids = crate::encode(&tok, "<|im_start|>hello").unwrap();
        assert_eq!(ids[0], 1);
        assert!(ids.iter().all(|&id| (id as usize) < cfg.vocab_size));
    }
}
