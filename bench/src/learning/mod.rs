//! The learning-curve harness: the whole Hindsight loop in one process, on the real model and
//! the real broker and Redis — `hindsight serve` (the agent's model), the capturing proxy with
//! the feedback webhook, the joiner, the learner (registry + publishing), and the simulated
//! support environment sending traffic and feedback through the proxy — measured with
//! `hindsight eval` on the held-out eval split after every K feedback events.
//!
//! Used by `cargo bench -p hindsight-bench --bench learning_curve` (all objective
//! configurations, JSON + PNG) and by the small learning test in `bench/tests/learning.rs`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hindsight_control::guard::{answer_drift, builtin_capability_set, Drift, GuardConfig};
use hindsight_eval::{
    compare_runs, evaluate, extract_json_answer, score_answer, Comparison, EvalSet, RunConfig,
    RunReport,
};
use hindsight_learner::online::{spawn_learner, LearnerControl, LearnerEvent, LearnerSummary};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::prior_probe::{PriorMargins, PriorProbe};
use services::{learner_setup, services_listen, start_capture, start_serve, unique, SECRET};

mod config;
mod plot;
mod rule_change;
mod services;
#[cfg(test)]
mod tests;

pub use config::{BenchFile, LearningConfig, Objective, RuleChange, Scenario};
use hindsight_sim::{
    eval_items_under, run_env, EnvRunConfig, EnvRunSummary, FeedbackConfig, PromptOptions, Records,
    Sop, Split, UserConfig, World,
};
pub use plot::plot;
pub use rule_change::{events_to_new_rule, RuleChangeMeter, RuleChangeScore};

/// One point of the curve.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CurvePoint {
    /// Feedback events sent so far.
    pub events: u64,
    /// Examples the learner trained on so far.
    pub examples: u64,
    /// Eval exact match (0..1).
    pub exact_match: f64,
    /// Eval per-field accuracy.
    pub field_accuracy: Option<f64>,
    /// Exact match on the first `train_eval_items` training tickets (when asked for).
    #[serde(default)]
    pub train_exact_match: Option<f64>,
    /// Field accuracy on those training tickets.
    #[serde(default)]
    pub train_field_accuracy: Option<f64>,
    /// Distinct decisions among the held-out answers (each answer projected on the decision's
    /// fields; unparseable answers count as one more): 1 means the same answer to every ticket.
    #[serde(default)]
    pub distinct_answers: Option<usize>,
    /// Share of held-out tickets that got the most common of those decisions.
    #[serde(default)]
    pub top_answer_share: Option<f64>,
    /// Exact match on the held-out tickets whose decision is *not* the constant answer: what
    /// always giving the most common decision scores 0 on, so what only rules learned can
    /// raise (older files lack it).
    #[serde(default)]
    pub exact_beyond_constant: Option<f64>,
    /// [`PriorProbe`] on the held-out tickets whose decision is not the constant answer: mean
    /// log p(correct) − log p(constant answer). Down = the prior learned, up = tickets told
    /// apart.
    #[serde(default)]
    pub prior_margin: Option<f64>,
    /// The same on the trained tickets scored (`train_eval_items`).
    #[serde(default)]
    pub train_prior_margin: Option<f64>,
    /// Positions (in eval-set order) of the held-out tickets answered exactly right, so any
    /// prefix of the set can be scored afterwards: the eval set is the first `eval_items`
    /// tickets of the held-out split, so a longer set starts with every shorter one (older
    /// files lack it).
    #[serde(default)]
    pub passed: Vec<usize>,
    /// Adapter version evaluated (`None` = base).
    pub version: Option<u64>,
    /// Seconds since the run started.
    pub wall_s: f64,
    /// In a changing-rule run: the affected tickets' answers by the new and the old rule, and
    /// exact match on the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_change: Option<RuleChangeScore>,
}

impl CurvePoint {
    /// Exact match on the first `n` held-out tickets, from [`CurvePoint::passed`].
    pub fn exact_on_first(&self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        self.passed.iter().filter(|&&i| i < n).count() as f64 / n as f64
    }
}

/// Held-out tickets of the runs before 2026-12-05 (docs/experiments/): a run on more
/// tickets also reports its figures on these, which it starts with.
pub const HISTORY_EVAL_ITEMS: usize = 20;

