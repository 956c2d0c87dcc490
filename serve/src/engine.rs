//! The generation worker: one dedicated OS thread owns the model and runs every forward pass, so
//! blocking candle work never touches the tokio runtime.
//!
//! Requests arrive through a bounded queue (full = the caller answers 429). The worker admits the
//! waiting requests as a *group*: their prompts are left-padded into one batch with one KV cache
//! and a per-row adapter selection, prefilled together and then decoded together, one token per
//! row per step. Groups admitted later run alongside (the worker steps every group in turn), so a
//! new request never waits for a long one to finish.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;

use hindsight_model::candle_core::{DType, Tensor};
use hindsight_model::tokenizers::Tokenizer;
use hindsight_model::{AdapterSelection, BatchLayout, KvCache, Model, PaddingSide};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::adapters::AdapterVersion;
use crate::error::ServeError;
use crate::grammar::allowed_by_grammar;
use crate::grammar::{grammar_vocab, JsonState, Node};
use crate::sampler::{pick, Pick, SamplingParams};

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-turn token, stop string, or the constrained document is complete.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The model or the constraint failed mid-way.
    Error,
}

impl FinishReason {
    /// OpenAI's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Error => "error",
        }
    }
}

/// What the worker reports for a job, per choice index.
#[derive(Debug, Clone)]
pub enum Event {
    /// A sampled token and the text it makes visible (may be empty while held back).
    Token {
        /// Choice index.
        index: usize,
        /// The token and its behaviour log-prob.
        pick: Pick,
        /// Newly visible text.
        delta: String,
    },
    /// The choice is finished.
    Finished {
        /// Choice index.
        index: usize,
        /// Why.
        reason: FinishReason,
    },
}

/// What a job asks for.
#[derive(Debug, Clone)]
pub struct JobParams {
    /// Upper bound on new tokens per choice.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Base seed (choice `i` uses `seed + i`).
    pub seed: u64,
    /// Choices.
    pub n: usize,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Grammar the output must follow.
    pub grammar: Option<Node>,
}

/// One request for the worker.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The adapter version captured at request start (`None` = base model).
    pub adapter: Option<Arc<AdapterVersion>>,
    /// Parameters.
    pub params: JobParams,
    /// Where to report.
    pub events: UnboundedSender<Event>,
    /// Score the prompt (vLLM's `prompt_logprobs`): the log-prob of every prompt token after
    /// the first under the model, with this many alternatives each, sent here after prefill.
    pub prompt_logprobs: Option<(usize, oneshot::Sender<Vec<PromptToken>>)>,
}

/// One scored prompt token: its log-prob given the tokens before it (the model's own
/// distribution, temperature 1), its rank in that distribution (1 = most likely) and the most
/// likely alternatives, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptToken {
    /// The prompt's token.
    pub id: u32,
    /// Its log-prob (natural log).
    pub logprob: f32,
    /// 1 + the number of tokens more likely than it.
    pub rank: usize,
    /// `(id, logprob)` of the most likely tokens at this position.
    pub top: Vec<(u32, f32)>,
}

/// Prompt positions whose logits are materialised at once while scoring (64 × the vocabulary
/// in f32: ~12 MB for SmolLM2's 49k tokens), so a long prompt does not hold its whole
/// `[len, vocab]` matrix.
const SCORE_CHUNK: usize = 64;

/// Worker limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Requests that may wait in the queue.
    pub queue_capacity: usize,
    /// Most sequences decoded at once (over all groups).
    pub max_active_sequences: usize,
    /// Most sequences admitted into one group.
    pub max_group_size: usize,
}

/// Handle to the generation worker.
#[derive(Debug, Clone)]
pub struct Engine {
    tx: SyncSender<Job>,
}

/// Per-token text for guided decoding, and the shared inference context.
struct Ctx {
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    vocab: Arc<Vec<Option<String>>>,
}

impl Engine {
    /// Starts the worker thread.
    pub fn start(
        model: Arc<Model>,
        tokenizer: Arc<Tokenizer>,
        eos: Vec<u32>,
        cfg: EngineConfig,
    ) -> Result<Self, ServeError> {
        let vocab = Arc::new(grammar_vocab(&tokenizer, model.config().vocab_size));
        let (tx, rx) = sync_channel(cfg.queue_capacity.max(1));
        let ctx = Ctx {
            model,
            tokenizer,
            eos,
            vocab,
        };
        std::thread::Builder::new()
            .name("hindsight-generate".into())
            .spawn(move || worker(ctx, rx, cfg))?;
        Ok(Self { tx })
    }

