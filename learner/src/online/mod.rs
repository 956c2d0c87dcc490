//! `hindsight learner`: the online loop.
//!
//! It consumes `hindsight.episodes` as a consumer group, turns records into examples
//! ([`crate::example`]), micro-batches them by token budget, steps the trainer, checkpoints, and
//! every N batches, M examples or T minutes snapshots a candidate adapter into the registry and
//! publishes it through the eval gate (`hindsight_control::publish`).
//!
//! **Exactly once.** A checkpoint holds the trainer and the Kafka position after the last record
//! its state includes. Offsets are committed to Kafka only after the checkpoint is durable, and
//! on start the loop resumes from the checkpoint and ignores records before its positions (they
//! are already in the weights even if the commit did not happen). Records read after the last
//! checkpoint are neither in the weights nor committed, so they are read again. Killing the
//! process at any instant therefore neither loses nor repeats an example; the crash test kills
//! it with SIGKILL and checks the trained record ids.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hindsight_feedback::{
    check_position, ensure_topics, now_ms, EpisodeRecord, LogError, Positions, RawRecord, Topic,
    TopicReader, ValidatedLogConfig,
};
use serde::Serialize;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::checkpoint::{CheckpointStore, LoopState};
use crate::error::LearnerError;
use crate::example::{build_example, SkipReason, TrainExample};
use crate::trainer::{DistillTarget, StepReport, TeacherDecoding, Trainer};
use hindsight_control::publish::{gate_and_publish, GateVerdict, PublishConfig, PublishError};
use hindsight_control::registry::{
    sha256_file, NewVersion, OffsetRange, Registry, RegistryConfig, RegistryError, VersionEntry,
};
use hindsight_model::grammar::grammar_vocab;
use hindsight_model::Adapter;
use hindsight_model::ModelBundle;

mod config;
#[cfg(test)]
mod tests;

pub use config::{Assignment, LearnerArgs, LearnerConfig, LearnerFile, ReplacedTopic};

/// Everything that stops the learner.
#[derive(Debug, thiserror::Error)]
pub enum OnlineError {
    /// A setting is invalid.
    #[error("learner config: {0}")]
    Config(String),
    /// The model or a training step failed.
    #[error(transparent)]
    Learner(#[from] LearnerError),
    /// The model could not be loaded.
    #[error(transparent)]
    Model(#[from] hindsight_model::ModelError),
    /// Kafka.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The registry.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// Publishing.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// The run log could not be written.
    #[error("run log {path}: {source}")]
    RunLog {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A blocking task panicked or was cancelled.
    #[error("training thread failed: {0}")]
    Thread(String),
    /// The checkpoint's position does not refer to the topic the broker holds now, and
    /// `learner.on_replaced_topic = "refuse"`.
    #[error("the checkpoint's position {position} on {partition} does not refer to this topic ({check}); move the checkpoint away or set learner.on_replaced_topic = \"restart\"")]
    TopicReplaced {
        /// `topic/partition`.
        partition: String,
        /// The saved next offset.
        position: i64,
        /// What the check found.
        check: String,
    },
}

/// Where the learner publishes (both optional: without a registry candidates are not kept).
#[derive(Debug, Clone)]
pub struct LearnerSetup {
    /// `[learner]`.
    pub learner: LearnerConfig,
    /// `[log]`: brokers and topic names.
    pub log: ValidatedLogConfig,
    /// `[registry]`, if candidates are registered.
    pub registry: Option<RegistryConfig>,
    /// `[publish]`, if candidates are gated and loaded into serving.
    pub publish: Option<PublishConfig>,
}

/// One candidate the loop produced.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateReport {
    /// Registry version.
    pub version: u64,
    /// Examples trained on when it was snapshotted.
    pub examples: u64,
    /// Micro-batches when it was snapshotted.
    pub batches: u64,
    /// The gate's verdict, if a gate ran.
    pub verdict: Option<GateVerdict>,
    /// Registry status after publishing.
    pub status: String,
}

/// What the learner reports while it runs (for benchmarks and `hindsight up`).
#[derive(Debug, Clone)]
pub enum LearnerEvent {
    /// A micro-batch of new examples was processed.
    Step(Box<StepReport>),
    /// A replay step on earlier examples was processed (`replay_steps_per_batch`).
    Replay(Box<StepReport>),
    /// A candidate was registered (and published when configured).
    Candidate(CandidateReport),
    /// A record was skipped.
    Skipped(SkipReason),
}

/// Commands to a running learner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LearnerControl {
    /// Snapshot a candidate after the current micro-batch (and publish it when configured),
    /// even if no new example arrived since the last one.
    SnapshotNow,
}

/// Totals when the loop stops.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LearnerSummary {
    /// Micro-batches processed.
    pub batches: u64,
    /// Optimizer steps applied.
    pub steps: u64,
    /// Steps refused by a guard.
    pub refused_steps: u64,
    /// Examples trained on.
    pub examples: u64,
    /// Records consumed.
    pub records: u64,
    /// Skipped records by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Candidates produced.
    pub candidates: Vec<CandidateReport>,
    /// Wall time, ms.
    pub duration_ms: u64,
}

