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
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hindsight_control::publish::{GateVerdict, PublishConfig, PublishError};
use hindsight_control::registry::{Registry, RegistryConfig, RegistryError};
use hindsight_feedback::{ensure_topics, now_ms, LogError, Topic, TopicReader, ValidatedLogConfig};
use serde::Serialize;
use serde_json::json;
use tokio::sync::mpsc;
use tracing::{info, info_span, warn};
use uuid::Uuid;

use crate::checkpoint::{CheckpointStore, LoopState};
use crate::error::LearnerError;
use crate::example::{SkipReason, TrainExample};
use crate::trainer::{StepReport, Trainer};
use replay::{remember_for_replay, replay_steps};
use resume::{resume, Resumed};
use run_log::RunLog;
use snapshot::{candidate, checkpoint};
use source::{forget_stale_positions, gather, to_positions, Gathered, Prompting};
use train::{record_metrics, train_step};

mod config;
mod replay;
mod resume;
mod run_log;
mod snapshot;
mod source;
#[cfg(test)]
mod tests;
mod train;

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
    /// `[routing]`, where `publish.rollout = "canary"` hands candidates over.
    pub routing: Option<hindsight_routing::RoutingConfig>,
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

/// Runs the learner until `shutdown` resolves or a configured limit is reached. Events go to
/// `events` when given; `control` takes commands (e.g. snapshot now).
///
/// Each turn of the loop runs the stages in order: source (gather a micro-batch), train (the
/// step and its replay steps), checkpoint then commit, candidate.
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
    let (topic, reader) = open_source(&setup, &cfg, &mut state).await?;
    let prompting = Prompting {
        tokenizer: &tokenizer,
        template: &template,
        end_of_turn,
    };

    let mut run = Run {
        cfg: &cfg,
        publish: setup.publish.as_ref(),
        routing: setup.routing.as_ref(),
        reader: &reader,
        events: &events,
        registry,
        store,
        base_sha,
        topic,
        state,
        trainer_slot: Some(trainer),
        run_log,
        summary: LearnerSummary::default(),
        batches_since_ckpt: 0,
        // Recently trained examples for replay steps (oldest first).
        replay: VecDeque::new(),
        last_rate: Instant::now(),
        rate_examples: 0,
        rate_tokens: 0,
    };
    tokio::pin!(shutdown);
    loop {
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
            &mut run.state,
            &cfg,
            &prompting,
            &events,
        )
        .await?;
        if !batch.is_empty() {
            run.train(batch, batch_ids).await?;
        }
        run.advance(records_in_batch, pending, pending_ids, stop)
            .await?;
        run.maybe_candidate(snapshot_requested, stop).await?;
        if stop {
            break;
        }
    }
    run.finish(started)
}

/// The episodes topic (created if missing) and a reader on it, positioned per the configured
/// assignment after stale saved positions are dealt with.
async fn open_source(
    setup: &LearnerSetup,
    cfg: &LearnerConfig,
    state: &mut LoopState,
) -> Result<(String, TopicReader), OnlineError> {
    let topic = setup.log.topics().get(Topic::Episodes).to_string();
    ensure_topics(
        &setup.log.client_config(),
        std::slice::from_ref(&topic),
        setup.log.raw().topic_partitions,
        setup.log.raw().topic_replication,
        Duration::from_secs(30),
    )
    .await?;
    forget_stale_positions(&setup.log, cfg, state).await?;
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
    Ok((topic, reader))
}

