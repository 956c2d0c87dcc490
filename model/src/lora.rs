//! LoRA adapters: configuration, trainable weights in their own `VarMap`, per-sequence selection
//! in a batch, merging, and the PEFT on-disk format (`adapter_config.json` +
//! `adapter_model.safetensors`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::model::Model;

/// A projection that can carry an adapter. The discriminant indexes a layer's projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LoraTarget {
    /// `self_attn.q_proj`
    #[serde(rename = "q_proj")]
    Q = 0,
    /// `self_attn.k_proj`
    #[serde(rename = "k_proj")]
    K = 1,
    /// `self_attn.v_proj`
    #[serde(rename = "v_proj")]
    V = 2,
    /// `self_attn.o_proj`
    #[serde(rename = "o_proj")]
    O = 3,
    /// `mlp.gate_proj`
    #[serde(rename = "gate_proj")]
    Gate = 4,
    /// `mlp.up_proj`
    #[serde(rename = "up_proj")]
    Up = 5,
    /// `mlp.down_proj`
    #[serde(rename = "down_proj")]
    Down = 6,
}

impl LoraTarget {
    /// Every projection, in layer order.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::Q,
        LoraTarget::K,
        LoraTarget::V,
        LoraTarget::O,
        LoraTarget::Gate,
        LoraTarget::Up,
        LoraTarget::Down,
    ];

    /// The HF module name (`q_proj`, ...), as used in PEFT's `target_modules`.
    pub fn hf_name(self) -> &'static str {
        match self {
            LoraTarget::Q => "q_proj",
            LoraTarget::K => "k_proj",
            LoraTarget::V => "v_proj",
            LoraTarget::O => "o_proj",
            LoraTarget::Gate => "gate_proj",
            LoraTarget::Up => "up_proj",
            LoraTarget::Down => "down_proj",
        }
    }

    /// The parent module (`self_attn` or `mlp`).
    pub fn module(self) -> &'static str {
        match self {
            LoraTarget::Q | LoraTarget::K | LoraTarget::V | LoraTarget::O => "self_attn",
            _ => "mlp",
        }
    }

    /// Parses an HF module name.
    pub fn from_hf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.hf_name() == name)
    }

    /// `(out_features, in_features)` of this projection.
    pub fn shape(self, cfg: &ModelConfig) -> (usize, usize) {
        let (h, q, kv, i) = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.intermediate_size,
        );
        match self {
            LoraTarget::Q => (q, h),
            LoraTarget::K | LoraTarget::V => (kv, h),
            LoraTarget::O => (h, q),
            LoraTarget::Gate | LoraTarget::Up => (i, h),
            LoraTarget::Down => (h, i),
        }
    }
}

/// LoRA hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank r.
    #[serde(default = "default_rank")]
    pub rank: usize,
    /// Scaling numerator alpha.
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// rsLoRA: scale by `alpha / sqrt(r)` instead of `alpha / r`.
    #[serde(default)]
    pub use_rslora: bool,
    /// Dropout probability on the adapter input during training.
    #[serde(default)]
    pub dropout: f64,
    /// Projections that carry an adapter.
    #[serde(default = "default_targets")]
    pub targets: Vec<LoraTarget>,
}

// Rank 8, alpha 16: what every learning curve was measured with (docs/experiments/).
fn default_rank() -> usize {
    8
}
fn default_alpha() -> f64 {
    16.0
}
fn default_targets() -> Vec<LoraTarget> {
    LoraTarget::ALL.to_vec()
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: default_rank(),
            alpha: default_alpha(),
            use_rslora: false,
            dropout: 0.0,
            targets: default_targets(),
        }
    }
}

impl LoraConfig {
    /// The factor applied to `B @ A`.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    fn check(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(ModelError::InvalidAdapter("rank must be positive".into()));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::InvalidAdapter(
                "dropout must be in [0, 1)".into(),
            ));
        }
        if self.targets.is_empty() {
            return Err(ModelError::InvalidAdapter("no target modules".into()));
        }
        Ok(())
    }
}