    /// Queues a job; refuses at once when the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), ServeError> {
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(ServeError::Overloaded { retry_after_s: 1 }),
            Err(TrySendError::Disconnected(_)) => Err(ServeError::Unavailable),
        }
    }
}

/// One sequence in a group.
struct Row {
    events: UnboundedSender<Event>,
    index: usize,
    params: Arc<JobParams>,
    rng: StdRng,
    grammar: Option<JsonState>,
    generated: Vec<u32>,
    /// Bytes of decoded text already sent.
    sent: usize,
    /// Last input token (fed at the next step).
    last: u32,
    /// Position of the next token.
    pos: usize,
    done: bool,
}

struct Group {
    rows: Vec<Row>,
    adapters: Vec<Option<Arc<AdapterVersion>>>,
    cache: KvCache,
}

impl Group {
    fn active(&self) -> usize {
        self.rows.iter().filter(|r| !r.done).count()
    }
}

fn worker(ctx: Ctx, rx: Receiver<Job>, cfg: EngineConfig) {
    let mut groups: Vec<Group> = Vec::new();
    let mut waiting: std::collections::VecDeque<Job> = Default::default();
    let mut open = true;
    loop {
        let active: usize = groups.iter().map(Group::active).sum();
        if groups.is_empty() && waiting.is_empty() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(j) => waiting.push_back(j),
                Err(_) => return,
            }
        }
        // Take what is queued, as long as it can be admitted soon.
        let want = cfg.max_group_size.max(1);
        while open && waiting.iter().map(|j| j.params.n).sum::<usize>() < want {
            match rx.try_recv() {
                Ok(j) => waiting.push_back(j),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        let mut admitted = Vec::new();
        let mut rows = 0;
        while let Some(j) = waiting.front() {
            let n = j.params.n;
            let fits = active + rows + n <= cfg.max_active_sequences.max(1) && rows + n <= want;
            if !(fits || (admitted.is_empty() && active == 0)) {
                break;
            }
            rows += n;
            if let Some(j) = waiting.pop_front() {
                admitted.push(j);
            }
        }
        if !admitted.is_empty() {
            match prefill(&ctx, admitted) {
                Ok(g) => groups.push(g),
                Err(e) => tracing::error!(error = %e, "Prefill failed."),
            }
        }
        for g in &mut groups {
            if let Err(e) = decode_step(&ctx, g) {
                tracing::error!(error = %e, "Decode step failed.");
                for r in g.rows.iter_mut().filter(|r| !r.done) {
                    finish(r, FinishReason::Error);
                }
            }
        }
        groups.retain(|g| g.active() > 0);
    }
}

fn finish(row: &mut Row, reason: FinishReason) {
    row.done = true;
    let _ = row.events.send(Event::Finished {
        index: row.index,
        reason,
    });
}

fn selection<'a>(adapters: &'a [Option<Arc<AdapterVersion>>]) -> AdapterSelection<'a> {
    if adapters.iter().all(Option::is_none) {
        return AdapterSelection::None;
    }
    if let Some(Some(first)) = adapters.first() {
        if adapters
            .iter()
            .all(|a| a.as_ref().is_some_and(|a| Arc::ptr_eq(a, first)))
        {
            return AdapterSelection::All(&first.adapter);
        }
    }
    AdapterSelection::PerSequence(
        adapters
            .iter()
            .map(|a| a.as_ref().map(|v| &v.adapter))
            .collect(),
    )
}

