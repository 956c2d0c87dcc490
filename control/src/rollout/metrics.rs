//! Online metrics per rollout arm, from `hindsight.interactions` and `hindsight.feedback`.
//!
//! Every interaction whose record carries a rollout assignment (arm `stable` or `canary`;
//! pinned traffic is excluded, it was not randomised) is an exposure of its arm. What the
//! interaction itself shows is counted at once: upstream errors and timeouts, latency, answer
//! length in tokens, tool calls per turn, empty or unparseable answers. What depends on
//! feedback is counted only once the exposure has *matured* (`maturation_ms` after it
//! happened), with whatever feedback arrived by then: negative feedback (thumbs down or a
//! correction), positive feedback, corrections, mean score, failed tool outcomes. So fresh
//! canary traffic, which has had no time to collect complaints, does not look better than old
//! stable traffic. Feedback arriving after maturation is counted as late and ignored.

use std::collections::{HashMap, HashSet, VecDeque};

use hindsight_feedback::{FeedbackRecord, FeedbackTarget, FeedbackValue, InteractionRecord};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use super::stats::{BoundedMeanArm, RateArm, StatsError};

/// Bounds of the real-valued metrics (values outside are clamped; see `stats`).
#[derive(Debug, Clone, Copy)]
pub struct MetricBounds {
    /// Latency upper bound (the upstream timeout is the honest choice).
    pub latency_ms: f64,
    /// Answer length upper bound, in tokens.
    pub length_tokens: f64,
    /// Tool calls per turn upper bound.
    pub tool_calls: f64,
    /// Turns per episode upper bound.
    pub turns: f64,
    /// A call slower than this counts as slow (the tail-latency guard).
    pub slow_ms: f64,
}

/// One arm's metrics.
#[derive(Debug, Clone)]
pub struct ArmMetrics {
    /// The version this arm served.
    pub version: String,
    /// Exposures (interactions) seen.
    pub exposures: u64,
    /// Upstream error or timeout (status ≥ 500 or a proxy-side error), per exposure.
    pub errors: RateArm,
    /// Empty or unparseable answers, per successful exposure.
    pub empty: RateArm,
    /// End-to-end latency, ms.
    pub latency_ms: BoundedMeanArm,
    /// Answer length, tokens.
    pub length_tokens: BoundedMeanArm,
    /// Tool calls per turn.
    pub tool_calls: BoundedMeanArm,
    /// Turns per episode, counted when an episode has been quiet for the maturation time.
    pub turns: BoundedMeanArm,
    /// Calls slower than `slow_ms`, per exposure (the tail-latency guard).
    pub slow: RateArm,
    /// Negative feedback (thumbs down or correction), per matured exposure.
    pub negative: RateArm,
    /// Matured exposures with any feedback at all.
    pub matured_with_feedback: u64,
    /// Thumbs up, per matured exposure.
    pub positive: u64,
    /// Corrections, per matured exposure.
    pub corrections: u64,
    /// Failed tool outcomes, per matured exposure.
    pub tool_failures: u64,
    /// Sum and count of scores on matured exposures.
    pub score_sum: f64,
    pub scores: u64,
    /// Latencies kept for p50/p99 (bounded reservoir of the most recent).
    latencies: Vec<f64>,
}

const LATENCY_KEPT: usize = 4_096;

impl ArmMetrics {
    fn new(version: &str, templates: &[BoundedMeanArm; 4]) -> Self {
        Self {
            version: version.to_string(),
            exposures: 0,
            errors: RateArm::default(),
            empty: RateArm::default(),
            latency_ms: templates[0],
            length_tokens: templates[1],
            tool_calls: templates[2],
            turns: templates[3],
            slow: RateArm::default(),
            negative: RateArm::default(),
            matured_with_feedback: 0,
            positive: 0,
            corrections: 0,
            tool_failures: 0,
            score_sum: 0.0,
            scores: 0,
            latencies: Vec::new(),
        }
    }

    /// Matured exposures.
    pub fn matured(&self) -> u64 {
        self.negative.exposures
    }

    /// The latency quantile `q` of the recent exposures, ms.
    pub fn latency_quantile(&self, q: f64) -> Option<f64> {
        if self.latencies.is_empty() {
            return None;
        }
        let mut v = self.latencies.clone();
        v.sort_by(f64::total_cmp);
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        v.get(i).copied()
    }

