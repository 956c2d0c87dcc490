//! The adapter table: loaded LoRA versions by name, swapped atomically.
//!
//! The table is an immutable snapshot behind an `Arc`; a load or unload builds a new snapshot and
//! swaps the pointer under a short write lock. A request resolves its adapter once, keeps the
//! `Arc<AdapterVersion>` for its whole life and so runs start to finish on one version, whatever
//! happens to the table meanwhile.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use hindsight_model::candle_core::Device;
use hindsight_model::{Adapter, ModelConfig};
use sha2::{Digest, Sha256};

use crate::error::ServeError;
use hindsight_core::now_ms;

/// One loaded version of a named adapter.
#[derive(Debug)]
pub struct AdapterVersion {
    /// The name clients use in `model`.
    pub name: String,
    /// Version number (increasing per name).
    pub version: u64,
    /// The weights.
    pub adapter: Adapter,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// Hex sha256 of `adapter_model.safetensors`.
    pub sha256: String,
    /// Load time, ms since the epoch.
    pub created_ms: i64,
}

impl AdapterVersion {
    /// `name@version`, as reported in `x-hindsight-adapter` and the response `model`.
    pub fn tag(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

/// An immutable snapshot of the loaded adapters.
#[derive(Debug, Default, Clone)]
pub struct AdapterTable {
    /// Per name: the retained versions, newest last; the last one is the current version.
    by_name: BTreeMap<String, Vec<Arc<AdapterVersion>>>,
}

impl AdapterTable {
    /// The current version of every adapter.
    pub fn current(&self) -> impl Iterator<Item = &Arc<AdapterVersion>> {
        self.by_name.values().filter_map(|v| v.last())
    }

    /// Every retained version.
    pub fn all(&self) -> impl Iterator<Item = &Arc<AdapterVersion>> {
        self.by_name.values().flatten()
    }

    /// `name` (current version) or `name@version` (pinned).
    pub fn resolve(&self, spec: &str) -> Option<Arc<AdapterVersion>> {
        if let Some(v) = self.by_name.get(spec) {
            return v.last().cloned();
        }
        let (name, version) = spec.rsplit_once('@')?;
        let version: u64 = version.parse().ok()?;
        self.by_name
            .get(name)?
            .iter()
            .find(|a| a.version == version)
            .cloned()
    }
}

/// What to load (vLLM's `load_lora_adapter` body plus the optional checksum).
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Adapter name.
    pub name: String,
    /// PEFT adapter directory.
    pub path: PathBuf,
    /// Replace an existing adapter of this name instead of refusing.
    pub load_inplace: bool,
    /// Expected hex sha256 of `adapter_model.safetensors`.
    pub sha256: Option<String>,
}

/// The adapter table and the rules to change it.
#[derive(Debug)]
pub struct AdapterRegistry {
    table: RwLock<Arc<AdapterTable>>,
    /// Serialises loads/unloads (the table swap itself is instant).
    changes: Mutex<()>,
    model_cfg: ModelConfig,
    device: Device,
    base_name: String,
    /// Versions kept per name (the current one included) so pinned requests keep working.
    keep_versions: usize,
}

/// The version written next to the adapter by the publisher, if any: `hindsight.json`
/// `{"version": N}` or `adapter_config.json` `"hindsight_version": N`.
fn metadata_version(dir: &Path) -> Option<u64> {
    for (file, key) in [
        ("hindsight.json", "version"),
        ("adapter_config.json", "hindsight_version"),
    ] {
        let text = std::fs::read_to_string(dir.join(file)).ok();
        let v = text
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|j| j.get(key).and_then(serde_json::Value::as_u64));
        if v.is_some() {
            return v;
        }
    }
    None
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.contains('@')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/".contains(c))
}

