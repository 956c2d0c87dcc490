//! The source and prepare stages: where the loop reads (positions checked against the topic
//! the broker holds now), and how records become a micro-batch of examples (dedup, staleness,
//! example building).

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use hindsight_feedback::{
    check_position, EpisodeRecord, Positions, RawRecord, TopicReader, ValidatedLogConfig,
};
use tokio::sync::mpsc;
use tracing::warn;
use uuid::Uuid;

use super::{emit, LearnerConfig, LearnerControl, LearnerEvent, OnlineError, ReplacedTopic};
use crate::checkpoint::LoopState;
use crate::example::{build_example, SkipReason, TrainExample};

/// The checkpoint's key for a partition: `topic/partition`.
pub(super) fn key(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

/// Checks every saved position against the episodes topic as the broker holds it now and
/// applies `on_replaced_topic` to the stale ones (see [`ReplacedTopic`]).
pub(super) async fn forget_stale_positions(
    log: &ValidatedLogConfig,
    cfg: &LearnerConfig,
    state: &mut LoopState,
) -> Result<(), OnlineError> {
    let saved: Vec<(String, i64)> = state
        .positions
        .iter()
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    for (key, next) in saved {
        let Some((topic, partition)) = split_key(&key) else {
            continue;
        };
        let last_id = state.last_ids.get(&key).copied();
        let client = log.client_config();
        let check = {
            let topic = topic.clone();
            tokio::task::spawn_blocking(move || {
                check_position(
                    &client,
                    &topic,
                    partition,
                    next,
                    last_id,
                    Duration::from_secs(10),
                )
            })
            .await
            .map_err(|e| OnlineError::Thread(e.to_string()))??
        };
        if !check.is_stale() {
            continue;
        }
        if cfg.on_replaced_topic == ReplacedTopic::Refuse {
            return Err(OnlineError::TopicReplaced {
                partition: key,
                position: next,
                check: format!("{check:?}"),
            });
        }
        warn!(partition = %key, position = next, ?check, "The checkpoint's position does not refer to this topic (emptied or replaced); reading it from the beginning.");
        metrics::counter!("hindsight_learner_positions_reset_total").increment(1);
        state.positions.remove(&key);
        state.last_ids.remove(&key);
        state.candidate_from.remove(&key);
    }
    Ok(())
}

/// `topic/partition` back into its parts.
fn split_key(key: &str) -> Option<(String, i32)> {
    let (t, p) = key.rsplit_once('/')?;
    Some((t.to_string(), p.parse().ok()?))
}

/// Saved positions (`topic/partition` keys) as the reader takes them.
pub(super) fn to_positions(map: &BTreeMap<String, i64>) -> Positions {
    map.iter()
        .filter_map(|(k, v)| Some((split_key(k)?, *v)))
        .collect()
}

/// The [`SkipReason`] a skip label names, for the skips an event reports (`duplicate` and
/// `malformed` have none).
fn skip_reason(label: &str) -> Option<SkipReason> {
    [
        SkipReason::NoAnswer,
        SkipReason::NoFeedback,
        SkipReason::TooLong,
        SkipReason::Unrenderable,
        SkipReason::Stale,
    ]
    .into_iter()
    .find(|r| r.as_str() == label)
}

/// Dedup, staleness and example building for one record; `Err(reason label)` skips it.
#[allow(clippy::too_many_arguments)]
fn prepare(
    rec: &EpisodeRecord,
    state: &LoopState,
    batch: &[TrainExample],
    cfg: &LearnerConfig,
    tokenizer: &tokenizers::Tokenizer,
    template: &hindsight_model::ChatTemplate,
    end_of_turn: u32,
) -> Result<TrainExample, &'static str> {
    // The same record again (in the checkpoint's memory or in the batch being gathered).
    if state.seen_record(&rec.record_id) || batch.iter().any(|e| e.record_id == rec.record_id) {
        return Err("duplicate");
    }
    // A re-emitted turn is trained on its new feedback only.
    let mut trained: Vec<uuid::Uuid> = state.trained_feedback(&rec.turn).to_vec();
    for e in batch.iter().filter(|e| e.turn == rec.turn) {
        trained.extend_from_slice(&e.feedback_ids);
    }
    let mut rec = rec.clone();
    if !trained.is_empty() {
        rec.feedback.retain(|f| !trained.contains(&f.feedback_id));
        if rec.feedback.is_empty() {
            return Err("duplicate");
        }
    }
    // Staleness: versions of this adapter behind the live one (other adapters and the base
    // model count as version 0).
    let produced = match crate::example::parse_adapter(rec.adapter.as_deref()) {
        Some((name, v)) if name == cfg.adapter_name => v,
        _ => 0,
    };
    let lag = state.live_version.unwrap_or(0).saturating_sub(produced);
    metrics::histogram!("hindsight_learner_staleness_versions").record(lag as f64);
    if lag > cfg.max_staleness_versions {
        return Err(SkipReason::Stale.as_str());
    }
    build_example(&rec, tokenizer, template, end_of_turn, &cfg.examples).map_err(SkipReason::as_str)
}