/// Positions of the items of `report` that passed every sample.
fn passed_items(report: &RunReport) -> Vec<usize> {
    report
        .items
        .iter()
        .enumerate()
        .filter(|(_, o)| o.pass_rate >= 1.0)
        .map(|(i, _)| i)
        .collect()
}

/// `report` restricted to the first `n` items of `set` (by id), for a paired comparison on
/// a prefix of the eval set.
fn first_items(set: &EvalSet, report: &RunReport, n: usize) -> RunReport {
    let ids: std::collections::HashSet<&str> =
        set.items.iter().take(n).map(|i| i.id.as_str()).collect();
    let mut out = report.clone();
    out.items.retain(|o| ids.contains(o.id.as_str()));
    out
}

/// The prompts of the learning runs: single-turn tickets, no rules, guided JSON (the
/// defaults) with `records`.
pub fn single_turn(records: Records) -> PromptOptions {
    PromptOptions {
        records,
        ..PromptOptions::default()
    }
}

/// Training tickets the constant baseline is drawn from.
pub const CONSTANT_BASELINE_TICKETS: usize = 1000;

/// The best a learner that ignores the ticket can do: give every ticket the training split's
/// most common decision. Critiques name the common values (`"refund": "none"`, `"priority":
/// "normal"`) most often, so a student that learns only that prior lifts exact match and
/// field accuracy without having learned a single rule; a curve has to rise above this line
/// to show rules learned.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConstantBaseline {
    /// The decision: the most common among [`CONSTANT_BASELINE_TICKETS`] training tickets.
    pub answer: serde_json::Value,
    /// Its share of those training tickets.
    pub train_share: f64,
    /// Exact match of always answering it, on the held-out eval items.
    pub exact_match: f64,
    /// Field accuracy of always answering it, on the held-out eval items.
    pub field_accuracy: f64,
    /// Exact match on the scored training tickets (when `train_eval_items` > 0).
    pub train_exact_match: Option<f64>,
    /// Field accuracy on the scored training tickets.
    pub train_field_accuracy: Option<f64>,
}

impl ConstantBaseline {
    /// The training split's most common decision, scored on `eval` (and `trained`) with the
    /// eval's own scorer.
    pub fn compute(
        world: &World,
        options: PromptOptions,
        sop: &Sop,
        eval: &EvalSet,
        trained: Option<&EvalSet>,
    ) -> anyhow::Result<Self> {
        let train = eval_items_under(world, Split::Train, CONSTANT_BASELINE_TICKETS, options, sop);
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for item in &train {
            *counts
                .entry(serde_json::to_string(&item.expected)?)
                .or_default() += 1;
        }
        // Ties go to the first decision in key order, so the choice is deterministic.
        let (text, n) = counts
            .iter()
            .fold(None::<(&String, usize)>, |best, (k, &n)| match best {
                Some((_, m)) if m >= n => best,
                _ => Some((k, n)),
            })
            .context("no training tickets")?;
        let score = |set: &EvalSet| {
            let scores: Vec<_> = set
                .items
                .iter()
                .map(|it| score_answer(it.scorer, &it.expected, text, true))
                .collect();
            let len = scores.len().max(1) as f64;
            (
                scores.iter().filter(|s| s.passed).count() as f64 / len,
                scores
                    .iter()
                    .map(|s| s.field_accuracy.unwrap_or(0.0))
                    .sum::<f64>()
                    / len,
            )
        };
        let (exact_match, field_accuracy) = score(eval);
        let trained = trained.map(score);
        Ok(Self {
            answer: serde_json::from_str(text)?,
            train_share: n as f64 / train.len().max(1) as f64,
            exact_match,
            field_accuracy,
            train_exact_match: trained.map(|t| t.0),
            train_field_accuracy: trained.map(|t| t.1),
        })
    }
}

