//! The adapter registry: every candidate the learner snapshots becomes a numbered version of a
//! named adapter. The PEFT files live in `<adapter_dir>/<name>/v<N>` (written to a temporary
//! directory, fsynced, renamed into place, hashed); the metadata lives in Redis:
//!
//! | key | value |
//! | --- | --- |
//! | `<prefix>:<name>:seq` | last allocated version (`INCR`) |
//! | `<prefix>:<name>:v:<N>` | the [`VersionEntry`] as JSON |
//! | `<prefix>:<name>:live` | the live version, if any |
//! | `<prefix>:names` | set of adapter names |
//!
//! Files are always complete before their metadata exists, so an entry never points at a
//! half-written directory. Status changes are compare-and-set (a Lua script checks the values
//! read are still there), so two writers can never leave two live versions of one name.
//! `hindsight adapters list|show|diff` read it through [`crate::report`].

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use hindsight_core::now_ms;
use hindsight_model::Adapter;
use hindsight_model::ModelError;

/// The PEFT weights file (serve checks its sha256 on load).
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The PEFT configuration file.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// Hindsight's own metadata next to the PEFT files: `{"version", "name", "parent"}`; `hindsight
/// serve` takes the adapter's version from it.
pub const METADATA_FILE: &str = "hindsight.json";

/// Where the registry keeps its metadata and files.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// Redis holding the metadata.
    #[serde(default = "default_redis_url")]
    pub redis_url: String,
    /// Prefix of every key the registry writes.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// Directory holding `<name>/v<version>` adapter directories.
    #[serde(default = "default_adapter_dir")]
    pub adapter_dir: PathBuf,
}

fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/".into()
}
fn default_key_prefix() -> String {
    "hindsight:registry".into()
}
fn default_adapter_dir() -> PathBuf {
    PathBuf::from("data/adapters")
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            redis_url: default_redis_url(),
            key_prefix: default_key_prefix(),
            adapter_dir: default_adapter_dir(),
        }
    }
}

/// Life cycle of a version: `candidate` → `live` → `retired`, or `candidate` → `rejected`; with
/// canary rollouts `candidate` → `canary` → `live` or `rolled_back`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionStatus {
    /// Registered, not (yet) serving as the live version.
    Candidate,
    /// The version that serves the name (at most one per name).
    Live,
    /// Was live, replaced by a newer version.
    Retired,
    /// Refused by the eval gate (or by an operator); never served as `<name>`.
    Rejected,
    /// Accepted by the gate and handed to the rollout controller (queued or in a canary).
    Canary,
    /// Its canary was rolled back (harm, drift, an operator or a newer candidate).
    RolledBack,
}

impl VersionStatus {
    /// The snake_case name (`candidate`, `live`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            VersionStatus::Candidate => "candidate",
            VersionStatus::Live => "live",
            VersionStatus::Retired => "retired",
            VersionStatus::Rejected => "rejected",
            VersionStatus::Canary => "canary",
            VersionStatus::RolledBack => "rolled_back",
        }
    }
}

impl std::fmt::Display for VersionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A range of Kafka offsets whose examples trained a version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetRange {
    /// Topic (normally `hindsight.episodes`).
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// First offset consumed.
    pub from: i64,
    /// One past the last offset consumed (exclusive).
    pub to: i64,
}

/// One version of a named adapter, as stored in Redis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionEntry {
    /// Adapter name (what serving calls it).
    pub name: String,
    /// Version number, from 1, allocated by the registry.
    pub version: u64,
    /// The version training started from, if any.
    pub parent: Option<u64>,
    /// Base model the adapter was trained on (name or path).
    pub base_model: String,
    /// sha256 (hex) of the base model file.
    pub base_model_sha256: String,
    /// `<adapter_dir>/<name>/v<version>` (absolute).
    pub path: PathBuf,
    /// File name → hex sha256 of every file in `path`.
    pub files_sha256: BTreeMap<String, String>,
    /// The training configuration that produced it.
    pub training_config: Value,
    /// Kafka offsets whose examples it learned from.
    pub offsets: Vec<OffsetRange>,
    /// Examples seen.
    pub examples: u64,
    /// Tokens seen.
    pub tokens: u64,
    /// Eval gate results (see `publish`), when gated.
    pub eval: Option<Value>,
    /// Life-cycle status.
    pub status: VersionStatus,
    /// Registration time, ms since the Unix epoch.
    pub created_at_ms: i64,
    /// Last change, ms since the Unix epoch.
    pub updated_at_ms: i64,
    /// Free-text reason of the last status change.
    pub note: Option<String>,
}