/// How a new adapter's weights start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoraInit {
    /// PEFT's default: A ~ kaiming-uniform (bound `1/sqrt(in)`), B = 0, so the adapter starts
    /// as the identity.
    Peft,
    /// A as PEFT, B ~ N(0, std): a non-trivial adapter for tests.
    RandomB(f32),
}

/// The PEFT key of a LoRA matrix (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`).
pub fn peft_key(layer: usize, target: LoraTarget, b: bool) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.{}.lora_{}.weight",
        target.module(),
        target.hf_name(),
        if b { "B" } else { "A" }
    )
}

/// One LoRA adapter: `W x + scale * B (A dropout(x))` on the configured projections. A is
/// `[r, in]`, B is `[out, r]`, f32, held as variables in the adapter's own `VarMap` (the only
/// trainable parameters).
pub struct Adapter {
    name: String,
    config: LoraConfig,
    varmap: VarMap,
    /// Per layer, per projection: (A, B).
    weights: Vec<[Option<(Var, Var)>; 7]>,
}

impl std::fmt::Debug for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adapter")
            .field("name", &self.name)
            .field("config", &self.config)
            .field("layers", &self.weights.len())
            .finish()
    }
}

impl Adapter {
    /// A new adapter for a model of configuration `model_cfg`.
    pub fn new(
        name: impl Into<String>,
        config: LoraConfig,
        model_cfg: &ModelConfig,
        init: LoraInit,
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        config.check()?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        for i in 0..model_cfg.num_layers {
            for &t in &config.targets {
                let (out, inp) = t.shape(model_cfg);
                let bound = 1.0 / (inp as f32).sqrt();
                let a: Vec<f32> = (0..config.rank * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let b: Vec<f32> = match init {
                    LoraInit::Peft => vec![0.0; out * config.rank],
                    LoraInit::RandomB(std) => (0..out * config.rank)
                        .map(|_| {
                            let u1: f32 = rng.random::<f32>().max(1e-7);
                            let u2: f32 = rng.random::<f32>();
                            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
                        })
                        .collect(),
                };
                tensors.insert(
                    peft_key(i, t, false),
                    Tensor::from_vec(a, (config.rank, inp), device)?,
                );
                tensors.insert(
                    peft_key(i, t, true),
                    Tensor::from_vec(b, (out, config.rank), device)?,
                );
            }
        }
        Self::from_tensors(name.into(), config, model_cfg, tensors)
    }

    fn from_tensors(
        name: String,
        config: LoraConfig,
        model_cfg: &ModelConfig,
        tensors: HashMap<String, Tensor>,
    ) -> Result<Self> {
        Self::from_tensors_dtype(name, config, model_cfg, tensors, DType::F32)
    }

    fn from_tensors_dtype(
        name: String,
        config: LoraConfig,
        model_cfg: &ModelConfig,
        mut tensors: HashMap<String, Tensor>,
        dtype: DType,
    ) -> Result<Self> {
        let mut config = config;
        config.targets.sort_unstable();
        config.targets.dedup();
        config.check()?;
        let varmap = VarMap::new();
        let mut weights: Vec<[Option<(Var, Var)>; 7]> = (0..model_cfg.num_layers)
            .map(|_| Default::default())
            .collect();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| ModelError::InvalidAdapter("poisoned var map".into()))?;
            for (i, layer) in weights.iter_mut().enumerate() {
                for &t in &config.targets {
                    let (out, inp) = t.shape(model_cfg);
                    let mut take = |b: bool, shape: [usize; 2]| -> Result<Var> {
                        let key = peft_key(i, t, b);
                        let tensor = tensors.remove(&key).ok_or_else(|| {
                            ModelError::InvalidAdapter(format!("missing tensor {key}"))
                        })?;
                        if tensor.dims() != shape {
                            return Err(ModelError::InvalidAdapter(format!(
                                "{key} has shape {:?}, expected {shape:?}",
                                tensor.dims()
                            )));
                        }
                        let var = Var::from_tensor(&tensor.to_dtype(dtype)?)?;
                        data.insert(key, var.clone());
                        Ok(var)
                    };
                    let a = take(false, [config.rank, inp])?;
                    let b = take(true, [out, config.rank])?;
                    layer[t as usize] = Some((a, b));
                }
            }
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(ModelError::InvalidAdapter(format!(
                "unexpected tensor {extra} (layer or target not in the config)"
            )));
        }
        Ok(Self {
            name,
            config,
            varmap,
            weights,
        })
    }

    /// The same adapter with its weights converted to `dtype` (f32 by default; f64 for
    /// numerical checks). The variables are new: gradients flow to the returned adapter.
    pub fn with_dtype(self, dtype: DType, model_cfg: &ModelConfig) -> Result<Self> {
        let tensors = self
            .varmap
            .data()
            .lock()
            .map_err(|_| ModelError::InvalidAdapter("poisoned var map".into()))?
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(dtype)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Self::from_tensors_dtype(self.name, self.config, model_cfg, tensors, dtype)
    }

    /// A deep copy under a new name (fresh variables): e.g. the teacher snapshot of
    /// self-distillation, or a candidate frozen for publishing while training continues.
    pub fn snapshot(&self, name: impl Into<String>, model_cfg: &ModelConfig) -> Result<Self> {
        let tensors = self.tensors()?;
        let dtype = tensors
            .values()
            .next()
            .map(|t| t.dtype())
            .unwrap_or(DType::F32);
        let tensors = tensors
            .into_iter()
            .map(|(k, t)| Ok((k, t.copy()?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Self::from_tensors_dtype(name.into(), self.config.clone(), model_cfg, tensors, dtype)
    }

    /// Exponential moving average towards `other` (same configuration): `self = (1 - rate) *
    /// self + rate * other`, e.g. a slowly moving teacher.
    pub fn ema_update(&self, other: &Adapter, rate: f64) -> Result<()> {
        if self.config != other.config {
            return Err(ModelError::InvalidAdapter(
                "EMA between adapters of different configurations".into(),
            ));
        }
        let mine = self.varmap.data().lock().map_err(|_| poisoned())?;
        let theirs = other.varmap.data().lock().map_err(|_| poisoned())?;
        for (k, v) in mine.iter() {
            let o = theirs
                .get(k)
                .ok_or_else(|| ModelError::InvalidAdapter(format!("{k} missing in EMA source")))?;
            let o = o.as_tensor().detach().to_dtype(v.dtype())?;
            let next = ((v.as_tensor().detach() * (1.0 - rate))? + (o * rate)?)?;
            v.set(&next)?;
        }
        Ok(())
    }

    /// The adapter's tensors by PEFT key (detached).
    pub fn tensors(&self) -> Result<HashMap<String, Tensor>> {
        Ok(self
            .varmap
            .data()
            .lock()
            .map_err(|_| poisoned())?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect())
    }

    /// Scales the gradients of this adapter's variables in `grads` so that their global L2
    /// norm is at most `max_norm`; returns the norm before clipping (NaN/Inf if a gradient is
    /// not finite, so the caller can skip the step).
    pub fn clip_grad_norm(
        &self,
        grads: &mut candle_core::backprop::GradStore,
        max_norm: f64,
    ) -> Result<f64> {
        let vars = self.vars();
        let mut sq = 0f64;
        for v in &vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += g
                    .to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
            }
        }
        let norm = sq.sqrt();
        if norm.is_finite() && norm > max_norm && norm > 0.0 {
            let scale = max_norm / norm;
            for v in &vars {
                if let Some(g) = grads.remove(v.as_tensor()) {
                    grads.insert(v.as_tensor(), (g * scale)?);
                }
            }
        }
        Ok(norm)
    }

    /// The adapter's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The LoRA configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }
    /// The trainable parameters (give `varmap().all_vars()` to the optimizer).
    pub fn varmap(&self) -> &VarMap {
        &self.varmap
    }
    /// The trainable parameters as a list.
    pub fn vars(&self) -> Vec<Var> {
        self.varmap.all_vars()
    }
    /// Layers the adapter was built for.
    pub fn num_layers(&self) -> usize {
        self.weights.len()
    }
    /// (A, B) of one projection, if adapted.
    pub fn matrices(&self, layer: usize, target: LoraTarget) -> Option<(&Var, &Var)> {
        self.weights
            .get(layer)
            .and_then(|l| l[target as usize].as_ref())
            .map(|(a, b)| (a, b))
    }

    /// The first adapted projection (layer, target) whose weights hold a NaN or an infinity.
    pub fn first_non_finite(&self) -> Result<Option<(usize, LoraTarget)>> {
        for (layer, targets) in self.weights.iter().enumerate() {
            for t in LoraTarget::ALL {
                if let Some((a, b)) = &targets[t as usize] {
                    for m in [a, b] {
                        let values = m.as_tensor().flatten_all()?.to_dtype(DType::F32)?;
                        if !values.to_vec1::<f32>()?.iter().all(|x| x.is_finite()) {
                            return Ok(Some((layer, t)));
                        }
                    }
                }
            }
        }
        Ok(None)
    }

    /// `scale * B @ A` (`[out, in]`, f32) for one projection, or `None` if not adapted.
    pub fn delta_weight(&self, layer: usize, target: LoraTarget) -> Result<Option<Tensor>> {
        match self.matrices(layer, target) {
            Some((a, b)) => Ok(Some(
                b.as_tensor()
                    .matmul(a.as_tensor())?
                    .affine(self.config.scale(), 0.0)?,
            )),
            None => Ok(None),
        }
    }

    /// Writes the adapter in PEFT's format into `dir`: `adapter_config.json` and
    /// `adapter_model.safetensors` (f32).
    pub fn save_peft(&self, dir: &Path, base_model_name: &str) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let mut targets: Vec<&str> = self.config.targets.iter().map(|t| t.hf_name()).collect();
        targets.sort_unstable();
        targets.dedup();
        let cfg = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name,
            "r": self.config.rank,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout,
            "use_rslora": self.config.use_rslora,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "revision": null,
        });
        let path = dir.join("adapter_config.json");
        let text = serde_json::to_string_pretty(&cfg)
            .map_err(|e| ModelError::json("adapter_config.json", e))?;
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
        let tensors: BTreeMap<String, Tensor> = self
            .varmap
            .data()
            .lock()
            .map_err(|_| ModelError::InvalidAdapter("poisoned var map".into()))?
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(DType::F32)?)))
            .collect::<Result<_>>()?;
        let path = dir.join("adapter_model.safetensors");
        let tensors: HashMap<String, Tensor> = tensors.into_iter().collect();
        candle_core::safetensors::save(&tensors, &path)?;
        Ok(())
    }

    /// Reads a PEFT adapter directory written by [`Adapter::save_peft`] or by PEFT itself.
    pub fn load_peft(
        dir: &Path,
        name: impl Into<String>,
        model_cfg: &ModelConfig,
        device: &Device,
    ) -> Result<Self> {
        let path = dir.join("adapter_model.safetensors");
        let weights = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::load_peft_with_weights(dir, &weights, name, model_cfg, device)
    }

    /// [`Adapter::load_peft`] with the bytes of `adapter_model.safetensors` already read, so a
    /// caller that also hashes the file reads it once.
    pub fn load_peft_with_weights(
        dir: &Path,
        weights: &[u8],
        name: impl Into<String>,
        model_cfg: &ModelConfig,
        device: &Device,
    ) -> Result<Self> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let raw: PeftConfig =
            serde_json::from_str(&text).map_err(|e| ModelError::json("adapter_config.json", e))?;
        if raw.peft_type.as_deref().unwrap_or("LORA") != "LORA" {
            return Err(ModelError::InvalidAdapter(format!(
                "peft_type {:?} is not LORA",
                raw.peft_type
            )));
        }
        if raw.use_dora {
            return Err(ModelError::InvalidAdapter("DoRA is not supported".into()));
        }
        let targets = match raw.target_modules {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .and_then(LoraTarget::from_hf_name)
                        .ok_or_else(|| {
                            ModelError::InvalidAdapter(format!("unsupported target module {v}"))
                        })
                })
                .collect::<Result<Vec<_>>>()?,
            serde_json::Value::String(s) if s == "all-linear" => LoraTarget::ALL.to_vec(),
            other => {
                return Err(ModelError::InvalidAdapter(format!(
                    "unsupported target_modules {other}"
                )))
            }
        };
        let config = LoraConfig {
            rank: raw.r,
            alpha: raw.lora_alpha,
            use_rslora: raw.use_rslora,
            dropout: raw.lora_dropout,
            targets,
        };
        let loaded = candle_core::safetensors::load_buffer(weights, device)?;
        // PEFT sometimes keeps the adapter name in keys (`lora_A.default.weight`).
        let tensors = loaded
            .into_iter()
            .map(|(k, v)| (k.replace(".default.weight", ".weight"), v))
            .collect();
        Self::from_tensors(name.into(), config, model_cfg, tensors)
    }
}