/// What building an example needs of the model: the tokenizer, the chat template, the
/// end-of-turn token.
pub(super) struct Prompting<'a> {
    pub(super) tokenizer: &'a tokenizers::Tokenizer,
    pub(super) template: &'a hindsight_model::ChatTemplate,
    pub(super) end_of_turn: u32,
}

/// One micro-batch as gathered: its examples, the positions it moves the checkpoint to, and
/// whether the loop should stop or snapshot after it.
pub(super) struct Gathered {
    pub(super) batch: Vec<TrainExample>,
    pub(super) batch_ids: Vec<Uuid>,
    pub(super) pending: BTreeMap<String, i64>,
    pub(super) pending_ids: BTreeMap<String, Uuid>,
    pub(super) records_in_batch: u64,
    pub(super) stop: bool,
    pub(super) snapshot_requested: bool,
}

/// The source stage: reads episode records until the micro-batch is full (examples or token
/// budget), its wait is over, a limit is reached, a command arrives or `shutdown` resolves;
/// turns each record into an example or counts why it was skipped.
pub(super) async fn gather<S: Future<Output = ()>>(
    shutdown: &mut std::pin::Pin<&mut S>,
    control: &mut Option<mpsc::UnboundedReceiver<LearnerControl>>,
    reader: &TopicReader,
    state: &mut LoopState,
    cfg: &LearnerConfig,
    p: &Prompting<'_>,
    events: &Option<mpsc::UnboundedSender<LearnerEvent>>,
) -> Result<Gathered, OnlineError> {
    let wait = Duration::from_millis(cfg.max_batch_wait_ms);
    let mut batch: Vec<TrainExample> = Vec::new();
    let mut batch_ids: Vec<Uuid> = Vec::new();
    let mut cost = 0usize;
    let mut pending = state.positions.clone();
    let mut pending_ids = state.last_ids.clone();
    let mut records_in_batch = 0u64;
    // The batch wait starts with the batch's first record, not before: after an idle spell
    // the first record would otherwise find the deadline passed and train alone.
    let mut deadline: Option<Instant> = None;
    let mut stop = false;
    let mut snapshot_requested = false;
    loop {
        if let Some(max) = cfg.max_examples {
            if state.examples + batch.len() as u64 >= max {
                stop = true;
                break;
            }
        }
        if let Some(max) = cfg.max_records {
            if state.records + records_in_batch >= max {
                stop = true;
                break;
            }
        }
        if batch.len() >= cfg.max_batch_examples || cost >= cfg.token_budget {
            break;
        }
        let left = deadline.map_or(wait, |d| d.saturating_duration_since(Instant::now()));
        // Train what we have; skipped records alone still get checkpointed (positions).
        if left.is_zero() && (!batch.is_empty() || records_in_batch > 0) {
            break;
        }
        let command = async {
            match control.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        let got: Option<RawRecord> = tokio::select! {
            biased;
            () = shutdown.as_mut() => { stop = true; break; }
            c = command => {
                match c {
                    Some(LearnerControl::SnapshotNow) => snapshot_requested = true,
                    None => *control = None, // sender gone: stop listening
                }
                break;
            }
            r = reader.recv_timeout(if batch.is_empty() { wait } else { left }) => r?,
        };
        let Some(raw) = got else { continue };
        deadline.get_or_insert_with(|| Instant::now() + wait);
        let k = key(&raw.topic, raw.partition);
        if raw.offset < state.positions.get(&k).copied().unwrap_or(0) {
            continue; // already in the checkpoint's weights
        }
        match raw.id {
            Some(id) => pending_ids.insert(k.clone(), id),
            None => pending_ids.remove(&k),
        };
        pending.insert(k, raw.offset + 1);
        records_in_batch += 1;
        let outcome = match raw.decode::<EpisodeRecord>() {
            Ok(rec) => prepare(
                &rec,
                state,
                &batch,
                cfg,
                p.tokenizer,
                p.template,
                p.end_of_turn,
            ),
            Err(e) => {
                warn!(error = %e, "Malformed episode record; skipped.");
                Err("malformed")
            }
        };
        match outcome {
            Ok(ex) => {
                cost += ex.cost_tokens();
                batch_ids.push(ex.record_id);
                batch.push(ex);
            }
            Err(reason) => {
                *state.skipped.entry(reason.to_string()).or_default() += 1;
                metrics::counter!("hindsight_learner_records_skipped_total", "reason" => reason)
                    .increment(1);
                if let Some(r) = skip_reason(reason) {
                    emit(events, LearnerEvent::Skipped(r));
                }
            }
        }
    }
    Ok(Gathered {
        batch,
        batch_ids,
        pending,
        pending_ids,
        records_in_batch,
        stop,
        snapshot_requested,
    })
}