impl VersionEntry {
    /// `name@version`, as serving tags it.
    pub fn tag(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// sha256 of `adapter_model.safetensors`, if recorded.
    pub fn weights_sha256(&self) -> Option<&str> {
        self.files_sha256.get(WEIGHTS_FILE).map(String::as_str)
    }
}

/// What the learner hands the registry for a new version.
#[derive(Debug)]
pub struct NewVersion<'a> {
    /// Adapter name (letters, digits, `-`, `_`, `.`).
    pub name: &'a str,
    /// The weights to store (written in PEFT format).
    pub adapter: &'a Adapter,
    /// Base model name or path (PEFT's `base_model_name_or_path`).
    pub base_model: &'a str,
    /// sha256 of the base model file (see [`sha256_file`]).
    pub base_model_sha256: &'a str,
    /// The version training started from.
    pub parent: Option<u64>,
    /// The training configuration.
    pub training_config: Value,
    /// Kafka offsets consumed.
    pub offsets: Vec<OffsetRange>,
    /// Examples seen.
    pub examples: u64,
    /// Tokens seen.
    pub tokens: u64,
}

/// Registry failures.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Redis refused or could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A file or directory could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A stored entry or a file is not the JSON expected.
    #[error("invalid JSON in {what}: {source}")]
    Json {
        /// What was being parsed.
        what: String,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// The adapter could not be written or read.
    #[error("adapter: {0}")]
    Adapter(#[from] ModelError),
    /// No such version.
    #[error("adapter {name} has no version {version} in the registry")]
    NotFound {
        /// Adapter name.
        name: String,
        /// Version asked for.
        version: u64,
    },
    /// A version's file no longer matches the sha256 recorded at registration.
    #[error("{path}: sha256 {actual}, registered as {expected}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// sha256 recorded.
        expected: String,
        /// sha256 found (or `missing`).
        actual: String,
    },
    /// Anything else a caller can fix (bad name, inconsistent state, ...).
    #[error("{0}")]
    Invalid(String),
}

fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RegistryError {
    let path = path.into();
    move |source| RegistryError::Io { path, source }
}

pub(crate) fn json_err(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> RegistryError {
    let what = what.into();
    move |source| RegistryError::Json { what, source }
}

/// Versions of named adapters: metadata in Redis, files under `adapter_dir`.
#[derive(Clone)]
pub struct Registry {
    cfg: RegistryConfig,
    conn: ConnectionManager,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry a password: print the prefix and directory only.
        f.debug_struct("Registry")
            .field("key_prefix", &self.cfg.key_prefix)
            .field("adapter_dir", &self.cfg.adapter_dir)
            .finish()
    }
}

/// Compare-and-set of a status change. KEYS: entry, live pointer, previous live entry (or the
/// entry again). ARGV: entry as read, new entry, live as read ('' = none), new live ('' =
/// none), previous live entry as read ('' = not touched), its new value.
const SET_STATUS_LUA: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local live = redis.call('GET', KEYS[2])
if not live then live = '' end
if live ~= ARGV[3] then return 0 end
if ARGV[5] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[5] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[6]) end
if ARGV[4] == '' then redis.call('DEL', KEYS[2]) else redis.call('SET', KEYS[2], ARGV[4]) end
return 1
";

/// Attempts of a status change before concurrent writers are reported.
const CAS_ATTEMPTS: usize = 32;

