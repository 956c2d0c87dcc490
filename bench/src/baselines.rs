//! The baselines (`cargo bench -p hindsight-bench --bench baselines`): the premise check for
//! self-distillation. On the eval split:
//! (a) the model as deployed, (b) with the whole SOP in its system prompt, (c) in hindsight —
//! its own first answer from (a), the truthful critic's critique of that very answer, then a
//! second answer — for each chosen prompt placement. Reports exact match, per-field accuracy
//! and pass@k for each.

use std::fmt::Write as _;

use anyhow::ensure;
use hindsight_eval::{
    evaluate, extract_json_answer, item_outcome, summarize, EvalItem, EvalSet, RunConfig,
    RunMetrics, RunReport, SampleOutcome,
};
use hindsight_learner::teacher_prompt::{hindsight_messages, HindsightPlacement};
use hindsight_sim::{
    critique, eval_items, resolve, CritiqueStyle, PromptOptions, Records, Rng, Split, Ticket,
    Variant, World,
};
use serde::{Deserialize, Serialize};

/// Feedback text used when the first answer was already right.
pub const CONFIRMATION: &str = "That decision is correct.";

/// Settings of the baselines.
#[derive(Debug, Clone)]
pub struct BaselineConfig {
    /// API base, e.g. `http://127.0.0.1:8000/v1` (`hindsight serve`).
    pub endpoint: String,
    /// Model name.
    pub model: String,
    /// Bearer token, if needed.
    pub api_key: Option<String>,
    /// World seed (the eval split of this seed is used).
    pub seed: u64,
    /// Eval tickets.
    pub tickets: usize,
    /// Samples per ticket (pass@samples is reported).
    pub samples: usize,
    /// Temperature of all runs.
    pub temperature: f64,
    /// max_tokens per request.
    pub max_tokens: Option<u32>,
    /// Requests in flight.
    pub concurrency: usize,
    /// Single- or multi-turn tickets.
    pub variant: Variant,
    /// How single-turn tickets write the order and customer records.
    pub records: Records,
    /// Use response_format (bare JSON) or `<final_output>` tags.
    pub response_format: bool,
    /// How explicit the critiques are.
    pub critique_style: CritiqueStyle,
    /// An earlier report whose runs (a) and (b) are reused when seed, tickets, samples and
    /// the eval set match (to iterate on hindsight prompts without re-running them).
    pub reuse: Option<BaselineReport>,
    /// Hindsight placements to measure.
    pub placements: Vec<HindsightPlacement>,
    /// Request timeout, ms.
    pub timeout_ms: u64,
    /// Progress bars.
    pub progress: bool,
}

/// One line of the baseline table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineRow {
    /// `(a) as deployed`, `(b) rules in system prompt`, `(c) hindsight: user-turn` …
    pub name: String,
    /// Exact match (mean per-sample).
    pub exact_match: f64,
    /// Per-field accuracy.
    pub field_accuracy: f64,
    /// pass@k for k = samples.
    pub pass_at_k: f64,
    /// Unparseable answers.
    pub unparseable: usize,
    /// The full metrics.
    pub metrics: RunMetrics,
}

/// All baselines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaselineReport {
    /// Endpoint.
    pub endpoint: String,
    /// Model.
    pub model: String,
    /// World seed.
    pub seed: u64,
    /// Tickets.
    pub tickets: usize,
    /// Samples per ticket.
    pub samples: usize,
    /// Temperature.
    pub temperature: f64,
    /// The table.
    pub rows: Vec<BaselineRow>,
    /// The underlying runs ((a), (b), then one per placement).
    pub runs: Vec<RunReport>,
}

