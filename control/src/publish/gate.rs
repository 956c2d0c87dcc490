//! The eval gate: the candidate and the live model (or the base model) on the same held-out
//! set, seed and settings, with the forgetting and collapse guard ([`crate::guard`]) beside
//! them; its settings and its verdict.

use std::path::PathBuf;

use hindsight_eval::{evaluate, EvalSet, RunConfig, RunReport};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{candidate_name, PublishConfig, PublishError};
use crate::guard::{self, GuardConfig};
use crate::registry::VersionEntry;
use hindsight_core::now_ms;

/// The eval gate's settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GateConfig {
    /// Eval set (JSONL, `hindsight eval` format); held out from training.
    pub eval_set: PathBuf,
    /// Evaluate only the first N items.
    #[serde(default)]
    pub max_items: Option<usize>,
    /// Exact-match points (as a fraction: 0.02 = 2 points) the candidate may lose against the
    /// live version and still pass.
    #[serde(default = "default_margin")]
    pub margin: f64,
    /// Samples per item.
    #[serde(default = "default_samples")]
    pub samples: usize,
    /// Sampling temperature (0 = greedy).
    #[serde(default)]
    pub temperature: f64,
    /// Base seed (sample i uses seed + i), the same for candidate and live.
    #[serde(default)]
    pub seed: u64,
    /// Requests in flight per evaluated model.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// `max_tokens` of every eval request.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Per-request timeout in milliseconds.
    #[serde(default = "default_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The forgetting and collapse guard (`[publish.gate.guard]`, on by default).
    #[serde(default)]
    pub guard: GuardConfig,
}

fn default_margin() -> f64 {
    0.02
}
fn default_samples() -> usize {
    1
}
fn default_concurrency() -> usize {
    4
}
fn default_request_timeout_ms() -> u64 {
    120_000
}
impl GateConfig {
    /// A gate on `eval_set` with the defaults (margin 0.02, 1 greedy sample, 4 in flight,
    /// 120 s per request).
    pub fn new(eval_set: impl Into<PathBuf>) -> Self {
        Self {
            eval_set: eval_set.into(),
            max_items: None,
            margin: default_margin(),
            samples: default_samples(),
            temperature: 0.0,
            seed: 0,
            concurrency: default_concurrency(),
            max_tokens: None,
            request_timeout_ms: default_request_timeout_ms(),
            guard: GuardConfig::default(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), PublishError> {
        let bad = |m: &str| Err(PublishError::Config(format!("gate: {m}")));
        if !self.margin.is_finite() || self.margin < 0.0 {
            return bad("margin must be a finite number >= 0");
        }
        if self.samples == 0 || self.concurrency == 0 {
            return bad("samples and concurrency must be at least 1");
        }
        if self.max_items == Some(0) {
            return bad("max_items must be at least 1");
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature must be a finite number >= 0");
        }
        self.guard.validate()
    }
}

/// The gate's decision, with the scores it rests on.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum GateVerdict {
    /// The candidate is not worse than live by more than the margin.
    Accepted {
        /// Candidate exact match (0..1).
        candidate: f64,
        /// Live (or base) exact match.
        live: f64,
        /// candidate − live.
        delta: f64,
        /// Items evaluated.
        items: usize,
    },
    /// The candidate lost more than the margin on the task set, or failed the forgetting and
    /// collapse guard.
    Rejected {
        /// Candidate exact match (0..1).
        candidate: f64,
        /// Live (or base) exact match.
        live: f64,
        /// candidate − live.
        delta: f64,
        /// Items evaluated.
        items: usize,
        /// Each failed check, in words (`task: …`, `forgetting: …`, `collapse: …`).
        reasons: Vec<String>,
    },
}

impl GateVerdict {
    /// Whether the candidate passed.
    pub fn accepted(&self) -> bool {
        matches!(self, GateVerdict::Accepted { .. })
    }

    /// `accepted` or `rejected` (the metric label).
    pub fn as_str(&self) -> &'static str {
        if self.accepted() {
            "accepted"
        } else {
            "rejected"
        }
    }
}

fn run_summary(r: &RunReport) -> Value {
    json!({
        "model": r.model,
        "exact_match": r.metrics.exact_match,
        "field_accuracy": r.metrics.field_accuracy,
        "mean_score": r.metrics.mean_score,
        "request_errors": r.metrics.request_errors,
        "unparseable": r.metrics.unparseable,
        "adapter_versions": r.adapter_versions,
        "duration_ms": r.duration_ms,
    })
}

