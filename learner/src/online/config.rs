//! `[learner]`: the loop's settings (the trainer's are in [`crate::trainer::TrainerConfig`]),
//! and the `hindsight learner` command's file and arguments. Defaults are the measured recipe.

use std::path::PathBuf;

use hindsight_control::publish::PublishConfig;
use hindsight_control::registry::RegistryConfig;
use hindsight_model::{DeviceSpec, WeightDType};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::OnlineError;
use crate::example::ExampleConfig;
use crate::trainer::TrainerConfig;

/// The `[learner]` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnerConfig {
    /// Base model: a `.gguf` file or an HF directory.
    #[serde(default = "default_model_path")]
    pub model_path: PathBuf,
    /// Where the model trains: `cpu` (default), `cuda` or `cuda:N` (needs the `cuda` build).
    #[serde(default)]
    pub device: DeviceSpec,
    /// dtype of the frozen base weights: `f32` (default) or, on a GPU, `bf16`/`f16`. Adapters
    /// and optimizer state are f32 either way.
    #[serde(default)]
    pub dtype: WeightDType,
    /// The base model's name at the serving endpoint (default: the file name without
    /// `.gguf`, as `hindsight serve` names it).
    #[serde(default)]
    pub base_model_name: Option<String>,
    /// The adapter this learner trains and publishes.
    #[serde(default = "default_adapter_name")]
    pub adapter_name: String,
    /// Kafka consumer group (offsets are committed to it in both assignment modes).
    #[serde(default = "default_group_id")]
    pub group_id: String,
    /// How the learner gets its partitions: `checkpoint` (default) reads every partition of
    /// the episodes topic from the checkpoint's positions, with no group rebalance to wait for;
    /// `group` joins `group_id` and reads from its committed offsets.
    #[serde(default)]
    pub assignment: Assignment,
    /// What to do when the checkpoint's positions no longer refer to the episodes topic (the
    /// broker was emptied, or the topic deleted and created again): `restart` (default) reads
    /// the new topic from its beginning, `refuse` stops with an error naming the topic.
    #[serde(default)]
    pub on_replaced_topic: ReplacedTopic,
    /// Checkpoint directory.
    #[serde(default = "default_checkpoint_dir")]
    pub checkpoint_dir: PathBuf,
    /// Checkpoints kept.
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// JSONL run log (one line per batch, checkpoint, candidate); none when empty.
    #[serde(default = "default_run_log")]
    pub run_log: PathBuf,
    /// Token budget of a micro-batch (sum of the forward passes' tokens).
    #[serde(default = "default_token_budget")]
    pub token_budget: usize,
    /// Examples per micro-batch at most.
    #[serde(default = "default_max_batch_examples")]
    pub max_batch_examples: usize,
    /// How long a partial micro-batch waits for more examples, in milliseconds.
    #[serde(default = "default_max_batch_wait_ms")]
    pub max_batch_wait_ms: u64,
    /// Checkpoint (and commit offsets) every this many micro-batches.
    #[serde(default = "one")]
    pub checkpoint_every_batches: u64,
    /// Snapshot a candidate every this many micro-batches (0 = never by batches).
    #[serde(default = "default_candidate_every_batches")]
    pub candidate_every_batches: u64,
    /// Snapshot a candidate every this many trained examples (0 = never by examples).
    #[serde(default)]
    pub candidate_every_examples: u64,
    /// Snapshot a candidate at least this often while training, in milliseconds (0 = never).
    #[serde(default = "default_candidate_every_ms")]
    pub candidate_every_ms: u64,
    /// Data from an adapter more than this many versions behind live is dropped.
    #[serde(default = "default_max_staleness_versions")]
    pub max_staleness_versions: u64,
    /// Extra optimizer steps after each new micro-batch, each on a micro-batch drawn from the
    /// replay buffer of earlier trained examples (0 = every example is trained once).
    /// Production feedback is scarce and each event yields one example, so a few passes over
    /// recent ones are how a handful of critiques becomes a rule. Replayed examples keep their
    /// logged behaviour log-probs (the importance ratio is clipped) and are re-taught by the
    /// current teacher. The default, 4 after every one-example batch, is the measured recipe
    /// (+25 to +28 points where 2 gave +7 to +25: docs/experiments/).
    #[serde(default = "default_replay_steps_per_batch")]
    pub replay_steps_per_batch: usize,
    /// Most recent trained examples kept for replay. In memory only: a restarted learner
    /// starts with an empty buffer (exactly-once applies to new records; replay is extra).
    #[serde(default = "default_replay_buffer_examples")]
    pub replay_buffer_examples: usize,
    /// Stop after this many trained examples (benchmarks and tests; none = run until stopped).
    #[serde(default)]
    pub max_examples: Option<u64>,
    /// Stop after this many episode records (trained or skipped) have been consumed.
    #[serde(default)]
    pub max_records: Option<u64>,
    /// The trainer.
    #[serde(default)]
    pub trainer: TrainerConfig,
    /// Example building.
    #[serde(default)]
    pub examples: ExampleConfig,
}

