//! `[serve]` configuration: the raw TOML section, `HINDSIGHT_SERVE__*` overrides, the command-line
//! flags and the validated [`ServeConfig`].

use std::net::SocketAddr;
use std::path::PathBuf;

use hindsight_model::{DeviceSpec, WeightDType};
use serde::{Deserialize, Serialize};

use crate::engine::EngineConfig;
use crate::error::ServeError;

/// `[serve]`: what `hindsight serve` runs. Every key is optional; `HINDSIGHT_SERVE__<KEY>`
/// overrides the file and the command-line flags override both (see
/// deploy/hindsight.example.toml).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServeSection {
    /// GGUF file or HF model directory.
    #[serde(default = "default_model")]
    pub model: PathBuf,
    /// Address to listen on.
    #[serde(default = "default_listen_addr")]
    pub listen_addr: String,
    /// Adapters to load at start: name → PEFT directory.
    #[serde(default)]
    pub adapters: std::collections::BTreeMap<String, PathBuf>,
    /// Name of the base model in `model` and `/v1/models` (default: the file or directory name).
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// Requests that may wait for the generation worker before new ones get 429.
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
    /// Most sequences decoded at once.
    #[serde(default = "default_max_active_sequences")]
    pub max_active_sequences: usize,
    /// Most sequences admitted into one batch.
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// Token budget when a request sets none.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: usize,
    /// Versions of each adapter kept loaded (for `name@version` pins), the current one included.
    #[serde(default = "default_keep_adapter_versions")]
    pub keep_adapter_versions: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N` (a build with `--features cuda`).
    #[serde(default)]
    pub device: DeviceSpec,
    /// dtype of the base weights: `f32`, or `bf16`/`f16` on a GPU (adapters stay f32).
    #[serde(default)]
    pub dtype: WeightDType,
}

impl Default for RawServeSection {
    fn default() -> Self {
        Self {
            model: default_model(),
            listen_addr: default_listen_addr(),
            adapters: Default::default(),
            served_model_name: None,
            queue_capacity: default_queue_capacity(),
            max_active_sequences: default_max_active_sequences(),
            max_batch: default_max_batch(),
            default_max_tokens: default_max_tokens(),
            keep_adapter_versions: default_keep_adapter_versions(),
            device: DeviceSpec::default(),
            dtype: WeightDType::default(),
        }
    }
}

/// The config file as `hindsight serve` reads it: its `[serve]` section.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    #[serde(default)]
    serve: RawServeSection,
}

/// `hindsight serve` arguments: a config file, then flags (each overrides its `serve.*` key).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// TOML config file with a `[serve]` section (see deploy/hindsight.example.toml).
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// GGUF file or HF model directory (`serve.model`).
    #[arg(long, env = "HINDSIGHT_MODEL")]
    pub model: Option<PathBuf>,
    /// Address to listen on (`serve.listen_addr`).
    #[arg(long)]
    pub listen: Option<String>,
    /// Adapters to load at start, `NAME=PATH` (repeatable; added to `serve.adapters`).
    #[arg(long = "adapter", value_name = "NAME=PATH")]
    pub adapters: Vec<String>,
    /// Name of the base model in `model` and `/v1/models` (`serve.served_model_name`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Requests that may wait before new ones get 429 (`serve.queue_capacity`).
    #[arg(long)]
    pub queue_capacity: Option<usize>,
    /// Most sequences decoded at once (`serve.max_active_sequences`).
    #[arg(long)]
    pub max_active_sequences: Option<usize>,
    /// Most sequences admitted into one batch (`serve.max_batch`).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Token budget when a request sets none (`serve.default_max_tokens`).
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Versions of each adapter kept loaded (`serve.keep_adapter_versions`).
    #[arg(long)]
    pub keep_adapter_versions: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N` (`serve.device`).
    #[arg(long, env = "HINDSIGHT_DEVICE")]
    pub device: Option<DeviceSpec>,
    /// dtype of the base weights: `f32`, `bf16`, `f16` (`serve.dtype`).
    #[arg(long, env = "HINDSIGHT_DTYPE")]
    pub dtype: Option<WeightDType>,
}

fn default_model() -> PathBuf {
    PathBuf::from(hindsight_model::DEFAULT_MODEL_FILE)
}
fn default_listen_addr() -> String {
    "127.0.0.1:8000".into()
}
fn default_queue_capacity() -> usize {
    64
}
fn default_max_active_sequences() -> usize {
    32
}
fn default_max_batch() -> usize {
    16
}
fn default_max_tokens() -> usize {
    512
}
fn default_keep_adapter_versions() -> usize {
    2
}

/// Validated server configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Model path.
    pub model: PathBuf,
    /// Listen address (used by the CLI to bind).
    pub listen: SocketAddr,
    /// Adapters to load at start.
    pub adapters: Vec<(String, PathBuf)>,
    /// Base model name.
    pub served_model_name: String,
    /// Worker limits.
    pub engine: EngineConfig,
    /// Default token budget.
    pub default_max_tokens: usize,
    /// Versions kept per adapter.
    pub keep_adapter_versions: usize,
    /// Where the model runs.
    pub device: DeviceSpec,
    /// dtype of the base weights.
    pub dtype: WeightDType,
}