fn run_config(cfg: &BaselineConfig, samples: usize, seed_offset: u64) -> RunConfig {
    let mut rc = RunConfig::new(&cfg.endpoint, &cfg.model);
    rc.api_key = cfg.api_key.clone();
    rc.samples = samples;
    rc.pass_k = if samples > 1 {
        vec![1, samples]
    } else {
        vec![1]
    };
    rc.temperature = cfg.temperature;
    rc.seed = cfg.seed.wrapping_add(seed_offset);
    rc.max_tokens = cfg.max_tokens;
    rc.concurrency = cfg.concurrency;
    rc.request_timeout_ms = cfg.timeout_ms;
    rc.progress = cfg.progress;
    rc
}

fn row(name: &str, metrics: RunMetrics, samples: usize) -> BaselineRow {
    tracing::info!(
        baseline = name,
        exact_match = metrics.exact_match,
        field_accuracy = metrics.field_accuracy.unwrap_or(0.0),
        "Baseline measured."
    );
    BaselineRow {
        name: name.to_string(),
        exact_match: metrics.exact_match,
        field_accuracy: metrics.field_accuracy.unwrap_or(0.0),
        pass_at_k: metrics
            .pass_at_k
            .get(&format!("pass@{samples}"))
            .copied()
            .unwrap_or(metrics.exact_match),
        unparseable: metrics.unparseable.values().sum(),
        metrics,
    }
}

/// The hindsight items for sample `s` of run (a): each ticket's first answer, the truthful
/// critique of it, placed as `placement`.
pub fn hindsight_items(
    world: &World,
    base_items: &[EvalItem],
    first: &RunReport,
    sample: usize,
    placement: HindsightPlacement,
    response_format: bool,
    style: CritiqueStyle,
) -> Vec<EvalItem> {
    let tickets = world.tickets(Split::Eval, base_items.len());
    base_items
        .iter()
        .zip(&tickets)
        .zip(&first.items)
        .map(|((item, ticket), outcome)| {
            let answer_text = outcome
                .samples
                .get(sample)
                .and_then(|s| s.content.clone())
                .unwrap_or_default();
            let feedback =
                feedback_for(world, ticket, &answer_text, response_format, sample, style);
            let mut h = item.clone();
            h.messages = hindsight_messages(placement, &item.messages, &answer_text, &feedback);
            h
        })
        .collect()
}

/// The truthful critic's text for a first answer (or [`CONFIRMATION`] when it was right).
pub fn feedback_for(
    world: &World,
    ticket: &Ticket,
    answer_text: &str,
    response_format: bool,
    sample: usize,
    style: CritiqueStyle,
) -> String {
    let resolution = resolve(ticket);
    let parsed = extract_json_answer(answer_text, response_format).ok();
    let broken = resolution.broken_rules(parsed.as_ref());
    if broken.is_empty() {
        return CONFIRMATION.to_string();
    }
    let mut rng = Rng::derive(
        world.seed,
        "baseline-critique",
        ticket.index * 64 + sample as u64,
    );
    critique(
        &mut rng,
        ticket,
        &resolution,
        &broken,
        parsed.is_none(),
        style,
    )
}