/// Prefills the admitted jobs' prompts as one batch, one row per job, then gives each of a job's
/// `n` choices its own row: the choices share the prompt's prefill (its KV cache rows are
/// copied), and differ from the first sampled token on by their seeds.
fn prefill(ctx: &Ctx, mut jobs: Vec<Job>) -> Result<Group, ServeError> {
    let mut rows = Vec::new();
    let mut adapters = Vec::new();
    // The prefilled row each choice continues.
    let mut source = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        let params = Arc::new(job.params.clone());
        for i in 0..job.params.n {
            rows.push(Row {
                events: job.events.clone(),
                index: i,
                params: params.clone(),
                rng: StdRng::seed_from_u64(job.params.seed.wrapping_add(i as u64)),
                grammar: job.params.grammar.as_ref().map(JsonState::new),
                generated: Vec::new(),
                sent: 0,
                last: 0,
                pos: job.prompt.len(),
                done: false,
            });
            adapters.push(job.adapter.clone());
            source.push(j);
        }
    }
    let t = jobs.iter().map(|j| j.prompt.len()).max().unwrap_or(0);
    let lengths: Vec<usize> = jobs.iter().map(|j| j.prompt.len()).collect();
    let mut flat = Vec::with_capacity(jobs.len() * t);
    for job in &jobs {
        flat.extend(std::iter::repeat_n(0u32, t - job.prompt.len()));
        flat.extend_from_slice(&job.prompt);
    }
    let dev = ctx.model.device();
    let input =
        Tensor::from_vec(flat, (jobs.len(), t), dev).map_err(hindsight_model::ModelError::from)?;
    let layout = BatchLayout::padded(&lengths, t, PaddingSide::Left)?;
    let job_adapters: Vec<Option<Arc<AdapterVersion>>> =
        jobs.iter().map(|j| j.adapter.clone()).collect();
    let mut cache = KvCache::new();
    let hidden = ctx.model.hidden(
        &input,
        &layout,
        Some(&mut cache),
        &selection(&job_adapters),
        false,
    );
    let last = hidden.and_then(|h| {
        // Prompts asking to be scored: all their positions through the LM head.
        for (row, job) in jobs.iter_mut().enumerate() {
            if let Some((top, tx)) = job.prompt_logprobs.take() {
                let len = job.prompt.len();
                let scored = h
                    .narrow(0, row, 1)
                    .and_then(|r| r.squeeze(0))
                    .map_err(hindsight_model::ModelError::from)
                    .and_then(|r| {
                        score_prompt(&ctx.model, &r.narrow(0, t - len, len)?, &job.prompt, top)
                    });
                match scored {
                    Ok(tokens) => {
                        let _ = tx.send(tokens);
                    }
                    Err(e) => tracing::error!(error = %e, "Scoring a prompt failed."),
                }
            }
        }
        let logits = ctx.model.logits(&h.narrow(1, t - 1, 1)?.squeeze(1)?)?;
        if source.len() == jobs.len() {
            // One choice per job: nothing to copy.
            return Ok((logits, cache));
        }
        let index: Vec<u32> = source.iter().map(|&j| j as u32).collect();
        let index = Tensor::from_vec(index, source.len(), dev)?;
        Ok((logits.index_select(&index, 0)?, cache.select_rows(&source)?))
    });
    let mut group = Group {
        rows,
        adapters,
        cache: KvCache::new(),
    };
    match last {
        Ok((logits, cache)) => {
            group.cache = cache;
            sample_rows(ctx, &mut group, &logits)?
        }
        Err(e) => {
            for r in &mut group.rows {
                finish(r, FinishReason::Error);
            }
            return Err(e.into());
        }
    }
    Ok(group)
}

/// The log-prob, rank and `top` alternatives of every prompt token after the first, from the
/// prompt's hidden states `[len, hidden]`.
fn score_prompt(
    model: &Model,
    hidden: &Tensor,
    prompt: &[u32],
    top: usize,
) -> Result<Vec<PromptToken>, hindsight_model::ModelError> {
    let len = prompt.len();
    let mut out = Vec::with_capacity(len.saturating_sub(1));
    // Position i predicts token i + 1; the last position predicts what comes after the prompt.
    let mut start = 0;
    while start + 1 < len {
        let n = SCORE_CHUNK.min(len - 1 - start);
        let logits: Vec<Vec<f32>> = model
            .logits(&hidden.narrow(0, start, n)?)?
            .to_dtype(DType::F32)?
            .to_vec2()?;
        for (i, l) in logits.iter().enumerate() {
            let id = prompt[start + i + 1];
            out.push(score_token(l, id, top));
        }
        start += n;
    }
    Ok(out)
}

/// `id`'s log-prob and rank under `logits`, with the `top` most likely alternatives.
fn score_token(logits: &[f32], id: u32, top: usize) -> PromptToken {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .map(|&x| f64::from(x - max).exp())
            .sum::<f64>()
            .ln() as f32;
    let own = logits
        .get(id as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let rank = 1 + logits.iter().filter(|&&x| x > own).count();
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (j, &x) in logits.iter().enumerate() {
            if best.len() < top || best.last().is_some_and(|b| x > b.1) {
                let at = best.partition_point(|b| b.1 >= x);
                best.insert(at, (j as u32, x));
                best.truncate(top);
            }
        }
    }
    PromptToken {
        id,
        logprob: own - lse,
        rank,
        top: best.into_iter().map(|(j, x)| (j, x - lse)).collect(),
    }
}

