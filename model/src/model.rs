//! The Llama-family decoder: weights, batched forward with padding and positions, KV cache.
//! Base weights are plain tensors (frozen); trainable parameters live only in adapters.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Shape, Tensor, D};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::lora::{Adapter, AdapterSelection, LoraTarget};
use crate::ops;
use crate::quant::{quantized_product, quantized_rows, QuantWeight};

// The submodule and parameter names of an HF Llama checkpoint. The constructors read weights
// below these paths and `Model::visit` names them with the same paths, so loading, saving and
// random initialisation agree on every name.
const MODEL: &str = "model";
const EMBED_TOKENS: &str = "embed_tokens";
const LAYERS: &str = "layers";
const NORM: &str = "norm";
const LM_HEAD: &str = "lm_head";
const INPUT_LAYERNORM: &str = "input_layernorm";
const POST_ATTENTION_LAYERNORM: &str = "post_attention_layernorm";
const WEIGHT: &str = "weight";
const BIAS: &str = "bias";

/// A path-scoped view of the base weights: candle's [`VarBuilder`] (`pp` descends into a
/// submodule, `get` checks the shape and converts to the model's dtype and device), with errors
/// that name the full checkpoint path of the missing or mis-shaped tensor.
#[derive(Clone)]
pub(crate) struct Weights<'a> {
    vb: VarBuilder<'a>,
}

impl<'a> Weights<'a> {
    /// Weights read from checkpoint-named tensors, converted to `dtype` on `device`.
    pub(crate) fn from_tensors(
        tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Self {
            vb: VarBuilder::from_tensors(tensors, dtype, device),
        }
    }

    /// Weights drawn at random from each constructor's init hint (see [`RandomWeights`]).
    fn random(seed: u64, dtype: DType, device: &Device) -> Self {
        Self {
            vb: VarBuilder::from_backend(Box::new(RandomWeights::new(seed)), dtype, device.clone()),
        }
    }

    /// Paths only: holds no tensor, for naming the weights of a built model.
    fn names() -> Self {
        Self::from_tensors(HashMap::new(), DType::F32, &Device::Cpu)
    }

    /// The view of submodule `s` below this path.
    pub(crate) fn pp(&self, s: impl ToString) -> Self {
        Self { vb: self.vb.pp(s) }
    }

    /// The full checkpoint name of `name` below this path.
    fn name(&self, name: &str) -> String {
        match self.vb.prefix() {
            p if p.is_empty() => name.to_string(),
            p => [p.as_str(), name].join("."),
        }
    }

    /// Whether the tensor `name` below this path exists.
    fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }

    /// The tensor `name` below this path, of shape `shape`, in the model's dtype and on its
    /// device; `init` is how [`Model::random`] draws it.
    fn get(&self, shape: impl Into<Shape>, name: &str, init: Init) -> Result<Tensor> {
        let path = self.name(name);
        let missing = || ModelError::InvalidModel(format!("missing tensor {path}"));
        if !self.contains(name) {
            return Err(missing());
        }
        self.vb
            .get_with_hints(shape, name, init)
            .map_err(|e| match innermost(&e) {
                candle_core::Error::CannotFindTensor { .. } => missing(),
                candle_core::Error::UnexpectedShape { expected, got, .. } => {
                    ModelError::InvalidModel(format!(
                        "{path} has shape {:?}, expected {:?}",
                        got.dims(),
                        expected.dims()
                    ))
                }
                _ => ModelError::Candle(e),
            })
    }

    fn dtype(&self) -> DType {
        self.vb.dtype()
    }

    fn device(&self) -> &Device {
        self.vb.device()
    }
}

/// The error under candle's backtrace and context wrappers.
fn innermost(e: &candle_core::Error) -> &candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. } => innermost(inner),
        other => other,
    }
}

/// A normal init hint; the parameters are `f32` so the drawn values match the `f32`
/// arithmetic of [`RandomWeights`] exactly.
fn randn(mean: f32, std: f32) -> Init {
    Init::Randn {
        mean: f64::from(mean),
        stdev: f64::from(std),
    }
}