impl Registry {
    /// Connects to Redis (2 s connection timeout, 5 s response timeout; the connection
    /// reconnects by itself afterwards).
    /// The Redis key prefix this registry lives under.
    pub fn key_prefix(&self) -> &str {
        &self.cfg.key_prefix
    }

    pub async fn connect(cfg: RegistryConfig) -> Result<Self, RegistryError> {
        if cfg.key_prefix.is_empty() {
            return Err(RegistryError::Invalid(
                "key_prefix must not be empty".into(),
            ));
        }
        let client = redis::Client::open(cfg.redis_url.as_str())?;
        let mgr_cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_secs(5))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, mgr_cfg).await?;
        Ok(Self { cfg, conn })
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &RegistryConfig {
        &self.cfg
    }

    fn key(&self, name: &str, suffix: &str) -> String {
        format!("{}:{name}:{suffix}", self.cfg.key_prefix)
    }
    fn version_key(&self, name: &str, version: u64) -> String {
        self.key(name, &format!("v:{version}"))
    }
    fn names_key(&self) -> String {
        format!("{}:names", self.cfg.key_prefix)
    }

    /// Allocates the next version (Redis `INCR`), writes the PEFT files into a temporary
    /// directory under `adapter_dir/<name>/`, adds `hindsight.json` `{"version", "name",
    /// "parent"}`, fsyncs, renames it to `v<N>` (atomic), hashes the files and stores the entry
    /// with status `candidate`. Files before metadata: a crash leaves at most an unused version
    /// number or an orphan directory, never an entry without files.
    pub async fn register(&self, v: NewVersion<'_>) -> Result<VersionEntry, RegistryError> {
        check_name(v.name)?;
        let root = &self.cfg.adapter_dir;
        std::fs::create_dir_all(root).map_err(io_err(root))?;
        let root = std::fs::canonicalize(root).map_err(io_err(root))?;
        let name_dir = root.join(v.name);
        std::fs::create_dir_all(&name_dir).map_err(io_err(&name_dir))?;

        let mut conn = self.conn.clone();
        let seq_key = self.key(v.name, "seq");
        // A directory already at v<N> means the sequence went backwards (Redis lost its data
        // while the files stayed): never overwrite, take the next free number.
        let mut version: u64 = conn.incr(&seq_key, 1u64).await?;
        let mut skipped = 0;
        while name_dir.join(format!("v{version}")).exists() {
            skipped += 1;
            if skipped > 10_000 {
                return Err(RegistryError::Invalid(format!(
                    "{}: no free version directory",
                    name_dir.display()
                )));
            }
            version = conn.incr(&seq_key, 1u64).await?;
        }
        if skipped > 0 {
            tracing::warn!(name = v.name, version, skipped, "Version directories already existed; the registry's sequence was behind the files.");
        }

        let final_dir = name_dir.join(format!("v{version}"));
        let tmp_dir = name_dir.join(format!(".tmp-v{version}-{}", uuid::Uuid::now_v7()));
        let written = write_version_dir(&v, version, &tmp_dir, &final_dir, &name_dir);
        let files_sha256 = match written {
            Ok(h) => h,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp_dir);
                return Err(e);
            }
        };

        let now = now_ms();
        let entry = VersionEntry {
            name: v.name.to_string(),
            version,
            parent: v.parent,
            base_model: v.base_model.to_string(),
            base_model_sha256: v.base_model_sha256.to_string(),
            path: final_dir,
            files_sha256,
            training_config: v.training_config,
            offsets: v.offsets,
            examples: v.examples,
            tokens: v.tokens,
            eval: None,
            status: VersionStatus::Candidate,
            created_at_ms: now,
            updated_at_ms: now,
            note: None,
        };
        let text = serde_json::to_string(&entry).map_err(json_err("registry entry"))?;
        let (stored,): (Option<String>,) = redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(self.version_key(v.name, version))
            .arg(text)
            .arg("NX")
            .sadd(self.names_key(), v.name)
            .ignore()
            .query_async(&mut conn)
            .await?;
        if stored.is_none() {
            return Err(RegistryError::Invalid(format!(
                "{} already has an entry for version {version}",
                v.name
            )));
        }
        tracing::info!(name = v.name, version, parent = ?v.parent, examples = v.examples, tokens = v.tokens, path = %entry.path.display(), "Adapter version registered.");
        metrics::counter!("hindsight_learner_registry_versions_total").increment(1);
        Ok(entry)
    }

    /// One version, if registered.
    pub async fn get(
        &self,
        name: &str,
        version: u64,
    ) -> Result<Option<VersionEntry>, RegistryError> {
        let mut conn = self.conn.clone();
        let raw: Option<String> = conn.get(self.version_key(name, version)).await?;
        raw.map(|r| parse_entry(&r, name, version)).transpose()
    }

    /// Every version of `name` (or of every name), sorted by name, then version.
    pub async fn list(&self, name: Option<&str>) -> Result<Vec<VersionEntry>, RegistryError> {
        let mut conn = self.conn.clone();
        let names: BTreeSet<String> = match name {
            Some(n) => [n.to_string()].into(),
            None => conn.smembers(self.names_key()).await?,
        };
        let mut out = Vec::new();
        for n in names {
            let seq: Option<u64> = conn.get(self.key(&n, "seq")).await?;
            let last = seq.unwrap_or(0);
            let mut first = 1u64;
            while first <= last {
                let end = last.min(first + 511);
                let keys: Vec<String> = (first..=end).map(|v| self.version_key(&n, v)).collect();
                let raws: Vec<Option<String>> =
                    redis::cmd("MGET").arg(&keys).query_async(&mut conn).await?;
                for (v, raw) in (first..=end).zip(raws) {
                    if let Some(raw) = raw {
                        out.push(parse_entry(&raw, &n, v)?);
                    }
                }
                first = end + 1;
            }
        }
        out.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        Ok(out)
    }

    /// The live version of `name`, if one is live.
    pub async fn live(&self, name: &str) -> Result<Option<VersionEntry>, RegistryError> {
        let mut conn = self.conn.clone();
        let live: Option<u64> = conn.get(self.key(name, "live")).await?;
        match live {
            Some(v) => self.get(name, v).await,
            None => Ok(None),
        }
    }

    /// Changes a version's status, replacing its eval results and note when given. Setting
    /// `live` retires the previous live version (one live version per name); moving the live
    /// version to another status leaves the name without a live version. Atomic against
    /// concurrent changes (compare-and-set, retried).
    pub async fn set_status(
        &self,
        name: &str,
        version: u64,
        status: VersionStatus,
        eval: Option<Value>,
        note: Option<String>,
    ) -> Result<VersionEntry, RegistryError> {
        let mut conn = self.conn.clone();
        let script = redis::Script::new(SET_STATUS_LUA);
        let entry_key = self.version_key(name, version);
        let live_key = self.key(name, "live");
        for _ in 0..CAS_ATTEMPTS {
            let raw: Option<String> = conn.get(&entry_key).await?;
            let raw = raw.ok_or_else(|| RegistryError::NotFound {
                name: name.to_string(),
                version,
            })?;
            let mut entry = parse_entry(&raw, name, version)?;
            let live_raw: Option<String> = conn.get(&live_key).await?;
            let live: Option<u64> = live_raw.as_deref().and_then(|s| s.parse().ok());
            let now = now_ms();
            entry.status = status;
            if eval.is_some() {
                entry.eval = eval.clone();
            }
            if note.is_some() {
                entry.note = note.clone();
            }
            entry.updated_at_ms = now;

            let new_live = match status {
                VersionStatus::Live => Some(version),
                _ if live == Some(version) => None,
                _ => live,
            };
            let mut prev_key = entry_key.clone();
            let (mut prev_raw, mut prev_new) = (String::new(), String::new());
            let mut retired = None;
            if let (VersionStatus::Live, Some(p)) = (status, live) {
                if p != version {
                    let key = self.version_key(name, p);
                    let raw: Option<String> = conn.get(&key).await?;
                    if let Some(raw) = raw {
                        let mut prev = parse_entry(&raw, name, p)?;
                        prev.status = VersionStatus::Retired;
                        prev.updated_at_ms = now;
                        prev.note = Some(format!("replaced by version {version}"));
                        prev_new =
                            serde_json::to_string(&prev).map_err(json_err("registry entry"))?;
                        prev_raw = raw;
                        prev_key = key;
                        retired = Some(p);
                    }
                }
            }
            let new_raw = serde_json::to_string(&entry).map_err(json_err("registry entry"))?;
            let done: i64 = script
                .key(&entry_key)
                .key(&live_key)
                .key(&prev_key)
                .arg(&raw)
                .arg(&new_raw)
                .arg(live_raw.unwrap_or_default())
                .arg(new_live.map(|v| v.to_string()).unwrap_or_default())
                .arg(&prev_raw)
                .arg(&prev_new)
                .invoke_async(&mut conn)
                .await?;
            if done == 1 {
                tracing::info!(name, version, status = %status, retired = ?retired, note = ?entry.note, "Adapter version status changed.");
                return Ok(entry);
            }
        }
        Err(RegistryError::Invalid(format!(
            "status change of {name}@{version} lost to concurrent writers {CAS_ATTEMPTS} times"
        )))
    }

    /// Verifies that a version's files still match the sha256 recorded at registration.
    pub async fn verify(&self, entry: &VersionEntry) -> Result<(), RegistryError> {
        let entry = entry.clone();
        tokio::task::spawn_blocking(move || verify_files(&entry))
            .await
            .map_err(|e| RegistryError::Invalid(format!("verification task failed: {e}")))?
    }
}

