//! The config files of the two processes this crate runs, as the binary reads them (raw TOML
//! sections, then `HINDSIGHT_<SECTION>__<KEY>` overrides, then each section's `validate`).
//! They live here, beside their sections, so the binary, its tests and the deploy manifests'
//! test read one definition.

use serde::Deserialize;

use crate::{FeedbackConfig, JoinerConfig, LogConfig};

/// The config file of `hindsight join`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinFile {
    /// Kafka.
    #[serde(default)]
    pub log: LogConfig,
    /// The join.
    #[serde(default)]
    pub joiner: JoinerConfig,
}

impl JoinFile {
    /// The sections `hindsight join` reads; others in a shared file are ignored.
    pub const SECTIONS: &'static [&'static str] = &["log", "joiner"];
}

/// The config file of `hindsight feedback` (the webhook receiver on its own).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackFile {
    /// Kafka.
    #[serde(default)]
    pub log: LogConfig,
    /// The webhook API.
    #[serde(default)]
    pub feedback: FeedbackConfig,
}

impl FeedbackFile {
    /// The sections `hindsight feedback` reads.
    pub const SECTIONS: &'static [&'static str] = &["log", "feedback"];
}
