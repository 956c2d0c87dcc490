//! The runner: sends every item (× samples) to an endpoint with bounded concurrency, replays
//! tool calls from the item's fixtures, scores the answers and aggregates the metrics.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

use futures::stream::{self, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::client::{CallError, ChatClient};
use crate::error::EvalError;
use crate::passk::pass_at_k;
use crate::score::{score_answer, Score, Unparseable};
use crate::set::{canonical_arguments, EvalItem, EvalSet, ScorerKind};
use crate::token_stats::TokenStats;
use hindsight_core::now_ms;

/// Schema tag of a single run's results.
pub const RUN_SCHEMA: &str = "hindsight.eval.run/v1";

/// Settings of one evaluation run against one endpoint and model.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// API base, e.g. `http://127.0.0.1:8080/v1`.
    pub endpoint: String,
    /// Model (or adapter) name sent as `model`.
    pub model: String,
    /// Bearer token, if the endpoint wants one.
    pub api_key: Option<String>,
    /// Samples per item (n of pass@k).
    pub samples: usize,
    /// The k values to report pass@k for (each ≤ samples).
    pub pass_k: Vec<usize>,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling, if set.
    pub top_p: Option<f64>,
    /// Base seed; sample i is sent with `seed + i`.
    pub seed: u64,
    /// `max_tokens`, if set.
    pub max_tokens: Option<u32>,
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Retries on 429/502/503/504 per request.
    pub max_retries: u32,
    /// Per-request timeout in milliseconds.
    pub request_timeout_ms: u64,
    /// Tool-call rounds allowed before the item counts as `tool_turn_limit`.
    pub max_tool_turns: usize,
    /// Send `x-hindsight-no-log: true` so a Hindsight proxy never turns eval traffic into
    /// training data (the eval split must stay unseen by the learner).
    pub no_log: bool,
    /// Extra headers sent with every request.
    pub headers: Vec<(String, String)>,
    /// Overrides every item's scorer.
    pub scorer_override: Option<ScorerKind>,
    /// Show a progress bar on stderr (hidden automatically when stderr is not a terminal).
    pub progress: bool,
    /// Keep each answer's full text in the results.
    pub keep_content: bool,
    /// Ask for the final answer's log-probs with this many alternatives per token (at most 20,
    /// OpenAI's limit) and record their [`TokenStats`]: the eval gate's collapse guard.
    pub top_logprobs: Option<u32>,
}

impl RunConfig {
    /// The client a run sends its requests with: endpoint, key, timeout, retries, the extra
    /// headers and, with `no_log`, the header that keeps a Hindsight proxy from logging them.
    pub fn client(&self) -> Result<ChatClient, EvalError> {
        let mut headers = self.headers.clone();
        if self.no_log {
            headers.push((hindsight_core::headers::NO_LOG.into(), "true".into()));
        }
        ChatClient::new(
            &self.endpoint,
            self.api_key.as_deref(),
            self.request_timeout_ms,
            self.max_retries,
            &headers,
        )
    }

    /// Defaults: 1 greedy sample (temperature 0, seed 0), pass@1, 4 in flight, 5 retries,
    /// 120 s timeout, 4 tool rounds, no-log on, progress bar on.
    pub fn new(endpoint: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            model: model.into(),
            api_key: None,
            samples: 1,
            pass_k: vec![1],
            temperature: 0.0,
            top_p: None,
            seed: 0,
            max_tokens: None,
            concurrency: 4,
            max_retries: 5,
            request_timeout_ms: 120_000,
            max_tool_turns: 4,
            no_log: true,
            headers: Vec::new(),
            scorer_override: None,
            progress: true,
            keep_content: true,
            top_logprobs: None,
        }
    }

    fn validate(&self) -> Result<(), EvalError> {
        let bad = |field, reason: &str| {
            Err(EvalError::InvalidConfig {
                field,
                reason: reason.to_string(),
            })
        };
        if self.model.is_empty() {
            return bad("model", "must not be empty");
        }
        if self.samples == 0 {
            return bad("samples", "must be at least 1");
        }
        if self.concurrency == 0 {
            return bad("concurrency", "must be at least 1");
        }
        if let Some(k) = self.pass_k.iter().find(|k| **k == 0 || **k > self.samples) {
            return Err(EvalError::InvalidConfig {
                field: "k",
                reason: format!("pass@{k} needs 1 <= k <= samples ({})", self.samples),
            });
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number >= 0");
        }
        if self.top_logprobs.is_some_and(|k| k == 0 || k > 20) {
            return bad("top_logprobs", "must be between 1 and 20");
        }
        Ok(())
    }
}

