//! The learner's JSONL run log: one line per start, batch, replay, checkpoint, candidate and
//! stop.

use std::io::Write;
use std::path::{Path, PathBuf};

use hindsight_feedback::now_ms;
use serde_json::json;

use super::OnlineError;

/// The JSONL run log.
pub(super) struct RunLog {
    file: Option<(PathBuf, std::fs::File)>,
}

impl RunLog {
    pub(super) fn open(path: &Path) -> Result<Self, OnlineError> {
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

    pub(super) fn write(&mut self, mut value: serde_json::Value) -> Result<(), OnlineError> {
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
