//! The checkpoint and candidate stages: saving the trainer with the loop state (before any
//! offset commit), and registering and publishing a candidate adapter.

use hindsight_control::publish::{gate_and_publish_with, PublishConfig, PublishRollout};
use hindsight_control::registry::RegistryError;
use hindsight_control::registry::{NewVersion, OffsetRange, Registry, VersionEntry};
use hindsight_feedback::now_ms;
use serde_json::json;
use tracing::{info, warn};

use super::run_log::RunLog;
use super::{CandidateReport, LearnerConfig, OnlineError};
use crate::checkpoint::{CheckpointStore, LoopState};
use crate::trainer::Trainer;

/// Saves the trainer with the loop state as the next checkpoint (sequence number bumped) and
/// logs it; the caller commits offsets only after this returns.
pub(super) async fn checkpoint(
    store: &CheckpointStore,
    slot: &mut Option<Trainer>,
    state: &mut LoopState,
    run_log: &mut RunLog,
) -> Result<(), OnlineError> {
    state.seq += 1;
    let tr = slot
        .take()
        .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
    let (st, store2) = (state.clone(), store.clone());
    let (tr, res) = tokio::task::spawn_blocking(move || {
        let r = store2.save(&tr, &st);
        (tr, r)
    })
    .await
    .map_err(|e| OnlineError::Thread(e.to_string()))?;
    *slot = Some(tr);
    let dir = res?;
    run_log.write(json!({
        "event": "checkpoint",
        "seq": state.seq,
        "batches": state.batches,
        "examples": state.examples,
        "positions": state.positions,
        "dir": dir,
    }))?;
    Ok(())
}

/// Registers the current policy as a candidate and publishes it when configured.
pub(super) async fn candidate(
    reg: &Registry,
    (publish, routing): (
        Option<&PublishConfig>,
        Option<&hindsight_routing::RoutingConfig>,
    ),
    tr: &Trainer,
    state: &mut LoopState,
    cfg: &LearnerConfig,
    base_sha: &str,
    topic: &str,
) -> Result<CandidateReport, OnlineError> {
    let adapter = tr.snapshot_policy(&cfg.adapter_name)?;
    let offsets: Vec<OffsetRange> = state
        .positions
        .iter()
        .filter_map(|(k, to)| {
            let (t, p) = k.rsplit_once('/')?;
            let from = state.candidate_from.get(k).copied().unwrap_or(0);
            let partition = p.parse().ok()?;
            (t == topic && *to > from).then(|| OffsetRange {
                topic: t.to_string(),
                partition,
                from,
                to: *to,
            })
        })
        .collect();
    let base_name = cfg.served_base_name();
    let new_version = || NewVersion {
        name: &cfg.adapter_name,
        adapter: &adapter,
        base_model: &base_name,
        base_model_sha256: base_sha,
        parent: state.live_version,
        training_config: serde_json::to_value(&cfg.trainer).unwrap_or_default(),
        offsets: offsets.clone(),
        examples: state.examples - state.candidate_examples,
        tokens: tr.state().tokens,
    };
    // A Redis blip (a restart, a failover) must not cost the candidate: transient errors are
    // retried with backoff for up to 30 s. A retry after an unknown outcome may leave one
    // version number unused, never an entry without files.
    let mut backoff = std::time::Duration::from_millis(200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let entry: VersionEntry = loop {
        match reg.register(new_version()).await {
            Err(RegistryError::Redis(e))
                if hindsight_routing::is_transient(&e) && std::time::Instant::now() < deadline =>
            {
                warn!(error = %e, "Registering the candidate hit a Redis error; retrying.");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
            }
            other => break other?,
        }
    };
    let version = entry.version;
    info!(version, examples = state.examples, "Candidate registered.");
    state.candidate_from = state.positions.clone();
    state.candidate_batches = state.batches;
    state.candidate_examples = state.examples;
    state.candidate_at_ms = now_ms();
    let (verdict, status) = match publish {
        Some(p) => match publish_one(reg, entry, p, routing, &base_name).await {
            Ok(out) => {
                if out.entry.status.to_string() == "live" {
                    state.live_version = Some(out.entry.version);
                }
                (out.verdict, out.entry.status.to_string())
            }
            Err(e) => {
                // Serving unreachable: the version stays a registered candidate (publishable
                // later by hand); training goes on.
                warn!(version, error = %e, "Publishing failed; the version stays a candidate.");
                (None, "candidate (publishing failed)".to_string())
            }
        },
        None => (None, entry.status.to_string()),
    };
    info!(version, status = %status, "Candidate published.");
    Ok(CandidateReport {
        version,
        examples: state.examples,
        batches: state.batches,
        verdict,
        status,
    })
}

/// Gates and publishes one candidate; with `publish.rollout = "canary"` through the routing
/// table of `[routing]`.
async fn publish_one(
    reg: &Registry,
    entry: VersionEntry,
    p: &PublishConfig,
    routing: Option<&hindsight_routing::RoutingConfig>,
    base_name: &str,
) -> Result<hindsight_control::publish::PublishOutcome, hindsight_control::publish::PublishError> {
    let store = match (p.rollout, routing) {
        (PublishRollout::Canary, Some(r)) => Some(
            hindsight_routing::RoutingStore::new(r.store()).map_err(|e| {
                hindsight_control::publish::PublishError::Config(format!("routing: {e}"))
            })?,
        ),
        _ => None,
    };
    gate_and_publish_with(reg, entry, p, base_name, store.as_ref()).await
}
