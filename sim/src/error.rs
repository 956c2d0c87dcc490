//! Errors of the simulated environment.

/// What can stop an environment command.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// Invalid settings.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An HTTP call failed to complete.
    #[error("http: {0}")]
    Http(String),
    /// The feedback webhook refused the events.
    #[error("feedback webhook answered {status}: {body}")]
    Feedback {
        /// HTTP status.
        status: u16,
        /// Start of the body.
        body: String,
    },
    /// The evaluation library failed.
    #[error(transparent)]
    Eval(#[from] hindsight_eval::EvalError),
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Every episode failed; usually a wrong agent endpoint.
    #[error("every episode failed; first error: {0}")]
    AllEpisodesFailed(String),
}