    /// A JSON summary (for status, the audit record and the admin API).
    pub fn summary(&self) -> Value {
        let rate = |r: &RateArm| r.rate();
        let per = |n: u64| (self.matured() > 0).then(|| n as f64 / self.matured() as f64);
        serde_json::json!({
            "version": self.version,
            "exposures": self.exposures,
            "matured": self.matured(),
            "feedback_coverage": per(self.matured_with_feedback),
            "negative_rate": rate(&self.negative),
            "positive_rate": per(self.positive),
            "correction_rate": per(self.corrections),
            "tool_failure_rate": per(self.tool_failures),
            "mean_score": (self.scores > 0).then(|| self.score_sum / self.scores as f64),
            "error_rate": rate(&self.errors),
            "empty_rate": rate(&self.empty),
            "latency_p50_ms": self.latency_quantile(0.5),
            "latency_p99_ms": self.latency_quantile(0.99),
            "mean_latency_ms": self.latency_ms.mean(),
            "mean_length_tokens": self.length_tokens.mean(),
            "tool_calls_per_turn": self.tool_calls.mean(),
            "turns_per_episode": self.turns.mean(),
            "slow_rate": self.slow.rate(),
        })
    }
}

/// An exposure waiting for its feedback to mature.
#[derive(Debug)]
struct Pending {
    key: ArmKey,
    at_ms: i64,
    episode: String,
    negative: bool,
    any_feedback: bool,
    positive: bool,
    correction: bool,
    tool_failure: bool,
    scores: Vec<f64>,
}

/// (route, rollout id, arm).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ArmKey {
    pub route: String,
    pub rollout_id: String,
    pub arm: String,
}

/// Every arm's metrics, fed from the two topics.
pub struct OnlineMetrics {
    templates: [BoundedMeanArm; 4],
    slow_ms: f64,
    /// (arm, episode) → (turns, last exposure time) of episodes still open.
    episodes: HashMap<(ArmKey, String), (u64, i64)>,
    maturation_ms: i64,
    arms: HashMap<ArmKey, ArmMetrics>,
    pending: HashMap<Uuid, Pending>,
    by_episode: HashMap<String, HashSet<Uuid>>,
    /// Feedback read before its interaction: (target, value, event time), oldest first.
    orphans: HashMap<String, Vec<(FeedbackTarget, FeedbackValue, i64)>>,
    /// Waiting feedback's keys in arrival order, for expiry.
    orphan_order: VecDeque<(String, i64)>,
    /// Feedback that never found a pending exposure (it came after maturation, or concerns
    /// traffic outside any rollout).
    pub late_feedback: u64,
}

/// Feedback kept waiting for its interaction, at most.
const ORPHANS_KEPT: usize = 100_000;

impl OnlineMetrics {
    /// Metrics with these bounds and maturation time (bounds must be finite and positive).
    pub fn new(bounds: MetricBounds, maturation_ms: i64) -> Result<Self, StatsError> {
        let templates = [
            BoundedMeanArm::new(0.0, bounds.latency_ms)?,
            BoundedMeanArm::new(0.0, bounds.length_tokens)?,
            BoundedMeanArm::new(0.0, bounds.tool_calls)?,
            BoundedMeanArm::new(0.0, bounds.turns)?,
        ];
        Ok(Self {
            templates,
            slow_ms: bounds.slow_ms,
            episodes: HashMap::new(),
            maturation_ms,
            arms: HashMap::new(),
            pending: HashMap::new(),
            by_episode: HashMap::new(),
            orphans: HashMap::new(),
            orphan_order: VecDeque::new(),
            late_feedback: 0,
        })
    }

    /// The arm's metrics, if it has seen traffic.
    pub fn arm(&self, route: &str, rollout_id: &str, arm: &str) -> Option<&ArmMetrics> {
        self.arms.get(&ArmKey {
            route: route.into(),
            rollout_id: rollout_id.into(),
            arm: arm.into(),
        })
    }

    /// The arm and version that served `interaction`, while its exposure waits to mature.
    pub fn arm_of(&self, interaction: &Uuid) -> Option<(&ArmKey, &str)> {
        let key = &self.pending.get(interaction)?.key;
        Some((key, self.arms.get(key)?.version.as_str()))
    }