/// How varied a run's answers are: (distinct decisions, share of the most common one), each
/// answer projected on the fields of its item's expected decision; `None` without answers.
pub fn answer_spread(set: &EvalSet, report: &RunReport) -> Option<(usize, f64)> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for (item, outcome) in set.items.iter().zip(&report.items) {
        for sample in &outcome.samples {
            let key = match (sample.content.as_deref(), item.expected.as_object()) {
                (Some(content), Some(expected)) => {
                    match extract_json_answer(content, item.response_format.is_some()) {
                        Ok(answer) => {
                            let decision: BTreeMap<&str, &serde_json::Value> = expected
                                .keys()
                                .map(|k| {
                                    (
                                        k.as_str(),
                                        answer.get(k).unwrap_or(&serde_json::Value::Null),
                                    )
                                })
                                .collect();
                            serde_json::to_string(&decision).unwrap_or_default()
                        }
                        Err(_) => "<unparseable>".to_string(),
                    }
                }
                _ => "<no answer>".to_string(),
            };
            *counts.entry(key).or_default() += 1;
        }
    }
    let total: usize = counts.values().sum();
    let top = counts.values().copied().max()?;
    Some((counts.len(), top as f64 / total as f64))
}

/// Exact match on the items whose expected decision (its fields) differs from `constant`, and
/// how many such items there are; `None` when there are none.
pub fn exact_beyond_constant(
    set: &EvalSet,
    report: &RunReport,
    constant: &serde_json::Value,
) -> Option<(f64, usize)> {
    let pass = report.items.iter().map(|o| o.pass_rate);
    beyond_constant(set.items.iter().map(|i| &i.expected).zip(pass), constant)
}

/// [`exact_beyond_constant`] over (expected answer, pass rate) pairs.
fn beyond_constant<'a>(
    items: impl Iterator<Item = (&'a serde_json::Value, f64)>,
    constant: &serde_json::Value,
) -> Option<(f64, usize)> {
    let (mut n, mut right) = (0usize, 0.0);
    for (expected, pass_rate) in items {
        let Some(expected) = expected.as_object() else {
            continue;
        };
        if expected.iter().all(|(k, v)| constant.get(k) == Some(v)) {
            continue;
        }
        n += 1;
        right += pass_rate;
    }
    (n > 0).then(|| (right / n as f64, n))
}

/// A finished run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LearningReport {
    /// The settings.
    pub config: LearningConfig,
    /// The curve, starting with the base model at 0 events.
    pub points: Vec<CurvePoint>,
    /// What always giving the most common training decision scores (older files lack it).
    #[serde(default)]
    pub constant_baseline: Option<ConstantBaseline>,
    /// Exact match of the traffic itself (the agent's answers during learning), per chunk.
    pub traffic_exact_match: Vec<f64>,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Where the wall time went (older files lack it).
    #[serde(default)]
    pub phases: PhaseTimes,
    /// Seconds spent in training steps.
    pub train_s: f64,
    /// Tokens processed by the trainer.
    pub train_tokens: u64,
    /// Trainer throughput, tokens per second of step time.
    pub train_tokens_per_s: f64,
    /// Replay steps taken besides the steps on new examples.
    #[serde(default)]
    pub replay_steps: u64,
    /// The learner's totals.
    pub learner: Option<serde_json::Value>,
    /// The last point against the base model on the same held-out tickets: the paired exact
    /// match difference with its 95% interval (what `hindsight eval --compare` reports), which
    /// says whether a gain is beyond the noise of which tickets happened to be drawn.
    #[serde(default)]
    pub held_out_vs_base: Option<Comparison>,
    /// The same on the scored training tickets (when `train_eval_items` > 0): fit.
    #[serde(default)]
    pub trained_vs_base: Option<Comparison>,
    /// [`LearningReport::held_out_vs_base`] on the first [`HISTORY_EVAL_ITEMS`] tickets, when
    /// the run scored more: the figure comparable with the older runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_vs_base: Option<Comparison>,
    /// Forgetting: the last version against the base model on the eval gate's capability set
    /// (general questions and formats the learner never trains on, greedy, with the guard's
    /// settings), paired by item. The gate rejects a candidate whose exact match there falls
    /// more than `capability_margin` below the base's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability_vs_base: Option<Comparison>,
    /// Drift: the base model's greedy capability answers scored under the last version and
    /// under the base (the gate rejects a drop over `max_logprob_drop` nats per token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability_drift: Option<Drift>,
    /// In a changing-rule run: feedback events after the change until the affected held-out
    /// tickets follow the new rule for good ([`events_to_new_rule`]); `None` when the run never
    /// got there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_to_new_rule: Option<u64>,
    /// In a changing-rule run: exact match on the held-out tickets the change leaves alone,
    /// the last version against the one evaluated at the change, paired (retention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_since_change: Option<Comparison>,
}

