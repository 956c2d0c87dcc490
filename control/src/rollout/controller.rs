//! The rollout controller: reads interactions and feedback, keeps the online metrics per arm,
//! and for every running rollout decides — continuously, with anytime-valid tests — whether
//! to roll back (a guard shows harm), freeze or roll back (a drift alarm), advance (the
//! stage's minimums are met and nothing fired; the last stage promotes) or wait (and why).
//! Each decision is a compare-and-set write of the route with its audit record (Redis), also
//! sent to `hindsight.rollouts` (Kafka, through the spilling log so none is lost); the
//! controller's current view of every route is kept in Redis for `hindsight rollout status`.
//!
//! The controller holds no state that is not in Kafka or Redis: on start it re-reads both topics
//! from their beginning (a fresh consumer group), so a restarted controller decides from the
//! same evidence.

use std::time::Duration;

use hindsight_core::now_ms;
use hindsight_feedback::{
    FeedbackRecord, FeedbackTarget, InteractionRecord, LogHandle, Positions, RawRecord, RecordLog,
    Topic, TopicReader, ValidatedLogConfig,
};
use hindsight_routing::{Rollout, RolloutState, RoutingError, RoutingStore};
use serde_json::{json, Value};

use super::config::{DriftPolicy, RolloutConfig};
use super::metrics::{ArmMetrics, OnlineMetrics};
use super::ops::{self, Op};
use super::recent::{RecentFeedback, RecentFeedbackEvent};
use super::stats::{
    guard_verdict, mean_difference_cs, rate_difference_cs, Alpha, Direction, DriftBand, DriftSides,
    DriftVerdict, Interval, Verdict,
};

/// What the controller decided for one rollout at one moment.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Nothing to do yet; the reason says what it waits for.
    Wait(String),
    /// Next stage (or promotion after the last).
    Advance(String),
    /// A guard found harm: all traffic back to stable.
    Rollback(String),
    /// A drift alarm under the `freeze` policy.
    Freeze(String),
}

/// Each arm's counts when the current stage began: a stage's minimums count only what it saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageBase {
    /// Canary exposures and matured exposures with feedback at the stage's start.
    pub canary: (u64, u64),
    /// Stable exposures and matured exposures with feedback at the stage's start.
    pub stable: (u64, u64),
}

impl StageBase {
    /// The counts of `c` and `s` now.
    pub fn of(c: Option<&ArmMetrics>, s: Option<&ArmMetrics>) -> Self {
        let counts =
            |m: Option<&ArmMetrics>| m.map_or((0, 0), |m| (m.exposures, m.matured_with_feedback));
        Self {
            canary: counts(c),
            stable: counts(s),
        }
    }
}

fn interval_json(i: Interval) -> Value {
    json!([i.lo, i.hi])
}

/// Decides for `rollout` from its arms' metrics, returning the decision and the statistics
/// it rests on (per arm summaries, each guard's interval and verdict).
pub fn decide(
    cfg: &RolloutConfig,
    rollout: &Rollout,
    canary: Option<&ArmMetrics>,
    stable: Option<&ArmMetrics>,
    base: StageBase,
    now_ms: i64,
) -> (Decision, Value) {
    let (Some(c), Some(s)) = (canary, stable) else {
        return (
            Decision::Wait("no exposures on one of the arms yet".into()),
            json!({}),
        );
    };
    let Ok(alpha) = Alpha::new(cfg.alpha) else {
        return (
            Decision::Wait(format!("rollout.alpha {} is invalid", cfg.alpha)),
            json!({}),
        );
    };
    let mut tests = serde_json::Map::new();
    let harm = guard_tests(cfg, c, s, alpha, &mut tests);
    let drift = drift_tests(cfg, c, s, alpha, &mut tests);
    let stats = json!({
        "stage": rollout.stage, "weight": rollout.weight,
        "canary": c.summary(), "stable": s.summary(), "guards": tests,
    });
    if !harm.is_empty() {
        return (
            Decision::Rollback(format!("harm: {}", harm.join("; "))),
            stats,
        );
    }
    if !drift.is_empty() {
        let why = format!("behaviour drift: {}", drift.join(", "));
        return match cfg.on_drift {
            DriftPolicy::Freeze => (Decision::Freeze(why), stats),
            DriftPolicy::Rollback => (Decision::Rollback(why), stats),
        };
    }
    let waiting = stage_waits(cfg, rollout, (c, s), base, now_ms);
    if !waiting.is_empty() {
        return (
            Decision::Wait(format!("waiting for {}", waiting.join(", "))),
            stats,
        );
    }
    let next = rollout
        .stages
        .get(rollout.stage + 1)
        .copied()
        .unwrap_or(1.0);
    let what = if next >= 1.0 {
        "promote".to_string()
    } else {
        format!("advance to {next}")
    };
    (
        Decision::Advance(format!(
            "{what}: stage minimums met, no guard or drift alarm"
        )),
        stats,
    )
}