#[derive(Debug, Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    lora_dropout: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    target_modules: serde_json::Value,
}

fn poisoned() -> ModelError {
    ModelError::InvalidAdapter("poisoned var map".into())
}

/// Several adapters held at once, by name (e.g. the stable and the candidate version).
#[derive(Debug, Default)]
pub struct AdapterSet {
    adapters: HashMap<String, Adapter>,
}

impl AdapterSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds or replaces an adapter under its name; returns the one replaced.
    pub fn insert(&mut self, adapter: Adapter) -> Option<Adapter> {
        self.adapters.insert(adapter.name.clone(), adapter)
    }
    /// Removes an adapter.
    pub fn remove(&mut self, name: &str) -> Option<Adapter> {
        self.adapters.remove(name)
    }
    /// Looks up an adapter.
    pub fn get(&self, name: &str) -> Option<&Adapter> {
        self.adapters.get(name)
    }
    /// Names held.
    pub fn names(&self) -> Vec<&str> {
        self.adapters.keys().map(String::as_str).collect()
    }
    /// A per-sequence selection by name (`None` = base model for that row).
    pub fn select(&self, names: &[Option<&str>]) -> Result<AdapterSelection<'_>> {
        let picked = names
            .iter()
            .map(|n| match n {
                Some(n) => self
                    .get(n)
                    .map(Some)
                    .ok_or_else(|| ModelError::InvalidArgument(format!("unknown adapter {n}"))),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdapterSelection::PerSequence(picked))
    }
}