/// Wall seconds by phase of a run (they add up to about `wall_s`; the learner trains during
/// `traffic_s` too, so `catch_up_s` is only what it still had left when the traffic ended).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PhaseTimes {
    /// Loading the eval sets, the prior probe and serve, before the first measurement.
    pub setup_s: f64,
    /// Measuring the base model and every candidate: held-out (and trained) eval runs through
    /// serve, the prior probe.
    pub eval_s: f64,
    /// Greedy capability-set runs (base and last version).
    pub capability_s: f64,
    /// Sending the traffic chunks with their feedback through the proxy.
    pub traffic_s: f64,
    /// After each chunk: waiting for the learner to take in its feedback and register the
    /// candidate.
    pub catch_up_s: f64,
}

impl LearningReport {
    /// Last minus first exact match.
    pub fn gain(&self) -> f64 {
        match (self.points.first(), self.points.last()) {
            (Some(a), Some(b)) => b.exact_match - a.exact_match,
            _ => 0.0,
        }
    }
}

/// Runs one configuration end to end: the base model measured, then chunks of traffic with
/// feedback through the proxy, each followed by a candidate snapshot and its measurement.
pub async fn run_learning(cfg: LearningConfig) -> anyhow::Result<LearningReport> {
    let sc = &cfg.scenario;
    check_ready(&cfg).await?;
    std::fs::create_dir_all(&cfg.work_dir)?;
    let started = Instant::now();
    let options = single_turn(sc.records);
    let world = World::new(sc.seed);
    // The held-out tickets are scored by the SOP in force at the end (after a rule change).
    let sop = sc.final_sop();
    let set = EvalSet::from_items(
        "support-eval",
        eval_items_under(&world, Split::Eval, sc.eval_items, options, &sop),
    )?;

    let train_set = match sc.train_eval_items {
        0 => None,
        n => Some(EvalSet::from_items(
            "support-trained",
            eval_items_under(&world, Split::Train, n, options, &sop),
        )?),
    };

    let constant_baseline =
        ConstantBaseline::compute(&world, options, &sop, &set, train_set.as_ref())?;
    let rule_change = sc.rule_change.map(|c| {
        RuleChangeMeter::new(
            world.tickets(Split::Eval, sc.eval_items),
            Sop::default(),
            c.new_sop(),
        )
    });
    let probe = prior_probe(&cfg, &set, train_set.as_ref(), &constant_baseline)?;
    let (serve_url, base_name, stop_serve) = start_serve(cfg.model_path()).await?;
    let capability = builtin_capability_set()?;
    let mut phases = PhaseTimes {
        setup_s: started.elapsed().as_secs_f64(),
        ..PhaseTimes::default()
    };
    let meter = Meter {
        set: &set,
        train_set: train_set.as_ref(),
        capability: &capability,
        constant: &constant_baseline.answer,
        probe,
        serve_url: &serve_url,
        rule_change: rule_change.as_ref(),
    };
    let t = Instant::now();
    let base = meter.measure(&base_name, None).await?;
    phases.eval_s += t.elapsed().as_secs_f64();
    let t = Instant::now();
    let base_capability = if cfg.objective == Objective::None {
        None
    } else {
        Some(meter.capability(&base_name).await?)
    };
    phases.capability_s += t.elapsed().as_secs_f64();
    let mut points = vec![meter.point(&base, 0, 0, None, started)];
    tracing::info!(
        objective = cfg.objective.as_str(),
        exact_match = base.report.metrics.exact_match,
        "Base model evaluated."
    );
    if cfg.objective == Objective::None {
        let report = untrained_report(cfg, points, constant_baseline, started, phases);
        let _ = stop_serve.send(());
        return Ok(report);
    }

    let prefix = unique(cfg.objective.as_str());
    let capture = start_capture(&cfg, &prefix, &serve_url).await?;
    let adapter_name = format!("support-{}", cfg.objective.as_str());
    let setup = learner_setup(
        &cfg,
        &prefix,
        &base_name,
        &adapter_name,
        capture.log_cfg.clone(),
        &serve_url,
    );
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (stop_learner, learner_stopped) = oneshot::channel::<()>();
    let learner = spawn_learner(setup, learner_stopped, Some(events_tx), Some(control_rx))?;

    let mut traffic = Vec::new();
    let mut tally = Tally::default();
    let mut live: Option<u64> = None;
    // The last point's eval runs, compared with the base model's at the end.
    let mut last: Option<Measured> = None;
    // In a changing-rule run, the held-out answers of the version at the change.
    let mut at_change: Option<RunReport> = None;
    let mut sent = 0u64;
    while sent < sc.events {
        let mut n = sc.eval_every.min(sc.events - sent);
        // A chunk never straddles a rule change: one SOP judges it, and a point measures the
        // version trained on the old rule alone.
        if let Some(c) = sc.rule_change.filter(|c| sent < c.after_events) {
            n = n.min(c.after_events - sent);
        }
        let model = if live.is_some() {
            adapter_name.clone()
        } else {
            base_name.clone()
        };
        let t = Instant::now();
        let summary = send_traffic(&cfg, &prefix, capture.proxy_addr, model, sent, n).await?;
        phases.traffic_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        traffic.push(summary.exact_match);
        let judged = summary
            .outcomes
            .iter()
            .filter(|o| !o.feedback_ids.is_empty())
            .count() as u64;
        sent += n;

        if !tally.take_in(&mut events_rx, judged).await? {
            bail!("the learner stopped: {:?}", learner.join());
        }
        control_tx
            .send(LearnerControl::SnapshotNow)
            .context("learner gone")?;
        let Some(version) = tally.next_candidate(&mut events_rx).await else {
            bail!("the learner stopped: {:?}", learner.join());
        };
        phases.catch_up_s += t.elapsed().as_secs_f64();
        live = Some(version);
        let adapter_dir = cfg
            .work_dir
            .join("adapters")
            .join(&adapter_name)
            .join(format!("v{version}"));
        let t = Instant::now();
        let m = meter.measure(&adapter_name, Some(adapter_dir)).await?;
        phases.eval_s += t.elapsed().as_secs_f64();
        tracing::info!(
            objective = cfg.objective.as_str(),
            events = sent,
            examples = tally.examples,
            version,
            exact_match = m.report.metrics.exact_match,
            prior_margin = m.margins.held_out,
            "Evaluated."
        );
        points.push(meter.point(&m, sent, tally.examples, Some(version), started));
        if sc.rule_change.is_some_and(|c| c.after_events == sent) {
            at_change = Some(m.report.clone());
        }
        last = Some(m);
    }
    // What the last version still knows outside the task.
    let (capability_vs_base, capability_drift) = match (&base_capability, live) {
        (Some(base), Some(_)) => {
            let t = Instant::now();
            let cap = meter.capability(&adapter_name).await?;
            let drift = answer_drift(
                &capability,
                base,
                &meter.capability_config(&adapter_name),
                &meter.capability_config(&base_name),
            )
            .await?;
            phases.capability_s += t.elapsed().as_secs_f64();
            tracing::info!(
                base = base.metrics.exact_match,
                adapter = cap.metrics.exact_match,
                drift = ?drift,
                "Capability set evaluated."
            );
            (Some(compare_runs(base, &cap, 10_000, sc.seed)?), drift)
        }
        _ => (None, None),
    };

    let _ = stop_learner.send(());
    let summary: Option<LearnerSummary> = tokio::task::spawn_blocking(move || learner.join())
        .await
        .ok()
        .and_then(|r| r.ok())
        .and_then(Result::ok);
    capture.stop().await;
    let _ = stop_serve.send(());
    let train_s = tally.train_ms as f64 / 1000.0;
    let (held_out_vs_base, trained_vs_base, history_vs_base) =
        compare_with_base(&set, &base, last.as_ref(), sc.seed)?;
    let retention_since_change = match (&rule_change, &at_change, &last) {
        (Some(meter), Some(before), Some(after)) => {
            meter.retention(before, &after.report, sc.seed)?
        }
        _ => None,
    };
    let events_to_new_rule = sc.rule_change.and_then(|c| {
        let scores: Vec<_> = points
            .iter()
            .map(|p| (p.events, p.rule_change.as_ref()))
            .collect();
        events_to_new_rule(&scores, c.after_events)
    });
    Ok(LearningReport {
        config: cfg,
        points,
        constant_baseline: Some(constant_baseline),
        traffic_exact_match: traffic,
        wall_s: started.elapsed().as_secs_f64(),
        phases,
        train_s,
        train_tokens: tally.train_tokens,
        train_tokens_per_s: if train_s > 0.0 {
            tally.train_tokens as f64 / train_s
        } else {
            0.0
        },
        replay_steps: tally.replay_steps,
        learner: summary.and_then(|s| serde_json::to_value(s).ok()),
        held_out_vs_base,
        trained_vs_base,
        history_vs_base,
        capability_vs_base,
        capability_drift,
        events_to_new_rule,
        retention_since_change,
    })
}