/// The harm guards (negative feedback, errors, latency), each an anytime-valid interval for
/// canary − stable against its non-inferiority margin; returns why each one that fired did.
fn guard_tests(
    cfg: &RolloutConfig,
    c: &ArmMetrics,
    s: &ArmMetrics,
    alpha: Alpha,
    out: &mut serde_json::Map<String, Value>,
) -> Vec<String> {
    let mut harm = Vec::new();
    for (name, diff, margin) in [
        (
            "negative_feedback",
            rate_difference_cs(&c.negative, &s.negative, alpha),
            cfg.negative_feedback_margin,
        ),
        (
            "error_rate",
            rate_difference_cs(&c.errors, &s.errors, alpha),
            cfg.error_rate_margin,
        ),
        (
            "latency_ms",
            mean_difference_cs(&c.latency_ms, &s.latency_ms, alpha),
            cfg.latency_margin_ms,
        ),
        (
            "slow_rate",
            rate_difference_cs(&c.slow, &s.slow, alpha),
            cfg.slow_rate_margin,
        ),
    ] {
        let v = guard_verdict(diff, margin, Direction::HigherIsWorse);
        out.insert(
            name.to_string(),
            json!({"canary_minus_stable": interval_json(diff), "margin": margin, "verdict": format!("{v:?}")}),
        );
        if v == Verdict::Harm {
            harm.push(format!(
                "{name}: canary − stable in [{:.4}, {:.4}], above the margin {margin}",
                diff.lo, diff.hi
            ));
        }
    }
    harm
}

/// The behaviour-drift alarms: answer length and tool calls per turn outside their ratio band,
/// and empty or unparseable answers above stable's rate by the margin; returns those that fired.
fn drift_tests(
    cfg: &RolloutConfig,
    c: &ArmMetrics,
    s: &ArmMetrics,
    alpha: Alpha,
    out: &mut serde_json::Map<String, Value>,
) -> Vec<String> {
    let mut drift = Vec::new();
    for (name, ratio, ca, sa) in [
        (
            "length_tokens",
            cfg.length_ratio,
            &c.length_tokens,
            &s.length_tokens,
        ),
        (
            "tool_calls_per_turn",
            cfg.tool_calls_ratio,
            &c.tool_calls,
            &s.tool_calls,
        ),
        ("turns_per_episode", cfg.turns_ratio, &c.turns, &s.turns),
    ] {
        let v = DriftBand::new(ratio, DriftSides::Both)
            .map(|b| b.verdict_for_arms(ca, sa, alpha))
            .unwrap_or(DriftVerdict::Undecided);
        out.insert(
            name.to_string(),
            json!({"ratio": ratio, "canary_mean": ca.mean(), "stable_mean": sa.mean(), "verdict": format!("{v:?}")}),
        );
        if v == DriftVerdict::Drift {
            drift.push(name.to_string());
        }
    }
    let empty = rate_difference_cs(&c.empty, &s.empty, alpha);
    let v = guard_verdict(empty, cfg.empty_rate_margin, Direction::HigherIsWorse);
    let v = if v == Verdict::Harm {
        DriftVerdict::Drift
    } else {
        DriftVerdict::Undecided
    };
    out.insert(
        "empty_answers".into(),
        json!({"canary_minus_stable": interval_json(empty), "margin": cfg.empty_rate_margin, "verdict": format!("{v:?}")}),
    );
    if v == DriftVerdict::Drift {
        drift.push("empty_answers".into());
    }
    drift
}