impl AdapterRegistry {
    /// An empty registry for a base model.
    pub fn new(
        base_name: &str,
        model_cfg: ModelConfig,
        device: Device,
        keep_versions: usize,
    ) -> Self {
        Self {
            table: RwLock::new(Arc::new(AdapterTable::default())),
            changes: Mutex::new(()),
            model_cfg,
            device,
            base_name: base_name.to_string(),
            keep_versions: keep_versions.max(1),
        }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<AdapterTable> {
        match self.table.read() {
            Ok(t) => t.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn swap(&self, table: AdapterTable) {
        let table = Arc::new(table);
        match self.table.write() {
            Ok(mut t) => *t = table,
            Err(p) => *p.into_inner() = table,
        }
    }

    /// Reads and verifies an adapter (blocking: file I/O and hashing).
    fn read_verified(&self, req: &LoadRequest, version: u64) -> Result<AdapterVersion, ServeError> {
        let weights = req.path.join("adapter_model.safetensors");
        let bytes = std::fs::read(&weights).map_err(|e| {
            ServeError::invalid(
                "lora_path",
                format!("cannot read {}: {e}", weights.display()),
            )
        })?;
        let sha256 = hex::encode(Sha256::digest(&bytes));
        if let Some(want) = &req.sha256 {
            if !want.eq_ignore_ascii_case(&sha256) {
                return Err(ServeError::invalid(
                    "sha256",
                    format!("adapter_model.safetensors has sha256 {sha256}, expected {want}"),
                ));
            }
        }
        let adapter = Adapter::load_peft_with_weights(
            &req.path,
            &bytes,
            req.name.clone(),
            &self.model_cfg,
            &self.device,
        )
        .map_err(|e| {
            ServeError::invalid(
                "lora_path",
                format!("adapter does not fit the base model: {e}"),
            )
        })?;
        // Non-finite weights would poison every token: refuse them.
        if let Some((layer, t)) = adapter.first_non_finite()? {
            return Err(ServeError::invalid(
                "lora_path",
                format!("adapter has non-finite weights in layer {layer} {t:?}"),
            ));
        }
        Ok(AdapterVersion {
            name: req.name.clone(),
            version,
            adapter,
            path: req.path.clone(),
            sha256,
            created_ms: now_ms(),
        })
    }

    /// Loads (or with `load_inplace` replaces) an adapter with vLLM's semantics; the new version
    /// serves new requests as soon as this returns. A refused load leaves the table untouched.
    pub fn load(&self, req: &LoadRequest) -> Result<Arc<AdapterVersion>, ServeError> {
        if !valid_name(&req.name) {
            return Err(ServeError::invalid(
                "lora_name",
                "adapter names are 1-128 characters of [A-Za-z0-9-_.:/], without '@'",
            ));
        }
        if req.name == self.base_name {
            return Err(ServeError::invalid(
                "lora_name",
                "an adapter cannot take the base model's name",
            ));
        }
        let started = std::time::Instant::now();
        let _guard = self.changes.lock().map_err(|_| ServeError::Unavailable)?;
        let current = self.snapshot();
        let existing = current.by_name.get(&req.name);
        if existing.is_some() && !req.load_inplace {
            return Err(ServeError::Conflict(format!(
                "The lora adapter '{}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                req.name
            )));
        }
        let latest = existing
            .and_then(|v| v.last())
            .map(|a| a.version)
            .unwrap_or(0);
        let version = match metadata_version(&req.path) {
            Some(v) if v > latest => v,
            _ => latest + 1,
        };
        let loaded = Arc::new(self.read_verified(req, version)?);
        let mut next = (*current).clone();
        let versions = next.by_name.entry(req.name.clone()).or_default();
        versions.push(loaded.clone());
        let excess = versions.len().saturating_sub(self.keep_versions);
        versions.drain(..excess);
        self.swap(next);
        tracing::info!(
            name = %loaded.name,
            version = loaded.version,
            sha256 = %loaded.sha256,
            load_ms = started.elapsed().as_secs_f64() * 1e3,
            "Adapter loaded."
        );
        Ok(loaded)
    }

    /// Unloads every version of an adapter; requests already running on it finish normally.
    pub fn unload(&self, name: &str) -> Result<(), ServeError> {
        let _guard = self.changes.lock().map_err(|_| ServeError::Unavailable)?;
        let current = self.snapshot();
        if !current.by_name.contains_key(name) {
            return Err(ServeError::NotFound(format!(
                "The lora adapter '{name}' cannot be found."
            )));
        }
        let mut next = (*current).clone();
        next.by_name.remove(name);
        self.swap(next);
        tracing::info!(%name, "Adapter unloaded.");
        Ok(())
    }
}
