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
    spawn_learner, LearnerConfig, LearnerControl, LearnerEvent, LearnerSetup, LearnerSummary,
};
use hindsight_learner::trainer::ObjectiveWeights;
use hindsight_proxy::{Extensions, RawConfig};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::prior_probe::{PriorMargins, PriorProbe};
use hindsight_sim::{
    eval_items, run_env, CritiqueStyle, EnvRunConfig, FeedbackConfig, PromptOptions, Records,
    Split, UserConfig, World,
};

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
    /// Feedback sent after each chunk's answers, in episode order, so the learner meets the
    /// examples in the same order on every run of a seed (false: as answers finish).
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

fn json_of<T: Serialize>(v: &T) -> serde_json::Value {
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

/// Draws the curves into a PNG with two panels side by side: eval exact match (the issue's
/// figure) and per-field accuracy (which moves long before whole decisions do), both against
/// feedback events. Text needs a TrueType font: DejaVu Sans from the system is used when
/// present, otherwise the plot is drawn without text (the JSON next to it carries the numbers).
pub fn plot(reports: &[LearningReport], path: &Path, title: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let font = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ]
    .iter()
    .find_map(|p| std::fs::read(p).ok());
    let with_text = match font {
        Some(bytes) => {
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok()
        }
        None => false,
    };
    // One constant-answer line per world (seed and eval size), not per curve.
    let mut baselines: Vec<(u64, &ConstantBaseline)> = Vec::new();
    for r in reports {
        if let Some(b) = &r.constant_baseline {
            if !baselines
                .iter()
                .any(|(seed, _)| *seed == r.config.scenario.seed)
            {
                baselines.push((r.config.scenario.seed, b));
            }
        }
    }
    // The legend goes under both panels, not inside them: the labels name every setting
    // that differs from the defaults and are far wider than a panel.
    let curve_style = |i: usize| Palette99::pick(i).to_rgba().stroke_width(2);
    let baseline_style =
        |i: usize| ShapeStyle::from(BLACK.mix(0.35 + 0.3 * i as f64)).stroke_width(2);
    let legend: Vec<(Vec<String>, ShapeStyle)> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| (wrap_label(&r.config.label(), LEGEND_CHARS), curve_style(i)))
        .chain(baselines.iter().enumerate().map(|(i, (seed, _))| {
            (
                vec![format!("constant answer (seed {seed})")],
                baseline_style(i),
            )
        }))
        .collect();
    let legend_lines: usize = legend.iter().map(|(lines, _)| lines.len()).sum();
    let legend_px = if with_text {
        30 + LEGEND_LINE_PX * legend_lines as u32
    } else {
        0
    };
    let root = BitMapBackend::new(path, (1400, 600 + legend_px)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = if with_text {
        root.titled(title, ("sans-serif", 22))?
    } else {
        root
    };
    let (panels_area, legend_area) = root.split_vertically(root.dim_in_pixel().1 - legend_px);
    let (left, right) = panels_area.split_horizontally(700);
    // Older result files have no field accuracy; their points are left out of that panel.
    type Metric = fn(&CurvePoint) -> Option<f64>;
    type Baseline = fn(&ConstantBaseline) -> f64;
    let panels: [(&_, &str, Metric, Baseline); 2] = [
        (
            &left,
            "eval exact match",
            |p| Some(p.exact_match),
            |b| b.exact_match,
        ),
        (
            &right,
            "eval field accuracy",
            |p| p.field_accuracy,
            |b| b.field_accuracy,
        ),
    ];
    let max_events = reports
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.events))
        .max()
        .unwrap_or(1)
        .max(1);
    for (area, y_desc, metric, baseline) in panels {
        let max_y = reports
            .iter()
            .flat_map(|r| r.points.iter().filter_map(metric))
            .chain(baselines.iter().map(|(_, b)| baseline(b)))
            .fold(0.1f64, f64::max)
            .min(1.0)
            * 1.15;
        let mut builder = ChartBuilder::on(area);
        builder.margin(20);
        if with_text {
            builder.x_label_area_size(45).y_label_area_size(60);
        }
        let mut chart = builder.build_cartesian_2d(0u64..max_events, 0f64..max_y)?;
        if with_text {
            chart
                .configure_mesh()
                .x_desc("feedback events")
                .y_desc(y_desc)
                .draw()?;
        } else {
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_y_mesh()
                .draw()?;
        }
        for (i, r) in reports.iter().enumerate() {
            let style = curve_style(i);
            let pts: Vec<(u64, f64)> = r
                .points
                .iter()
                .filter_map(|p| metric(p).map(|y| (p.events, y)))
                .collect();
            chart.draw_series(LineSeries::new(pts.clone(), style))?;
            chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, style.filled())))?;
        }
        for (i, (_, b)) in baselines.iter().enumerate() {
            let y = baseline(b);
            chart.draw_series(DashedLineSeries::new(
                [(0, y), (max_events, y)],
                10,
                6,
                baseline_style(i),
            ))?;
        }
    }
    if with_text {
        let mut y = 10i32;
        for (lines, style) in &legend {
            let mid = y + LEGEND_LINE_PX as i32 / 2 - 2;
            legend_area.draw(&PathElement::new(vec![(30, mid), (60, mid)], *style))?;
            for line in lines {
                legend_area.draw(&Text::new(line.clone(), (70, y), ("sans-serif", 14)))?;
                y += LEGEND_LINE_PX as i32;
            }
        }
    }
    root.present()?;
    Ok(())
}