/// How the learner is given the episodes topic's partitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Assignment {
    /// Own every partition and start where the checkpoint says (partitions it does not name:
    /// the group's committed offset, else the earliest). The checkpoint is the source of truth,
    /// so a restart reads at once, and commits are advisory (a failed commit is logged).
    #[default]
    Checkpoint,
    /// Join the consumer group and read from its committed offsets. A restart within the
    /// previous member's session timeout may wait for the rebalance (tansu can hand out an
    /// empty assignment until the old member expires).
    Group,
}

/// The policy for checkpoint positions that no longer refer to the topic they were saved on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplacedTopic {
    /// Forget the stale positions (with a warning naming the partition and why) and read the
    /// new topic from its beginning; the trained weights are kept.
    #[default]
    Restart,
    /// Stop with an error: an operator decides (move the checkpoint away, or point the
    /// learner at the old topic).
    Refuse,
}

fn default_model_path() -> PathBuf {
    PathBuf::from(hindsight_model::DEFAULT_MODEL_FILE)
}
fn default_adapter_name() -> String {
    "hindsight".into()
}
fn default_group_id() -> String {
    "hindsight-learner".into()
}
fn default_checkpoint_dir() -> PathBuf {
    PathBuf::from("data/learner")
}
fn default_keep_checkpoints() -> usize {
    2
}
fn default_run_log() -> PathBuf {
    PathBuf::from("data/learner/run.jsonl")
}
fn default_token_budget() -> usize {
    4096
}
/// One example per micro-batch, each followed by the replay steps: the measured recipe
/// (larger batches are unmeasured; on a GPU they are the first thing to try).
fn default_max_batch_examples() -> usize {
    1
}
fn default_replay_steps_per_batch() -> usize {
    4
}
fn default_max_batch_wait_ms() -> u64 {
    2_000
}
fn one() -> u64 {
    1
}
fn default_candidate_every_batches() -> u64 {
    50
}
fn default_candidate_every_ms() -> u64 {
    600_000
}
fn default_max_staleness_versions() -> u64 {
    3
}
fn default_replay_buffer_examples() -> usize {
    256
}

impl Default for LearnerConfig {
    fn default() -> Self {
        // Every field has a serde default.
        serde_json::from_value(json!({})).unwrap_or_else(|_| unreachable_default())
    }
}

#[allow(clippy::panic)]
fn unreachable_default() -> LearnerConfig {
    // Only reachable if a serde default above were removed; caught by the unit test.
    panic!("LearnerConfig has a field without a default")
}

impl LearnerConfig {
    /// Checks the settings once at start-up.
    pub fn validate(&self) -> Result<(), OnlineError> {
        let bad = |m: &str| Err(OnlineError::Config(m.to_string()));
        if self.adapter_name.is_empty() || self.adapter_name.contains(['/', '@', ' ']) {
            return bad("adapter_name must be non-empty without '/', '@' or spaces");
        }
        if self.group_id.is_empty() {
            return bad("group_id must not be empty");
        }
        if self.token_budget == 0 || self.max_batch_examples == 0 {
            return bad("token_budget and max_batch_examples must be >= 1");
        }
        if self.checkpoint_every_batches == 0 {
            return bad("checkpoint_every_batches must be >= 1");
        }
        if self.replay_steps_per_batch > 0 && self.replay_buffer_examples == 0 {
            return bad("replay_buffer_examples must be >= 1 when replay_steps_per_batch > 0");
        }
        self.trainer.check()?;
        Ok(())
    }

    pub(super) fn served_base_name(&self) -> String {
        self.base_model_name.clone().unwrap_or_else(|| {
            let stem = self
                .model_path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            stem.strip_suffix(".gguf").unwrap_or(&stem).to_string()
        })
    }
}

/// `hindsight learner` arguments.
#[derive(Debug, clap::Args)]
pub struct LearnerArgs {
    /// TOML config with `[log]`, `[learner]`, `[registry]` and `[publish]` sections (env:
    /// HINDSIGHT_LEARNER__*, HINDSIGHT_REGISTRY__*, HINDSIGHT_PUBLISH__*, HINDSIGHT_LOG__*).
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
}

/// The config file of `hindsight learner`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnerFile {
    /// Kafka.
    #[serde(default)]
    pub log: hindsight_feedback::LogConfig,
    /// The loop and trainer.
    #[serde(default)]
    pub learner: LearnerConfig,
    /// The registry (candidates are not kept without it).
    #[serde(default)]
    pub registry: Option<RegistryConfig>,
    /// Publishing (candidates are only registered without it).
    #[serde(default)]
    pub publish: Option<PublishConfig>,
    /// The routing table, for `publish.rollout = "canary"`.
    #[serde(default)]
    pub routing: Option<hindsight_routing::RoutingConfig>,
}

impl LearnerFile {
    /// The sections `hindsight learner` reads; others in a shared file are ignored.
    pub const SECTIONS: &'static [&'static str] =
        &["log", "learner", "registry", "publish", "routing"];
}
