//! `[rollout]`: how the controller moves a canary through its stages and what stops it. Every
//! key has a default; `deploy/hindsight.example.toml` documents them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use hindsight_routing::{validate_stages, RoutingError};

use super::metrics::MetricBounds;
use super::stats::Alpha;

/// What a drift alarm does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftPolicy {
    /// Stop advancing, keep the canary's weight, wait for an operator.
    Freeze,
    /// Roll back at once.
    Rollback,
}

/// What a new accepted candidate does while a canary runs on its route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidatePolicy {
    /// Wait until the running rollout ends, then start (newest queued candidate only).
    Queue,
    /// Roll the running canary back and start the new one.
    Supersede,
}

/// The config file of `hindsight rollout` (the controller and the operator commands), as the
/// binary reads it: the routing table's Redis, the controller, Kafka (online metrics and the
/// audit topic) and the registry it keeps in step.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutFile {
    /// The routing table.
    #[serde(default)]
    pub routing: hindsight_routing::RoutingConfig,
    /// The controller and its admin API.
    #[serde(default)]
    pub rollout: RolloutConfig,
    /// Kafka.
    #[serde(default)]
    pub log: hindsight_feedback::LogConfig,
    /// The adapter registry.
    #[serde(default)]
    pub registry: crate::registry::RegistryConfig,
}

impl RolloutFile {
    /// The sections `hindsight rollout` reads; others in a shared file are ignored.
    pub const SECTIONS: &'static [&'static str] = &["routing", "rollout", "log", "registry"];
}

/// `[rollout]` as written in the file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Canary weight of each stage; increasing, the last 1.0 (promotion).
    #[serde(default = "default_stages")]
    pub stages: Vec<f64>,
    /// Least time in a stage before it may advance.
    #[serde(default = "default_min_stage_ms")]
    pub min_stage_ms: u64,
    /// Least exposures per arm (canary and stable, this rollout) before a stage advances.
    #[serde(default = "default_min_exposures")]
    pub min_exposures: u64,
    /// Least matured exposures with feedback per arm before a stage advances.
    #[serde(default = "default_min_matured_feedback")]
    pub min_matured_feedback: u64,
    /// Feedback counts for an exposure only once it is this old (late feedback is the norm).
    #[serde(default = "default_maturation_ms")]
    pub maturation_ms: u64,
    /// Error level of each anytime-valid test (per guard).
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Non-inferiority margin: the canary's negative-feedback rate may exceed stable's by this.
    #[serde(default = "default_negative_feedback_margin")]
    pub negative_feedback_margin: f64,
    /// Margin on the upstream error + timeout rate.
    #[serde(default = "default_error_rate_margin")]
    pub error_rate_margin: f64,
    /// Margin on mean latency, ms.
    #[serde(default = "default_latency_margin_ms")]
    pub latency_margin_ms: f64,
    /// Latency bound for the test (set it to the upstream timeout), ms.
    #[serde(default = "default_latency_bound_ms")]
    pub latency_bound_ms: f64,
    /// The tail-latency guard: a call slower than this is slow ...
    #[serde(default = "default_slow_ms")]
    pub slow_ms: f64,
    /// ... and the canary's share of slow calls may exceed stable's by this margin.
    #[serde(default = "default_slow_rate_margin")]
    pub slow_rate_margin: f64,
    /// Drift alarm on empty or unparseable answers: canary rate above stable's by this.
    #[serde(default = "default_empty_rate_margin")]
    pub empty_rate_margin: f64,
    /// Drift alarm when mean answer length leaves [stable / r, stable × r].
    #[serde(default = "default_ratio")]
    pub length_ratio: f64,
    /// Answer length bound for the test, tokens.
    #[serde(default = "default_length_bound_tokens")]
    pub length_bound_tokens: f64,
    /// Drift alarm when tool calls per turn leave [stable / r, stable × r].
    #[serde(default = "default_ratio")]
    pub tool_calls_ratio: f64,
    /// Tool calls per turn bound for the test.
    #[serde(default = "default_tool_calls_bound")]
    pub tool_calls_bound: f64,
    /// Drift alarm when turns per episode leave [stable / r, stable × r].
    #[serde(default = "default_ratio")]
    pub turns_ratio: f64,
    /// Turns per episode bound for the test.
    #[serde(default = "default_turns_bound")]
    pub turns_bound: f64,
    /// What a drift alarm does.
    #[serde(default = "default_on_drift")]
    pub on_drift: DriftPolicy,
    /// What a new candidate does while a canary runs.
    #[serde(default = "default_on_new_candidate")]
    pub on_new_candidate: CandidatePolicy,
    /// How often the controller evaluates every route.
    #[serde(default = "default_eval_interval_ms")]
    pub eval_interval_ms: u64,
    /// Where `hindsight rollout run` serves its admin API and `/metrics`.
    #[serde(default = "default_admin_addr")]
    pub admin_addr: String,
    /// Bearer token of the admin API's commands (without one, every command is refused with
    /// 401; set it from the environment: `HINDSIGHT_ROLLOUT__ADMIN_TOKEN`).
    #[serde(default, skip_serializing)]
    pub admin_token: Option<AdminToken>,
    /// Whether the admin listener's reads (routes, audit trail, registry, learning curves, the
    /// recent feedback's kinds and values) are open without the admin token. Set false where the
    /// listener is reachable beyond trusted hosts (the compose and Kubernetes manifests bind
    /// 0.0.0.0); the page itself and `/metrics` stay open, and the page sends the token it is
    /// given with every read.
    #[serde(default = "yes")]
    pub open_reads: bool,
    /// The learner's JSONL run log, read by the operator page for its learning curves (the
    /// learner's `[learner] run_log`, whose default this is); none when empty. A missing file
    /// shows as no curve.
    #[serde(default = "default_run_log")]
    pub run_log: PathBuf,
}