/// A weight source that draws every tensor the constructors ask for from a seeded normal (the
/// `Init::Randn` hint they pass), in the order they ask, f32 on the CPU before conversion:
/// [`Model::random`]'s weights, reproducible across platforms.
struct RandomWeights {
    rng: Mutex<rand::rngs::StdRng>,
}

impl RandomWeights {
    fn new(seed: u64) -> Self {
        use rand::SeedableRng;
        Self {
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
        }
    }
}

impl SimpleBackend for RandomWeights {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        use rand::Rng;
        let (mean, std) = match init {
            Init::Randn { mean, stdev } => (mean as f32, stdev as f32),
            Init::Const(c) => (c as f32, 0.0),
            other => {
                candle_core::bail!("{name}: random weights support normal inits, not {other:?}")
            }
        };
        let mut rng = self
            .rng
            .lock()
            .map_err(|_| candle_core::Error::Msg("random weights: poisoned lock".into()))?;
        // Box-Muller from the seeded RNG so weights are reproducible across platforms.
        let v: Vec<f32> = (0..shape.elem_count())
            .map(|_| {
                let u1: f32 = rng.random::<f32>().max(1e-7);
                let u2: f32 = rng.random::<f32>();
                mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)?
            .to_device(device)?
            .to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("{name}: random weights need a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

/// A linear layer `x @ w^T + b` with `w` of shape `[out, in]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
    /// Quantized blocks of `w` for inference: the GGUF's own (`load_gguf`) or
    /// [`Model::quantize_for_inference`]'s.
    pub(crate) q: Option<QuantWeight>,
}

impl Linear {
    /// The projection `target` of a layer, from `vb` scoped to it
    /// (`model.layers.{i}.self_attn.q_proj`).
    pub(crate) fn new(cfg: &ModelConfig, target: LoraTarget, vb: Weights) -> Result<Self> {
        let (out, inp) = target.shape(cfg);
        let w = vb.get((out, inp), WEIGHT, randn(0.0, 1.0 / (inp as f32).sqrt()))?;
        let b = if has_bias(cfg, target) {
            Some(vb.get(out, BIAS, randn(0.0, 0.1))?)
        } else {
            None
        };
        Ok(Self { w, b, q: None })
    }

    /// Names this projection's tensors below `vb` (the path [`Linear::new`] read them from).
    fn visit(&self, vb: &Weights, f: &mut dyn FnMut(String, &Tensor)) {
        f(vb.name(WEIGHT), &self.w);
        if let Some(b) = &self.b {
            f(vb.name(BIAS), b);
        }
    }

    /// `x @ w^T + b`; the quantized blocks serve inference on few rows when present.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match &self.q {
            Some(q) if !train && quantized_rows(x) => {
                let y = quantized_product(q, x)?;
                Ok(match &self.b {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            _ => Ok(ops::frozen_linear(x, &self.w, self.b.as_ref())?),
        }
    }
}

/// Whether the configuration gives projection `t` a bias.
fn has_bias(cfg: &ModelConfig, t: LoraTarget) -> bool {
    match t {
        LoraTarget::Q | LoraTarget::K | LoraTarget::V => cfg.qkv_bias,
        LoraTarget::O => cfg.o_bias,
        _ => false,
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) mlp_norm: Tensor,
    pub(crate) proj: [Linear; 7],
}

impl Layer {
    /// Decoder layer weights from `vb` scoped to the layer (`model.layers.{i}`).
    pub(crate) fn new(cfg: &ModelConfig, vb: Weights) -> Result<Self> {
        let h = cfg.hidden_size;
        let norm = randn(1.0, 0.1);
        let attn_norm = vb.pp(INPUT_LAYERNORM).get(h, WEIGHT, norm)?;
        let mlp_norm = vb.pp(POST_ATTENTION_LAYERNORM).get(h, WEIGHT, norm)?;
        let mut proj = Vec::with_capacity(LoraTarget::ALL.len());
        for t in LoraTarget::ALL {
            proj.push(Linear::new(cfg, t, Self::proj_weights(&vb, t))?);
        }
        let proj: [Linear; 7] = proj
            .try_into()
            .map_err(|_| ModelError::InvalidModel("projection count".into()))?;
        Ok(Self {
            attn_norm,
            mlp_norm,
            proj,
        })
    }

    /// Where projection `t` lives below the layer (`self_attn.q_proj`, `mlp.down_proj`, ...).
    fn proj_weights<'a>(vb: &Weights<'a>, t: LoraTarget) -> Weights<'a> {
        vb.pp(t.module()).pp(t.hf_name())
    }

    /// Names this layer's tensors below `vb` (the path [`Layer::new`] read them from).
    fn visit(&self, vb: &Weights, f: &mut dyn FnMut(String, &Tensor)) {
        f(vb.pp(INPUT_LAYERNORM).name(WEIGHT), &self.attn_norm);
        f(vb.pp(POST_ATTENTION_LAYERNORM).name(WEIGHT), &self.mlp_norm);
        for t in LoraTarget::ALL {
            self.proj(t).visit(&Self::proj_weights(vb, t), f);
        }
    }

    pub(crate) fn proj(&self, t: LoraTarget) -> &Linear {
        &self.proj[t as usize]
    }
}

/// Which tokens of a `[batch, seq]` input are real and at which positions they sit. Padding may
/// be on either side; padded tokens never influence real ones.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLayout {
    batch: usize,
    seq: usize,
    positions: Vec<u32>,
    valid: Vec<bool>,
}

