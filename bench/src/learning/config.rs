//! What a learning run is: the objective, the simulated scenario (`[scenario]`) and the
//! learner's own config (`[learner]`), read like every Hindsight process's config.

use std::path::{Path, PathBuf};

use anyhow::bail;
use hindsight_learner::online::LearnerConfig;
use hindsight_learner::trainer::ObjectiveWeights;
use hindsight_sim::{CritiqueStyle, Records, Sop};
use serde::{Deserialize, Serialize};

/// Which objectives learn from the feedback: the learner's configured mix, or one alone for a
/// comparison on the same events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
#[value(rename_all = "kebab-case")]
pub enum Objective {
    /// `learner.trainer.objectives` as configured (by default the measured recipe:
    /// self-distillation on the teacher's own answer).
    Default,
    /// No learning: the base model (its curve is flat by construction; evaluated once).
    None,
    /// SFT on corrections only.
    Sft,
    /// KTO on thumbs only.
    Kto,
    /// Dense-reward policy gradient (teacher/student gap + scalar feedback).
    Dense,
    /// Hindsight self-distillation.
    Distill,
    /// Self-distillation + dense reward.
    DistillDense,
}

impl Objective {
    /// kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Default => "default",
            Objective::None => "none",
            Objective::Sft => "sft",
            Objective::Kto => "kto",
            Objective::Dense => "dense",
            Objective::Distill => "distill",
            Objective::DistillDense => "distill-dense",
        }
    }

    /// The trainer's objective weights, from the configured ones.
    pub fn weights(self, configured: ObjectiveWeights) -> ObjectiveWeights {
        let w = |sft, kto, distill, dense| ObjectiveWeights {
            sft,
            kto,
            distill,
            dense,
        };
        match self {
            Objective::Default => configured,
            Objective::None => w(0.0, 0.0, 0.0, 0.0),
            Objective::Sft => w(1.0, 0.0, 0.0, 0.0),
            Objective::Kto => w(0.0, 1.0, 0.0, 0.0),
            Objective::Dense => w(0.0, 0.0, 0.0, 1.0),
            Objective::Distill => w(0.0, 0.0, 1.0, 0.0),
            Objective::DistillDense => w(0.0, 0.0, 1.0, 1.0),
        }
    }
}

/// The simulated production scenario a learning run is measured on (`[scenario]` of the
/// bench's config): what traffic and feedback the environment sends, and how the curve is
/// scored. The defaults are the headline run (docs/experiments/2026-12-04-feedback-order-and-replay-4.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Feedback events (episodes, each judged once) to learn from.
    #[serde(default = "default_events")]
    pub events: u64,
    /// Evaluate after every this many events.
    #[serde(default = "default_eval_every")]
    pub eval_every: u64,
    /// Held-out eval tickets (the first N of the eval split).
    #[serde(default = "default_eval_items")]
    pub eval_items: usize,
    /// Also evaluate the first this many *training* tickets at every point (0 = off): held-out
    /// vs trained tells generalization from fit.
    #[serde(default)]
    pub train_eval_items: usize,
    /// World seed (tickets, users).
    #[serde(default)]
    pub seed: u64,
    /// The agent's sampling temperature.
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Episodes in flight.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Feedback sent in episode order (each episode's once it and every earlier one of the chunk
    /// are answered), so the learner meets the examples in the same order on every run of a
    /// seed and trains while the chunk's later tickets are answered (false: as answers finish).
    #[serde(default = "yes")]
    pub feedback_in_episode_order: bool,
    /// How critiques are worded.
    #[serde(default)]
    pub critique_style: CritiqueStyle,
    /// Share of wrong answers whose feedback also carries a corrected answer (1: every one,
    /// the headline; 0.3: the realistic stream).
    #[serde(default = "default_correction_rate")]
    pub correction_rate: f64,
    /// Share of wrong (noisy) feedback.
    #[serde(default)]
    pub noise_rate: f64,
    /// How the tickets write the order and customer records.
    #[serde(default)]
    pub records: Records,
    /// Run the likelihood probe of learning beyond the prior ([`PriorProbe`]) at every point
    /// (about a second per probed ticket on this CPU).
    #[serde(default = "yes")]
    pub prior_probe: bool,
    /// A business rule that changes mid-stream (none by default): the simulated user judges
    /// by the new SOP from `after_events` on, and the held-out tickets are scored by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_change: Option<RuleChange>,
}

/// The changing-rule scenario (issue 39, item 3): the retention window moves (30 → 14 days
/// in the measured run) after some feedback events. Tickets between the two windows change
/// department and refund; every other ticket keeps its decision, which measures retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleChange {
    /// Feedback events judged by the old SOP before the change.
    pub after_events: u64,
    /// The new retention window, in days.
    pub retention_after_days: u32,
}

impl Scenario {
    /// The SOP the user judges the episode of index `event` by.
    pub fn sop_at(&self, event: u64) -> Sop {
        match self.rule_change {
            Some(c) if event >= c.after_events => c.new_sop(),
            _ => Sop::default(),
        }
    }

    /// The SOP at the end of the run: what the held-out tickets are scored by.
    pub fn final_sop(&self) -> Sop {
        self.rule_change.map_or_else(Sop::default, |c| c.new_sop())
    }
}