/// Which adapter each sequence of a batch runs with.
#[derive(Debug, Clone, Default)]
pub enum AdapterSelection<'a> {
    /// The base model.
    #[default]
    None,
    /// One adapter for every sequence.
    All(&'a Adapter),
    /// One entry per sequence (`None` = base model).
    PerSequence(Vec<Option<&'a Adapter>>),
}

pub(crate) struct ResolvedOne {
    /// Per layer, per target: (A, B) as tensors (tracked when training).
    weights: Vec<[Option<(Tensor, Tensor)>; 7]>,
    scale: f64,
    dropout: f64,
    /// `[rows, 1]` mask of the rows this adapter applies to; `None` = all rows.
    rows: Option<Tensor>,
}

/// An [`AdapterSelection`] prepared for one forward pass.
pub(crate) struct ResolvedAdapters {
    parts: Vec<ResolvedOne>,
}

impl AdapterSelection<'_> {
    pub(crate) fn resolve(
        &self,
        model: &Model,
        batch: usize,
        seq: usize,
        train: bool,
    ) -> Result<ResolvedAdapters> {
        let mut groups: Vec<(&Adapter, Option<Vec<bool>>)> = Vec::new();
        match self {
            AdapterSelection::None => {}
            AdapterSelection::All(a) => groups.push((a, None)),
            AdapterSelection::PerSequence(per) => {
                if per.len() != batch {
                    return Err(ModelError::InvalidArgument(format!(
                        "{} adapter choices for a batch of {batch}",
                        per.len()
                    )));
                }
                for (row, choice) in per.iter().enumerate() {
                    let Some(a) = choice else { continue };
                    let idx = match groups.iter().position(|(g, _)| std::ptr::eq(*g, *a)) {
                        Some(i) => i,
                        None => {
                            groups.push((a, Some(vec![false; batch])));
                            groups.len() - 1
                        }
                    };
                    if let Some(rows) = groups[idx].1.as_mut() {
                        rows[row] = true;
                    }
                }
                // An adapter chosen for every row needs no mask.
                for g in groups.iter_mut() {
                    if g.1.as_ref().is_some_and(|r| r.iter().all(|x| *x)) {
                        g.1 = None;
                    }
                }
            }
        }
        let cfg = model.config();
        let mut parts = Vec::with_capacity(groups.len());
        for (adapter, rows) in groups {
            if adapter.num_layers() != cfg.num_layers {
                return Err(ModelError::InvalidAdapter(format!(
                    "adapter {} has {} layers, model has {}",
                    adapter.name,
                    adapter.num_layers(),
                    cfg.num_layers
                )));
            }
            let weights = adapter
                .weights
                .iter()
                .map(|layer| {
                    let mut out: [Option<(Tensor, Tensor)>; 7] = Default::default();
                    for (slot, w) in out.iter_mut().zip(layer.iter()) {
                        if let Some((a, b)) = w {
                            let (a, b) = (a.as_tensor(), b.as_tensor());
                            *slot = Some(if train {
                                (a.clone(), b.clone())
                            } else {
                                (a.detach(), b.detach())
                            });
                        }
                    }
                    out
                })
                .collect();
            let rows = match rows {
                Some(r) => {
                    let v: Vec<f32> = r
                        .iter()
                        .flat_map(|&on| std::iter::repeat_n(if on { 1f32 } else { 0.0 }, seq))
                        .collect();
                    Some(Tensor::from_vec(v, (batch * seq, 1), model.device())?)
                }
                None => None,
            };
            parts.push(ResolvedOne {
                weights,
                scale: adapter.config.scale(),
                dropout: if train { adapter.config.dropout } else { 0.0 },
                rows,
            });
        }
        Ok(ResolvedAdapters { parts })
    }
}

