//! The signal: record schemas, the Kafka interaction/feedback log with disk spill, webhook ingestion and the join into episodes.

mod log;
mod reader;
mod records;
mod spill;

pub use log::{
    ensure_topics, FlushReport, LogConfig, LogError, LogHandle, LogStats, RecordLog, TopicNames,
    ValidatedLogConfig, ID_HEADER,
};
pub use reader::{Positions, RawRecord, TopicReader};
pub use records::{
    now_ms, Behaviour, Correction, CorrectionMessage, DeadLetterRecord, EpisodeContext,
    EpisodeRecord, EpisodeSource, FeedbackEvent, FeedbackRecord, FeedbackTarget, FeedbackValue,
    InteractionRecord, Timings, ToolOutcome, Topic, DEAD_LETTER_SCHEMA, EPISODE_SCHEMA,
    FEEDBACK_SCHEMA, INTERACTION_SCHEMA,
};