fn key(topic: &str, partition: i32) -> String {
    format!("{topic}/{partition}")
}

/// Checks every saved position against the episodes topic as the broker holds it now and
/// applies `on_replaced_topic` to the stale ones (see [`ReplacedTopic`]).
async fn forget_stale_positions(
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

fn to_positions(map: &BTreeMap<String, i64>) -> Positions {
    map.iter()
        .filter_map(|(k, v)| Some((split_key(k)?, *v)))
        .collect()
}

/// The JSONL run log.
struct RunLog {
    file: Option<(PathBuf, std::fs::File)>,
}

impl RunLog {
    fn open(path: &Path) -> Result<Self, OnlineError> {
        if path.as_os_str().is_empty() {
            return Ok(Self { file: None });
        }
        let err = |source| OnlineError::RunLog {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(err)?;
        Ok(Self {
            file: Some((path.to_path_buf(), f)),
        })
    }

    fn write(&mut self, mut value: serde_json::Value) -> Result<(), OnlineError> {
        let Some((path, f)) = self.file.as_mut() else {
            return Ok(());
        };
        if let Some(obj) = value.as_object_mut() {
            obj.insert("time_ms".into(), json!(now_ms()));
        }
        let mut line = value.to_string();
        line.push('\n');
        f.write_all(line.as_bytes())
            .and_then(|_| f.flush())
            .map_err(|source| OnlineError::RunLog {
                path: path.clone(),
                source,
            })
    }
}

/// What the loop starts from: the model's tokenizer and template, the registry, and the
/// trainer and loop state restored from the latest checkpoint (else from the live adapter,
/// else fresh).
struct Resumed {
    tokenizer: tokenizers::Tokenizer,
    template: hindsight_model::ChatTemplate,
    end_of_turn: u32,
    registry: Option<Registry>,
    base_sha: String,
    store: CheckpointStore,
    state: LoopState,
    trainer: Trainer,
}

/// The start-up stage: loads the model, connects the registry, builds the trainer and restores
/// the latest checkpoint into it.
async fn resume(setup: &LearnerSetup) -> Result<Resumed, OnlineError> {
    let cfg = &setup.learner;
    // The model, loaded once, in the configured dtype on the configured device (never the
    // quantized inference copies).
    let model_path = cfg.model_path.clone();
    let (device_spec, dtype) = (cfg.device, cfg.dtype.dtype());
    let bundle = tokio::task::spawn_blocking(move || {
        ModelBundle::load(&model_path, dtype, &device_spec.open()?)
    })
    .await
    .map_err(|e| OnlineError::Thread(e.to_string()))??;
    let end_of_turn = bundle
        .end_of_turn()
        .ok_or_else(|| OnlineError::Config("the model has no end-of-turn token".into()))?;
    let template = bundle.chat_template.ok_or_else(|| {
        OnlineError::Config(format!(
            "{} carries no chat template; the learner must render prompts exactly as served",
            cfg.model_path.display()
        ))
    })?;
    let tokenizer = bundle.tokenizer.clone();
    let model_cfg = bundle.config.clone();
    let model = Arc::new(bundle.model);

    let registry = match &setup.registry {
        Some(r) => Some(Registry::connect(r.clone()).await?),
        None => None,
    };
    let base_sha = {
        let p = cfg.model_path.clone();
        tokio::task::spawn_blocking(move || {
            if p.is_file() {
                sha256_file(&p)
            } else {
                sha256_file(&p.join("config.json"))
            }
        })
        .await
        .map_err(|e| OnlineError::Thread(e.to_string()))??
    };

    // The trainer: from the latest checkpoint, else from the live adapter, else fresh.
    let live = match &registry {
        Some(r) => r.live(&cfg.adapter_name).await?,
        None => None,
    };
    let mut trainer = match &live {
        Some(entry) => {
            let adapter = Adapter::load_peft(
                &entry.path,
                cfg.adapter_name.clone(),
                &model_cfg,
                model.device(),
            )?;
            Trainer::with_policy(model.clone(), cfg.trainer.clone(), adapter)?
        }
        None => Trainer::new(model.clone(), cfg.trainer.clone(), &cfg.adapter_name)?,
    };
    if cfg.trainer.distill_target != DistillTarget::Logged {
        // The teacher decodes its own answers under the logged requests' grammars.
        trainer.set_decoding(TeacherDecoding {
            vocab: Arc::new(grammar_vocab(&tokenizer, model_cfg.vocab_size)),
            end_of_turn,
            tokenizer: Some(Arc::new(tokenizer.clone())),
        });
    }
    let store = CheckpointStore::open(&cfg.checkpoint_dir, cfg.keep_checkpoints)?;
    let mut state = match store.restore(&mut trainer)? {
        Some(s) => {
            info!(
                seq = s.seq,
                batches = s.batches,
                examples = s.examples,
                "Resumed from checkpoint."
            );
            s
        }
        None => LoopState {
            candidate_at_ms: now_ms(),
            live_version: live.as_ref().map(|e| e.version),
            ..Default::default()
        },
    };
    if let Some(entry) = &live {
        state.live_version = Some(state.live_version.unwrap_or(0).max(entry.version));
    }
    Ok(Resumed {
        tokenizer,
        template,
        end_of_turn,
        registry,
        base_sha,
        store,
        state,
        trainer,
    })
}

/// Runs the learner until `shutdown` resolves or a configured limit is reached. Events go to
/// `events` when given; `control` takes commands (e.g. snapshot now).
pub async fn run_learner(
    setup: LearnerSetup,
    shutdown: impl Future<Output = ()>,
    events: Option<mpsc::UnboundedSender<LearnerEvent>>,
    mut control: Option<mpsc::UnboundedReceiver<LearnerControl>>,
) -> Result<LearnerSummary, OnlineError> {
    let cfg = setup.learner.clone();
    cfg.validate()?;
    let started = Instant::now();
    let mut run_log = RunLog::open(&cfg.run_log)?;
    let Resumed {
        tokenizer,
        template,
        end_of_turn,
        registry,
        base_sha,
        store,
        mut state,
        trainer,
    } = resume(&setup).await?;
    run_log.write(json!({
        "event": "start",
        "checkpoint_seq": state.seq,
        "batches": state.batches,
        "examples": state.examples,
        "positions": state.positions,
        "live_version": state.live_version,
    }))?;

    let topic = setup.log.topics().get(Topic::Episodes).to_string();
    ensure_topics(
        &setup.log.client_config(),
        std::slice::from_ref(&topic),
        setup.log.raw().topic_partitions,
        setup.log.raw().topic_replication,
        Duration::from_secs(30),
    )
    .await?;
    forget_stale_positions(&setup.log, &cfg, &mut state).await?;
    let reader = match cfg.assignment {
        Assignment::Checkpoint => TopicReader::assigned(
            &setup.log,
            &cfg.group_id,
            &[Topic::Episodes],
            &to_positions(&state.positions),
            Duration::from_secs(30),
        )?,
        Assignment::Group => TopicReader::new(&setup.log, &cfg.group_id, &[Topic::Episodes])?,
    };
    info!(topic = %topic, group = %cfg.group_id, assignment = ?cfg.assignment, adapter = %cfg.adapter_name, "Learner consuming episodes.");
    // Checkpoint first, then commit. In `checkpoint` assignment the commit only reports
    // progress (the checkpoint decides where a restart reads), so a broker refusing it does not
    // stop training; in `group` mode it decides where a restart reads, so it must succeed.
    let commit = |positions: &BTreeMap<String, i64>| -> Result<(), OnlineError> {
        match reader.commit_offsets(&to_positions(positions)) {
            Ok(()) => Ok(()),
            Err(e) if cfg.assignment == Assignment::Checkpoint => {
                warn!(error = %e, "Offset commit failed (advisory; the checkpoint holds the positions).");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    };

    let mut summary = LearnerSummary::default();
    let emit = |e: LearnerEvent| emit(&events, e);
    tokio::pin!(shutdown);
    let mut batches_since_ckpt = 0u64;
    let mut trainer_slot = Some(trainer);
    // Recently trained examples for replay steps (oldest first).
    let mut replay: VecDeque<TrainExample> = VecDeque::new();
    let mut last_rate = Instant::now();
    let (mut rate_examples, mut rate_tokens) = (0u64, 0u64);

    'outer: loop {
        // Gather one micro-batch.
        let Gathered {
            batch,
            batch_ids,
            pending,
            pending_ids,
            records_in_batch,
            stop,
            snapshot_requested,
        } = gather(
            &mut shutdown,
            &mut control,
            &reader,
            &mut state,
            &cfg,
            &Prompting {
                tokenizer: &tokenizer,
                template: &template,
                end_of_turn,
            },
            &events,
        )
        .await?;

        if !batch.is_empty() {
            let (b, report) = train_step(
                &mut trainer_slot,
                batch,
                info_span!("learner_batch", batch = state.batches + 1),
            )
            .await?;
            for ex in &b {
                state.remember(ex.record_id, ex.turn, &ex.feedback_ids);
            }
            state.examples += b.len() as u64;
            state.batches += 1;
            batches_since_ckpt += 1;
            rate_examples += b.len() as u64;
            rate_tokens += report.tokens as u64;
            record_metrics(&report);
            let secs = last_rate.elapsed().as_secs_f64().max(1e-3);
            let (eps, tps) = (rate_examples as f64 / secs, rate_tokens as f64 / secs);
            metrics::gauge!("hindsight_learner_examples_per_second").set(eps);
            metrics::gauge!("hindsight_learner_tokens_per_second").set(tps);
            if secs > 30.0 {
                last_rate = Instant::now();
                rate_examples = 0;
                rate_tokens = 0;
            }
            info!(
                batch = state.batches,
                step = report.step,
                examples = state.examples,
                loss = format!("{:.4}", report.loss),
                kl = format!("{:.4}", report.kl_to_base),
                grad_norm = format!("{:.3}", report.grad_norm),
                tokens_per_s = format!("{tps:.0}"),
                skipped = report.skipped.as_deref().unwrap_or(""),
                "Trained a micro-batch."
            );
            run_log.write(json!({
                "event": "batch",
                "batch": state.batches,
                "record_ids": batch_ids,
                "report": report,
            }))?;
            let (trained, unlearned) = (report.examples, report.unlearned.clone());
            emit(LearnerEvent::Step(Box::new(report)));

            replay_steps(
                &mut trainer_slot,
                &replay,
                &cfg,
                state.batches,
                &mut run_log,
                &events,
            )
            .await?;
            if cfg.replay_steps_per_batch > 0 {
                let skip: &[Uuid] = if cfg.replay_unlearned {
                    &[]
                } else {
                    &unlearned
                };
                let kept = remember_for_replay(&mut replay, b, skip, cfg.replay_buffer_examples);
                metrics::counter!("hindsight_learner_replay_excluded_total")
                    .increment(trained.saturating_sub(kept) as u64);
            }
        }
        state.records += records_in_batch;
        let moved = pending != state.positions;
        state.positions = pending;
        state.last_ids = pending_ids;

        // Checkpoint, then commit: the order that makes a crash safe.
        if batches_since_ckpt >= cfg.checkpoint_every_batches
            || (moved && batches_since_ckpt == 0)
            || (stop && (batches_since_ckpt > 0 || moved))
        {
            checkpoint(&store, &mut trainer_slot, &mut state, &mut run_log).await?;
            commit(&state.positions)?;
            batches_since_ckpt = 0;
        }

        // Candidate?
        let since_batches = state.batches - state.candidate_batches;
        let since_examples = state.examples - state.candidate_examples;
        // (Not at shutdown: the checkpoint keeps the progress and the next run continues; a
        // stopping process should not start a gate run.)
        let due = snapshot_requested
            || !stop
                && since_examples > 0
                && ((cfg.candidate_every_batches > 0
                    && since_batches >= cfg.candidate_every_batches)
                    || (cfg.candidate_every_examples > 0
                        && since_examples >= cfg.candidate_every_examples)
                    || (cfg.candidate_every_ms > 0
                        && now_ms() - state.candidate_at_ms >= cfg.candidate_every_ms as i64));
        if due && registry.is_none() && snapshot_requested {
            warn!("Snapshot requested but no [registry] is configured; ignored.");
        }
        if due {
            if let Some(reg) = &registry {
                if batches_since_ckpt > 0 {
                    checkpoint(&store, &mut trainer_slot, &mut state, &mut run_log).await?;
                    commit(&state.positions)?;
                    batches_since_ckpt = 0;
                }
                let tr = trainer_slot
                    .as_ref()
                    .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
                let made = candidate(
                    reg,
                    setup.publish.as_ref(),
                    tr,
                    &mut state,
                    &cfg,
                    &base_sha,
                    &topic,
                )
                .await;
                match made {
                    Ok(report) => {
                        run_log.write(json!({"event": "candidate", "candidate": report}))?;
                        summary.candidates.push(report.clone());
                        emit(LearnerEvent::Candidate(report));
                    }
                    Err(e) => {
                        // Redis away or the registry's disk full: keep training; the next
                        // trigger tries again.
                        warn!(error = %e, "Could not register a candidate; training goes on.");
                        metrics::counter!("hindsight_learner_candidate_failures_total")
                            .increment(1);
                        run_log
                            .write(json!({"event": "candidate_failed", "error": e.to_string()}))?;
                        state.candidate_batches = state.batches;
                        state.candidate_examples = state.examples;
                        state.candidate_at_ms = now_ms();
                    }
                }
                // The candidate bookkeeping belongs in the checkpoint too.
                checkpoint(&store, &mut trainer_slot, &mut state, &mut run_log).await?;
                commit(&state.positions)?;
            }
        }
        if stop {
            break 'outer;
        }
    }

    let tr = trainer_slot
        .as_ref()
        .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
    summary.batches = state.batches;
    summary.steps = tr.state().steps;
    summary.refused_steps = tr.state().skipped_steps;
    summary.examples = state.examples;
    summary.records = state.records;
    summary.skipped = state.skipped.clone();
    summary.duration_ms = started.elapsed().as_millis() as u64;
    run_log.write(json!({"event": "stop", "summary": summary}))?;
    info!(?summary, "Learner stopped.");
    Ok(summary)
}

/// Runs [`run_learner`] on a thread of its own (with its own Tokio runtime) until `shutdown`
/// fires or is dropped: how `hindsight up` and the benchmarks embed the learner next to other
/// services. (The loop's future is not `Send` for every lifetime — rustc cannot prove it
/// through some dependencies' futures, rust-lang/rust#110338 — so it cannot go to
/// `tokio::spawn`; it is CPU-bound anyway.)
pub fn spawn_learner(
    setup: LearnerSetup,
    shutdown: tokio::sync::oneshot::Receiver<()>,
    events: Option<mpsc::UnboundedSender<LearnerEvent>>,
    control: Option<mpsc::UnboundedReceiver<LearnerControl>>,
) -> std::io::Result<std::thread::JoinHandle<Result<LearnerSummary, OnlineError>>> {
    std::thread::Builder::new()
        .name("hindsight-learner".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| OnlineError::Thread(e.to_string()))?;
            rt.block_on(run_learner(
                setup,
                async {
                    let _ = shutdown.await;
                },
                events,
                control,
            ))
        })
}

/// Appends the trained `batch` to the replay buffer (oldest out beyond `cap`), except the
/// examples the step learned nothing from ([`crate::trainer::StepReport::unlearned`]: e.g. an
/// edit target below the confidence floor, which a replay would skip again at the cost of its
/// passes). Returns how many went in.
fn remember_for_replay(
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
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` indices into a buffer of `len` (none if it is empty), drawn deterministically from
/// `key`: distinct while `n <= len`; beyond that, further shuffled passes over the buffer, so
/// an index repeats only after every other one has been drawn as often.
fn replay_draw(len: usize, n: usize, key: u64) -> Vec<usize> {
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
fn replay_indices(len: usize, n: usize, key: u64) -> Vec<usize> {
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
struct Prompting<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    template: &'a hindsight_model::ChatTemplate,
    end_of_turn: u32,
}

/// One micro-batch as gathered: its examples, the positions it moves the checkpoint to, and
/// whether the loop should stop or snapshot after it.
struct Gathered {
    batch: Vec<TrainExample>,
    batch_ids: Vec<Uuid>,
    pending: BTreeMap<String, i64>,
    pending_ids: BTreeMap<String, Uuid>,
    records_in_batch: u64,
    stop: bool,
    snapshot_requested: bool,
}

/// The source stage: reads episode records until the micro-batch is full (examples or token
/// budget), its wait is over, a limit is reached, a command arrives or `shutdown` resolves;
/// turns each record into an example or counts why it was skipped.
async fn gather<S: Future<Output = ()>>(
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

/// Sends `e` to the listener, if there is one (a listener gone is not an error).
fn emit(events: &Option<mpsc::UnboundedSender<LearnerEvent>>, e: LearnerEvent) {
    if let Some(tx) = events {
        let _ = tx.send(e);
    }
}

/// One trainer step on `batch`, off the async runtime (it is CPU-bound); the trainer goes back
/// into its slot, and the batch comes back for the caller's bookkeeping.
async fn train_step(
    slot: &mut Option<Trainer>,
    batch: Vec<TrainExample>,
    span: tracing::Span,
) -> Result<(Vec<TrainExample>, StepReport), OnlineError> {
    let mut tr = slot
        .take()
        .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
    let (tr, batch, result) = tokio::task::spawn_blocking(move || {
        let r = tr.step(&batch);
        (tr, batch, r)
    })
    .instrument(span)
    .await
    .map_err(|e| OnlineError::Thread(e.to_string()))?;
    *slot = Some(tr);
    Ok((batch, result?))
}

/// The replay stage after batch `batches`: `replay_steps_per_batch` extra steps on earlier
/// examples (never the batch just trained). One draw per batch covers all its replay steps, so
/// they train distinct examples as long as the buffer holds enough of them.
async fn replay_steps(
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

fn record_metrics(r: &StepReport) {
    let outcome = if r.skipped.is_some() {
        "refused"
    } else {
        "applied"
    };
    metrics::counter!("hindsight_learner_steps_total", "outcome" => outcome).increment(1);
    metrics::counter!("hindsight_learner_examples_total").increment(r.examples as u64);
    metrics::counter!("hindsight_learner_tokens_total").increment(r.tokens as u64);
    metrics::gauge!("hindsight_learner_loss", "term" => "total").set(r.loss);
    for term in ["sft", "kto", "distill", "dense", "kl_penalty"] {
        if let Some(v) = r.terms.get(term) {
            metrics::gauge!("hindsight_learner_loss", "term" => term).set(*v);
        }
    }
    metrics::gauge!("hindsight_learner_kl_to_base").set(r.kl_to_base);
    metrics::gauge!("hindsight_learner_grad_norm").set(r.grad_norm);
    if let Some(v) = r.teacher_student_gap {
        metrics::gauge!("hindsight_learner_teacher_student_gap").set(v);
    }
    if let Some(v) = r.advantage_mean {
        metrics::gauge!("hindsight_learner_advantage_mean").set(v);
    }
    if let Some(v) = r.advantage_std {
        metrics::gauge!("hindsight_learner_advantage_std").set(v);
    }
    if let Some(v) = r.clip_fraction {
        metrics::gauge!("hindsight_learner_ratio_clip_fraction").set(v);
    }
    if let Some(c) = r.teacher_answers {
        // Outcome of the teacher's own answers (`distill_target = teacher | edit`).
        let counter = |outcome: &'static str, n: usize| {
            metrics::counter!("hindsight_learner_teacher_answers_total", "outcome" => outcome)
                .increment(n as u64)
        };
        counter("changed", c.changed);
        counter("kept", c.decoded.saturating_sub(c.changed + c.fallback));
        counter("fallback", c.fallback);
        metrics::counter!("hindsight_learner_teacher_edited_fields_total")
            .increment(c.edited_fields as u64);
    }
}

async fn checkpoint(
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
async fn candidate(
    reg: &Registry,
    publish: Option<&PublishConfig>,
    tr: &Trainer,
    state: &mut LoopState,
    cfg: &LearnerConfig,
    base_sha: &str,
    topic: &str,
) -> Result<CandidateReport, OnlineError> {
    let adapter = tr.snapshot_policy(&cfg.adapter_name)?;
    let offsets = state
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
    let entry: VersionEntry = reg
        .register(NewVersion {
            name: &cfg.adapter_name,
            adapter: &adapter,
            base_model: &cfg.served_base_name(),
            base_model_sha256: base_sha,
            parent: state.live_version,
            training_config: serde_json::to_value(&cfg.trainer).unwrap_or_default(),
            offsets,
            examples: state.examples - state.candidate_examples,
            tokens: tr.state().tokens,
        })
        .await?;
    let version = entry.version;
    info!(version, examples = state.examples, "Candidate registered.");
    state.candidate_from = state.positions.clone();
    state.candidate_batches = state.batches;
    state.candidate_examples = state.examples;
    state.candidate_at_ms = now_ms();
    let (verdict, status) = match publish {
        Some(p) => match gate_and_publish(reg, entry, p, &cfg.served_base_name()).await {
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