impl ResolvedAdapters {
    /// The adapter's `(A, B, scale)` for projection `target` of `layer` when
    /// [`crate::ops::lora_linear`] computes exactly what [`ResolvedAdapters::apply`] would, with
    /// less memory for the backward: one adapter on every row, no dropout, weights tracked for
    /// training and in the input's dtype.
    pub(crate) fn fusable(
        &self,
        layer: usize,
        target: LoraTarget,
        dtype: candle_core::DType,
    ) -> Option<(&Tensor, &Tensor, f64)> {
        let [part] = self.parts.as_slice() else {
            return None;
        };
        if part.rows.is_some() || part.dropout > 0.0 {
            return None;
        }
        let (a, b) = part.weights.get(layer)?[target as usize].as_ref()?;
        (a.dtype() == dtype && a.track_op()).then_some((a, b, part.scale))
    }

    /// `y + sum_adapters rows * scale * (dropout(x) @ A^T) @ B^T` for projection `target` of
    /// layer `layer`; `x` is `[n, in]`, `y` is `[n, out]`.
    pub(crate) fn apply(
        &self,
        layer: usize,
        target: LoraTarget,
        x: &Tensor,
        y: Tensor,
    ) -> Result<Tensor> {
        let mut y = y;
        for part in &self.parts {
            let Some((a, b)) = part
                .weights
                .get(layer)
                .and_then(|l| l[target as usize].as_ref())
            else {
                continue;
            };
            let xin = if x.dtype() == a.dtype() {
                x.clone()
            } else {
                x.to_dtype(a.dtype())?
            };
            let xin = if part.dropout > 0.0 {
                candle_nn::ops::dropout(&xin, part.dropout as f32)?
            } else {
                xin
            };
            let mut delta = xin
                .matmul(&a.t()?)?
                .matmul(&b.t()?)?
                .affine(part.scale, 0.0)?;
            if let Some(rows) = &part.rows {
                delta = delta.broadcast_mul(rows)?;
            }
            y = (y + delta.to_dtype(x.dtype())?)?;
        }
        Ok(y)
    }
}