/// One answer to one item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleOutcome {
    /// Sample index (0-based); its request used seed `seed + sample`.
    pub sample: usize,
    /// The judgement.
    pub score: Score,
    /// The final answer text (unless results were asked to omit it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The request error, when the call failed after retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Adapter version that answered (header `x-hindsight-adapter`, else the body's `model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// Tool calls the model made before answering.
    pub tool_calls: usize,
    /// Wall time of all requests of this sample, in milliseconds.
    pub latency_ms: u64,
    /// The final answer's token statistics (with [`RunConfig::top_logprobs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenStats>,
}

/// All samples of one item and its aggregates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemOutcome {
    /// The item id.
    pub id: String,
    /// The scorer used.
    pub scorer: ScorerKind,
    /// Samples that passed.
    pub correct: usize,
    /// correct / samples (the item's exact-match rate for JSON scorers).
    pub pass_rate: f64,
    /// Mean scorer value.
    pub mean_score: f64,
    /// Mean share of fields right (JSON scorers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_accuracy: Option<f64>,
    /// pass@k per requested k, keyed `"pass@k"`.
    pub pass_at_k: BTreeMap<String, f64>,
    /// The item's metadata, carried through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Every sample.
    pub samples: Vec<SampleOutcome>,
}

/// The aggregate scores of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunMetrics {
    /// Items scored.
    pub items: usize,
    /// Answers scored (items × samples).
    pub samples: usize,
    /// Mean over items of the item pass rate: exact match for JSON scorers (= pass@1).
    pub exact_match: f64,
    /// Mean over items of the mean scorer value.
    pub mean_score: f64,
    /// Mean share of fields right over JSON-scored items.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_accuracy: Option<f64>,
    /// Mean pass@k over items, keyed `"pass@k"`.
    pub pass_at_k: BTreeMap<String, f64>,
    /// Unscoreable answers by reason.
    pub unparseable: BTreeMap<String, usize>,
    /// Samples whose request failed after retries (also counted as `request_failed`).
    pub request_errors: usize,
    /// Mean tool calls per sample.
    pub tool_calls_per_sample: f64,
    /// Mean latency per sample, in milliseconds.
    pub mean_latency_ms: f64,
    /// Mean over answers of their mean chosen-token log-prob (runs with `top_logprobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_token_logprob: Option<f64>,
    /// Mean over answers of their mean next-token entropy estimate, nats (runs with
    /// `top_logprobs`; comparable between runs at the same k only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_token_entropy: Option<f64>,
}

/// Identity of the eval set a run used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetInfo {
    /// Short name.
    pub name: String,
    /// File path, if read from a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// sha256 of the set's bytes.
    pub sha256: String,
    /// Items evaluated (after any limit).
    pub items: usize,
}

/// The results of one run: settings, identity, metrics, per-item outcomes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// `hindsight.eval.run/v1`.
    pub schema: String,
    /// API base called.
    pub endpoint: String,
    /// Model name sent.
    pub model: String,
    /// Adapter versions that answered (usually one).
    pub adapter_versions: Vec<String>,
    /// The eval set.
    pub set: SetInfo,
    /// Base seed.
    pub seed: u64,
    /// Samples per item.
    pub samples: usize,
    /// Temperature.
    pub temperature: f64,
    /// Top-p, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// max_tokens, if set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Start, ms since the Unix epoch.
    pub started_at_ms: i64,
    /// Wall time of the run, ms.
    pub duration_ms: u64,
    /// Aggregates.
    pub metrics: RunMetrics,
    /// Per-item outcomes, in set order.
    pub items: Vec<ItemOutcome>,
}

