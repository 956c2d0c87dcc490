//! Durable learner checkpoints: the trainer (policy, teacher, optimizer moments, running
//! statistics) plus the loop state (the Kafka positions its examples came from, counters,
//! dedup memory), written so that a crash at any instant leaves either the previous or the new
//! checkpoint whole, never a mix:
//!
//! 1. everything is written into `tmp-<seq>/` and each file fsynced;
//! 2. the directory is renamed to `ckpt-<seq>/` and the parent fsynced;
//! 3. `LATEST` is replaced atomically (write `LATEST.tmp`, fsync, rename, fsync the parent).
//!
//! The online loop commits Kafka offsets only after step 3 (see [`crate::online`]).

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{LearnerError, Result};
use crate::trainer::Trainer;

/// Next offset to read per `topic/partition` (what a checkpoint has consumed up to).
pub type PositionMap = BTreeMap<String, i64>;

/// The loop's own state, saved with the trainer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LoopState {
    /// Checkpoint sequence number.
    pub seq: u64,
    /// Micro-batches consumed (trained or refused by a guard).
    pub batches: u64,
    /// Episode records read (trained, skipped or duplicate).
    pub records: u64,
    /// Examples trained on.
    pub examples: u64,
    /// Next offset per `topic/partition`: every record before it is in this checkpoint.
    pub positions: PositionMap,
    /// Per `topic/partition`, the `hindsight-id` of the record just before its position: what
    /// the position refers to, so a topic replaced under the checkpoint is noticed
    /// (`hindsight_feedback::check_position`). Absent in checkpoints written before it existed.
    #[serde(default)]
    pub last_ids: BTreeMap<String, Uuid>,
    /// Positions when the last candidate was snapshotted (its offset ranges start here).
    pub candidate_from: PositionMap,
    /// Batches at the last candidate.
    pub candidate_batches: u64,
    /// Examples at the last candidate.
    pub candidate_examples: u64,
    /// Wall-clock time of the last candidate (ms since the epoch).
    pub candidate_at_ms: i64,
    /// Live version of the adapter as far as the learner knows (for staleness).
    pub live_version: Option<u64>,
    /// Skipped records by reason.
    pub skipped: BTreeMap<String, u64>,
    /// Recently trained episode record ids (bounded; the joiner may re-emit a record).
    pub recent_records: VecDeque<Uuid>,
    /// Feedback ids already trained on per turn (bounded by turns): a re-emitted turn is
    /// trained only on its new feedback.
    pub turn_feedback: VecDeque<(Uuid, Vec<Uuid>)>,
}

/// How many record ids and turns the dedup memory keeps.
pub const DEDUP_MEMORY: usize = 50_000;

impl LoopState {
    /// Remembers a trained record and its turn's feedback ids.
    pub fn remember(&mut self, record: Uuid, turn: Uuid, feedback: &[Uuid]) {
        self.recent_records.push_back(record);
        while self.recent_records.len() > DEDUP_MEMORY {
            self.recent_records.pop_front();
        }
        match self.turn_feedback.iter_mut().find(|(t, _)| *t == turn) {
            Some((_, ids)) => {
                for f in feedback {
                    if !ids.contains(f) {
                        ids.push(*f);
                    }
                }
            }
            None => {
                self.turn_feedback.push_back((turn, feedback.to_vec()));
                while self.turn_feedback.len() > DEDUP_MEMORY {
                    self.turn_feedback.pop_front();
                }
            }
        }
    }

    /// Whether the record id was trained on recently.
    pub fn seen_record(&self, record: &Uuid) -> bool {
        self.recent_records.contains(record)
    }