/// Fails early when the run cannot work: the model file missing, an empty scenario, or (for
/// a run that trains) the broker or Redis down.
async fn check_ready(cfg: &LearningConfig) -> anyhow::Result<()> {
    let sc = &cfg.scenario;
    if !cfg.model_path().is_file() {
        bail!(
            "{} is missing: run deploy/fetch-model.sh",
            cfg.model_path().display()
        );
    }
    if sc.eval_every == 0 || sc.events == 0 {
        bail!("scenario.events and scenario.eval_every must be >= 1");
    }
    // The proxy never fails traffic when Kafka is down (it spills), so without this a run
    // with the services stopped would wait on episodes that never come.
    if cfg.objective != Objective::None {
        services_listen(&cfg.brokers, &cfg.redis_url).await?;
    }
    Ok(())
}

/// The prior probe on the tickets whose decision is not the constant answer, when the
/// scenario asks for it.
fn prior_probe(
    cfg: &LearningConfig,
    set: &EvalSet,
    train_set: Option<&EvalSet>,
    constant_baseline: &ConstantBaseline,
) -> anyhow::Result<Option<Arc<PriorProbe>>> {
    if !cfg.scenario.prior_probe {
        return Ok(None);
    }
    let probe = PriorProbe::new(cfg.model_path(), set, train_set, &constant_baseline.answer)?;
    tracing::info!(
        held_out = probe.sizes().0,
        trained = probe.sizes().1,
        "Prior probe ready (tickets whose decision is not the constant answer)."
    );
    Ok(Some(Arc::new(probe)))
}

