//! Learning curves for the operator page, from the learner's JSONL run log (`[learner] run_log`,
//! written by `hindsight_learner::online`): one point per trained micro-batch or replay step
//! (loss, KL to the base model, gradient norm, the loss of each objective) and one mark per
//! candidate (version, registry status, the gate's verdict).
//!
//! The log only grows, so only its last [`TAIL_BYTES`] are read: a long run shows its recent
//! history, and a poll costs the same however long the learner has run. Lines that do not parse
//! (one being written, an event of a newer learner) are skipped; a missing file is an empty
//! curve, since the learner may not have started yet.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Bytes read from the end of the run log.
pub const TAIL_BYTES: u64 = 8 * 1024 * 1024;
/// Points returned at most (the newest).
pub const POINTS_KEPT: usize = 5_000;

/// Reading the run log failed (not: it does not exist).
#[derive(Debug, thiserror::Error)]
#[error("reading the learner's run log {path}: {source}")]
pub struct RunLogError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// One training step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LearningPoint {
    /// `batch` (new examples) or `replay` (earlier ones again).
    pub event: String,
    /// Micro-batches so far.
    pub batch: u64,
    /// Optimizer steps so far.
    pub step: Option<u64>,
    pub time_ms: Option<i64>,
    pub loss: Option<f64>,
    pub kl_to_base: Option<f64>,
    pub grad_norm: Option<f64>,
    /// Mean loss per objective (`sft`, `kto`, `distill`, `dense`, `kl_penalty`).
    pub terms: BTreeMap<String, f64>,
    /// Why the step was skipped, if it was.
    pub skipped: Option<String>,
}

/// One candidate the learner registered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateMark {
    pub version: Option<u64>,
    /// Micro-batches when it was snapshotted.
    pub batch: Option<u64>,
    pub time_ms: Option<i64>,
    /// Registry status after publishing.
    pub status: Option<String>,
    /// The gate's verdict, if a gate ran.
    pub verdict: Option<Value>,
}

/// What the page plots.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LearningCurve {
    pub points: Vec<LearningPoint>,
    pub candidates: Vec<CandidateMark>,
}

/// A run-log line, as far as the curves need it (the learner writes more; unknown fields are
/// ignored on purpose, so a newer learner's log still plots).
#[derive(Deserialize)]
struct Line {
    event: String,
    #[serde(default)]
    batch: Option<u64>,
    #[serde(default)]
    time_ms: Option<i64>,
    #[serde(default)]
    report: Option<StepLine>,
    #[serde(default)]
    candidate: Option<CandidateLine>,
}

#[derive(Deserialize)]
struct StepLine {
    #[serde(default)]
    step: Option<u64>,
    #[serde(default)]
    loss: Option<f64>,
    #[serde(default)]
    kl_to_base: Option<f64>,
    #[serde(default)]
    grad_norm: Option<f64>,
    #[serde(default)]
    terms: BTreeMap<String, Option<f64>>,
    #[serde(default)]
    skipped: Option<String>,
}

#[derive(Deserialize)]
struct CandidateLine {
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    batches: Option<u64>,
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    verdict: Option<Value>,
}

/// Parses run-log text; lines that are not step or candidate events are skipped.
pub fn parse(text: &str) -> LearningCurve {
    let mut curve = LearningCurve::default();
    for line in text.lines() {
        let Ok(l) = serde_json::from_str::<Line>(line) else {
            continue;
        };
        match (l.event.as_str(), l.report, l.candidate) {
            ("batch" | "replay", Some(r), _) => curve.points.push(LearningPoint {
                event: l.event,
                batch: l.batch.unwrap_or(0),
                step: r.step,
                time_ms: l.time_ms,
                loss: r.loss,
                kl_to_base: r.kl_to_base,
                grad_norm: r.grad_norm,
                terms: r
                    .terms
                    .into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k, v)))
                    .collect(),
                skipped: r.skipped,
            }),
            ("candidate", _, Some(c)) => curve.candidates.push(CandidateMark {
                version: c.version,
                batch: c.batches,
                time_ms: l.time_ms,
                status: c.status,
                verdict: c.verdict,
            }),
            _ => {}
        }
    }
    let extra = curve.points.len().saturating_sub(POINTS_KEPT);
    curve.points.drain(..extra);
    curve
}