/// Commits `positions` to the broker; called only after the checkpoint holding them is
/// durable. In `checkpoint` assignment the commit only reports progress (the checkpoint
/// decides where a restart reads), so a broker refusing it does not stop training; in `group`
/// mode it decides where a restart reads, so it must succeed.
fn commit(
    reader: &TopicReader,
    cfg: &LearnerConfig,
    positions: &BTreeMap<String, i64>,
) -> Result<(), OnlineError> {
    match reader.commit_offsets(&to_positions(positions)) {
        Ok(()) => Ok(()),
        Err(e) if cfg.assignment == Assignment::Checkpoint => {
            warn!(error = %e, "Offset commit failed (advisory; the checkpoint holds the positions).");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// The loop's state between micro-batches: the trainer (in a slot, as it moves to blocking
/// threads for steps and saves), the loop state the checkpoints hold, the replay buffer, the
/// throughput window and the summary so far.
struct Run<'a> {
    cfg: &'a LearnerConfig,
    publish: Option<&'a PublishConfig>,
    routing: Option<&'a hindsight_routing::RoutingConfig>,
    reader: &'a TopicReader,
    events: &'a Option<mpsc::UnboundedSender<LearnerEvent>>,
    registry: Option<Registry>,
    store: CheckpointStore,
    base_sha: String,
    topic: String,
    state: LoopState,
    trainer_slot: Option<Trainer>,
    run_log: RunLog,
    summary: LearnerSummary,
    batches_since_ckpt: u64,
    replay: VecDeque<TrainExample>,
    last_rate: Instant,
    rate_examples: u64,
    rate_tokens: u64,
}

impl Run<'_> {
    /// The train stage: one step on the gathered `batch`, its bookkeeping (loop state,
    /// throughput, metrics, run log, event), then the replay steps and the replay buffer.
    async fn train(
        &mut self,
        batch: Vec<TrainExample>,
        batch_ids: Vec<Uuid>,
    ) -> Result<(), OnlineError> {
        let (cfg, state) = (self.cfg, &mut self.state);
        let (b, report) = train_step(
            &mut self.trainer_slot,
            batch,
            info_span!("learner_batch", batch = state.batches + 1),
        )
        .await?;
        for ex in &b {
            state.remember(ex.record_id, ex.turn, &ex.feedback_ids);
        }
        state.examples += b.len() as u64;
        state.batches += 1;
        self.batches_since_ckpt += 1;
        self.rate_examples += b.len() as u64;
        self.rate_tokens += report.tokens as u64;
        record_metrics(&report);
        let secs = self.last_rate.elapsed().as_secs_f64().max(1e-3);
        let (eps, tps) = (
            self.rate_examples as f64 / secs,
            self.rate_tokens as f64 / secs,
        );
        metrics::gauge!("hindsight_learner_examples_per_second").set(eps);
        metrics::gauge!("hindsight_learner_tokens_per_second").set(tps);
        if secs > 30.0 {
            self.last_rate = Instant::now();
            self.rate_examples = 0;
            self.rate_tokens = 0;
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
        self.run_log.write(json!({
            "event": "batch",
            "batch": state.batches,
            "record_ids": batch_ids,
            "report": report,
        }))?;
        let (trained, unlearned) = (report.examples, report.unlearned.clone());
        emit(self.events, LearnerEvent::Step(Box::new(report)));

        replay_steps(
            &mut self.trainer_slot,
            &self.replay,
            cfg,
            state.batches,
            &mut self.run_log,
            self.events,
        )
        .await?;
        if cfg.replay_steps_per_batch > 0 {
            let kept =
                remember_for_replay(&mut self.replay, b, &unlearned, cfg.replay_buffer_examples);
            metrics::counter!("hindsight_learner_replay_excluded_total")
                .increment(trained.saturating_sub(kept) as u64);
        }
        Ok(())
    }

    /// Moves the loop state past the records just gathered and checkpoints (then commits)
    /// when due: every `checkpoint_every_batches` batches, when only skipped records moved the
    /// positions, and at a stop with anything unsaved.
    async fn advance(
        &mut self,
        records_in_batch: u64,
        pending: BTreeMap<String, i64>,
        pending_ids: BTreeMap<String, Uuid>,
        stop: bool,
    ) -> Result<(), OnlineError> {
        self.state.records += records_in_batch;
        let moved = pending != self.state.positions;
        self.state.positions = pending;
        self.state.last_ids = pending_ids;

        // Checkpoint, then commit: the order that makes a crash safe.
        if self.batches_since_ckpt >= self.cfg.checkpoint_every_batches
            || (moved && self.batches_since_ckpt == 0)
            || (stop && (self.batches_since_ckpt > 0 || moved))
        {
            self.checkpoint_and_commit().await?;
        }
        Ok(())
    }

    /// Saves a checkpoint, then commits its positions (the order that makes a crash safe).
    async fn checkpoint_and_commit(&mut self) -> Result<(), OnlineError> {
        checkpoint(
            &self.store,
            &mut self.trainer_slot,
            &mut self.state,
            &mut self.run_log,
        )
        .await?;
        commit(self.reader, self.cfg, &self.state.positions)?;
        self.batches_since_ckpt = 0;
        Ok(())
    }

    /// The candidate stage: when a snapshot was requested or a candidate trigger (batches,
    /// examples, time) fired, checkpoints anything unsaved, registers the policy as a
    /// candidate (and publishes it when configured), then checkpoints the candidate
    /// bookkeeping. A failure to register is logged and training goes on.
    async fn maybe_candidate(
        &mut self,
        snapshot_requested: bool,
        stop: bool,
    ) -> Result<(), OnlineError> {
        let (cfg, state) = (self.cfg, &self.state);
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
        if due && self.registry.is_none() && snapshot_requested {
            warn!("Snapshot requested but no [registry] is configured; ignored.");
        }
        if !due || self.registry.is_none() {
            return Ok(());
        }
        if self.batches_since_ckpt > 0 {
            self.checkpoint_and_commit().await?;
        }
        let (Some(reg), Some(tr)) = (&self.registry, self.trainer_slot.as_ref()) else {
            return Err(OnlineError::Thread("trainer lost".into()));
        };
        let made = candidate(
            reg,
            (self.publish, self.routing),
            tr,
            &mut self.state,
            cfg,
            &self.base_sha,
            &self.topic,
        )
        .await;
        match made {
            Ok(report) => {
                self.run_log
                    .write(json!({"event": "candidate", "candidate": report}))?;
                self.summary.candidates.push(report.clone());
                emit(self.events, LearnerEvent::Candidate(report));
            }
            Err(e) => {
                // Redis away or the registry's disk full: keep training; the next trigger
                // tries again.
                warn!(error = %e, "Could not register a candidate; training goes on.");
                metrics::counter!("hindsight_learner_candidate_failures_total").increment(1);
                self.run_log
                    .write(json!({"event": "candidate_failed", "error": e.to_string()}))?;
                self.state.candidate_batches = self.state.batches;
                self.state.candidate_examples = self.state.examples;
                self.state.candidate_at_ms = now_ms();
            }
        }
        // The candidate bookkeeping belongs in the checkpoint too.
        self.checkpoint_and_commit().await
    }

    /// The totals when the loop stops, also written to the run log.
    fn finish(mut self, started: Instant) -> Result<LearnerSummary, OnlineError> {
        let tr = self
            .trainer_slot
            .as_ref()
            .ok_or_else(|| OnlineError::Thread("trainer lost".into()))?;
        let state = &self.state;
        let summary = &mut self.summary;
        summary.batches = state.batches;
        summary.steps = tr.state().steps;
        summary.refused_steps = tr.state().skipped_steps;
        summary.examples = state.examples;
        summary.records = state.records;
        summary.skipped = state.skipped.clone();
        summary.duration_ms = started.elapsed().as_millis() as u64;
        self.run_log
            .write(json!({"event": "stop", "summary": summary}))?;
        info!(?summary, "Learner stopped.");
        Ok(self.summary)
    }
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

/// Sends `e` to the listener, if there is one (a listener gone is not an error).
fn emit(events: &Option<mpsc::UnboundedSender<LearnerEvent>>, e: LearnerEvent) {
    if let Some(tx) = events {
        let _ = tx.send(e);
    }
}