/// The report of a run that does not train (`objective = none`): the base model does not
/// change, so its curve is the same number at every point.
fn untrained_report(
    cfg: LearningConfig,
    mut points: Vec<CurvePoint>,
    constant_baseline: ConstantBaseline,
    started: Instant,
    phases: PhaseTimes,
) -> LearningReport {
    let sc = &cfg.scenario;
    let mut e = sc.eval_every;
    while e <= sc.events {
        let mut p = points[0].clone();
        p.events = e;
        points.push(p);
        e += sc.eval_every;
    }
    LearningReport {
        config: cfg,
        points,
        constant_baseline: Some(constant_baseline),
        traffic_exact_match: vec![],
        wall_s: started.elapsed().as_secs_f64(),
        phases,
        train_s: 0.0,
        train_tokens: 0,
        train_tokens_per_s: 0.0,
        replay_steps: 0,
        learner: None,
        held_out_vs_base: None,
        trained_vs_base: None,
        history_vs_base: None,
        capability_vs_base: None,
        capability_drift: None,
        events_to_new_rule: None,
        retention_since_change: None,
    }
}

/// What one curve point measures of a model: the held-out eval run, the trained-ticket run
/// (when asked for) and the prior probe's margins.
struct Measured {
    report: RunReport,
    trained: Option<RunReport>,
    margins: PriorMargins,
}

/// How the harness measures a model served at `serve_url`: the eval sets, the constant
/// baseline's answer and the prior probe.
struct Meter<'a> {
    set: &'a EvalSet,
    train_set: Option<&'a EvalSet>,
    capability: &'a EvalSet,
    constant: &'a serde_json::Value,
    probe: Option<Arc<PriorProbe>>,
    serve_url: &'a str,
    rule_change: Option<&'a RuleChangeMeter>,
}

