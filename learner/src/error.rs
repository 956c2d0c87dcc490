//! The crate's error type.

use std::path::PathBuf;

use hindsight_model::ModelError;

/// Everything that can go wrong while building examples, training or checkpointing.
#[derive(Debug, thiserror::Error)]
pub enum LearnerError {
    /// The model core failed (loading, forward pass, adapter shape, tokenizer).
    #[error(transparent)]
    Model(#[from] ModelError),
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
    /// A JSON document (checkpoint, trainer state) is invalid.
    #[error("invalid JSON in {what}: {source}")]
    Json {
        /// What was being parsed.
        what: String,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// An adapter snapshot does not fit the trainer's adapter.
    #[error("invalid adapter: {0}")]
    InvalidAdapter(String),
    /// A caller passed arguments that cannot work (empty batch, bad config, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, LearnerError>;

impl LearnerError {
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
