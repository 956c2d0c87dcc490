//! The learning-curve harness: the whole Hindsight loop in one process, on the real model and
//! the real broker and Redis — `hindsight serve` (the agent's model), the capturing proxy with
//! the feedback webhook, the joiner, the learner (registry + publishing), and the simulated
//! support environment sending traffic and feedback through the proxy — measured with
//! `hindsight eval` on the held-out eval split after every K feedback events.
//!
//! Used by `cargo bench -p hindsight-bench --bench learning_curve` (all objective
//! configurations, JSON + PNG) and by the small learning test in `bench/tests/learning.rs`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hindsight_control::publish::PublishConfig;
use hindsight_control::registry::RegistryConfig;
use hindsight_eval::{
    compare_runs, evaluate, extract_json_answer, score_answer, Comparison, EvalSet, RunConfig,
    RunReport,
};
use hindsight_feedback::{JoinerConfig, LogConfig, Secret};
use hindsight_learner::online::{
    spawn_learner, LearnerControl, LearnerEvent, LearnerSetup, LearnerSummary,
};
use hindsight_proxy::{Extensions, RawConfig};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::prior_probe::{PriorMargins, PriorProbe};

mod config;
mod plot;
#[cfg(test)]
mod tests;

pub use config::{BenchFile, LearningConfig, Objective, Scenario};
use hindsight_sim::{
    eval_items, run_env, EnvRunConfig, FeedbackConfig, PromptOptions, Records, Split, UserConfig,
    World,
};
pub use plot::plot;

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
        eval: &EvalSet,
        trained: Option<&EvalSet>,
    ) -> anyhow::Result<Self> {
        let train = eval_items(world, Split::Train, CONSTANT_BASELINE_TICKETS, options);
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

const SECRET: &str = "learning-curve-secret";

fn unique(what: &str) -> String {
    format!("lc-{what}-{}", uuid::Uuid::now_v7().simple())
}

/// Starts `hindsight serve` on a free port; returns its API base and a stopper.
async fn start_serve(model: &Path) -> anyhow::Result<(String, String, oneshot::Sender<()>)> {
    use clap::Parser;
    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        serve: hindsight_serve::ServeArgs,
    }
    let args = Args::try_parse_from([
        "serve".to_string(),
        "--model".to_string(),
        model.display().to_string(),
        "--listen".to_string(),
        "127.0.0.1:0".to_string(),
    ])?;
    let config = args.serve.load()?;
    let base = config.served_model_name.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let r = hindsight_serve::run_serve(config, listener, async {
            let _ = rx.await;
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "serve stopped");
        }
    });
    let url = format!("http://{addr}/v1");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = client.get(format!("{url}/models")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!("hindsight serve did not come up within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok((url, base, tx))
}

/// Runs one configuration end to end.
pub async fn run_learning(cfg: LearningConfig) -> anyhow::Result<LearningReport> {
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
    std::fs::create_dir_all(&cfg.work_dir)?;
    let started = Instant::now();
    let options = single_turn(sc.records);
    let world = World::new(sc.seed);
    let set = EvalSet::from_items(
        "support-eval",
        eval_items(&world, Split::Eval, sc.eval_items, options),
    )?;

    let train_set = match sc.train_eval_items {
        0 => None,
        n => Some(EvalSet::from_items(
            "support-trained",
            eval_items(&world, Split::Train, n, options),
        )?),
    };

    let constant_baseline = ConstantBaseline::compute(&world, options, &set, train_set.as_ref())?;
    let probe = if sc.prior_probe {
        let probe = PriorProbe::new(
            cfg.model_path(),
            &set,
            train_set.as_ref(),
            &constant_baseline.answer,
        )?;
        tracing::info!(
            held_out = probe.sizes().0,
            trained = probe.sizes().1,
            "Prior probe ready (tickets whose decision is not the constant answer)."
        );
        Some(std::sync::Arc::new(probe))
    } else {
        None
    };
    // Runs the probe off the async workers (it is seconds of CPU per point).
    let probe_at = |adapter_dir: Option<PathBuf>| {
        let probe = probe.clone();
        async move {
            match probe {
                Some(p) => tokio::task::spawn_blocking(move || p.margins(adapter_dir.as_deref()))
                    .await
                    .context("the prior probe panicked")?,
                None => Ok(PriorMargins::default()),
            }
        }
    };
    let (serve_url, base_name, stop_serve) = start_serve(cfg.model_path()).await?;
    let eval_at = |model: String| {
        let mut rc = RunConfig::new(serve_url.clone(), model);
        rc.progress = false;
        // The answers are kept to measure their spread (distinct decisions per point).
        rc.keep_content = true;
        rc.concurrency = 8;
        rc
    };
    // Scores on the trained tickets, when asked for.
    let eval_trained = |model: String| {
        let rc = eval_at(model);
        let set = train_set.as_ref();
        async move {
            match set {
                Some(set) => anyhow::Ok(Some(evaluate(set, &rc).await?)),
                None => Ok(None),
            }
        }
    };
    // Exact match and field accuracy of a trained-ticket run, when there is one.
    let trained_metrics = |r: &Option<RunReport>| match r {
        Some(r) => (Some(r.metrics.exact_match), r.metrics.field_accuracy),
        None => (None, None),
    };
    let base_report = evaluate(&set, &eval_at(base_name.clone())).await?;
    let base_trained = eval_trained(base_name.clone()).await?;
    let (train_exact_match, train_field_accuracy) = trained_metrics(&base_trained);
    let base_margins = probe_at(None).await?;
    let mut points = vec![CurvePoint {
        events: 0,
        examples: 0,
        exact_match: base_report.metrics.exact_match,
        field_accuracy: base_report.metrics.field_accuracy,
        train_exact_match,
        train_field_accuracy,
        distinct_answers: answer_spread(&set, &base_report).map(|s| s.0),
        top_answer_share: answer_spread(&set, &base_report).map(|s| s.1),
        exact_beyond_constant: exact_beyond_constant(&set, &base_report, &constant_baseline.answer)
            .map(|e| e.0),
        prior_margin: base_margins.held_out,
        train_prior_margin: base_margins.trained,
        passed: passed_items(&base_report),
        version: None,
        wall_s: started.elapsed().as_secs_f64(),
    }];
    tracing::info!(
        objective = cfg.objective.as_str(),
        exact_match = base_report.metrics.exact_match,
        "Base model evaluated."
    );
    if cfg.objective == Objective::None {
        // The base model does not change: its curve is the same number at every point.
        let mut e = sc.eval_every;
        while e <= sc.events {
            let mut p = points[0].clone();
            p.events = e;
            points.push(p);
            e += sc.eval_every;
        }
        let _ = stop_serve.send(());
        return Ok(LearningReport {
            config: cfg,
            points,
            constant_baseline: Some(constant_baseline),
            traffic_exact_match: vec![],
            wall_s: started.elapsed().as_secs_f64(),
            train_s: 0.0,
            train_tokens: 0,
            train_tokens_per_s: 0.0,
            replay_steps: 0,
            learner: None,
            held_out_vs_base: None,
            trained_vs_base: None,
            history_vs_base: None,
        });
    }

    // Proxy in front of serve, with the signed feedback webhook.
    let prefix = unique(cfg.objective.as_str());
    let mut raw = RawConfig::default();
    raw.proxy.upstream_url = serve_url.trim_end_matches("/v1").to_string();
    raw.proxy.listen_addr = "127.0.0.1:0".into();
    raw.proxy.admin_addr = "127.0.0.1:0".into();
    raw.log = LogConfig {
        brokers: cfg.brokers.clone(),
        topic_prefix: prefix.clone(),
        spill_dir: cfg.work_dir.join("spill"),
        ..LogConfig::default()
    };
    raw.feedback.redis_url = cfg.redis_url.clone();
    raw.feedback.redis_key_prefix = format!("{prefix}:idem:");
    raw.feedback.signing.secrets = vec![Secret::new(SECRET)];
    let proxy_cfg = raw.validate()?;
    let log_cfg = proxy_cfg.log.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let (stop_proxy, proxy_stopped) = oneshot::channel::<()>();
    let proxy = tokio::spawn(async move {
        hindsight_proxy::run(proxy_cfg, listener, admin, Extensions::default(), async {
            let _ = proxy_stopped.await;
        })
        .await
    });

    // Joiner.
    let joiner_cfg = JoinerConfig {
        group_id: format!("{prefix}-joiner"),
        redis_url: cfg.redis_url.clone(),
        redis_key_prefix: format!("{prefix}:join:"),
        ..JoinerConfig::default()
    }
    .validate()?;
    let (stop_joiner, joiner_stopped) = oneshot::channel::<()>();
    let joiner_log = log_cfg.clone();
    let joiner = tokio::spawn(async move {
        hindsight_feedback::run_joiner(joiner_cfg, joiner_log, async {
            let _ = joiner_stopped.await;
        })
        .await
    });

    // Learner: candidates on request, published without a gate (the curve is the measure;
    // the gate has its own test) and promoted so traffic comes from the newest adapter.
    // The configured learner, with the harness's own files, names and candidate schedule.
    let adapter_name = format!("support-{}", cfg.objective.as_str());
    let mut learner_cfg = cfg.learner.clone();
    learner_cfg.base_model_name = Some(base_name.clone());
    learner_cfg.adapter_name = adapter_name.clone();
    learner_cfg.group_id = format!("{prefix}-learner");
    learner_cfg.checkpoint_dir = cfg.work_dir.join("checkpoints");
    learner_cfg.run_log = cfg.work_dir.join("run.jsonl");
    learner_cfg.max_batch_wait_ms = 1_000;
    learner_cfg.checkpoint_every_batches = 4;
    learner_cfg.candidate_every_batches = 0;
    learner_cfg.candidate_every_examples = 0;
    learner_cfg.candidate_every_ms = 0;
    learner_cfg.trainer.objectives = cfg.objective.weights(cfg.learner.trainer.objectives);
    let setup = LearnerSetup {
        learner: learner_cfg,
        log: log_cfg.clone(),
        registry: Some(RegistryConfig {
            redis_url: cfg.redis_url.clone(),
            key_prefix: format!("{prefix}:registry"),
            adapter_dir: cfg.work_dir.join("adapters"),
        }),
        publish: Some(PublishConfig {
            endpoints: vec![serve_url.clone()],
            api_key: None,
            gate: None,
            promote: true,
            load_timeout_ms: 60_000,
        }),
    };
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (stop_learner, learner_stopped) = oneshot::channel::<()>();
    let learner = spawn_learner(setup, learner_stopped, Some(events_tx), Some(control_rx))?;

    let mut traffic = Vec::new();
    let (mut seen_records, mut examples) = (0u64, 0u64);
    let (mut train_ms, mut train_tokens) = (0u64, 0u64);
    let mut replay_steps = 0u64;
    let mut live: Option<u64> = None;
    // The last point's eval runs, compared with the base model's at the end.
    let mut last: Option<(RunReport, Option<RunReport>)> = None;
    let mut sent = 0u64;
    while sent < sc.events {
        let n = sc.eval_every.min(sc.events - sent);
        let mut env = EnvRunConfig::new(
            format!("http://{proxy_addr}/v1"),
            if live.is_some() {
                adapter_name.clone()
            } else {
                base_name.clone()
            },
        );
        env.episodes = n;
        env.first_episode = sent;
        env.rate_per_s = 20.0;
        env.concurrency = sc.concurrency;
        env.seed = sc.seed;
        env.temperature = sc.temperature;
        env.options = options;
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
        let summary = run_env(env).await?;
        if summary.feedback_failures > 0 {
            bail!(
                "{} episodes could not send feedback",
                summary.feedback_failures
            );
        }
        traffic.push(summary.exact_match);
        let judged = summary
            .outcomes
            .iter()
            .filter(|o| !o.feedback_ids.is_empty())
            .count() as u64;
        sent += n;

        // Wait until the learner has taken in every judged turn of this chunk; give up only
        // when it makes no progress for STALL (a chunk of slow steps can take longer in all).
        const STALL: Duration = Duration::from_secs(600);
        let want = seen_records + judged;
        let mut deadline = Instant::now() + STALL;
        while seen_records < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "the learner took in {seen_records} of {want} records and then nothing for {} s",
                    STALL.as_secs()
                );
            }
            match tokio::time::timeout(left, events_rx.recv()).await {
                Ok(Some(LearnerEvent::Step(r))) => {
                    deadline = Instant::now() + STALL;
                    seen_records += r.examples as u64;
                    examples += r.examples as u64;
                    train_ms += r.duration_ms;
                    train_tokens += r.tokens as u64;
                }
                Ok(Some(LearnerEvent::Replay(r))) => {
                    deadline = Instant::now() + STALL;
                    replay_steps += 1;
                    train_ms += r.duration_ms;
                    train_tokens += r.tokens as u64;
                }
                Ok(Some(LearnerEvent::Skipped(_))) => seen_records += 1,
                Ok(Some(LearnerEvent::Candidate(_))) => {}
                Ok(None) => bail!("the learner stopped: {:?}", learner.join()),
                Err(_) => {}
            }
        }
        control_tx
            .send(LearnerControl::SnapshotNow)
            .context("learner gone")?;
        let version = loop {
            match events_rx.recv().await {
                Some(LearnerEvent::Candidate(c)) => break c.version,
                Some(LearnerEvent::Step(r)) => {
                    examples += r.examples as u64;
                    train_ms += r.duration_ms;
                    train_tokens += r.tokens as u64;
                }
                Some(LearnerEvent::Replay(r)) => {
                    replay_steps += 1;
                    train_ms += r.duration_ms;
                    train_tokens += r.tokens as u64;
                }
                Some(LearnerEvent::Skipped(_)) => {}
                None => bail!("the learner stopped: {:?}", learner.join()),
            }
        };
        live = Some(version);
        let report = evaluate(&set, &eval_at(adapter_name.clone())).await?;
        let trained = eval_trained(adapter_name.clone()).await?;
        let (train_exact_match, train_field_accuracy) = trained_metrics(&trained);
        let margins = probe_at(Some(
            cfg.work_dir
                .join("adapters")
                .join(&adapter_name)
                .join(format!("v{version}")),
        ))
        .await?;
        tracing::info!(
            objective = cfg.objective.as_str(),
            events = sent,
            examples,
            version,
            exact_match = report.metrics.exact_match,
            prior_margin = margins.held_out,
            "Evaluated."
        );
        points.push(CurvePoint {
            events: sent,
            examples,
            exact_match: report.metrics.exact_match,
            field_accuracy: report.metrics.field_accuracy,
            train_exact_match,
            train_field_accuracy,
            distinct_answers: answer_spread(&set, &report).map(|s| s.0),
            top_answer_share: answer_spread(&set, &report).map(|s| s.1),
            exact_beyond_constant: exact_beyond_constant(&set, &report, &constant_baseline.answer)
                .map(|e| e.0),
            prior_margin: margins.held_out,
            train_prior_margin: margins.trained,
            passed: passed_items(&report),
            version: Some(version),
            wall_s: started.elapsed().as_secs_f64(),
        });
        last = Some((report, trained));
    }

    let _ = stop_learner.send(());
    let summary: Option<LearnerSummary> = tokio::task::spawn_blocking(move || learner.join())
        .await
        .ok()
        .and_then(|r| r.ok())
        .and_then(Result::ok);
    let _ = stop_joiner.send(());
    let _ = joiner.await;
    let _ = stop_proxy.send(());
    let _ = proxy.await;
    let _ = stop_serve.send(());
    let train_s = train_ms as f64 / 1000.0;
    // Paired over the same tickets; the bootstrap is seeded, so a report is reproducible.
    const RESAMPLES: usize = 10_000;
    let (held_out_vs_base, trained_vs_base) = match &last {
        Some((held_out, trained)) => (
            Some(compare_runs(&base_report, held_out, RESAMPLES, sc.seed)?),
            match (&base_trained, trained) {
                (Some(a), Some(b)) => Some(compare_runs(a, b, RESAMPLES, sc.seed)?),
                _ => None,
            },
        ),
        None => (None, None),
    };
    let history_vs_base = match &last {
        Some((held_out, _)) if set.items.len() > HISTORY_EVAL_ITEMS => Some(compare_runs(
            &first_items(&set, &base_report, HISTORY_EVAL_ITEMS),
            &first_items(&set, held_out, HISTORY_EVAL_ITEMS),
            RESAMPLES,
            sc.seed,
        )?),
        _ => None,
    };
    Ok(LearningReport {
        config: cfg,
        points,
        constant_baseline: Some(constant_baseline),
        traffic_exact_match: traffic,
        wall_s: started.elapsed().as_secs_f64(),
        train_s,
        train_tokens,
        train_tokens_per_s: if train_s > 0.0 {
            train_tokens as f64 / train_s
        } else {
            0.0
        },
        replay_steps,
        learner: summary.and_then(|s| serde_json::to_value(s).ok()),
        held_out_vs_base,
        trained_vs_base,
        history_vs_base,
    })
}