/// Reads the curves from the run log at `path`: empty when the path is empty (no run log
/// configured) or the file does not exist.
pub fn read(path: &Path) -> Result<LearningCurve, RunLogError> {
    if path.as_os_str().is_empty() {
        return Ok(LearningCurve::default());
    }
    let err = |source| RunLogError {
        path: path.to_path_buf(),
        source,
    };
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(LearningCurve::default()),
        Err(e) => return Err(err(e)),
    };
    let len = f.metadata().map_err(err)?.len();
    let start = len.saturating_sub(TAIL_BYTES);
    f.seek(SeekFrom::Start(start)).map_err(err)?;
    let mut bytes = Vec::new();
    f.take(TAIL_BYTES).read_to_end(&mut bytes).map_err(err)?;
    // Starting mid-file, the first line is a fragment.
    if start > 0 {
        let cut = bytes.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
        bytes.drain(..cut);
    }
    Ok(parse(&String::from_utf8_lossy(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const LOG: &str = r#"{"event":"start","checkpoint_seq":0,"batches":0,"time_ms":1}
{"event":"batch","batch":1,"record_ids":[],"report":{"step":1,"examples":1,"tokens":90,"loss":2.5,"terms":{"distill":2.0,"kto":null},"applied":{},"kl_to_base":0.0,"grad_norm":1.5,"skipped":null,"duration_ms":10},"time_ms":2}
{"event":"replay","batch":1,"record_ids":[],"report":{"step":2,"loss":2.25,"terms":{},"kl_to_base":0.01,"grad_norm":1.1},"time_ms":3}
{"event":"checkpoint","seq":1,"batches":1,"time_ms":4}
{"event":"candidate","candidate":{"version":3,"examples":16,"batches":1,"verdict":null,"status":"canary"},"time_ms":5}
{"event":"batch","batch":2,"rep"#;

    #[test]
    fn steps_and_candidates_are_read_and_broken_lines_skipped() {
        let c = parse(LOG);
        assert_eq!(c.points.len(), 2);
        assert_eq!(c.points[0].loss, Some(2.5));
        assert_eq!(
            c.points[0].terms.get("distill"),
            Some(&2.0),
            "a null term is left out"
        );
        assert_eq!(c.points[0].terms.len(), 1);
        assert_eq!(
            (c.points[1].event.as_str(), c.points[1].step),
            ("replay", Some(2))
        );
        assert_eq!(c.candidates.len(), 1);
        assert_eq!(
            (c.candidates[0].version, c.candidates[0].status.as_deref()),
            (Some(3), Some("canary"))
        );
    }

    #[test]
    fn a_missing_log_is_an_empty_curve_and_a_long_one_is_read_from_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read(&dir.path().join("none.jsonl")).unwrap(),
            LearningCurve::default()
        );
        assert_eq!(read(Path::new("")).unwrap(), LearningCurve::default());
        let path = dir.path().join("run.jsonl");
        let mut f = std::fs::File::create(&path).unwrap();
        let line =
            r#"{"event":"batch","batch":1,"report":{"step":1,"loss":1.0,"terms":{}},"time_ms":2}"#;
        let n = TAIL_BYTES as usize / line.len() + 100;
        for _ in 0..n {
            writeln!(f, "{line}").unwrap();
        }
        drop(f);
        let c = read(&path).unwrap();
        assert_eq!(c.points.len(), POINTS_KEPT);
        assert!(c.points.iter().all(|p| p.loss == Some(1.0)));
    }
}
