//! The signal: record schemas, the Kafka interaction/feedback log with disk spill, webhook ingestion and the join into episodes.

mod api;
mod episodes;
mod files;
mod joiner;
mod log;
mod reader;
mod records;
mod redis_conn;
mod signing;
mod spill;

pub use api::{
    feedback_router, serve_feedback, ApiError, FeedbackConfig, FeedbackState, MetricRange,
    SigningConfig, ValidatedFeedbackConfig, FEEDBACK_BATCH_PATH, FEEDBACK_PATH, IDEMPOTENCY_HEADER,
};
pub use episodes::{ConversationKey, EpisodeInference};
pub use files::{FeedbackFile, JoinFile};
pub use joiner::{run_joiner, JoinerConfig, JoinerStats, ValidatedJoinerConfig};
pub use log::{
    ensure_topics, FlushReport, LogConfig, LogError, LogHandle, LogStats, RecordLog, TopicNames,
    ValidatedLogConfig, ID_HEADER,
};
pub use reader::{check_position, end_offsets, PositionCheck, Positions, RawRecord, TopicReader};
pub use records::{
    now_ms, AssignmentRecord, Behaviour, Correction, CorrectionMessage, DeadLetterRecord,
    EpisodeContext, EpisodeRecord, EpisodeSource, FeedbackEvent, FeedbackRecord, FeedbackTarget,
    FeedbackValue, InteractionRecord, Timings, ToolOutcome, Topic, DEAD_LETTER_SCHEMA,
    EPISODE_SCHEMA, FEEDBACK_SCHEMA, INTERACTION_SCHEMA,
};
pub use signing::{sign, verify, Secret, SignatureError, SIGNATURE_HEADER, TIMESTAMP_HEADER};

/// Errors of the feedback crate outside the log.
#[derive(Debug, thiserror::Error)]
pub enum FeedbackError {
    /// A configuration value is invalid.
    #[error("invalid config `{key}`: {reason}")]
    Config {
        /// The offending key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The record log failed to start.
    #[error(transparent)]
    Log(#[from] LogError),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Serving failed.
    #[error("i/o: {0}")]
    Io(#[source] std::io::Error),
    /// Another process holds what this one needs (a joiner's lease); retried.
    #[error("busy: {0}")]
    Busy(String),
}