fn parse_entry(raw: &str, name: &str, version: u64) -> Result<VersionEntry, RegistryError> {
    serde_json::from_str(raw).map_err(json_err(format!("registry entry {name}@{version}")))
}

/// Names become directories, Redis key parts and serving names: keep them plain.
fn check_name(name: &str) -> Result<(), RegistryError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(RegistryError::Invalid(format!(
            "adapter name {name:?}: use 1-64 letters, digits, '-', '_' or '.', not starting with '.' or '-'"
        )))
    }
}

/// Writes `tmp_dir` completely, renames it to `final_dir` and returns the files' hashes.
fn write_version_dir(
    v: &NewVersion<'_>,
    version: u64,
    tmp_dir: &Path,
    final_dir: &Path,
    name_dir: &Path,
) -> Result<BTreeMap<String, String>, RegistryError> {
    v.adapter.save_peft(tmp_dir, v.base_model)?;
    let meta = json!({"version": version, "name": v.name, "parent": v.parent});
    let meta_path = tmp_dir.join(METADATA_FILE);
    let text = serde_json::to_string_pretty(&meta).map_err(json_err(METADATA_FILE))?;
    std::fs::write(&meta_path, text).map_err(io_err(&meta_path))?;
    let mut hashes = BTreeMap::new();
    for file in files_in(tmp_dir)? {
        let path = tmp_dir.join(&file);
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(io_err(&path))?;
        hashes.insert(file, sha256_file(&path)?);
    }
    sync_dir(tmp_dir)?;
    std::fs::rename(tmp_dir, final_dir).map_err(io_err(final_dir))?;
    sync_dir(name_dir)?;
    Ok(hashes)
}