impl RuleChange {
    /// The SOP after the change.
    pub fn new_sop(&self) -> Sop {
        Sop {
            retention_after_days: self.retention_after_days,
        }
    }
}

fn default_events() -> u64 {
    64
}
fn default_eval_every() -> u64 {
    32
}
fn default_eval_items() -> usize {
    60
}
fn default_temperature() -> f64 {
    0.7
}
fn default_concurrency() -> usize {
    4
}
fn default_correction_rate() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
            events: default_events(),
            eval_every: default_eval_every(),
            eval_items: default_eval_items(),
            train_eval_items: 0,
            seed: 0,
            temperature: default_temperature(),
            concurrency: default_concurrency(),
            feedback_in_episode_order: true,
            critique_style: CritiqueStyle::default(),
            correction_rate: default_correction_rate(),
            noise_rate: 0.0,
            records: Records::default(),
            prior_probe: true,
            rule_change: None,
        }
    }
}

/// The bench's config file: `[scenario]` and `[learner]`, the very section (and type)
/// `hindsight learner` reads, with its defaults (the measured recipe).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BenchFile {
    /// The simulated scenario.
    #[serde(default)]
    pub scenario: Scenario,
    /// The learner.
    #[serde(default)]
    pub learner: LearnerConfig,
}

impl BenchFile {
    /// Reads the file (or nothing) and `HINDSIGHT_SCENARIO__*` / `HINDSIGHT_LEARNER__*`
    /// overrides from `env`, failing on an unknown key or a bad value with the key's name.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<Self> {
        let file: BenchFile = hindsight_core::load_toml(path, env, &["scenario", "learner"])?;
        file.learner
            .validate()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if file.scenario.eval_every == 0 || file.scenario.events == 0 {
            bail!("config key `scenario.events` / `scenario.eval_every`: must be >= 1");
        }
        if let Some(c) = file.scenario.rule_change {
            if c.after_events == 0 || c.after_events >= file.scenario.events {
                bail!(
                    "config key `scenario.rule_change.after_events`: must be between 1 and \
                     `scenario.events` - 1 (got {})",
                    c.after_events
                );
            }
            if c.retention_after_days == 0 || c.new_sop() == Sop::default() {
                bail!(
                    "config key `scenario.rule_change.retention_after_days`: must be >= 1 and \
                     differ from the default SOP's {} (got {})",
                    Sop::default().retention_after_days,
                    c.retention_after_days
                );
            }
        }
        Ok(file)
    }
}

/// One learning run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LearningConfig {
    /// The objective configuration.
    pub objective: Objective,
    /// The simulated scenario.
    pub scenario: Scenario,
    /// The learner (`model_path` is the base model everything runs on). The harness sets
    /// where its files go, names the adapter after the objective, and takes candidates on
    /// request after every eval interval.
    pub learner: LearnerConfig,
    /// Kafka brokers.
    pub brokers: String,
    /// Redis.
    pub redis_url: String,
    /// Where checkpoints, adapters, spill and the run log go.
    pub work_dir: PathBuf,
}

impl LearningConfig {
    /// The defaults (the measured recipe on the headline scenario) for the local services.
    pub fn new(objective: Objective, work_dir: impl Into<PathBuf>) -> Self {
        Self::from_file(objective, BenchFile::default(), work_dir)
    }

    /// A run of `objective` with the file's scenario and learner.
    pub fn from_file(objective: Objective, file: BenchFile, work_dir: impl Into<PathBuf>) -> Self {
        Self {
            objective,
            scenario: file.scenario,
            learner: file.learner,
            brokers: std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into()),
            redis_url: std::env::var("REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379/".into()),
            work_dir: work_dir.into(),
        }
    }

    /// The curve's name in plots: the objective, then every scenario and learner setting that
    /// differs from the defaults (`key=value`, dotted paths as in the config file).
    pub fn label(&self) -> String {
        let mut parts = vec![self.objective.as_str().to_string()];
        let differs = |a: &Scenario, b: &Scenario| changed_keys("", &json_of(a), &json_of(b));
        parts.extend(differs(&self.scenario, &Scenario::default()));
        // The files the harness places itself are not settings.
        let mut learner = self.learner.clone();
        let defaults = LearnerConfig::default();
        learner.model_path = defaults.model_path.clone();
        learner.trainer.objectives = defaults.trainer.objectives;
        parts.extend(changed_keys("", &json_of(&learner), &json_of(&defaults)));
        parts.join(", ")
    }

    /// The base model file.
    pub fn model_path(&self) -> &Path {
        &self.learner.model_path
    }
}

pub(super) fn json_of<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

/// `path=value` for every leaf of `a` that differs from `b`, in key order.
fn changed_keys(path: &str, a: &serde_json::Value, b: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x
            .iter()
            .flat_map(|(k, v)| {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                changed_keys(&p, v, y.get(k).unwrap_or(&Value::Null))
            })
            .collect(),
        _ if a == b => vec![],
        (Value::String(s), _) => vec![format!("{path}={s}")],
        _ => vec![format!("{path}={a}")],
    }
}