/// Characters of a legend line before it wraps (at 14 px over the plot's width).
const LEGEND_CHARS: usize = 170;
/// Height of a legend line, pixels.
const LEGEND_LINE_PX: u32 = 18;

/// `label` in lines of at most `width` characters, broken after the commas between its
/// settings (a single setting longer than `width` gets a line of its own).
fn wrap_label(label: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for part in label.split_inclusive(", ") {
        let last = lines.last_mut().map(|l| l.chars().count()).unwrap_or(0);
        if last > 0 && last + part.chars().count() > width {
            lines.push(String::new());
        }
        if let Some(l) = lines.last_mut() {
            l.push_str(if l.is_empty() {
                part.trim_start()
            } else {
                part
            });
        }
    }
    lines.iter().map(|l| l.trim_end().to_string()).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_constant_baseline_is_the_most_common_training_decision_scored_by_the_eval() {
        let world = World::new(0);
        let options = single_turn(Records::Json);
        let eval = EvalSet::from_items("e", eval_items(&world, Split::Eval, 40, options)).unwrap();
        let b = ConstantBaseline::compute(&world, options, &eval, None).unwrap();
        let train = eval_items(&world, Split::Train, CONSTANT_BASELINE_TICKETS, options);
        let share = |v: &serde_json::Value| {
            train.iter().filter(|t| &t.expected == v).count() as f64 / train.len() as f64
        };
        assert!((share(&b.answer) - b.train_share).abs() < 1e-12);
        assert!(train.iter().all(|t| share(&t.expected) <= b.train_share));
        let hits = eval.items.iter().filter(|i| i.expected == b.answer).count();
        assert!((b.exact_match - hits as f64 / 40.0).abs() < 1e-12);
        assert!(b.field_accuracy >= b.exact_match && b.field_accuracy <= 1.0);
        assert!(b.train_exact_match.is_none());
    }

    #[test]
    fn exact_beyond_the_constant_answer_counts_only_the_other_tickets() {
        let world = World::new(0);
        let eval = EvalSet::from_items(
            "e",
            eval_items(&world, Split::Eval, 40, single_turn(Records::Json)),
        )
        .unwrap();
        let b = ConstantBaseline::compute(&world, single_turn(Records::Json), &eval, None).unwrap();
        let expected: Vec<&serde_json::Value> = eval.items.iter().map(|i| &i.expected).collect();
        let others = expected.iter().filter(|e| ***e != b.answer).count();
        assert!(others > 0 && others < 40, "{others}");
        // Right exactly on the constant answer's tickets (what always giving it scores): 0.
        let on_constant = expected
            .iter()
            .map(|e| (*e, f64::from(u8::from(**e == b.answer))));
        assert_eq!(beyond_constant(on_constant, &b.answer), Some((0.0, others)));
        // Right on every ticket: 1; on one of the others: 1 / others.
        let all = expected.iter().map(|e| (*e, 1.0));
        assert_eq!(beyond_constant(all, &b.answer), Some((1.0, others)));
        let first = expected.iter().position(|e| **e != b.answer).unwrap();
        let one = expected
            .iter()
            .enumerate()
            .map(|(i, e)| (*e, f64::from(u8::from(i == first))));
        let (rate, n) = beyond_constant(one, &b.answer).unwrap();
        assert!((rate - 1.0 / others as f64).abs() < 1e-12 && n == others);
        assert_eq!(beyond_constant(std::iter::empty(), &b.answer), None);
    }

    #[test]
    fn a_longer_eval_set_starts_with_the_shorter_one_and_its_prefix_is_scored_alone() {
        let world = World::new(0);
        let options = single_turn(Records::Compact);
        let short = eval_items(&world, Split::Eval, HISTORY_EVAL_ITEMS, options);
        let long = eval_items(&world, Split::Eval, 3 * HISTORY_EVAL_ITEMS, options);
        assert_eq!(short, long[..HISTORY_EVAL_ITEMS]);
        let set = EvalSet::from_items("e", long).unwrap();
        // Right on every third ticket: 21 of 60 right, 7 of the first 20.
        let outcome = |(i, item): (usize, &hindsight_eval::EvalItem)| {
            let pass = f64::from(u8::from(i % 3 == 0));
            serde_json::json!({"id": item.id, "scorer": "json_exact", "correct": pass as usize,
                "pass_rate": pass, "mean_score": pass, "pass_at_k": {}, "samples": []})
        };
        let report: RunReport = serde_json::from_value(serde_json::json!({
            "schema": "x", "endpoint": "x", "model": "m", "adapter_versions": [],
            "set": {"name": "e", "sha256": set.sha256, "items": set.items.len()},
            "seed": 0, "samples": 1, "temperature": 0.0, "started_at_ms": 0, "duration_ms": 0,
            "metrics": {"items": 60, "samples": 60, "exact_match": 0.35, "mean_score": 0.35,
                "pass_at_k": {}, "unparseable": {}, "request_errors": 0,
                "tool_calls_per_sample": 0.0, "mean_latency_ms": 0.0},
            "items": set.items.iter().enumerate().map(outcome).collect::<Vec<_>>(),
        }))
        .unwrap();
        let passed = passed_items(&report);
        assert_eq!(passed.len(), 20);
        assert!(passed.iter().all(|i| i % 3 == 0));
        let point = CurvePoint {
            events: 0,
            examples: 0,
            exact_match: 20.0 / 60.0,
            field_accuracy: None,
            train_exact_match: None,
            train_field_accuracy: None,
            distinct_answers: None,
            top_answer_share: None,
            exact_beyond_constant: None,
            prior_margin: None,
            train_prior_margin: None,
            passed,
            version: None,
            wall_s: 0.0,
        };
        assert!((point.exact_on_first(HISTORY_EVAL_ITEMS) - 7.0 / 20.0).abs() < 1e-12);
        assert!((point.exact_on_first(60) - point.exact_match).abs() < 1e-12);
        let first = first_items(&set, &report, HISTORY_EVAL_ITEMS);
        assert_eq!(first.items, report.items[..HISTORY_EVAL_ITEMS]);
        // Against a run right on none of them: +7 of 20, paired.
        let mut none = report.clone();
        for o in &mut none.items {
            o.pass_rate = 0.0;
        }
        let c = compare_runs(
            &first_items(&set, &none, HISTORY_EVAL_ITEMS),
            &first,
            1000,
            0,
        )
        .unwrap();
        assert_eq!(c.items, HISTORY_EVAL_ITEMS);
        assert!(
            (c.exact_match.diff - 0.35).abs() < 1e-12,
            "{:?}",
            c.exact_match
        );
    }

    #[test]
    fn service_addresses_come_from_the_broker_list_and_the_redis_url() {
        let addrs = service_addrs("127.0.0.1:9092, k2:9093", "redis://:pw@r:6380/0").unwrap();
        let addrs: Vec<&str> = addrs.iter().map(|(_, a)| a.as_str()).collect();
        assert_eq!(addrs, ["127.0.0.1:9092", "k2:9093", "r:6380"]);
        let (what, addr) = service_addrs("b:1", "redis://localhost")
            .unwrap()
            .pop()
            .unwrap();
        assert_eq!((what, addr.as_str()), ("Redis", "localhost:6379"));
        assert!(service_addrs("", "redis://r/").is_err());
        assert!(service_addrs("b:1", "http://r/").is_err());
    }

    #[tokio::test]
    async fn a_service_that_does_not_listen_is_named_with_what_to_run() {
        // A port just released: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let up = listening.local_addr().unwrap().to_string();
        let err = services_listen(&format!("127.0.0.1:{port}"), &format!("redis://{up}/"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Kafka broker") && err.contains("deploy/services.sh up"),
            "{err}"
        );
        let err = services_listen(&up, &format!("redis://127.0.0.1:{port}/"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("Redis"), "{err}");
        services_listen(&up, &format!("redis://{up}/"))
            .await
            .unwrap();
    }

    #[test]
    fn legend_labels_wrap_between_settings() {
        let label = "distill + replay 2, lr 1e-3, compact records, frozen teacher";
        assert_eq!(wrap_label(label, 200), vec![label]);
        assert_eq!(
            wrap_label(label, 30),
            vec![
                "distill + replay 2, lr 1e-3,",
                "compact records,",
                "frozen teacher"
            ]
        );
        // A setting longer than the width gets its own line rather than being cut.
        assert_eq!(
            wrap_label("a, a very long setting, b", 8),
            vec!["a,", "a very long setting,", "b"]
        );
        assert_eq!(wrap_label("", 10), vec![""]);
    }

    #[test]
    fn curve_labels_name_what_differs_from_the_defaults() {
        let mut cfg = LearningConfig::new(Objective::Default, "/tmp/x");
        assert_eq!(cfg.label(), "default");
        cfg.scenario.seed = 1;
        cfg.learner.replay_steps_per_batch = 2;
        cfg.learner.trainer.optimizer.lr = 3e-3;
        assert_eq!(
            cfg.label(),
            "default, seed=1, replay_steps_per_batch=2, trainer.optimizer.lr=0.003"
        );
        cfg.learner.trainer.divergence = hindsight_learner::objectives::Divergence::ReverseKl;
        assert!(
            cfg.label().contains(", trainer.divergence=reverse_kl"),
            "{}",
            cfg.label()
        );
        // The objective names the mix; the files the harness places are not settings.
        let mut kto = LearningConfig::new(Objective::Kto, "/tmp/y");
        kto.learner.model_path = "/elsewhere/model.gguf".into();
        assert_eq!(kto.label(), "kto");
    }

    #[test]
    fn the_bench_reads_the_learner_config_and_fails_loudly_on_a_bad_value() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let f = BenchFile::load(
            None,
            env(&[
                ("HINDSIGHT_LEARNER__TRAINER__OPTIMIZER__LR", "2e-3"),
                ("HINDSIGHT_SCENARIO__CORRECTION_RATE", "0.3"),
            ]),
        )
        .unwrap();
        assert_eq!(f.learner.trainer.optimizer.lr, 2e-3);
        assert_eq!(f.scenario.correction_rate, 0.3);
        // The defaults are the measured recipe and the headline scenario.
        let d = BenchFile::load(None, env(&[])).unwrap();
        assert_eq!(json_of(&d.learner), json_of(&LearnerConfig::default()));
        assert_eq!((d.scenario.events, d.scenario.eval_items), (64, 60));
        let bad = BenchFile::load(
            None,
            env(&[("HINDSIGHT_LEARNER__TRAINER__OPTIMIZER__LR", "1e-3x")]),
        )
        .unwrap_err()
        .to_string();
        assert!(bad.contains("learner.trainer.optimizer.lr"), "{bad}");
        let unknown = BenchFile::load(None, env(&[("HINDSIGHT_SCENARIO__EVENT", "3")]))
            .unwrap_err()
            .to_string();
        assert!(unknown.contains("unknown field `event`"), "{unknown}");
    }
}