fn files_in(dir: &Path) -> Result<Vec<String>, RegistryError> {
    let mut files = Vec::new();
    for item in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let item = item.map_err(io_err(dir))?;
        if item.file_type().map_err(io_err(item.path()))?.is_file() {
            files.push(item.file_name().to_string_lossy().into_owned());
        }
    }
    files.sort();
    Ok(files)
}

fn sync_dir(dir: &Path) -> Result<(), RegistryError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}

fn verify_files(entry: &VersionEntry) -> Result<(), RegistryError> {
    if !entry.files_sha256.contains_key(WEIGHTS_FILE) {
        return Err(RegistryError::Invalid(format!(
            "{} records no sha256 for {WEIGHTS_FILE}",
            entry.tag()
        )));
    }
    for (file, expected) in &entry.files_sha256 {
        let path = entry.path.join(file);
        let actual = if path.is_file() {
            sha256_file(&path)?
        } else {
            "missing".to_string()
        };
        if !actual.eq_ignore_ascii_case(expected) {
            return Err(RegistryError::Mismatch {
                path,
                expected: expected.clone(),
                actual,
            });
        }
    }
    Ok(())
}

/// sha256 (hex) of a file, streamed in 256 KiB blocks (base models are large).
pub fn sha256_file(path: &Path) -> Result<String, RegistryError> {
    let mut file = std::fs::File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = file.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

// ---------------------------------------------------------------------------------------------
// diff

/// One adapted projection's LoRA factors as read from a PEFT file.
struct Factors {
    a: Tensor,
    b: Tensor,
}

/// The scale `alpha / r` (or `alpha / sqrt(r)` with rsLoRA) from `adapter_config.json`.
fn peft_scale(dir: &Path) -> Result<(f64, Value), RegistryError> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let cfg: Value = serde_json::from_str(&text).map_err(json_err(CONFIG_FILE))?;
    let r = cfg.get("r").and_then(Value::as_f64).unwrap_or(0.0);
    let alpha = cfg.get("lora_alpha").and_then(Value::as_f64).unwrap_or(0.0);
    if r <= 0.0 {
        return Err(RegistryError::Invalid(format!(
            "{}: r must be positive",
            path.display()
        )));
    }
    let rslora = cfg
        .get("use_rslora")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let scale = if rslora { alpha / r.sqrt() } else { alpha / r };
    Ok((scale, cfg))
}