/// The admin API's bearer token; `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct AdminToken(pub String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

fn default_stages() -> Vec<f64> {
    vec![0.01, 0.05, 0.25, 0.5, 1.0]
}
fn default_min_stage_ms() -> u64 {
    600_000
}
fn default_min_exposures() -> u64 {
    200
}
fn default_min_matured_feedback() -> u64 {
    50
}
fn default_maturation_ms() -> u64 {
    300_000
}
fn default_alpha() -> f64 {
    0.05
}
fn default_negative_feedback_margin() -> f64 {
    0.02
}
fn default_error_rate_margin() -> f64 {
    0.01
}
fn default_latency_margin_ms() -> f64 {
    250.0
}
fn default_latency_bound_ms() -> f64 {
    60_000.0
}
fn default_slow_ms() -> f64 {
    5_000.0
}
fn default_slow_rate_margin() -> f64 {
    0.01
}
fn default_turns_bound() -> f64 {
    32.0
}
fn default_empty_rate_margin() -> f64 {
    0.02
}
fn default_ratio() -> f64 {
    1.5
}
fn default_length_bound_tokens() -> f64 {
    4_096.0
}
fn default_tool_calls_bound() -> f64 {
    16.0
}
fn default_on_drift() -> DriftPolicy {
    DriftPolicy::Freeze
}
fn default_on_new_candidate() -> CandidatePolicy {
    CandidatePolicy::Queue
}
fn default_eval_interval_ms() -> u64 {
    1_000
}
/// The learner's default run log (`hindsight_learner`'s `[learner] run_log`).
fn default_run_log() -> PathBuf {
    PathBuf::from("data/learner/run.jsonl")
}
fn default_admin_addr() -> String {
    "127.0.0.1:9466".into()
}
fn yes() -> bool {
    true
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            stages: default_stages(),
            min_stage_ms: default_min_stage_ms(),
            min_exposures: default_min_exposures(),
            min_matured_feedback: default_min_matured_feedback(),
            maturation_ms: default_maturation_ms(),
            alpha: default_alpha(),
            negative_feedback_margin: default_negative_feedback_margin(),
            error_rate_margin: default_error_rate_margin(),
            latency_margin_ms: default_latency_margin_ms(),
            latency_bound_ms: default_latency_bound_ms(),
            slow_ms: default_slow_ms(),
            slow_rate_margin: default_slow_rate_margin(),
            empty_rate_margin: default_empty_rate_margin(),
            length_ratio: default_ratio(),
            length_bound_tokens: default_length_bound_tokens(),
            tool_calls_ratio: default_ratio(),
            tool_calls_bound: default_tool_calls_bound(),
            turns_ratio: default_ratio(),
            turns_bound: default_turns_bound(),
            on_drift: default_on_drift(),
            on_new_candidate: default_on_new_candidate(),
            eval_interval_ms: default_eval_interval_ms(),
            admin_addr: default_admin_addr(),
            admin_token: None,
            open_reads: true,
            run_log: default_run_log(),
        }
    }
}

impl RolloutConfig {
    /// Checks every value; the error names the key under `rollout.`.
    pub fn validate(&self) -> Result<(), RoutingError> {
        let bad = |key: &str, reason: String| RoutingError::Invalid {
            field: format!("rollout.{key}"),
            reason,
        };
        validate_stages(&self.stages).map_err(|e| bad("stages", e.to_string()))?;
        Alpha::new(self.alpha).map_err(|e| bad("alpha", e.to_string()))?;
        for (key, v) in [
            ("negative_feedback_margin", self.negative_feedback_margin),
            ("error_rate_margin", self.error_rate_margin),
            ("empty_rate_margin", self.empty_rate_margin),
            ("slow_rate_margin", self.slow_rate_margin),
        ] {
            if !(v.is_finite() && (0.0..1.0).contains(&v)) {
                return Err(bad(key, format!("{v} is outside [0, 1)")));
            }
        }
        for (key, v) in [
            ("latency_margin_ms", self.latency_margin_ms),
            ("latency_bound_ms", self.latency_bound_ms),
            ("length_bound_tokens", self.length_bound_tokens),
            ("tool_calls_bound", self.tool_calls_bound),
            ("turns_bound", self.turns_bound),
            ("slow_ms", self.slow_ms),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(key, format!("{v} must be a positive number")));
            }
        }
        for (key, v) in [
            ("length_ratio", self.length_ratio),
            ("tool_calls_ratio", self.tool_calls_ratio),
            ("turns_ratio", self.turns_ratio),
        ] {
            if !(v.is_finite() && v > 1.0) {
                return Err(bad(key, format!("{v} must be greater than 1")));
            }
        }
        if self.admin_addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(bad(
                "admin_addr",
                format!("`{}` is not an IP:port address", self.admin_addr),
            ));
        }
        if self.admin_token.as_ref().is_some_and(|t| t.0.len() < 16) {
            return Err(bad("admin_token", "must be at least 16 characters".into()));
        }
        if !self.open_reads && self.admin_token.is_none() {
            return Err(bad(
                "open_reads",
                "false needs rollout.admin_token: without a token nothing could read".into(),
            ));
        }
        if self.eval_interval_ms == 0 {
            return Err(bad("eval_interval_ms", "must be greater than 0".into()));
        }
        Ok(())
    }

    /// The metric bounds the tests use.
    pub fn bounds(&self) -> MetricBounds {
        MetricBounds {
            latency_ms: self.latency_bound_ms,
            length_tokens: self.length_bound_tokens,
            tool_calls: self.tool_calls_bound,
            turns: self.turns_bound,
            slow_ms: self.slow_ms,
        }
    }
}