impl Meter<'_> {
    /// The eval settings for `model`.
    fn run_config(&self, model: String) -> RunConfig {
        let mut rc = RunConfig::new(self.serve_url.to_string(), model);
        rc.progress = false;
        // The answers are kept to measure their spread (distinct decisions per point).
        rc.keep_content = true;
        rc.concurrency = 8;
        rc
    }

    /// Evaluates `model` on the held-out tickets and on the trained ones (when asked for),
    /// then probes its prior (the base model, or the adapter saved in `adapter_dir`).
    async fn measure(&self, model: &str, adapter_dir: Option<PathBuf>) -> anyhow::Result<Measured> {
        let report = evaluate(self.set, &self.run_config(model.to_string())).await?;
        let trained = match self.train_set {
            Some(set) => Some(evaluate(set, &self.run_config(model.to_string())).await?),
            None => None,
        };
        let margins = self.probe_at(adapter_dir).await?;
        Ok(Measured {
            report,
            trained,
            margins,
        })
    }

    /// The capability runs' settings: greedy, the eval gate's guard settings, the answers kept
    /// (the drift check scores the base's).
    fn capability_config(&self, model: &str) -> RunConfig {
        let mut rc = self.run_config(model.to_string());
        rc.max_tokens = Some(GuardConfig::default().max_tokens);
        rc
    }

    /// Greedy answers of `model` to the capability set, with the eval gate's guard settings.
    async fn capability(&self, model: &str) -> anyhow::Result<RunReport> {
        Ok(evaluate(self.capability, &self.capability_config(model)).await?)
    }

    /// Runs the probe off the async workers (it is seconds of CPU per point).
    async fn probe_at(&self, adapter_dir: Option<PathBuf>) -> anyhow::Result<PriorMargins> {
        match self.probe.clone() {
            Some(p) => tokio::task::spawn_blocking(move || p.margins(adapter_dir.as_deref()))
                .await
                .context("the prior probe panicked")?,
            None => Ok(PriorMargins::default()),
        }
    }

    /// The curve point of measurement `m` after `events` feedback events and `examples`
    /// trained examples, of candidate `version` (none for the base model).
    fn point(
        &self,
        m: &Measured,
        events: u64,
        examples: u64,
        version: Option<u64>,
        started: Instant,
    ) -> CurvePoint {
        // Exact match and field accuracy of a trained-ticket run, when there is one.
        let (train_exact_match, train_field_accuracy) = match &m.trained {
            Some(r) => (Some(r.metrics.exact_match), r.metrics.field_accuracy),
            None => (None, None),
        };
        let report = &m.report;
        CurvePoint {
            events,
            examples,
            exact_match: report.metrics.exact_match,
            field_accuracy: report.metrics.field_accuracy,
            train_exact_match,
            train_field_accuracy,
            distinct_answers: answer_spread(self.set, report).map(|s| s.0),
            top_answer_share: answer_spread(self.set, report).map(|s| s.1),
            exact_beyond_constant: exact_beyond_constant(self.set, report, self.constant)
                .map(|e| e.0),
            prior_margin: m.margins.held_out,
            train_prior_margin: m.margins.trained,
            passed: passed_items(report),
            version,
            wall_s: started.elapsed().as_secs_f64(),
            rule_change: self.rule_change.and_then(|r| r.score(self.set, report)),
        }
    }
}

/// One chunk of simulated traffic through the proxy at `proxy_addr`: `n` episodes from
/// episode `first` answered by `model`, each judged by the simulated user through the
/// feedback webhook.
async fn send_traffic(
    cfg: &LearningConfig,
    prefix: &str,
    proxy_addr: std::net::SocketAddr,
    model: String,
    first: u64,
    n: u64,
) -> anyhow::Result<EnvRunSummary> {
    let sc = &cfg.scenario;
    let mut env = EnvRunConfig::new(format!("http://{proxy_addr}/v1"), model);
    env.episodes = n;
    env.first_episode = first;
    env.rate_per_s = 20.0;
    env.concurrency = sc.concurrency;
    env.seed = sc.seed;
    env.temperature = sc.temperature;
    env.options = single_turn(sc.records);
    env.run_id = format!("{prefix}-traffic");
    env.feedback = Some(FeedbackConfig {
        endpoint: format!("http://{proxy_addr}"),
        secret: Some(SECRET.into()),
        delay_ms: 100,
        in_episode_order: sc.feedback_in_episode_order,
    });
    env.user = UserConfig {
        noise_rate: sc.noise_rate,
        correction_rate: sc.correction_rate,
        thanks_rate: 0.0,
        critique_style: sc.critique_style,
    };
    env.sop = sc.sop_at(first);
    let summary = run_env(env).await?;
    if summary.feedback_failures > 0 {
        bail!(
            "{} episodes could not send feedback",
            summary.feedback_failures
        );
    }
    Ok(summary)
}

