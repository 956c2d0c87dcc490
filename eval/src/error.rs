//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can stop an evaluation run (a single failed request is not an error: it is
/// scored 0 and counted).
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The eval set file could not be read.
    #[error("cannot read eval set {path}: {source}")]
    ReadSet {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line of the eval set is not a valid item.
    #[error("eval set line {line}: {reason}")]
    InvalidItem {
        /// 1-based line number (0 when the item was built in memory).
        line: usize,
        /// What to fix.
        reason: String,
    },
    /// The eval set has no items.
    #[error("eval set is empty")]
    EmptySet,
    /// Invalid run settings (samples, k, concurrency …).
    #[error("invalid setting {field}: {reason}")]
    InvalidConfig {
        /// The offending setting.
        field: &'static str,
        /// What to fix.
        reason: String,
    },
    /// The HTTP client could not be built.
    #[error("cannot build HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// Every request of the run failed, so there is nothing to score; usually a wrong endpoint.
    #[error("every request to {endpoint} failed; first error: {first_error}")]
    AllRequestsFailed {
        /// The endpoint that was called.
        endpoint: String,
        /// The first failure, verbatim.
        first_error: String,
    },
    /// The results file could not be written.
    #[error("cannot write results to {path}: {source}")]
    WriteResults {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Results could not be serialized.
    #[error("cannot serialize results: {0}")]
    Serialize(#[from] serde_json::Error),
}