/// The `host:port` addresses of a broker list and a Redis URL.
fn service_addrs(brokers: &str, redis_url: &str) -> anyhow::Result<Vec<(&'static str, String)>> {
    let mut addrs: Vec<(&'static str, String)> = brokers
        .split(',')
        .map(str::trim)
        .filter(|b| !b.is_empty())
        .map(|b| ("Kafka broker", b.to_string()))
        .collect();
    if addrs.is_empty() {
        bail!("KAFKA_BROKERS is empty");
    }
    // The redis crate's own URL parsing (defaults, credentials, schemes).
    let client = redis::Client::open(redis_url)
        .with_context(|| format!("REDIS_URL {redis_url:?} is not a Redis URL"))?;
    let host_port = match &client.get_connection_info().addr {
        redis::ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        other => bail!("REDIS_URL {redis_url:?}: only plain TCP is checked here, not {other}"),
    };
    addrs.push(("Redis", host_port));
    Ok(addrs)
}

/// Fails with what to run when a broker or Redis does not accept connections.
async fn services_listen(brokers: &str, redis_url: &str) -> anyhow::Result<()> {
    for (what, addr) in service_addrs(brokers, redis_url)? {
        let connect = tokio::net::TcpStream::connect(addr.as_str());
        match tokio::time::timeout(Duration::from_secs(3), connect).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!(
                "the {what} at {addr} does not accept connections ({e}): start the local \
                 services with deploy/services.sh up"
            ),
            Err(_) => bail!(
                "the {what} at {addr} did not answer within 3 s: start the local services \
                 with deploy/services.sh up"
            ),
        }
    }
    Ok(())
}