/// Runs (a), (b) and (c) and returns the table.
pub async fn run_baselines(cfg: &BaselineConfig) -> anyhow::Result<BaselineReport> {
    ensure!(
        cfg.samples >= 1 && cfg.tickets >= 1,
        "tickets and samples must be >= 1"
    );
    let world = World::new(cfg.seed);
    let options = PromptOptions {
        variant: cfg.variant,
        records: cfg.records,
        with_rules: false,
        response_format: cfg.response_format,
    };
    let base_items = eval_items(&world, Split::Eval, cfg.tickets, options);
    let rules_items = eval_items(
        &world,
        Split::Eval,
        cfg.tickets,
        PromptOptions {
            with_rules: true,
            ..options
        },
    );

    let mut rows = Vec::new();
    let mut runs = Vec::new();

    let set_a = EvalSet::from_items(format!("env-eval-seed{}", cfg.seed), base_items.clone())?;
    let reused = cfg.reuse.as_ref().filter(|r| {
        r.seed == cfg.seed
            && r.tickets == cfg.tickets
            && r.samples == cfg.samples
            && r.runs.len() >= 2
            && r.runs[0].set.sha256 == set_a.sha256
    });
    let a = match reused {
        Some(r) => {
            tracing::info!("Reusing runs (a) and (b) from the earlier report.");
            let b = r.runs[1].clone();
            rows.push(row(
                "(a) as deployed",
                r.runs[0].metrics.clone(),
                cfg.samples,
            ));
            rows.push(row(
                "(b) rules in system prompt",
                b.metrics.clone(),
                cfg.samples,
            ));
            runs.push(b);
            r.runs[0].clone()
        }
        None => {
            let a = evaluate(&set_a, &run_config(cfg, cfg.samples, 0)).await?;
            rows.push(row("(a) as deployed", a.metrics.clone(), cfg.samples));
            let set_b =
                EvalSet::from_items(format!("env-eval-rules-seed{}", cfg.seed), rules_items)?;
            let b = evaluate(&set_b, &run_config(cfg, cfg.samples, 0)).await?;
            rows.push(row(
                "(b) rules in system prompt",
                b.metrics.clone(),
                cfg.samples,
            ));
            runs.push(b);
            a
        }
    };

    for placement in &cfg.placements {
        // Sample s of (c) continues sample s of (a), with seed + s like (a)'s sample s.
        let mut per_ticket: Vec<Vec<SampleOutcome>> = vec![Vec::new(); base_items.len()];
        let mut last = None;
        for s in 0..cfg.samples {
            let items = hindsight_items(
                &world,
                &base_items,
                &a,
                s,
                *placement,
                cfg.response_format,
                cfg.critique_style,
            );
            let set =
                EvalSet::from_items(format!("env-hindsight-{}-s{s}", placement.as_str()), items)?;
            let run = evaluate(&set, &run_config(cfg, 1, s as u64)).await?;
            for (slot, item) in per_ticket.iter_mut().zip(&run.items) {
                if let Some(mut sample) = item.samples.first().cloned() {
                    sample.sample = s;
                    slot.push(sample);
                }
            }
            last = Some(run);
        }
        let pass_k = if cfg.samples > 1 {
            vec![1, cfg.samples]
        } else {
            vec![1]
        };
        let items: Vec<_> = base_items
            .iter()
            .zip(per_ticket)
            .map(|(item, samples)| {
                item_outcome(
                    &item.id,
                    item.scorer,
                    item.metadata.clone(),
                    samples,
                    &pass_k,
                )
            })
            .collect();
        let metrics = summarize(&items, &pass_k);
        rows.push(row(
            &format!("(c) hindsight: {}", placement.as_str()),
            metrics.clone(),
            cfg.samples,
        ));
        if let Some(mut run) = last {
            run.set.name = format!("env-hindsight-{}", placement.as_str());
            run.samples = cfg.samples;
            run.seed = cfg.seed;
            run.metrics = metrics;
            run.items = items;
            runs.push(run);
        }
    }
    runs.insert(0, a);
    Ok(BaselineReport {
        endpoint: cfg.endpoint.clone(),
        model: cfg.model.clone(),
        seed: cfg.seed,
        tickets: cfg.tickets,
        samples: cfg.samples,
        temperature: cfg.temperature,
        rows,
        runs,
    })
}

/// The table as Markdown (for bench/README.md).
pub fn render_table(report: &BaselineReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {} @ {}, {} eval tickets (seed {}), {} samples at temperature {}",
        report.model,
        report.endpoint,
        report.tickets,
        report.seed,
        report.samples,
        report.temperature
    );
    let _ = writeln!(
        out,
        "| baseline | exact match | field accuracy | pass@{} | unparseable |",
        report.samples
    );
    let _ = writeln!(out, "| --- | ---: | ---: | ---: | ---: |");
    for r in &report.rows {
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {:.1}% | {:.1}% | {} |",
            r.name,
            100.0 * r.exact_match,
            100.0 * r.field_accuracy,
            100.0 * r.pass_at_k,
            r.unparseable
        );
    }
    out
}
