//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading, running or differentiating the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed (shape mismatch, device error, ...).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A file could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON document (config, tokenizer, adapter config) is invalid.
    #[error("invalid JSON in {what}: {source}")]
    Json {
        /// What was being parsed.
        what: String,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// The model files are missing something or contradict each other.
    #[error("invalid model: {0}")]
    InvalidModel(String),
    /// The tokenizer could not be built or failed to encode/decode.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render (including `raise_exception`).
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// An adapter is invalid or does not fit the model.
    #[error("invalid adapter: {0}")]
    InvalidAdapter(String),
    /// A caller passed arguments that cannot work (empty batch, unknown adapter, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn json(what: impl Into<String>, source: serde_json::Error) -> Self {
        Self::Json {
            what: what.into(),
            source,
        }
    }
}