/// What the current stage still waits for: its minimum time, and per arm its minimum
/// exposures and matured feedback counted since the stage began.
fn stage_waits(
    cfg: &RolloutConfig,
    rollout: &Rollout,
    (c, s): (&ArmMetrics, &ArmMetrics),
    base: StageBase,
    now_ms: i64,
) -> Vec<String> {
    let mut waiting = Vec::new();
    let in_stage_ms = now_ms - rollout.stage_started_ms;
    if in_stage_ms < cfg.min_stage_ms as i64 {
        waiting.push(format!(
            "stage time {}s of {}s",
            in_stage_ms / 1000,
            cfg.min_stage_ms / 1000
        ));
    }
    for (arm, m, (e0, f0)) in [("canary", c, base.canary), ("stable", s, base.stable)] {
        let (e, f) = (
            m.exposures.saturating_sub(e0),
            m.matured_with_feedback.saturating_sub(f0),
        );
        if e < cfg.min_exposures {
            waiting.push(format!(
                "{arm} exposures this stage {e} of {}",
                cfg.min_exposures
            ));
        }
        if f < cfg.min_matured_feedback {
            waiting.push(format!(
                "{arm} matured feedback this stage {f} of {}",
                cfg.min_matured_feedback
            ));
        }
    }
    waiting
}

/// The controller process.
pub struct Controller {
    cfg: RolloutConfig,
    store: RoutingStore,
    audit: LogHandle,
    metrics: OnlineMetrics,
    /// The adapter registry, which follows each rollout's outcome (when configured).
    registry: Option<crate::registry::Registry>,
    /// (route, rollout id, stage) → counts when the controller first saw that stage.
    stage_bases: std::collections::HashMap<(String, String, usize), StageBase>,
    /// Routes whose decision counters are registered (see [`DECISIONS`]).
    counted_routes: std::collections::HashSet<String>,
    /// The last feedback events read, for the operator page (when the admin API shows them).
    recent_feedback: Option<RecentFeedback>,
}

/// The (action, cause) pairs of `hindsight_rollout_decisions_total` the controller produces,
/// registered at zero per route when it first sees the route: Prometheus's `increase` sees no
/// increase in a counter whose first sample is already 1, so the first rollback would raise no
/// alert.
const DECISIONS: [(&str, &str); 5] = [
    ("advance", "stages"),
    ("rollback", "alarm"),
    ("freeze", "alarm"),
    ("rollback", "superseded"),
    ("start", "queue"),
];