/// What the learner reported so far: records taken in, examples trained, step time and
/// tokens, replay steps.
#[derive(Default)]
struct Tally {
    seen_records: u64,
    examples: u64,
    train_ms: u64,
    train_tokens: u64,
    replay_steps: u64,
}

impl Tally {
    /// Waits until the learner has taken in `judged` more records (trained or skipped); gives
    /// up only when it makes no progress for `STALL` (a chunk of slow steps can take longer in
    /// all). False when the learner stopped.
    async fn take_in(
        &mut self,
        events_rx: &mut mpsc::UnboundedReceiver<LearnerEvent>,
        judged: u64,
    ) -> anyhow::Result<bool> {
        const STALL: Duration = Duration::from_secs(600);
        let want = self.seen_records + judged;
        let mut deadline = Instant::now() + STALL;
        while self.seen_records < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "the learner took in {} of {want} records and then nothing for {} s",
                    self.seen_records,
                    STALL.as_secs()
                );
            }
            match tokio::time::timeout(left, events_rx.recv()).await {
                Ok(Some(LearnerEvent::Step(r))) => {
                    deadline = Instant::now() + STALL;
                    self.seen_records += r.examples as u64;
                    self.examples += r.examples as u64;
                    self.train_ms += r.duration_ms;
                    self.train_tokens += r.tokens as u64;
                }
                Ok(Some(LearnerEvent::Replay(r))) => {
                    deadline = Instant::now() + STALL;
                    self.replay_steps += 1;
                    self.train_ms += r.duration_ms;
                    self.train_tokens += r.tokens as u64;
                }
                Ok(Some(LearnerEvent::Skipped(_))) => self.seen_records += 1,
                Ok(Some(LearnerEvent::Candidate(_))) => {}
                Ok(None) => return Ok(false),
                Err(_) => {}
            }
        }
        Ok(true)
    }

    /// The version of the next candidate the learner registers, counting the steps before
    /// it; `None` when the learner stopped.
    async fn next_candidate(
        &mut self,
        events_rx: &mut mpsc::UnboundedReceiver<LearnerEvent>,
    ) -> Option<u64> {
        loop {
            match events_rx.recv().await {
                Some(LearnerEvent::Candidate(c)) => return Some(c.version),
                Some(LearnerEvent::Step(r)) => {
                    self.examples += r.examples as u64;
                    self.train_ms += r.duration_ms;
                    self.train_tokens += r.tokens as u64;
                }
                Some(LearnerEvent::Replay(r)) => {
                    self.replay_steps += 1;
                    self.train_ms += r.duration_ms;
                    self.train_tokens += r.tokens as u64;
                }
                Some(LearnerEvent::Skipped(_)) => {}
                None => return None,
            }
        }
    }
}

/// The last point's eval runs against the base model's, paired over the same tickets: held
/// out, trained (when scored), and the first [`HISTORY_EVAL_ITEMS`] held-out tickets (when the
/// run scored more). The bootstrap is seeded, so a report is reproducible.
#[allow(clippy::type_complexity)]
fn compare_with_base(
    set: &EvalSet,
    base: &Measured,
    last: Option<&Measured>,
    seed: u64,
) -> anyhow::Result<(Option<Comparison>, Option<Comparison>, Option<Comparison>)> {
    const RESAMPLES: usize = 10_000;
    let (held_out_vs_base, trained_vs_base) = match last {
        Some(last) => (
            Some(compare_runs(&base.report, &last.report, RESAMPLES, seed)?),
            match (&base.trained, &last.trained) {
                (Some(a), Some(b)) => Some(compare_runs(a, b, RESAMPLES, seed)?),
                _ => None,
            },
        ),
        None => (None, None),
    };
    let history_vs_base = match last {
        Some(last) if set.items.len() > HISTORY_EVAL_ITEMS => Some(compare_runs(
            &first_items(set, &base.report, HISTORY_EVAL_ITEMS),
            &first_items(set, &last.report, HISTORY_EVAL_ITEMS),
            RESAMPLES,
            seed,
        )?),
        _ => None,
    };
    Ok((held_out_vs_base, trained_vs_base, history_vs_base))
}