    /// Counts an interaction (ignored unless it carries a stable/canary rollout assignment).
    pub fn interaction(&mut self, rec: &InteractionRecord) {
        let Some(a) = &rec.assignment else { return };
        let (Some(rollout_id), "stable" | "canary") = (&a.rollout_id, a.arm.as_str()) else {
            return;
        };
        let key = ArmKey {
            route: a.route.clone(),
            rollout_id: rollout_id.clone(),
            arm: a.arm.clone(),
        };
        let templates = &self.templates;
        let m = self
            .arms
            .entry(key.clone())
            .or_insert_with(|| ArmMetrics::new(&a.version, templates));
        m.exposures += 1;
        let failed =
            rec.status >= 500 || rec.status == 0 || (rec.error.is_some() && rec.status >= 400);
        m.errors.record(failed);
        m.latency_ms.record(rec.timings.total_ms);
        m.slow.record(rec.timings.total_ms > self.slow_ms);
        let open = self
            .episodes
            .entry((key.clone(), rec.episode_id.clone()))
            .or_insert((0, rec.event_time_ms));
        open.0 += 1;
        open.1 = open.1.max(rec.event_time_ms);
        if m.latencies.len() >= LATENCY_KEPT {
            m.latencies.remove(0);
        }
        m.latencies.push(rec.timings.total_ms);
        if !failed {
            let (empty, length, tools) = answer_shape(rec.response.as_ref());
            m.empty.record(empty);
            m.length_tokens.record(length);
            m.tool_calls.record(tools);
        }
        self.by_episode
            .entry(rec.episode_id.clone())
            .or_default()
            .insert(rec.interaction_id);
        self.pending.insert(
            rec.interaction_id,
            Pending {
                key,
                at_ms: rec.event_time_ms,
                episode: rec.episode_id.clone(),
                negative: false,
                any_feedback: false,
                positive: false,
                correction: false,
                tool_failure: false,
                scores: Vec::new(),
            },
        );
        self.adopt_orphans(rec.interaction_id, &rec.episode_id);
    }

    /// Attaches feedback to the pending exposures it targets. Feedback read before its
    /// interaction (the two topics are read side by side, in no order across them) waits,
    /// bounded, for the interaction to arrive.
    pub fn feedback(&mut self, rec: &FeedbackRecord) {
        if !self.attach(&rec.target, &rec.value) {
            if self.orphan_order.len() >= ORPHANS_KEPT {
                self.expire_orphans(i64::MIN, 1);
            }
            let key = rec.target.key();
            self.orphans.entry(key.clone()).or_default().push((
                rec.target.clone(),
                rec.value.clone(),
                rec.event_time_ms,
            ));
            self.orphan_order.push_back((key, rec.event_time_ms));
        }
    }

    /// Applies one feedback value to the pending exposures of `target`; false if none.
    fn attach(&mut self, target: &FeedbackTarget, value: &FeedbackValue) -> bool {
        let ids: Vec<Uuid> = match target {
            FeedbackTarget::Interaction(id) => vec![*id],
            FeedbackTarget::Episode(e) => self
                .by_episode
                .get(e)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default(),
        };
        let mut matched = false;
        for id in ids {
            let Some(p) = self.pending.get_mut(&id) else {
                continue;
            };
            matched = true;
            p.any_feedback = true;
            match value {
                FeedbackValue::Thumbs(up) => {
                    p.positive |= *up;
                    p.negative |= !*up;
                }
                FeedbackValue::Correction(_) => {
                    p.correction = true;
                    p.negative = true;
                }
                FeedbackValue::Score(s) => p.scores.push(*s),
                FeedbackValue::ToolOutcome(o) => {
                    p.tool_failure |= !tool_succeeded(o);
                }
                FeedbackValue::Comment(_) | FeedbackValue::Retraction => {}
            }
        }
        matched
    }

    /// Applies waiting feedback that targets `interaction_id` or `episode` (episode feedback
    /// keeps waiting: it concerns the episode's later turns too).
    fn adopt_orphans(&mut self, interaction_id: Uuid, episode: &str) {
        if self.orphans.is_empty() {
            return;
        }
        if let Some(waiting) = self.orphans.remove(&interaction_id.to_string()) {
            for (target, value, _) in &waiting {
                self.attach(target, value);
            }
        }
        if let Some(waiting) = self.orphans.get(episode).cloned() {
            for (target, value, _) in &waiting {
                self.attach(target, value);
            }
        }
    }

    /// Drops waiting feedback older than `before` (at least `at_least` entries when that many
    /// wait), counting it as late.
    fn expire_orphans(&mut self, before: i64, at_least: usize) {
        let mut dropped = 0;
        while let Some((key, at)) = self.orphan_order.front().cloned() {
            if at >= before && dropped >= at_least {
                break;
            }
            self.orphan_order.pop_front();
            dropped += 1;
            if let Some(v) = self.orphans.get_mut(&key) {
                let n = v.len();
                v.retain(|o| o.2 != at);
                self.late_feedback += (n - v.len()) as u64;
                if v.is_empty() {
                    self.orphans.remove(&key);
                }
            }
        }
    }