impl Controller {
    /// A controller writing through `store` and auditing to `audit`.
    pub fn new(
        cfg: RolloutConfig,
        store: RoutingStore,
        audit: LogHandle,
    ) -> Result<Self, RoutingError> {
        let metrics = OnlineMetrics::new(cfg.bounds(), cfg.maturation_ms as i64).map_err(|e| {
            RoutingError::Invalid {
                field: "rollout".into(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self {
            cfg,
            store,
            audit,
            metrics,
            registry: None,
            stage_bases: std::collections::HashMap::new(),
            counted_routes: std::collections::HashSet::new(),
            recent_feedback: None,
        })
    }

    /// Keeps `registry` in step with each rollout (`canary` → `live` or `rolled_back`).
    pub fn with_registry(mut self, registry: crate::registry::Registry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Keeps the last feedback events read in `recent` (the operator page's live feedback).
    pub fn with_recent_feedback(mut self, recent: RecentFeedback) -> Self {
        self.recent_feedback = Some(recent);
        self
    }

    /// Writes one decision: the route (compare-and-set), the audit record to Kafka, and the
    /// registry's status of the canary.
    /// Carries out `op` on `route`. `cause` labels `hindsight_rollout_decisions_total`: `alarm`
    /// (a harm guard or drift alarm fired), `stages` (a stage's minimums were met), `queue` (a
    /// queued candidate started) or `superseded` (a newer candidate replaced the canary).
    async fn act(
        &self,
        route: &hindsight_routing::Route,
        op: &Op,
        cause: &'static str,
        reason: &str,
        stats: Value,
    ) -> Result<(), RoutingError> {
        let req = ops::Request {
            route: &route.route,
            by: "controller",
            reason,
            expected_generation: Some(route.generation),
            stats,
        };
        match ops::execute(&self.store, &req, op).await {
            Ok((stored, audit)) => {
                tracing::info!(route = %stored.route, action = op.action(), %reason, "Rollout decision.");
                metrics::counter!(
                    "hindsight_rollout_decisions_total",
                    "route" => stored.route.clone(),
                    "action" => op.action(),
                    "cause" => cause,
                )
                .increment(1);
                if let Some(reg) = &self.registry {
                    if let Err(e) = super::lineage::follow(reg, &stored, &audit).await {
                        tracing::warn!(error = %e, "Could not update the registry after a rollout decision; the next tick reconciles it.");
                    }
                }
                Ok(())
            }
            // An operator acted in between: decide again next tick on the new state.
            Err(RoutingError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Feeds one record read from the interactions or feedback topic.
    pub fn observe(&mut self, topic: Topic, payload: &[u8]) {
        match topic {
            Topic::Interactions => {
                if let Ok(rec) = serde_json::from_slice::<InteractionRecord>(payload) {
                    self.metrics.interaction(&rec);
                }
            }
            Topic::Feedback => {
                if let Ok(rec) = serde_json::from_slice::<FeedbackRecord>(payload) {
                    self.metrics.feedback(&rec);
                    if let Some(recent) = &self.recent_feedback {
                        let exposure = match &rec.target {
                            FeedbackTarget::Interaction(id) => self.metrics.arm_of(id),
                            FeedbackTarget::Episode(_) => None,
                        };
                        let exposure = exposure
                            .map(|(k, version)| (k.route.as_str(), k.arm.as_str(), version));
                        recent.push(RecentFeedbackEvent::of(&rec, exposure));
                    }
                }
            }
            _ => {}
        }
    }

    /// One evaluation of every route, for a caller that has fed every record written so far
    /// (tests feeding records by hand): [`Self::tick_at`] with the wall clock.
    pub async fn tick(&mut self) -> Result<(), RoutingError> {
        self.tick_at(now_ms()).await
    }

    /// One evaluation of every route: mature the exposures whose feedback window has closed
    /// *in what has been read* (`read_until_ms`: every feedback record produced before it has
    /// been observed), decide, act, publish status. Maturing by the wall clock instead would
    /// let a controller catching up on a backlog close old exposures before it has read their
    /// feedback, and count them as feedback-free.
    pub async fn tick_at(&mut self, read_until_ms: i64) -> Result<(), RoutingError> {
        let now = now_ms();
        self.metrics.mature(read_until_ms.min(now));
        for parsed in self.store.load_all().await? {
            let Ok(route) = parsed else { continue };
            if self.counted_routes.insert(route.route.clone()) {
                for (action, cause) in DECISIONS {
                    metrics::counter!(
                        "hindsight_rollout_decisions_total",
                        "route" => route.route.clone(),
                        "action" => action,
                        "cause" => cause,
                    )
                    .increment(0);
                }
            }
            self.mirror_audit(&route.route).await?;
            if let Some(reg) = &self.registry {
                if let Err(e) = super::lineage::reconcile(reg, &route).await {
                    tracing::warn!(error = %e, "Could not bring the registry in line with the rollout; retrying next tick.");
                }
            }
            if let Some(next) = super::queue::next_queued(&self.store, &route).await? {
                let op = Op::Start {
                    canary: next.clone(),
                    stages: self.cfg.stages.clone(),
                    rollout_id: None,
                };
                self.act(
                    &route,
                    &op,
                    "queue",
                    &format!("starting queued candidate {next}"),
                    json!({}),
                )
                .await?;
                continue;
            }
            if let (Some(active), super::config::CandidatePolicy::Supersede) =
                (route.active_rollout(), self.cfg.on_new_candidate)
            {
                if let Some(newer) = self.store.get_queued(&route.route).await? {
                    if newer != active.canary {
                        let why = format!("superseded by the newer candidate {newer}");
                        self.act(&route, &Op::Rollback, "superseded", &why, json!({}))
                            .await?;
                        continue;
                    }
                }
            }
            let Some(rollout) = route.rollout.clone() else {
                continue;
            };
            let c = self.metrics.arm(&route.route, &rollout.id, "canary");
            let s = self.metrics.arm(&route.route, &rollout.id, "stable");
            self.export(&route.route, c, s);
            let base = *self
                .stage_bases
                .entry((route.route.clone(), rollout.id.clone(), rollout.stage))
                .or_insert_with(|| {
                    if rollout.stage == 0 {
                        StageBase::default()
                    } else {
                        StageBase::of(c, s)
                    }
                });
            let (decision, stats) = decide(&self.cfg, &rollout, c, s, base, now);
            let shown = match rollout.state {
                RolloutState::Running => format!("{decision:?}"),
                RolloutState::Paused | RolloutState::Frozen => {
                    format!(
                        "{}: waiting for an operator (resume, promote or rollback)",
                        rollout.state
                    )
                }
                done => format!("finished: {done}"),
            };
            let status = json!({
                "route": route.route, "rollout_id": rollout.id, "state": rollout.state,
                "decision": shown, "stats": stats, "at_ms": now,
            });
            self.store.put_status(&route.route, &status).await?;
            if rollout.state != RolloutState::Running {
                continue;
            }
            let (op, cause, reason) = match decision {
                Decision::Wait(_) => continue,
                Decision::Advance(r) => (Op::Advance, "stages", r),
                Decision::Rollback(r) => (Op::Rollback, "alarm", r),
                Decision::Freeze(r) => (Op::Freeze, "alarm", r),
            };
            self.act(&route, &op, cause, &reason, stats).await?;
        }
        Ok(())
    }

    fn export(&self, route: &str, c: Option<&ArmMetrics>, s: Option<&ArmMetrics>) {
        for (arm, m) in [("canary", c), ("stable", s)] {
            let Some(m) = m else { continue };
            let labels = [("route", route.to_string()), ("arm", arm.to_string())];
            metrics::gauge!("hindsight_rollout_exposures", &labels).set(m.exposures as f64);
            if let Some(r) = m.negative.rate() {
                metrics::gauge!("hindsight_rollout_negative_feedback_rate", &labels).set(r);
            }
            if let Some(r) = m.errors.rate() {
                metrics::gauge!("hindsight_rollout_error_rate", &labels).set(r);
            }
            if let Some(v) = m.latency_quantile(0.99) {
                metrics::gauge!("hindsight_rollout_latency_p99_ms", &labels).set(v);
            }
            if let Some(v) = m.length_tokens.mean() {
                metrics::gauge!("hindsight_rollout_answer_tokens_mean", &labels).set(v);
            }
        }
    }

    /// Copies the route's audit records that Kafka has not had yet — every writer's: the
    /// controller's, operators' (CLI, admin API), the learner's — to `hindsight.rollouts`, in
    /// generation order, through the spilling log (so a broker outage loses none), then records
    /// how far it got in Redis. At least once: a crash between the two re-sends a few records
    /// with the same id (the `hindsight-id` header), which readers drop.
    async fn mirror_audit(&self, route: &str) -> Result<(), RoutingError> {
        let done = self.store.get_mirrored(route).await?;
        let mut fresh: Vec<_> = self
            .store
            .audit(route, hindsight_routing::store::AUDIT_KEPT)
            .await?
            .into_iter()
            .filter(|a| a.generation > done)
            .collect();
        if fresh.is_empty() {
            return Ok(());
        }
        fresh.sort_by_key(|a| a.generation);
        let mut last = done;
        for audit in &fresh {
            match serde_json::to_vec(audit) {
                Ok(bytes) => {
                    let id =
                        uuid::Uuid::parse_str(&audit.id).unwrap_or_else(|_| uuid::Uuid::now_v7());
                    self.audit
                        .submit(Topic::Rollouts, audit.route.clone(), id, bytes.into());
                }
                Err(e) => tracing::error!(error = %e, "Audit record could not be serialised."),
            }
            last = audit.generation;
        }
        self.store.put_mirrored(route, last).await
    }

    /// Reads both topics and ticks every `eval_interval_ms` until `shutdown` resolves.
    pub async fn run(
        mut self,
        log: &ValidatedLogConfig,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), RoutingError> {
        let group = format!("hindsight-rollout-{}", uuid::Uuid::now_v7());
        let reader = TopicReader::new(log, &group, &[Topic::Interactions, Topic::Feedback])
            .map_err(|e| RoutingError::Invalid {
                field: "log".into(),
                reason: e.to_string(),
            })?;
        let names = log.topics().clone();
        let mut progress = ReadProgress::default();
        let mut tick = tokio::time::interval(Duration::from_millis(self.cfg.eval_interval_ms));
        // Fires after a quiet spell with nothing to read.
        let quiet = tokio::time::sleep(QUIET);
        tokio::pin!(shutdown, quiet);
        loop {
            tokio::select! {
                rec = reader.recv() => match rec {
                    Ok(rec) => {
                        let topic = if rec.topic == names.get(Topic::Feedback) {
                            Topic::Feedback
                        } else {
                            Topic::Interactions
                        };
                        progress.read(topic, &rec);
                        self.observe(topic, &rec.payload);
                        quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "Reading the topics failed; retrying.");
                        tokio::time::sleep(QUIET).await;
                    }
                },
                () = &mut quiet => {
                    if !progress.knows_backlog() {
                        // Once, at start: where the backlog ends (until then, quiet proves nothing:
                        // the reader may not have fetched yet).
                        let client = log.client_config();
                        let topics = [Topic::Interactions, Topic::Feedback]
                            .map(|t| names.get(t).to_string());
                        let ends = tokio::task::spawn_blocking(move || {
                            hindsight_feedback::end_offsets(&client, &topics, Duration::from_secs(5))
                        })
                        .await;
                        match ends {
                            Ok(Ok(ends)) => progress.backlog_ends(ends),
                            Ok(Err(e)) => tracing::warn!(error = %e, "Could not read where the topics end; retrying."),
                            Err(e) => tracing::warn!(error = %e, "Could not read where the topics end; retrying."),
                        }
                    }
                    let quiet_ms = i64::try_from(QUIET.as_millis()).unwrap_or(0);
                    progress.quiet_since(now_ms() - quiet_ms);
                    quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
                }
                _ = tick.tick() => {
                    if let Err(e) = self.tick_at(progress.read_until_ms()).await {
                        tracing::warn!(error = %e, "Rollout controller tick failed; retrying next tick.");
                    }
                }
                () = &mut shutdown => return Ok(()),
            }
        }
    }
}

/// How long the reader must find nothing before it counts as caught up.
const QUIET: Duration = Duration::from_millis(200);

/// How far the controller has read the feedback topic, as a time: every feedback record
/// produced before [`ReadProgress::read_until_ms`] has been observed. It is the newest feedback
/// timestamp read (one partition, read in order); and, once the reader has read the whole
/// backlog it started with and then found nothing for a quiet spell, when that spell began, less
/// [`DELIVERY_MARGIN_MS`] for records still in flight.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReadProgress {
    feedback_ms: i64,
    caught_up_ms: i64,
    /// Next offset to read per partition, as far as read.
    next: Positions,
    /// Where each partition ended when the controller started (`None`: not known yet).
    ends: Option<Positions>,
}

/// Produce-to-fetch time allowed for a record written just before a quiet spell.
pub const DELIVERY_MARGIN_MS: i64 = 1_000;

impl ReadProgress {
    /// `rec`, of `topic`, was read.
    pub fn read(&mut self, topic: Topic, rec: &RawRecord) {
        if let (Topic::Feedback, Some(ts)) = (topic, rec.timestamp_ms) {
            self.feedback_ms = self.feedback_ms.max(ts);
        }
        let next = self
            .next
            .entry((rec.topic.clone(), rec.partition))
            .or_insert(0);
        *next = (*next).max(rec.offset + 1);
    }

    /// Whether the backlog's ends are known.
    pub fn knows_backlog(&self) -> bool {
        self.ends.is_some()
    }

    /// Where each partition ended at start.
    pub fn backlog_ends(&mut self, ends: Positions) {
        self.ends = Some(ends);
    }

    /// The reader has found nothing to read since `since_ms`: if it has read the whole backlog,
    /// it has read everything produced before then.
    pub fn quiet_since(&mut self, since_ms: i64) {
        let Some(ends) = &self.ends else { return };
        let done = ends
            .iter()
            .all(|(k, end)| self.next.get(k).copied().unwrap_or(0) >= *end);
        if done {
            self.caught_up_ms = self.caught_up_ms.max(since_ms - DELIVERY_MARGIN_MS);
        }
    }

    /// Every feedback record produced before this time has been read.
    pub fn read_until_ms(&self) -> i64 {
        self.feedback_ms.max(self.caught_up_ms)
    }
}

/// Starts the audit log (the spilling Kafka producer) for a controller or an operator command.
pub async fn audit_log(
    log: ValidatedLogConfig,
) -> Result<(RecordLog, LogHandle), hindsight_feedback::LogError> {
    RecordLog::start(log).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(topic: &str, offset: i64, ts: i64) -> RawRecord {
        RawRecord {
            topic: topic.into(),
            partition: 0,
            offset,
            key: None,
            id: None,
            payload: bytes::Bytes::new(),
            timestamp_ms: Some(ts),
        }
    }

    #[test]
    fn read_progress_follows_feedback_read_not_the_clock() {
        let mut p = ReadProgress::default();
        assert_eq!(p.read_until_ms(), 0, "nothing read: nothing may mature");
        p.quiet_since(100_000);
        assert_eq!(
            p.read_until_ms(),
            0,
            "quiet before the backlog is known proves nothing"
        );
        let ends = Positions::from([(("i".into(), 0), 1), (("f".into(), 0), 2)]);
        p.backlog_ends(ends);
        p.read(Topic::Interactions, &record("i", 0, 50_000));
        assert_eq!(
            p.read_until_ms(),
            0,
            "interactions say nothing about feedback"
        );
        p.read(Topic::Feedback, &record("f", 0, 10_000));
        assert_eq!(p.read_until_ms(), 10_000);
        p.quiet_since(100_000);
        assert_eq!(
            p.read_until_ms(),
            10_000,
            "quiet inside the backlog proves nothing"
        );
        p.read(Topic::Feedback, &record("f", 1, 20_000));
        p.quiet_since(100_000);
        assert_eq!(p.read_until_ms(), 100_000 - DELIVERY_MARGIN_MS);
        p.read(Topic::Feedback, &record("f", 2, 30_000));
        assert_eq!(
            p.read_until_ms(),
            100_000 - DELIVERY_MARGIN_MS,
            "never backwards"
        );
    }
}