/// Runs `set` against `cfg.endpoint` / `cfg.model` and scores it. This is what the learner's
/// promotion gate calls.
///
/// Failed requests score 0 and are counted; the run fails only when its settings are invalid
/// or when every single request failed (nothing was measured).
pub async fn evaluate(set: &EvalSet, cfg: &RunConfig) -> Result<RunReport, EvalError> {
    cfg.validate()?;
    if set.items.is_empty() {
        return Err(EvalError::EmptySet);
    }
    let client = cfg.client()?;
    let started_at_ms = now_ms();
    let clock = Instant::now();

    let total = (set.items.len() * cfg.samples) as u64;
    let bar = if cfg.progress {
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} answers (eta {eta})",
        ) {
            bar.set_style(style);
        }
        bar.set_prefix(cfg.model.clone());
        bar
    } else {
        ProgressBar::hidden()
    };

    let jobs = set
        .items
        .iter()
        .enumerate()
        .flat_map(|(i, _)| (0..cfg.samples).map(move |s| (i, s)));
    let mut results: Vec<(usize, SampleOutcome)> = stream::iter(jobs)
        .map(|(i, s)| {
            let client = &client;
            let item = &set.items[i];
            let bar = &bar;
            async move {
                let outcome = run_sample(client, cfg, item, s).await;
                bar.inc(1);
                (i, outcome)
            }
        })
        .buffer_unordered(cfg.concurrency)
        .collect()
        .await;
    bar.finish_and_clear();
    results.sort_by_key(|(i, o)| (*i, o.sample));

    let failed = results.iter().filter(|(_, o)| o.error.is_some()).count();
    if failed == results.len() {
        let first_error = results
            .iter()
            .find_map(|(_, o)| o.error.clone())
            .unwrap_or_default();
        return Err(EvalError::AllRequestsFailed {
            endpoint: cfg.endpoint.clone(),
            first_error,
        });
    }

    let mut per_item: Vec<Vec<SampleOutcome>> = vec![Vec::new(); set.items.len()];
    for (i, outcome) in results {
        per_item[i].push(outcome);
    }
    let items: Vec<ItemOutcome> = set
        .items
        .iter()
        .zip(per_item)
        .map(|(item, samples)| {
            item_outcome(
                &item.id,
                cfg.scorer_override.unwrap_or(item.scorer),
                item.metadata.clone(),
                samples,
                &cfg.pass_k,
            )
        })
        .collect();
    let adapter_versions: BTreeSet<String> = items
        .iter()
        .flat_map(|i| i.samples.iter().filter_map(|s| s.adapter.clone()))
        .collect();
    Ok(RunReport {
        schema: RUN_SCHEMA.to_string(),
        endpoint: cfg.endpoint.clone(),
        model: cfg.model.clone(),
        adapter_versions: adapter_versions.into_iter().collect(),
        set: SetInfo {
            name: set.name.clone(),
            path: set.path.clone(),
            sha256: set.sha256.clone(),
            items: set.items.len(),
        },
        seed: cfg.seed,
        samples: cfg.samples,
        temperature: cfg.temperature,
        top_p: cfg.top_p,
        max_tokens: cfg.max_tokens,
        started_at_ms,
        duration_ms: clock.elapsed().as_millis() as u64,
        metrics: summarize(&items, &cfg.pass_k),
        items,
    })
}

/// Aggregates per-sample outcomes of one item. Public so callers that regroup samples (the
/// hindsight baselines run each sample as its own request) compute identical figures.
pub fn item_outcome(
    id: &str,
    scorer: ScorerKind,
    metadata: Option<Value>,
    samples: Vec<SampleOutcome>,
    pass_k: &[usize],
) -> ItemOutcome {
    let n = samples.len();
    let correct = samples.iter().filter(|s| s.score.passed).count();
    let mean = |f: &dyn Fn(&SampleOutcome) -> f64| {
        if n == 0 {
            0.0
        } else {
            samples.iter().map(f).sum::<f64>() / n as f64
        }
    };
    let pass_rate = mean(&|s| if s.score.passed { 1.0 } else { 0.0 });
    let mean_score = mean(&|s| s.score.value);
    let field_accuracy = scorer
        .is_json()
        .then(|| mean(&|s| s.score.field_accuracy.unwrap_or(0.0)));
    let pass_at_k = pass_k
        .iter()
        .filter_map(|&k| pass_at_k(n, correct, k).map(|v| (format!("pass@{k}"), v)))
        .collect();
    ItemOutcome {
        id: id.to_string(),
        scorer,
        correct,
        pass_rate,
        mean_score,
        field_accuracy,
        pass_at_k,
        metadata,
        samples,
    }
}

/// Aggregates item outcomes into run metrics (means over items).
pub fn summarize(items: &[ItemOutcome], pass_k: &[usize]) -> RunMetrics {
    let n = items.len().max(1) as f64;
    let samples: Vec<&SampleOutcome> = items.iter().flat_map(|i| i.samples.iter()).collect();
    let json_items: Vec<f64> = items.iter().filter_map(|i| i.field_accuracy).collect();
    let mut unparseable = BTreeMap::new();
    for s in &samples {
        if let Some(reason) = s.score.unparseable {
            *unparseable.entry(reason.as_str().to_string()).or_insert(0) += 1;
        }
    }
    let pass_at_k = pass_k
        .iter()
        .map(|k| {
            let key = format!("pass@{k}");
            let sum: f64 = items.iter().filter_map(|i| i.pass_at_k.get(&key)).sum();
            (key, sum / n)
        })
        .collect();
    let sample_count = samples.len().max(1) as f64;
    RunMetrics {
        items: items.len(),
        samples: samples.len(),
        exact_match: items.iter().map(|i| i.pass_rate).sum::<f64>() / n,
        mean_score: items.iter().map(|i| i.mean_score).sum::<f64>() / n,
        field_accuracy: (!json_items.is_empty())
            .then(|| json_items.iter().sum::<f64>() / json_items.len() as f64),
        pass_at_k,
        unparseable,
        request_errors: samples.iter().filter(|s| s.error.is_some()).count(),
        tool_calls_per_sample: samples.iter().map(|s| s.tool_calls as f64).sum::<f64>()
            / sample_count,
        mean_latency_ms: samples.iter().map(|s| s.latency_ms as f64).sum::<f64>() / sample_count,
        mean_token_logprob: mean_of(
            samples
                .iter()
                .filter_map(|s| s.tokens.map(|t| t.mean_logprob)),
        ),
        mean_token_entropy: mean_of(samples.iter().filter_map(|s| s.tokens?.mean_entropy)),
    }
}

