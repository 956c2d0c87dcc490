//! The replay stage: a buffer of recently trained examples and deterministic draws from it for
//! extra steps after each batch.

use std::collections::VecDeque;

use serde_json::json;
use tokio::sync::mpsc;
use tracing::info_span;
use uuid::Uuid;

use super::run_log::RunLog;
use super::train::train_step;
use super::{emit, LearnerConfig, LearnerEvent, OnlineError};
use crate::example::TrainExample;
use crate::trainer::Trainer;

/// Appends the trained `batch` to the replay buffer (oldest out beyond `cap`), except the
/// examples the step learned nothing from ([`crate::trainer::StepReport::unlearned`]: e.g. an
/// example no configured objective applies to, which a replay would skip again at the cost of
/// its passes). Returns how many went in.
pub(super) fn remember_for_replay(
    replay: &mut VecDeque<TrainExample>,
    batch: Vec<TrainExample>,
    unlearned: &[Uuid],
    cap: usize,
) -> usize {
    let mut kept = 0;
    for ex in batch {
        if unlearned.contains(&ex.record_id) {
            continue;
        }
        if replay.len() >= cap {
            replay.pop_front();
        }
        replay.push_back(ex);
        kept += 1;
    }
    kept
}

/// SplitMix64: the replay sampler's deterministic hash of (batch, step, slot).
pub(super) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` indices into a buffer of `len` (none if it is empty), drawn deterministically from
/// `key`: distinct while `n <= len`; beyond that, further shuffled passes over the buffer, so
/// an index repeats only after every other one has been drawn as often.
pub(super) fn replay_draw(len: usize, n: usize, key: u64) -> Vec<usize> {
    let mut out = Vec::with_capacity(n);
    if len == 0 {
        return out;
    }
    let mut pass = 0u64;
    while out.len() < n {
        let take = (n - out.len()).min(len);
        out.extend(replay_indices(len, take, key ^ mix(pass)));
        pass += 1;
    }
    out
}

/// Up to `n` distinct indices into a buffer of `len`, drawn deterministically from `key`.
pub(super) fn replay_indices(len: usize, n: usize, key: u64) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..len).collect();
    let n = n.min(len);
    for i in 0..n {
        let j =
            i + (mix(key ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)) as usize) % (len - i);
        idx.swap(i, j);
    }
    idx.truncate(n);
    idx
}

/// The replay stage after batch `batches`: `replay_steps_per_batch` extra steps on earlier
/// examples (never the batch just trained). One draw per batch covers all its replay steps, so
/// they train distinct examples as long as the buffer holds enough of them.
pub(super) async fn replay_steps(
    slot: &mut Option<Trainer>,
    replay: &VecDeque<TrainExample>,
    cfg: &LearnerConfig,
    batches: u64,
    run_log: &mut RunLog,
    events: &Option<mpsc::UnboundedSender<LearnerEvent>>,
) -> Result<(), OnlineError> {
    let draw = replay_draw(
        replay.len(),
        cfg.replay_steps_per_batch * cfg.max_batch_examples,
        mix(batches),
    );
    for (j, slots) in draw.chunks(cfg.max_batch_examples.max(1)).enumerate() {
        let picked: Vec<TrainExample> = slots
            .iter()
            .filter_map(|&i| replay.get(i).cloned())
            .collect();
        let ids: Vec<Uuid> = picked.iter().map(|e| e.record_id).collect();
        let (_, report) = train_step(
            slot,
            picked,
            info_span!("learner_replay", batch = batches, step = j),
        )
        .await?;
        metrics::counter!("hindsight_learner_replay_steps_total").increment(1);
        run_log.write(json!({
            "event": "replay",
            "batch": batches,
            "record_ids": ids,
            "report": report,
        }))?;
        emit(events, LearnerEvent::Replay(Box::new(report)));
    }
    Ok(())
}