/// Which side of a sequence the padding goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddingSide {
    /// `[pad pad t0 t1]`: the usual layout for batched generation.
    Left,
    /// `[t0 t1 pad pad]`: the usual layout for training.
    Right,
}

impl BatchLayout {
    /// No padding; positions `offset..offset + seq` in every row.
    pub fn dense(batch: usize, seq: usize, offset: usize) -> Self {
        let positions = (0..batch)
            .flat_map(|_| (offset..offset + seq).map(|p| p as u32))
            .collect();
        Self {
            batch,
            seq,
            positions,
            valid: vec![true; batch * seq],
        }
    }

    /// Rows of the given real lengths padded to `seq` on `side`; real tokens get positions
    /// `0..len`.
    pub fn padded(lengths: &[usize], seq: usize, side: PaddingSide) -> Result<Self> {
        let mut positions = Vec::with_capacity(lengths.len() * seq);
        let mut valid = Vec::with_capacity(lengths.len() * seq);
        for &len in lengths {
            if len > seq {
                return Err(ModelError::InvalidArgument(format!(
                    "sequence length {len} exceeds padded length {seq}"
                )));
            }
            let pad = seq - len;
            for i in 0..seq {
                let (is_valid, pos) = match side {
                    PaddingSide::Left => (i >= pad, i.saturating_sub(pad)),
                    PaddingSide::Right => (i < len, i),
                };
                valid.push(is_valid);
                positions.push(pos as u32);
            }
        }
        Ok(Self {
            batch: lengths.len(),
            seq,
            positions,
            valid,
        })
    }

    /// Explicit positions and validity, row-major `[batch, seq]`.
    pub fn new(batch: usize, seq: usize, positions: Vec<u32>, valid: Vec<bool>) -> Result<Self> {
        if positions.len() != batch * seq || valid.len() != batch * seq {
            return Err(ModelError::InvalidArgument(
                "positions and validity must have batch * seq entries".into(),
            ));
        }
        Ok(Self {
            batch,
            seq,
            positions,
            valid,
        })
    }

    /// Rows.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Columns.
    pub fn seq(&self) -> usize {
        self.seq
    }
    /// Positions, row-major.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }
    /// Validity (true = real token), row-major.
    pub fn valid(&self) -> &[bool] {
        &self.valid
    }
}

/// A Llama-family decoder-only model.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    lm_head_q: Option<QuantWeight>,
    cos: Tensor,
    sin: Tensor,
    dtype: DType,
    device: Device,
}

impl Model {
    /// Builds the model from HF-named tensors (`model.embed_tokens.weight`,
    /// `model.layers.{i}.self_attn.q_proj.weight`, ...), converted to `dtype` on `device`.
    pub fn from_tensors(
        cfg: ModelConfig,
        tensors: &HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        // Cloning the map clones reference-counted handles, not the weights.
        Self::new(cfg, Weights::from_tensors(tensors.clone(), dtype, device))
    }