/// Module name (`layers.3.self_attn.q_proj`) → factors, in f64.
fn read_factors(dir: &Path) -> Result<BTreeMap<String, Factors>, RegistryError> {
    let path = dir.join(WEIGHTS_FILE);
    if !path.is_file() {
        return Err(RegistryError::Io {
            path,
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        });
    }
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(ModelError::from)?;
    let mut a_s = BTreeMap::new();
    let mut b_s = BTreeMap::new();
    for (key, t) in tensors {
        let key = key.replace(".default.weight", ".weight");
        let key = key.strip_prefix("base_model.model.model.").unwrap_or(&key);
        let t = t.to_dtype(DType::F64).map_err(ModelError::from)?;
        if let Some(m) = key.strip_suffix(".lora_A.weight") {
            a_s.insert(m.to_string(), t);
        } else if let Some(m) = key.strip_suffix(".lora_B.weight") {
            b_s.insert(m.to_string(), t);
        }
    }
    let mut out = BTreeMap::new();
    for (m, a) in a_s {
        let b = b_s.remove(&m).ok_or_else(|| {
            RegistryError::Invalid(format!("{}: {m} has lora_A but no lora_B", path.display()))
        })?;
        out.insert(m, Factors { a, b });
    }
    if let Some(m) = b_s.keys().next() {
        return Err(RegistryError::Invalid(format!(
            "{}: {m} has lora_B but no lora_A",
            path.display()
        )));
    }
    Ok(out)
}

/// `tr(X Y)` for square-compatible matrices.
fn trace_of_product(x: &Tensor, y: &Tensor) -> Result<f64, ModelError> {
    // tr(XY) = sum(X ∘ Yᵀ)
    Ok((x * y.t()?)?.sum_all()?.to_scalar::<f64>()?)
}

/// `<s_p B_p A_p, s_q B_q A_q>_F` through r×r Gram matrices: `s_p s_q tr((B_pᵀ B_q)(A_q A_pᵀ))`,
/// so no `[out, in]` product is formed.
fn lora_inner(p: &Factors, sp: f64, q: &Factors, sq: f64) -> Result<f64, ModelError> {
    let bb = p.b.t()?.matmul(&q.b)?;
    let aa = q.a.matmul(&p.a.t()?)?;
    Ok(sp * sq * trace_of_product(&bb, &aa)?)
}