/// The mean of the values, `None` when there are none.
fn mean_of(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (n, sum) = values.fold((0usize, 0.0), |(n, sum), v| (n + 1, sum + v));
    (n > 0).then(|| sum / n as f64)
}

/// The request body for one turn of an item.
pub fn request_body(cfg: &RunConfig, item: &EvalItem, messages: &[Value], sample: usize) -> Value {
    let mut body = json!({
        "model": cfg.model,
        "messages": messages,
        "temperature": cfg.temperature,
        "seed": cfg.seed.wrapping_add(sample as u64),
        "n": 1,
    });
    if let Some(top_p) = cfg.top_p {
        body["top_p"] = json!(top_p);
    }
    if let Some(max_tokens) = cfg.max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    if let Some(tools) = &item.tools {
        body["tools"] = json!(tools);
    }
    if let Some(format) = &item.response_format {
        body["response_format"] = format.clone();
    }
    if let Some(k) = cfg.top_logprobs {
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(k);
    }
    body
}

async fn run_sample(
    client: &ChatClient,
    cfg: &RunConfig,
    item: &EvalItem,
    sample: usize,
) -> SampleOutcome {
    let scorer = cfg.scorer_override.unwrap_or(item.scorer);
    let mut messages = item.messages.clone();
    let mut tool_calls = 0;
    let mut adapter = None;
    let clock = Instant::now();
    let elapsed = |c: &Instant| c.elapsed().as_millis() as u64;
    for turn in 0..=cfg.max_tool_turns {
        let body = request_body(cfg, item, &messages, sample);
        let response = match client.complete(&body).await {
            Ok(r) => r,
            Err(e) => return failed_sample(scorer, sample, &e, tool_calls, elapsed(&clock)),
        };
        adapter = response.adapter.clone().or(adapter);
        let calls = response.tool_calls();
        if calls.is_empty() {
            let content = response.content();
            let score = score_answer(
                scorer,
                &item.expected,
                &content,
                item.response_format.is_some(),
            );
            return SampleOutcome {
                sample,
                score,
                content: cfg.keep_content.then_some(content),
                error: None,
                adapter,
                tool_calls,
                latency_ms: elapsed(&clock),
                tokens: TokenStats::from_logprobs(&response.body["choices"][0]["logprobs"]),
            };
        }
        if turn == cfg.max_tool_turns {
            break;
        }
        messages.push(response.message().clone());
        for call in calls {
            tool_calls += 1;
            messages.push(json!({
                "role": "tool",
                "tool_call_id": call["id"].as_str().unwrap_or_default(),
                "content": replay_tool(item, &call),
            }));
        }
    }
    SampleOutcome {
        sample,
        score: Score::unparseable(scorer, Unparseable::ToolTurnLimit),
        content: None,
        error: None,
        adapter,
        tool_calls,
        latency_ms: elapsed(&clock),
        tokens: None,
    }
}

fn failed_sample(
    scorer: ScorerKind,
    sample: usize,
    e: &CallError,
    tool_calls: usize,
    latency_ms: u64,
) -> SampleOutcome {
    SampleOutcome {
        sample,
        score: Score::unparseable(scorer, Unparseable::RequestFailed),
        content: None,
        error: Some(e.to_string()),
        adapter: None,
        tool_calls,
        latency_ms,
        tokens: None,
    }
}

/// The replayed result (a JSON string) of one tool call.
fn replay_tool(item: &EvalItem, call: &Value) -> String {
    let name = call["function"]["name"].as_str().unwrap_or_default();
    let arguments = call["function"]["arguments"].as_str().unwrap_or("{}");
    let found = item
        .tool_replay
        .as_ref()
        .and_then(|tables| tables.get(name))
        .and_then(|table| table.get(&canonical_arguments(arguments)));
    match found {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None if item
            .tool_replay
            .as_ref()
            .is_some_and(|t| t.contains_key(name)) =>
        {
            json!({"error": format!("no record for arguments {arguments}")}).to_string()
        }
        None => json!({"error": format!("unknown tool {name:?}")}).to_string(),
    }
}
