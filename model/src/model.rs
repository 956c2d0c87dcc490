//! The Llama-family decoder: weights, batched forward with padding and positions, KV cache.
//! Base weights are plain tensors (frozen); trainable parameters live only in adapters.

use std::collections::HashMap;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::lora::{Adapter, AdapterSelection, LoraTarget};
use crate::ops;

/// A linear layer `x @ w^T + b` with `w` of shape `[out, in]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
    /// Quantized copy of `w` for inference (see [`Model::quantize_for_inference`]).
    pub(crate) q: Option<QMatMul>,
}

impl Linear {
    /// `x @ w^T + b`; the quantized copy serves inference when present.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match (&self.q, train) {
            (Some(q), false) => {
                let y = q.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?;
                Ok(match &self.b {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            _ => Ok(ops::frozen_linear(x, &self.w, self.b.as_ref())?),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) mlp_norm: Tensor,
    pub(crate) proj: [Linear; 7],
}

impl Layer {
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

/// Keys and values of past tokens, per layer, for incremental decoding.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per row, whether each cached token is real.
    valid: Vec<Vec<bool>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// Tokens cached per row.
    pub fn len(&self) -> usize {
        self.valid.first().map(Vec::len).unwrap_or(0)
    }
    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    lm_head_q: Option<QMatMul>,
    cos: Tensor,
    sin: Tensor,
    dtype: DType,
    device: Device,
}

/// The HF parameter name of a projection in layer `i`.
pub(crate) fn hf_proj_name(i: usize, t: LoraTarget) -> String {
    format!("model.layers.{i}.{}.{}", t.module(), t.hf_name())
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
        cfg.check()?;
        let get = |name: &str| -> Result<Tensor> {
            let t = tensors
                .get(name)
                .ok_or_else(|| ModelError::InvalidModel(format!("missing tensor {name}")))?;
            Ok(t.to_device(device)?.to_dtype(dtype)?)
        };
        let check_shape = |t: &Tensor, shape: &[usize], name: &str| -> Result<()> {
            if t.dims() != shape {
                return Err(ModelError::InvalidModel(format!(
                    "{name} has shape {:?}, expected {shape:?}",
                    t.dims()
                )));
            }
            Ok(())
        };
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let embed = get("model.embed_tokens.weight")?;
        check_shape(&embed, &[cfg.vocab_size, h], "model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let mut proj = Vec::with_capacity(7);
            for t in LoraTarget::ALL {
                let name = hf_proj_name(i, t);
                let w = get(&format!("{name}.weight"))?;
                let (out, inp) = t.shape(&cfg);
                check_shape(&w, &[out, inp], &name)?;
                let has_bias = match t {
                    LoraTarget::Q | LoraTarget::K | LoraTarget::V => cfg.qkv_bias,
                    LoraTarget::O => cfg.o_bias,
                    _ => false,
                };
                let b = if has_bias {
                    Some(get(&format!("{name}.bias"))?)
                } else {
                    None
                };
                proj.push(Linear { w, b, q: None });
            }
            let proj: [Linear; 7] = proj
                .try_into()
                .map_err(|_| ModelError::InvalidModel("projection count".into()))?;
            layers.push(Layer {
                attn_norm: get(&format!("model.layers.{i}.input_layernorm.weight"))?,
                mlp_norm: get(&format!("model.layers.{i}.post_attention_layernorm.weight"))?,
                proj,
            });
        }
        let norm = get("model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            match tensors.get("lm_head.weight") {
                Some(_) => get("lm_head.weight")?,
                // Some exports drop the head of tied models without setting the flag.
                None => embed.clone(),
            }
        };
        check_shape(&lm_head, &[cfg.vocab_size, h], "lm_head.weight")?;
        let (cos, sin) = rope_tables(&cfg, hd, dtype, device)?;
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
            device: device.clone(),
        })
    }

    /// A model with random weights (normal, std 0.02 for matrices, ones plus noise for norms),
    /// for tests and examples.
    pub fn random(cfg: ModelConfig, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        let tensors = random_tensors(&cfg, seed)?;
        Self::from_tensors(cfg, &tensors, dtype, device)
    }

    /// The HF-named weights (as stored: compute dtype), e.g. to save an HF directory.
    pub fn named_tensors(&self) -> HashMap<String, Tensor> {
        let mut m = HashMap::new();
        m.insert("model.embed_tokens.weight".to_string(), self.embed.clone());
        m.insert("model.norm.weight".to_string(), self.norm.clone());
        if !self.cfg.tie_word_embeddings {
            m.insert("lm_head.weight".to_string(), self.lm_head.clone());
        }
        for (i, layer) in self.layers.iter().enumerate() {
            m.insert(
                format!("model.layers.{i}.input_layernorm.weight"),
                layer.attn_norm.clone(),
            );
            m.insert(
                format!("model.layers.{i}.post_attention_layernorm.weight"),
                layer.mlp_norm.clone(),
            );
            for t in LoraTarget::ALL {
                let lin = layer.proj(t);
                m.insert(format!("{}.weight", hf_proj_name(i, t)), lin.w.clone());
                if let Some(b) = &lin.b {
                    m.insert(format!("{}.bias", hf_proj_name(i, t)), b.clone());
                }
            }
        }
        m
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
            Some(q) if !hidden.track_op() => {
                let d = hidden.dims().to_vec();
                let x = hidden.reshape(((), self.cfg.hidden_size))?;
                let y = q.forward(&x.to_dtype(DType::F32)?)?;
                let mut out = d;
                let last = out.len() - 1;
                out[last] = self.cfg.vocab_size;
                Ok(y.reshape(out)?)
            }
            _ => Ok(ops::frozen_linear(hidden, &self.lm_head, None)?.to_dtype(DType::F32)?),
        }
    }

    /// Adds quantized copies (`dtype`, e.g. `GgmlDType::Q8_0`) of the projection and LM-head
    /// weights, used by the inference paths ([`Model::forward`], [`Model::forward_last`], and
    /// `hidden(.., train = false)`): decoding a single stream on a CPU is bound by reading the
    /// weights, and Q8_0 reads a quarter of f32's bytes. Matrices whose input width is not a
    /// multiple of the quantization block stay in f32. Training keeps the f32 weights and exact
    /// gradients. Logits move slightly (Q8_0 rounding); merge adapters before quantizing.
    pub fn quantize_for_inference(&mut self, dtype: GgmlDType) -> Result<()> {
        // Rows must split into whole quantization blocks; other matrices stay in f32.
        let quantize = |w: &Tensor| -> Result<Option<QMatMul>> {
            if w.dim(1)? % dtype.block_size() != 0 {
                return Ok(None);
            }
            let q = QTensor::quantize(&w.to_dtype(DType::F32)?, dtype)?;
            Ok(Some(QMatMul::from_qtensor(q)?))
        };
        for layer in &mut self.layers {
            for lin in layer.proj.iter_mut() {
                lin.q = quantize(&lin.w)?;
            }
        }
        self.lm_head_q = quantize(&self.lm_head)?;
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
            let y = layer.proj(t_).forward(inp, train)?;
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
        let s = k.dim(2)?;
        // Grouped-query attention without materialising repeated keys: the `rep` query heads
        // sharing a key head are stacked along the time axis.
        let q2 = q.reshape((b, nkv, rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut scores = q2.matmul(&k.t()?)?.affine(scale, 0.0)?;
        if let Some(m) = mask {
            scores = scores
                .reshape((b, nkv, rep, t, s))?
                .broadcast_add(m)?
                .reshape((b, nkv, rep * t, s))?;
        }
        let p = ops::softmax_last_dim(&scores)?;
        let o = p
            .matmul(&v)?
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

/// Random HF-named weights for `cfg` (f32, CPU).
pub(crate) fn random_tensors(cfg: &ModelConfig, seed: u64) -> Result<HashMap<String, Tensor>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dev = Device::Cpu;
    let mut normal = |shape: &[usize], std: f32, mean: f32| -> Result<Tensor> {
        let n: usize = shape.iter().product();
        // Box-Muller from the seeded RNG so weights are reproducible across platforms.
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let u1: f32 = rng.random::<f32>().max(1e-7);
                let u2: f32 = rng.random::<f32>();
                mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &dev)?)
    };
    let mut m = HashMap::new();
    let h = cfg.hidden_size;
    m.insert(
        "model.embed_tokens.weight".into(),
        normal(&[cfg.vocab_size, h], 0.5, 0.0)?,
    );
    m.insert("model.norm.weight".into(), normal(&[h], 0.1, 1.0)?);
    if !cfg.tie_word_embeddings {
        m.insert(
            "lm_head.weight".into(),
            normal(&[cfg.vocab_size, h], 0.2, 0.0)?,
        );
    }
    for i in 0..cfg.num_layers {
        m.insert(
            format!("model.layers.{i}.input_layernorm.weight"),
            normal(&[h], 0.1, 1.0)?,
        );
        m.insert(
            format!("model.layers.{i}.post_attention_layernorm.weight"),
            normal(&[h], 0.1, 1.0)?,
        );
        for t in LoraTarget::ALL {
            let (out, inp) = t.shape(cfg);
            let name = hf_proj_name(i, t);
            m.insert(
                format!("{name}.weight"),
                normal(&[out, inp], 1.0 / (inp as f32).sqrt(), 0.0)?,
            );
            let has_bias = match t {
                LoraTarget::Q | LoraTarget::K | LoraTarget::V => cfg.qkv_bias,
                LoraTarget::O => cfg.o_bias,
                _ => false,
            };
            if has_bias {
                m.insert(format!("{name}.bias"), normal(&[out], 0.1, 0.0)?);
            }
        }
    }
    Ok(m)
}

/// Index of the largest logit in each row of `[batch, vocab]`.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