fn decode_step(ctx: &Ctx, g: &mut Group) -> Result<(), ServeError> {
    let b = g.rows.len();
    let ids: Vec<u32> = g.rows.iter().map(|r| r.last).collect();
    let positions: Vec<u32> = g.rows.iter().map(|r| r.pos as u32 - 1).collect();
    let input = Tensor::from_vec(ids, (b, 1), ctx.model.device())
        .map_err(hindsight_model::ModelError::from)?;
    let layout = BatchLayout::new(b, 1, positions, vec![true; b])?;
    let logits =
        ctx.model
            .forward_last(&input, &layout, Some(&mut g.cache), &selection(&g.adapters))?;
    sample_rows(ctx, g, &logits)
}

/// Samples the next token of every live row from `logits` `[b, vocab]` and reports it.
fn sample_rows(ctx: &Ctx, g: &mut Group, logits: &Tensor) -> Result<(), ServeError> {
    let logits: Vec<Vec<f32>> = logits
        .to_dtype(DType::F32)
        .and_then(|l| l.to_vec2())
        .map_err(hindsight_model::ModelError::from)?;
    for (row, l) in g.rows.iter_mut().zip(&logits) {
        if row.done {
            continue;
        }
        // A disconnected client: stop spending compute on it.
        if row.events.is_closed() {
            row.done = true;
            continue;
        }
        step_row(ctx, row, l);
    }
    Ok(())
}

fn step_row(ctx: &Ctx, row: &mut Row, logits: &[f32]) {
    let p = &row.params;
    let picked = match &row.grammar {
        Some(state) => {
            let allow = allowed_by_grammar(state, &ctx.vocab);
            pick(logits, &p.sampling, Some(&allow), &mut row.rng)
        }
        None => pick(logits, &p.sampling, None, &mut row.rng),
    };
    let Some(picked) = picked else {
        finish(row, FinishReason::Error);
        return;
    };
    let id = picked.id;
    row.generated.push(id);
    row.last = id;
    row.pos += 1;
    let is_eos = row.grammar.is_none() && ctx.eos.contains(&id);
    let mut grammar_done = false;
    if let Some(state) = row.grammar.as_mut() {
        let text = ctx
            .vocab
            .get(id as usize)
            .cloned()
            .flatten()
            .unwrap_or_default();
        if !state.feed_str(&text) {
            // Cannot happen: the sampler only picks allowed tokens.
            finish(row, FinishReason::Error);
            return;
        }
        grammar_done = state.finished();
    }
    // Visible text: everything decoded so far, minus a held-back tail that might still become
    // a stop string or is an incomplete UTF-8 sequence.
    let text = hindsight_model::decode(&ctx.tokenizer, &row.generated, true).unwrap_or_default();
    let mut stop_at = None;
    for s in &p.stop {
        if s.is_empty() {
            continue;
        }
        let from = row.sent.saturating_sub(s.len());
        let from = (0..=from)
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        if let Some(i) = text[from..].find(s.as_str()) {
            stop_at = Some(stop_at.map_or(from + i, |x: usize| x.min(from + i)));
        }
    }
    let ending = is_eos || grammar_done || stop_at.is_some() || row.generated.len() >= p.max_tokens;
    let mut end = stop_at.unwrap_or(text.len());
    if !ending {
        let hold = p
            .stop
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0);
        end = end.saturating_sub(hold);
        while end > 0 && !text.is_char_boundary(end) {
            end -= 1;
        }
        if text[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
    }
    let end = end.max(row.sent);
    let delta = text.get(row.sent..end).unwrap_or_default().to_string();
    row.sent = end;
    let _ = row.events.send(Event::Token {
        index: row.index,
        pick: picked,
        delta,
    });
    if is_eos || grammar_done || stop_at.is_some() {
        finish(row, FinishReason::Stop);
    } else if row.generated.len() >= p.max_tokens {
        finish(row, FinishReason::Length);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scored_token_has_its_log_softmax_rank_and_the_best_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lse = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln() as f32;
        let t = score_token(&logits, 2, 3);
        assert!((t.logprob - (2.0 - lse)).abs() < 1e-6, "{t:?}");
        assert_eq!(t.rank, 3, "two tokens are more likely");
        let ids: Vec<u32> = t.top.iter().map(|a| a.0).collect();
        assert_eq!(ids, [1, 3, 2], "best first; ties keep vocabulary order");
        assert!((t.top[0].1 - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(score_token(&logits, 1, 0).rank, 1);
        assert!(score_token(&logits, 1, 0).top.is_empty());
    }
}