    /// Feedback ids already trained on for `turn`.
    pub fn trained_feedback(&self, turn: &Uuid) -> &[Uuid] {
        self.turn_feedback
            .iter()
            .find(|(t, _)| t == turn)
            .map(|(_, ids)| ids.as_slice())
            .unwrap_or(&[])
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LearnerError + '_ {
    move |e| LearnerError::io(path, e)
}

fn fsync_file(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

fn fsync_dir(path: &Path) -> Result<()> {
    // Directories are opened read-only to fsync them (POSIX).
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// Checkpoints under one directory.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointStore {
    /// A store in `dir` (created if missing) keeping the newest `keep` checkpoints (≥ 1).
    pub fn open(dir: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Self {
            dir,
            keep: keep.max(1),
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The newest complete checkpoint's directory, if any.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        let latest = self.dir.join("LATEST");
        match std::fs::read_to_string(&latest) {
            Ok(name) => {
                let path = self.dir.join(name.trim());
                if path.join("loop.json").is_file() {
                    Ok(Some(path))
                } else {
                    Err(LearnerError::InvalidArgument(format!(
                        "{} names {}, which is not a complete checkpoint",
                        latest.display(),
                        path.display()
                    )))
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(LearnerError::io(&latest, e)),
        }
    }

    /// Writes a checkpoint of `trainer` and `state` (whose `seq` must be new) durably and makes
    /// it the latest; returns its directory.
    pub fn save(&self, trainer: &Trainer, state: &LoopState) -> Result<PathBuf> {
        let name = format!("ckpt-{:010}", state.seq);
        let tmp = self.dir.join(format!("tmp-{:010}", state.seq));
        let fin = self.dir.join(&name);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        trainer.save(&tmp)?;
        let loop_path = tmp.join("loop.json");
        let text = serde_json::to_vec(state).map_err(|e| LearnerError::json("loop state", e))?;
        std::fs::write(&loop_path, text).map_err(io(&loop_path))?;
        for entry in std::fs::read_dir(&tmp).map_err(io(&tmp))? {
            let p = entry.map_err(io(&tmp))?.path();
            fsync_file(&p)?;
        }
        fsync_dir(&tmp)?;
        if fin.exists() {
            std::fs::remove_dir_all(&fin).map_err(io(&fin))?;
        }
        std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
        fsync_dir(&self.dir)?;
        let latest_tmp = self.dir.join("LATEST.tmp");
        std::fs::write(&latest_tmp, &name).map_err(io(&latest_tmp))?;
        fsync_file(&latest_tmp)?;
        let latest = self.dir.join("LATEST");
        std::fs::rename(&latest_tmp, &latest).map_err(io(&latest))?;
        fsync_dir(&self.dir)?;
        self.prune(&name)?;
        Ok(fin)
    }

    /// Restores the latest checkpoint into `trainer`; returns its loop state (`None` when
    /// there is no checkpoint yet).
    pub fn restore(&self, trainer: &mut Trainer) -> Result<Option<LoopState>> {
        let Some(dir) = self.latest()? else {
            return Ok(None);
        };
        trainer.load(&dir)?;
        let path = dir.join("loop.json");
        let text = std::fs::read(&path).map_err(io(&path))?;
        let state =
            serde_json::from_slice(&text).map_err(|e| LearnerError::json("loop state", e))?;
        Ok(Some(state))
    }

    /// Deletes leftovers of interrupted saves and all but the newest `keep` checkpoints.
    fn prune(&self, newest: &str) -> Result<()> {
        let mut ckpts = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("tmp-") {
                let p = entry.path();
                std::fs::remove_dir_all(&p).map_err(io(&p))?;
            } else if name.starts_with("ckpt-") && name.as_str() <= newest {
                ckpts.push(name);
            }
        }
        ckpts.sort();
        let excess = ckpts.len().saturating_sub(self.keep);
        for name in &ckpts[..excess] {
            let p = self.dir.join(name);
            std::fs::remove_dir_all(&p).map_err(io(&p))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::TrainerConfig;
    use candle_core::{DType, Device};
    use hindsight_model::Model;
    use hindsight_model::{Architecture, ModelConfig};
    use std::sync::Arc;

    fn trainer() -> Trainer {
        let cfg = ModelConfig::tiny(Architecture::Llama);
        let model = Arc::new(Model::random(cfg, 1, DType::F32, &Device::Cpu).unwrap());
        Trainer::new(model, TrainerConfig::default(), "p").unwrap()
    }

    #[test]
    fn save_restore_prune_and_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 2).unwrap();
        let mut t = trainer();
        assert_eq!(store.restore(&mut t).unwrap(), None);
        // A leftover of a save killed half-way is ignored and cleaned up.
        std::fs::create_dir_all(dir.path().join("tmp-0000000009")).unwrap();
        for seq in 1..=3 {
            let mut st = LoopState {
                seq,
                batches: seq * 10,
                ..Default::default()
            };
            st.positions.insert("t/0".into(), seq as i64 * 5);
            st.remember(Uuid::now_v7(), Uuid::now_v7(), &[Uuid::now_v7()]);
            store.save(&t, &st).unwrap();
        }
        let back = store.restore(&mut t).unwrap().unwrap();
        assert_eq!(back.seq, 3);
        assert_eq!(back.positions["t/0"], 15);
        assert_eq!(back.recent_records.len(), 1);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, vec!["LATEST", "ckpt-0000000002", "ckpt-0000000003"]);
    }

    #[test]
    fn a_latest_pointing_at_an_incomplete_checkpoint_is_an_error_not_a_fresh_start() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), 2).unwrap();
        std::fs::write(dir.path().join("LATEST"), "ckpt-0000000001").unwrap();
        assert!(store.latest().is_err());
    }

    #[test]
    fn dedup_memory_tracks_records_and_turn_feedback() {
        let mut st = LoopState::default();
        let (r, turn, f1, f2) = (
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
        );
        st.remember(r, turn, &[f1]);
        st.remember(Uuid::now_v7(), turn, &[f1, f2]);
        assert!(st.seen_record(&r));
        assert_eq!(st.trained_feedback(&turn), &[f1, f2]);
        assert!(st.trained_feedback(&Uuid::now_v7()).is_empty());
    }
}