impl ServeArgs {
    /// The file's `[serve]` section (if any), `HINDSIGHT_SERVE__*` overrides, then the flags;
    /// validated.
    pub fn load(&self) -> Result<ServeConfig, ServeError> {
        let mut raw = RawServeSection::load(self.config.as_deref(), std::env::vars())?;
        if let Some(v) = &self.model {
            raw.model = v.clone();
        }
        if let Some(v) = &self.listen {
            raw.listen_addr = v.clone();
        }
        for a in &self.adapters {
            let (n, p) = a
                .split_once('=')
                .filter(|(n, p)| !n.is_empty() && !p.is_empty())
                .ok_or_else(|| ServeError::Config(format!("--adapter {a:?} is not NAME=PATH")))?;
            raw.adapters.insert(n.to_string(), PathBuf::from(p));
        }
        if let Some(v) = &self.served_model_name {
            raw.served_model_name = Some(v.clone());
        }
        let set = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut raw.queue_capacity, self.queue_capacity);
        set(&mut raw.max_active_sequences, self.max_active_sequences);
        set(&mut raw.max_batch, self.max_batch);
        set(&mut raw.default_max_tokens, self.default_max_tokens);
        set(&mut raw.keep_adapter_versions, self.keep_adapter_versions);
        if let Some(v) = self.device {
            raw.device = v;
        }
        if let Some(v) = self.dtype {
            raw.dtype = v;
        }
        raw.validate()
    }
}

impl RawServeSection {
    /// The `[serve]` section of a config file (or the defaults without one), with
    /// `HINDSIGHT_SERVE__<KEY>` overrides from `env`.
    pub fn load(
        path: Option<&std::path::Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ServeError> {
        let file: ServeFile = hindsight_core::load_toml(path, env, &["serve"])
            .map_err(|e| ServeError::Config(e.to_string()))?;
        Ok(file.serve)
    }

    /// Checks the section once at start-up; errors name the key.
    pub fn validate(self) -> Result<ServeConfig, ServeError> {
        let listen: SocketAddr = self.listen_addr.parse().map_err(|e| {
            ServeError::Config(format!(
                "config key `serve.listen_addr`: `{}` is not an address ({e})",
                self.listen_addr
            ))
        })?;
        for (key, v) in [
            ("queue_capacity", self.queue_capacity),
            ("max_active_sequences", self.max_active_sequences),
            ("max_batch", self.max_batch),
            ("default_max_tokens", self.default_max_tokens),
            ("keep_adapter_versions", self.keep_adapter_versions),
        ] {
            if v == 0 {
                return Err(ServeError::Config(format!(
                    "config key `serve.{key}`: must be at least 1"
                )));
            }
        }
        let served_model_name = match &self.served_model_name {
            Some(n) => n.clone(),
            None => {
                let name = self
                    .model
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_else(|| "model".into());
                name.strip_suffix(".gguf").unwrap_or(&name).to_string()
            }
        };
        Ok(ServeConfig {
            model: self.model,
            listen,
            adapters: self.adapters.into_iter().collect(),
            served_model_name,
            engine: EngineConfig {
                queue_capacity: self.queue_capacity,
                max_active_sequences: self.max_active_sequences,
                max_group_size: self.max_batch,
            },
            default_max_tokens: self.default_max_tokens,
            keep_adapter_versions: self.keep_adapter_versions,
            device: self.device,
            dtype: self.dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/hindsight.example.toml")
    }

    /// The shared example file's `[serve]` shows the defaults, and the other processes'
    /// sections in it are left alone.
    #[test]
    fn the_example_file_shows_the_serve_defaults() {
        let shown = RawServeSection::load(Some(&example()), Vec::new()).unwrap();
        assert_eq!(shown, RawServeSection::default());
    }

    #[test]
    fn overrides_and_flags_apply_in_order_and_bad_values_name_the_key() {
        let env = vec![
            ("HINDSIGHT_SERVE__MAX_BATCH".to_string(), "4".to_string()),
            (
                "HINDSIGHT_SERVE__LISTEN_ADDR".to_string(),
                "127.0.0.1:9".to_string(),
            ),
        ];
        let raw = RawServeSection::load(Some(&example()), env).unwrap();
        assert_eq!(
            (raw.max_batch, raw.listen_addr.as_str()),
            (4, "127.0.0.1:9")
        );
        let cfg = raw.validate().unwrap();
        assert_eq!(cfg.served_model_name, "SmolLM2-135M-Instruct.Q4_1");
        let bad = RawServeSection {
            listen_addr: "nowhere".into(),
            ..RawServeSection::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("serve.listen_addr"), "{e}");
        let zero = RawServeSection {
            max_batch: 0,
            ..RawServeSection::default()
        };
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("serve.max_batch"));
        let args = ServeArgs {
            adapters: vec!["nopath".into()],
            ..ServeArgs::default()
        };
        assert!(args.load().unwrap_err().to_string().contains("NAME=PATH"));
    }
}