/// Items the live model passed more often than the candidate, with both answers (first
/// sample, truncated), so an operator sees what broke.
fn regressions(cand: &RunReport, live: &RunReport) -> Vec<Value> {
    const MAX: usize = 10;
    let text = |o: &hindsight_eval::ItemOutcome| -> String {
        o.samples
            .first()
            .and_then(|s| s.content.as_deref())
            .unwrap_or("")
            .chars()
            .take(200)
            .collect()
    };
    cand.items
        .iter()
        .zip(&live.items)
        .filter(|(c, l)| c.pass_rate < l.pass_rate)
        .take(MAX)
        .map(|(c, l)| json!({"id": c.id, "live_answer": text(l), "candidate_answer": text(c)}))
        .collect()
}

/// Runs the gate: candidate (`<name>-candidate`) and reference (`live_model`) evaluated at
/// the same time on the first endpoint, same items, seed and settings; with the guard on,
/// the candidate and `base_model` on the capability set at the same time too.
pub(super) async fn run_gate(
    gate: &GateConfig,
    cfg: &PublishConfig,
    entry: &VersionEntry,
    (live_model, live_version): (&str, Option<u64>),
    base_model: &str,
) -> Result<(GateVerdict, Value), PublishError> {
    let mut set = EvalSet::load(&gate.eval_set)?;
    if let Some(n) = gate.max_items {
        set.truncate(n);
    }
    let capability = match gate.guard.enabled {
        true => Some(gate.guard.capability_set()?),
        false => None,
    };
    let endpoint = cfg.endpoints.first().cloned().unwrap_or_default();
    let run_cfg = |model: &str| {
        let mut r = RunConfig::new(endpoint.clone(), model);
        r.api_key = cfg.api_key.clone();
        r.samples = gate.samples;
        r.pass_k = vec![1];
        r.temperature = gate.temperature;
        r.seed = gate.seed;
        r.max_tokens = gate.max_tokens;
        r.concurrency = gate.concurrency;
        r.request_timeout_ms = gate.request_timeout_ms;
        r.progress = false;
        r
    };
    let cand_name = candidate_name(&entry.name);
    let cand_cfg = run_cfg(&cand_name);
    let live_cfg = run_cfg(live_model);
    let guarded = async {
        match &capability {
            Some(set) => guard::run(&gate.guard, set, &run_cfg, &cand_name, base_model)
                .await
                .map(Some),
            None => Ok(None),
        }
    };
    let (cand, live, capability) = tokio::join!(
        evaluate(&set, &cand_cfg),
        evaluate(&set, &live_cfg),
        guarded
    );
    let (cand, live, capability) = (cand?, live?, capability?);
    let (c, l) = (cand.metrics.exact_match, live.metrics.exact_match);
    let delta = c - l;
    let items = cand.metrics.items;
    let mut reasons = Vec::new();
    // A hair of tolerance so equal scores never fail a zero margin through rounding.
    if c + 1e-9 < l - gate.margin {
        reasons.push(format!(
            "task: exact match {:.1}% < live {:.1}% − margin {:.1} points",
            c * 100.0,
            l * 100.0,
            gate.margin * 100.0
        ));
    }
    let guard_json = capability.map(|(cand_runs, base_runs)| {
        let report = guard::judge(&gate.guard, &cand_runs, &base_runs);
        reasons.extend(report.reasons);
        report.json
    });
    let verdict = if reasons.is_empty() {
        GateVerdict::Accepted {
            candidate: c,
            live: l,
            delta,
            items,
        }
    } else {
        GateVerdict::Rejected {
            candidate: c,
            live: l,
            delta,
            items,
            reasons,
        }
    };
    let mut live_json = run_summary(&live);
    live_json["version"] = json!(live_version);
    let per_item: Vec<Value> = cand
        .items
        .iter()
        .zip(&live.items)
        .map(|(c, l)| json!({"id": c.id, "candidate": c.pass_rate, "live": l.pass_rate}))
        .collect();
    let eval = json!({
        "schema": "hindsight.learner.gate/v1",
        "verdict": verdict.as_str(),
        "margin": gate.margin,
        "delta": delta,
        "items": items,
        "set": {"name": cand.set.name, "path": cand.set.path, "sha256": cand.set.sha256},
        "endpoint": endpoint,
        "seed": gate.seed,
        "samples": gate.samples,
        "temperature": gate.temperature,
        "max_tokens": gate.max_tokens,
        "candidate": run_summary(&cand),
        "live": live_json,
        "per_item": per_item,
        "regressions": regressions(&cand, &live),
        "guard": guard_json,
        "evaluated_at_ms": now_ms(),
    });
    Ok((verdict, eval))
}