    /// Moves every exposure older than the maturation time into its arm's feedback metrics,
    /// and counts the turns of every episode quiet for that long.
    pub fn mature(&mut self, now_ms: i64) {
        let cutoff = now_ms - self.maturation_ms;
        // Feedback that waited a maturation time plus ten minutes for its interaction is late.
        self.expire_orphans(cutoff - 600_000, 0);
        let closed: Vec<(ArmKey, String)> = self
            .episodes
            .iter()
            .filter(|(_, (_, last))| *last <= cutoff)
            .map(|(k, _)| k.clone())
            .collect();
        for k in closed {
            if let (Some((turns, _)), Some(m)) = (self.episodes.remove(&k), self.arms.get_mut(&k.0))
            {
                m.turns.record(turns as f64);
            }
        }
        let ripe: Vec<Uuid> = self
            .pending
            .iter()
            .filter(|(_, p)| p.at_ms <= cutoff)
            .map(|(id, _)| *id)
            .collect();
        for id in ripe {
            let Some(p) = self.pending.remove(&id) else {
                continue;
            };
            if let Some(set) = self.by_episode.get_mut(&p.episode) {
                set.remove(&id);
                if set.is_empty() {
                    self.by_episode.remove(&p.episode);
                }
            }
            let Some(m) = self.arms.get_mut(&p.key) else {
                continue;
            };
            m.negative.record(p.negative);
            m.matured_with_feedback += u64::from(p.any_feedback);
            m.positive += u64::from(p.positive);
            m.corrections += u64::from(p.correction);
            m.tool_failures += u64::from(p.tool_failure);
            m.scores += p.scores.len() as u64;
            m.score_sum += p.scores.iter().sum::<f64>();
        }
    }
}

fn tool_succeeded(o: &hindsight_feedback::ToolOutcome) -> bool {
    o.success
}

/// (empty or unparseable, length in tokens, tool calls) of a response. Length is the
/// upstream's `usage.completion_tokens` when present, else whitespace-separated words.
fn answer_shape(response: Option<&Value>) -> (bool, f64, f64) {
    let Some(msg) = response.and_then(|r| r.pointer("/choices/0/message")) else {
        return (true, 0.0, 0.0);
    };
    let content = msg.get("content").and_then(Value::as_str).unwrap_or("");
    let tools = msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .map_or(0, Vec::len) as f64;
    let length = response
        .and_then(|r| r.pointer("/usage/completion_tokens"))
        .and_then(Value::as_f64)
        .unwrap_or_else(|| content.split_whitespace().count() as f64);
    (content.trim().is_empty() && tools == 0.0, length, tools)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hindsight_feedback::{AssignmentRecord, Timings, FEEDBACK_SCHEMA};
    use serde_json::json;

    fn interaction(arm: &str) -> InteractionRecord {
        InteractionRecord {
            timings: Timings {
                upstream_headers_ms: 5.0,
                total_ms: 10.0,
            },
            assignment: Some(AssignmentRecord {
                route: "support".into(),
                arm: arm.into(),
                version: "support@2".into(),
                rollout_id: Some("r1".into()),
                probability: 0.5,
            }),
            ..InteractionRecord::chat(
                format!("ep-{}", Uuid::now_v7()),
                json!({}),
                json!({"choices": [{"message": {"content": "two words"}}]}),
                1_000,
            )
        }
    }

    fn thumbs(target: FeedbackTarget, up: bool) -> FeedbackRecord {
        FeedbackRecord {
            schema: FEEDBACK_SCHEMA.into(),
            feedback_id: Uuid::now_v7(),
            target,
            value: FeedbackValue::Thumbs(up),
            metric: None,
            source: None,
            rater: None,
            tags: vec![],
            retracts: None,
            event_time_ms: 1_500,
        }
    }

    fn metrics() -> OnlineMetrics {
        let b = MetricBounds {
            latency_ms: 1000.0,
            length_tokens: 16.0,
            tool_calls: 2.0,
            turns: 8.0,
            slow_ms: 500.0,
        };
        OnlineMetrics::new(b, 100).unwrap()
    }

    #[test]
    fn feedback_read_before_its_interaction_still_counts() {
        let mut m = metrics();
        let a = interaction("canary");
        let b = interaction("canary");
        m.feedback(&thumbs(
            FeedbackTarget::Interaction(a.interaction_id),
            false,
        ));
        m.feedback(&thumbs(FeedbackTarget::Episode(b.episode_id.clone()), true));
        m.interaction(&a);
        m.interaction(&b);
        m.mature(10_000);
        let arm = m.arm("support", "r1", "canary").unwrap();
        assert_eq!(
            (
                arm.matured(),
                arm.matured_with_feedback,
                arm.negative.events,
                arm.positive
            ),
            (2, 2, 1, 1)
        );
        assert_eq!(arm.length_tokens.mean(), Some(2.0));
    }

    #[test]
    fn feedback_that_never_finds_its_interaction_expires_as_late() {
        let mut m = metrics();
        m.feedback(&thumbs(FeedbackTarget::Interaction(Uuid::now_v7()), false));
        m.mature(1_000_000);
        assert_eq!(m.late_feedback, 1);
        assert!(m.orphans.is_empty() && m.orphan_order.is_empty());
    }
}