    /// Builds the model from `vb` scoped to the checkpoint root, in `vb`'s dtype and on its
    /// device. Weights are read embedding, final norm, head, then layer by layer: the order
    /// [`Model::random`] draws them in.
    pub(crate) fn new(cfg: ModelConfig, vb: Weights) -> Result<Self> {
        cfg.check()?;
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        let h = cfg.hidden_size;
        let model = vb.pp(MODEL);
        let embed = model
            .pp(EMBED_TOKENS)
            .get((cfg.vocab_size, h), WEIGHT, randn(0.0, 0.5))?;
        let norm = model.pp(NORM).get(h, WEIGHT, randn(1.0, 0.1))?;
        let head = vb.pp(LM_HEAD);
        // Some exports drop the head of tied models without setting the flag.
        let lm_head = if cfg.tie_word_embeddings || !head.contains(WEIGHT) {
            embed.clone()
        } else {
            head.get((cfg.vocab_size, h), WEIGHT, randn(0.0, 0.2))?
        };
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::new(&cfg, model.pp(LAYERS).pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let (cos, sin) = rope_tables(&cfg, cfg.head_dim, dtype, &device)?;
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            lm_head_q: None,
            cos,
            sin,
            dtype,
            device,
        })
    }

    /// A model with random weights (normal: std `1/sqrt(in)` for projections, 0.5 for the
    /// embedding, 0.2 for an untied head, 0.1 for biases; ones plus noise for norms), for tests
    /// and examples.
    pub fn random(cfg: ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        Self::new(cfg, Weights::random(seed, dtype, device))
    }

    /// The HF-named weights (as stored: compute dtype), e.g. to save an HF directory.
    pub fn named_tensors(&self) -> HashMap<String, Tensor> {
        let mut m = HashMap::new();
        self.visit(&Weights::names(), &mut |name, t| {
            m.insert(name, t.clone());
        });
        m
    }

    /// Names every weight below `vb` with the paths [`Model::new`] read them from; the head
    /// only when untied.
    fn visit(&self, vb: &Weights, f: &mut dyn FnMut(String, &Tensor)) {
        let model = vb.pp(MODEL);
        f(model.pp(EMBED_TOKENS).name(WEIGHT), &self.embed);
        f(model.pp(NORM).name(WEIGHT), &self.norm);
        if !self.cfg.tie_word_embeddings {
            f(vb.pp(LM_HEAD).name(WEIGHT), &self.lm_head);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            layer.visit(&model.pp(LAYERS).pp(i), f);
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The LM head `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Inference forward: logits `[batch, seq, vocab]` for every position (f32), appending to
    /// `cache` when given. No dropout, no gradient graph.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        layout: &BatchLayout,
        cache: Option<&mut KvCache>,
        adapters: &AdapterSelection,
    ) -> Result<Tensor> {
        let h = self.hidden(input_ids, layout, cache, adapters, false)?;
        self.logits(&h)
    }

    /// Inference forward returning only the last position's logits `[batch, vocab]` (f32): the
    /// cheap call for generation.
    pub fn forward_last(
        &self,
        input_ids: &Tensor,
        layout: &BatchLayout,
        cache: Option<&mut KvCache>,
        adapters: &AdapterSelection,
    ) -> Result<Tensor> {
        let h = self.hidden(input_ids, layout, cache, adapters, false)?;
        let t = h.dim(1)?;
        self.logits(&h.narrow(1, t - 1, 1)?.squeeze(1)?)
    }

    /// Final hidden states `[batch, seq, hidden]` (after the last norm). With `train`, adapter
    /// dropout is on and adapter variables are tracked for gradients; feed the result to
    /// [`Model::logits`] or to [`crate::ops::cross_entropy_with_head`] with [`Model::lm_head`].
    pub fn hidden(
        &self,
        input_ids: &Tensor,
        layout: &BatchLayout,
        mut cache: Option<&mut KvCache>,
        adapters: &AdapterSelection,
        train: bool,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        if layout.batch != b || layout.seq != t {
            return Err(ModelError::InvalidArgument(format!(
                "layout is {}x{} but input is {b}x{t}",
                layout.batch, layout.seq
            )));
        }
        if t == 0 {
            return Err(ModelError::InvalidArgument("empty input".into()));
        }
        let past = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        if let Some(c) = cache.as_ref() {
            if !c.valid.is_empty() && c.valid.len() != b {
                return Err(ModelError::InvalidArgument(
                    "cache batch size differs from input".into(),
                ));
            }
        }
        let max_pos = layout.positions.iter().copied().max().unwrap_or(0) as usize;
        if max_pos >= self.cfg.max_position_embeddings.max(1) {
            return Err(ModelError::InvalidArgument(format!(
                "position {max_pos} beyond max_position_embeddings {}",
                self.cfg.max_position_embeddings
            )));
        }
        let dev = &self.device;
        let pos = Tensor::from_slice(&layout.positions, b * t, dev)?;
        let half = self.cfg.head_dim / 2;
        let cos = self.cos.index_select(&pos, 0)?.reshape((b, t, half))?;
        let sin = self.sin.index_select(&pos, 0)?.reshape((b, t, half))?;

        // Key validity over past + current tokens, per row.
        let mut valid_rows: Vec<Vec<bool>> = (0..b)
            .map(|r| {
                let mut v = cache
                    .as_ref()
                    .and_then(|c| c.valid.get(r).cloned())
                    .unwrap_or_default();
                v.extend_from_slice(&layout.valid[r * t..(r + 1) * t]);
                v
            })
            .collect();
        let mask = build_mask(&valid_rows, t, past, self.dtype, dev)?;

        let ids = input_ids.flatten_all()?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let resolved = adapters.resolve(self, b, t, train)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let kv = match cache.as_mut() {
                Some(c) => {
                    if c.layers.len() < self.layers.len() {
                        c.layers.resize(self.layers.len(), None);
                    }
                    Some(&mut c.layers[i])
                }
                None => None,
            };
            x = self.layer_forward(
                layer,
                i,
                &x,
                b,
                t,
                &cos,
                &sin,
                mask.as_ref(),
                kv,
                &resolved,
                train,
            )?;
        }
        if let Some(c) = cache {
            c.valid = std::mem::take(&mut valid_rows);
        }
        let x = ops::rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?;
        Ok(x.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// Logits (f32) for hidden states `[..., hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.lm_head_q {
            Some(q) if quantized_rows(hidden) => {
                Ok(quantized_product(q, &hidden.to_dtype(DType::F32)?)?)
            }
            _ => Ok(ops::frozen_linear(hidden, &self.lm_head, None)?.to_dtype(DType::F32)?),
        }
    }

    /// Adds quantized copies (`dtype`, e.g. `GgmlDType::Q8_0`) of the projection and LM-head
    /// weights, for the inference paths on few rows ([`crate::quant::QUANT_MAX_ROWS`]: decode steps).
    /// Training keeps the f32 weights and exact gradients. Unlike the GGUF's own blocks
    /// (which `load_gguf` attaches, and which equal the f32 weights), re-quantized weights move
    /// the logits slightly; merge adapters before quantizing. Matrices whose input width is not
    /// a multiple of the block, and formats other than Q4_1 and Q8_0, stay in f32.
    pub fn quantize_for_inference(&mut self, dtype: GgmlDType) -> Result<()> {
        for layer in &mut self.layers {
            for lin in layer.proj.iter_mut() {
                lin.q = QuantWeight::quantize(&lin.w, dtype)?;
            }
        }
        self.lm_head_q = QuantWeight::quantize(&self.lm_head, dtype)?;
        Ok(())
    }

    /// This model without quantized blocks: every path multiplies the f32 weights (the
    /// reference the quantized decoding is compared with).
    pub fn dequantized(&self) -> Self {
        let mut out = self.clone();
        for layer in &mut out.layers {
            for lin in layer.proj.iter_mut() {
                lin.q = None;
            }
        }
        out.lm_head_q = None;
        out
    }

    /// Whether the inference paths have quantized blocks (the head's or a projection's).
    pub fn is_quantized(&self) -> bool {
        self.lm_head_q.is_some()
            || self
                .layers
                .iter()
                .any(|l| l.proj.iter().any(|p| p.q.is_some()))
    }

    /// Takes the GGUF file's own blocks (by HF name, as [`Model::named_tensors`] names the
    /// weights; the loader has put q/k rows in HF order) for the inference paths of the
    /// projections and the head. They are what the f32 weights were dequantized from, so the
    /// products equal the f32 ones up to the order of the additions. Names not in `blocks`, or
    /// of another shape, stay f32 only.
    pub(crate) fn attach_quantized(&mut self, blocks: &HashMap<String, QuantWeight>) -> Result<()> {
        let names = Weights::names();
        let model = names.pp(MODEL);
        let fits = |q: &QuantWeight, w: &Tensor| -> Result<bool> { Ok(q.dims() == w.dims2()?) };
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let vb = model.pp(LAYERS).pp(i);
            for t in LoraTarget::ALL {
                let lin = &mut layer.proj[t as usize];
                let name = Layer::proj_weights(&vb, t).name(WEIGHT);
                if let Some(q) = blocks.get(&name) {
                    if fits(q, &lin.w)? {
                        lin.q = Some(q.clone());
                    }
                }
            }
        }
        let head = if self.cfg.tie_word_embeddings {
            model.pp(EMBED_TOKENS).name(WEIGHT)
        } else {
            names.pp(LM_HEAD).name(WEIGHT)
        };
        if let Some(q) = blocks.get(&head) {
            if fits(q, &self.lm_head)? {
                self.lm_head_q = Some(q.clone());
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        layer: &Layer,
        index: usize,
        x: &Tensor,
        b: usize,
        t: usize,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        kv: Option<&mut Option<(Tensor, Tensor)>>,
        adapters: &crate::lora::ResolvedAdapters,
        train: bool,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let rep = nh / nkv;
        let lin = |t_: LoraTarget, inp: &Tensor| -> Result<Tensor> {
            let proj = layer.proj(t_);
            if train {
                // Training with one adapter: the fused op keeps one tensor per projection for
                // the backward instead of four.
                if let Some((a, b, scale)) = adapters.fusable(index, t_, inp.dtype()) {
                    return Ok(ops::lora_linear(
                        inp,
                        &proj.w,
                        proj.b.as_ref(),
                        a,
                        b,
                        scale,
                    )?);
                }
            }
            let y = proj.forward(inp, train)?;
            adapters.apply(index, t_, inp, y)
        };
        let h = ops::rms_norm(x, &layer.attn_norm, cfg.rms_norm_eps)?;
        let q = lin(LoraTarget::Q, &h)?
            .reshape((b, t, nh, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = lin(LoraTarget::K, &h)?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = lin(LoraTarget::V, &h)?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = ops::rope(&q, cos, sin)?;
        let k = ops::rope(&k, cos, sin)?;
        let (k, v) = match kv {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                *slot = Some((k.clone(), v.clone()));
                (k, v)
            }
            None => (k, v),
        };
        // Grouped-query attention without materialising repeated keys: the `rep` query heads
        // sharing a key head are stacked along the time axis.
        let q2 = q.reshape((b, nkv, rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let o = ops::attention(&q2, &k, &v, mask, rep, scale)?
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b * t, nh * hd))?;
        let x = (x + lin(LoraTarget::O, &o)?)?;
        let h = ops::rms_norm(&x, &layer.mlp_norm, cfg.rms_norm_eps)?;
        let g = lin(LoraTarget::Gate, &h)?;
        let u = lin(LoraTarget::Up, &h)?;
        let m = ops::swiglu(&g, &u)?;
        let d = lin(LoraTarget::Down, &m)?;
        Ok((x + d)?)
    }

    /// A copy of this model with `adapter` merged into the base weights (`W += scale * B @ A`),
    /// for fast inference with a single adapter. Shares all untouched tensors.
    pub fn merged(&self, adapter: &Adapter) -> Result<Self> {
        let mut out = self.clone();
        for (i, layer) in out.layers.iter_mut().enumerate() {
            for t in LoraTarget::ALL {
                if let Some(delta) = adapter.delta_weight(i, t)? {
                    let lin = &mut layer.proj[t as usize];
                    lin.w = (&lin.w + delta.to_dtype(self.dtype)?.to_device(&self.device)?)?;
                    // A quantized copy of the old weight would be stale.
                    lin.q = None;
                }
            }
        }
        Ok(out)
    }
}

fn rope_tables(
    cfg: &ModelConfig,
    head_dim: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let n = cfg.max_position_embeddings.max(1);
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / head_dim as f64) as f32)
        .collect();
    let inv = Tensor::from_vec(inv, (1, half), device)?;
    let pos = Tensor::arange(0u32, n as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?;
    let freqs = pos.broadcast_mul(&inv)?;
    Ok((freqs.cos()?.to_dtype(dtype)?, freqs.sin()?.to_dtype(dtype)?))
}

/// Additive attention mask `[b, 1, 1, t, s]` (0 = attend, -inf = not), or `None` when every key
/// is visible to every query (one new token, no padding). Query `i` (absolute index `past + i`)
/// sees key `j` when `j <= past + i` and key `j` is real; it always sees itself, so rows of padded
/// queries stay finite.
fn build_mask(
    valid: &[Vec<bool>],
    t: usize,
    past: usize,
    dtype: DType,
    device: &Device,
) -> Result<Option<Tensor>> {
    let b = valid.len();
    let s = past + t;
    if t == 1 && valid.iter().all(|r| r.iter().all(|v| *v)) {
        return Ok(None);
    }
    let mut m = vec![0f32; b * t * s];
    for (r, row) in valid.iter().enumerate() {
        for i in 0..t {
            let qi = past + i;
            for j in 0..s {
                let ok = j == qi || (j < qi && row.get(j).copied().unwrap_or(false));
                if !ok {
                    m[(r * t + i) * s + j] = f32::NEG_INFINITY;
                }
            }
        }
    }
    let m = Tensor::from_vec(m, (b, 1, 1, t, s), device)?.to_dtype(dtype)?;
    Ok(Some(m))
}

/// Index of the largest logit in each row of `[batch, vocab]`.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;
    use proptest::prelude::*;

    fn invalid_model_message(r: Result<Model>) -> String {
        match r {
            Err(ModelError::InvalidModel(m)) => m,
            other => panic!("expected InvalidModel, got {other:?}"),
        }
    }

    /// `named_tensors` names exactly the tensors the constructors read: the model rebuilds from
    /// them, and dropping any one of them is reported by its full name.
    #[test]
    fn named_tensors_are_what_the_constructors_read() {
        // Llama: tied head, no biases; Qwen2: untied head, q/k/v biases.
        for arch in [Architecture::Llama, Architecture::Qwen2] {
            let cfg = ModelConfig::tiny(arch);
            let model = Model::random(cfg.clone(), 5, DType::F32, &Device::Cpu).unwrap();
            let named = model.named_tensors();
            let per_layer = 2 + 7 + if cfg.qkv_bias { 3 } else { 0 };
            let head = usize::from(!cfg.tie_word_embeddings);
            assert_eq!(named.len(), 2 + head + cfg.num_layers * per_layer);
            assert!(named.contains_key("model.layers.1.self_attn.q_proj.weight"));
            let rebuilt =
                Model::from_tensors(cfg.clone(), &named, DType::F32, &Device::Cpu).unwrap();
            for (name, t) in rebuilt.named_tensors() {
                let diff = (&t - &named[&name])
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap();
                assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
            }
            for name in named.keys() {
                // A missing head falls back to the embedding (exports that drop a tied head).
                if name == "lm_head.weight" {
                    continue;
                }
                let mut partial = named.clone();
                partial.remove(name);
                let r = Model::from_tensors(cfg.clone(), &partial, DType::F32, &Device::Cpu);
                assert_eq!(invalid_model_message(r), format!("missing tensor {name}"));
            }
        }
    }

    /// A tensor of the wrong shape is reported with its full name, its shape and the expected one.
    #[test]
    fn mis_shaped_tensor_is_named() {
        let cfg = ModelConfig::tiny(Architecture::Qwen2);
        let model = Model::random(cfg.clone(), 5, DType::F32, &Device::Cpu).unwrap();
        let (out, inp) = LoraTarget::K.shape(&cfg);
        let cases = [
            ("model.layers.1.self_attn.k_proj.weight", vec![inp, out]),
            ("model.layers.0.self_attn.v_proj.bias", vec![out + 1]),
            ("model.norm.weight", vec![1, cfg.hidden_size]),
        ];
        for (name, shape) in cases {
            let mut named = model.named_tensors();
            let expected = named[name].dims().to_vec();
            named.insert(
                name.into(),
                Tensor::zeros(shape.as_slice(), DType::F32, &Device::Cpu).unwrap(),
            );
            let r = Model::from_tensors(cfg.clone(), &named, DType::F32, &Device::Cpu);
            assert_eq!(
                invalid_model_message(r),
                format!("{name} has shape {shape:?}, expected {expected:?}")
            );
        }
    }

    /// The weights convert to the requested dtype, and an untied head without `lm_head.weight`
    /// shares the embedding.
    #[test]
    fn loads_in_dtype_and_falls_back_to_the_embedding_head() {
        let cfg = ModelConfig::tiny(Architecture::Qwen2);
        assert!(!cfg.tie_word_embeddings);
        let model = Model::random(cfg.clone(), 5, DType::F32, &Device::Cpu).unwrap();
        let mut named = model.named_tensors();
        named.remove("lm_head.weight");
        let m = Model::from_tensors(cfg, &named, DType::BF16, &Device::Cpu).unwrap();
        assert_eq!(m.dtype(), DType::BF16);
        assert_eq!(m.lm_head().dtype(), DType::BF16);
        let embed = named["model.embed_tokens.weight"]
            .to_dtype(DType::BF16)
            .unwrap();
        let diff = (m.lm_head() - &embed).unwrap().abs().unwrap();
        let diff = diff.to_dtype(DType::F32).unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
    }

    proptest! {
        /// Real tokens get positions 0..len in order on either side; padding fills the rest.
        #[test]
        fn padded_layout_positions(lengths in proptest::collection::vec(0usize..12, 1..5), extra in 0usize..4, left in any::<bool>()) {
            let seq = lengths.iter().copied().max().unwrap_or(0) + extra;
            let side = if left { PaddingSide::Left } else { PaddingSide::Right };
            let layout = BatchLayout::padded(&lengths, seq, side).unwrap();
            for (r, &len) in lengths.iter().enumerate() {
                let row = r * seq..(r + 1) * seq;
                let valid = &layout.valid()[row.clone()];
                let pos = &layout.positions()[row];
                prop_assert_eq!(valid.iter().filter(|v| **v).count(), len);
                let real: Vec<u32> = pos.iter().zip(valid).filter(|(_, v)| **v).map(|(p, _)| *p).collect();
                prop_assert_eq!(real, (0..len as u32).collect::<Vec<_>>());
                let first_valid = valid.iter().position(|v| *v).unwrap_or(seq);
                if left { prop_assert_eq!(first_valid, seq - len) } else if len > 0 { prop_assert_eq!(first_valid, 0) }
            }
        }

        /// Every query sees itself, never a later key, never a padded key other than itself.
        #[test]
        fn mask_is_causal_and_respects_padding(valid in proptest::collection::vec(any::<bool>(), 1..10), past_frac in 0usize..10) {
            let s = valid.len();
            let past = past_frac.min(s - 1);
            let t = s - past;
            let m = build_mask(std::slice::from_ref(&valid), t, past, DType::F32, &Device::Cpu).unwrap();
            let m: Vec<f32> = match m {
                Some(m) => m.flatten_all().unwrap().to_vec1().unwrap(),
                None => vec![0.0; t * s],
            };
            for i in 0..t {
                for j in 0..s {
                    let q = past + i;
                    let seen = m[i * s + j] == 0.0;
                    let want = j == q || (j < q && valid[j]);
                    prop_assert_eq!(seen, want, "query {} key {}", q, j);
                }
            }
        }
    }
}