fn same_tensor(x: &Tensor, y: &Tensor) -> Result<bool, ModelError> {
    if x.dims() != y.dims() {
        return Ok(false);
    }
    Ok((x - y)?.abs()?.max_all()?.to_scalar::<f64>()? == 0.0)
}

/// Per-module comparison of two versions' weights (even of different names): for each adapted
/// projection the Frobenius norms of `ΔW = scale·B·A` in each version and of their difference,
/// whether it changed, modules present in only one; LoRA settings and entry fields that
/// differ. For `hindsight adapters diff`.
pub fn diff(a: &VersionEntry, b: &VersionEntry) -> Result<Value, RegistryError> {
    let (sa, cfg_a) = peft_scale(&a.path)?;
    let (sb, cfg_b) = peft_scale(&b.path)?;
    let fa = read_factors(&a.path)?;
    let fb = read_factors(&b.path)?;

    let mut modules = Vec::new();
    let (mut tot_a, mut tot_b, mut tot_d) = (0f64, 0f64, 0f64);
    let mut changed = 0usize;
    for (m, x) in &fa {
        let Some(y) = fb.get(m) else { continue };
        let na2 = lora_inner(x, sa, x, sa)?.max(0.0);
        let nb2 = lora_inner(y, sb, y, sb)?.max(0.0);
        let identical = sa == sb && same_tensor(&x.a, &y.a)? && same_tensor(&x.b, &y.b)?;
        let d2 = if identical {
            0.0
        } else {
            (na2 + nb2 - 2.0 * lora_inner(x, sa, y, sb)?).max(0.0)
        };
        tot_a += na2;
        tot_b += nb2;
        tot_d += d2;
        if !identical {
            changed += 1;
        }
        let (na, d) = (na2.sqrt(), d2.sqrt());
        modules.push(json!({
            "module": m,
            "norm_a": na,
            "norm_b": nb2.sqrt(),
            "diff_norm": d,
            "relative_change": if na > 0.0 { Some(d / na) } else { None },
            "changed": !identical,
        }));
    }
    let only_in_a: Vec<&String> = fa.keys().filter(|m| !fb.contains_key(*m)).collect();
    let only_in_b: Vec<&String> = fb.keys().filter(|m| !fa.contains_key(*m)).collect();

    let va = serde_json::to_value(a).map_err(json_err("registry entry"))?;
    let vb = serde_json::to_value(b).map_err(json_err("registry entry"))?;
    let metadata = differing_fields(&va, &vb);
    let lora_config = differing_fields(&cfg_a, &cfg_b);

    Ok(json!({
        "a": a.tag(),
        "b": b.tag(),
        "metadata": metadata,
        "lora_config": lora_config,
        "summary": {
            "modules_compared": modules.len(),
            "modules_changed": changed,
            "only_in_a": only_in_a,
            "only_in_b": only_in_b,
            "total_norm_a": tot_a.sqrt(),
            "total_norm_b": tot_b.sqrt(),
            "total_diff_norm": tot_d.sqrt(),
        },
        "modules": modules,
    }))
}

/// Top-level fields of two JSON objects that differ: `{field: {"a": .., "b": ..}}`.
pub(crate) fn differing_fields(a: &Value, b: &Value) -> Value {
    let empty = serde_json::Map::new();
    let ma = a.as_object().unwrap_or(&empty);
    let mb = b.as_object().unwrap_or(&empty);
    let keys: BTreeSet<&String> = ma.keys().chain(mb.keys()).collect();
    let mut out = serde_json::Map::new();
    for k in keys {
        let (x, y) = (ma.get(k), mb.get(k));
        if x != y {
            out.insert(k.clone(), json!({"a": x, "b": y}));
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests;
