//! Differentiable fused ops. candle-nn 0.11's fast `softmax_last_dim`, `rms_norm` and `rope` have
//! no backward pass (gradients through them are silently dropped), and candle's matmul backward
//! always computes the gradient of both operands, even a frozen weight. The ops here run the fast
//! fused forward kernels and attach a hand-written backward to the result.
//!
//! How: the forward result is computed with gradient tracking off, then handed to the graph
//! through a `CustomOp1` on the input whose forward just returns that result's storage and whose
//! `bwd` is the hand-written gradient. The backward passes are written with candle tensor ops, so
//! the same code runs on every device candle supports (CPU here, CUDA with the `cuda` feature);
//! the only device-specific code is the storage hand-over in [`Attached`].

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Storage, Tensor, D};

/// Reductions run in f32 for f32/bf16/f16 inputs, in f64 for f64 inputs.
fn compute_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

type Backward =
    Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Option<Tensor>> + Send + Sync>;

/// A forward result computed elsewhere, handed to the graph once (by a custom op's forward).
struct Handover {
    name: &'static str,
    out: Mutex<Option<Tensor>>,
}

impl Handover {
    fn new(name: &'static str, out: Tensor) -> Self {
        Self {
            name,
            out: Mutex::new(Some(out)),
        }
    }

    fn take(&self) -> candle_core::Result<Tensor> {
        let mut slot = self
            .out
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: poisoned lock", self.name)))?;
        slot.take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }

    fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, out.shape().clone())),
            _ => candle_core::bail!("{}: result is not on the CPU", self.name),
        }
    }

    fn cuda(&self) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, out.shape().clone())),
            _ => candle_core::bail!("{}: result is not on the CUDA device", self.name),
        }
    }
}

/// A contiguous copy of `out` (no copy when it already is one), as a handover needs.
fn handover(name: &'static str, out: Tensor) -> candle_core::Result<Handover> {
    let out = if out.is_contiguous() && out.layout().start_offset() == 0 {
        out
    } else {
        out.force_contiguous()?
    };
    Ok(Handover::new(name, out))
}

/// A graph node whose forward value was computed elsewhere and whose backward is `bwd(arg, res,
/// grad_res)`.
struct Attached {
    out: Handover,
    bwd: Backward,
}

impl CustomOp1 for Attached {
    fn name(&self) -> &'static str {
        self.out.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        (self.bwd)(arg, res, grad)
    }
}

/// Returns `out` as a function of `arg` with the given backward. When `arg` is not part of a
/// gradient graph, `out` is returned as is (no copy).
fn attach(
    name: &'static str,
    arg: &Tensor,
    out: Tensor,
    bwd: Backward,
) -> candle_core::Result<Tensor> {
    if !arg.track_op() {
        return Ok(out);
    }
    arg.apply_op1(Attached {
        out: handover(name, out)?,
        bwd,
    })
}

type Backward3 =
    Box<dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> candle_core::Result<Grads3> + Send + Sync>;
type Grads3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// [`Attached`] for a result of three arguments: `bwd(a, b, c, grad_res)`.
struct Attached3 {
    out: Handover,
    bwd: Backward3,
}

impl CustomOp3 for Attached3 {
    fn name(&self) -> &'static str {
        self.out.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.out.cpu()
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.out.cuda()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Grads3> {
        (self.bwd)(a, b, c, grad)
    }
}

/// Grouped-query scaled dot-product attention, `softmax(q k^T * scale + mask) v`, whose backward
/// recomputes the attention weights from `q` and `k` instead of keeping them. Autograd through
/// the plain ops keeps the scores, the masked scores and the weights of every layer until the
/// backward reaches it: three `[heads, queries, keys]` matrices per layer, most of a training
/// step's memory when it back-propagates through a long prompt. Here a layer keeps only its
/// `q`, `k`, `v` and output, and the weights exist again only while its own backward runs.
///
/// `q` is `[b, g, rep * t, d]`: the `rep` query heads that share key head `g`, stacked along the
/// time axis; `k` and `v` are `[b, g, s, d]`; `mask` is additive, `[b, 1, 1, t, s]` (0 or -inf).
/// The forward runs the same ops as the unfused composition, so its values are identical.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    rep: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let mask = mask.cloned();
    let weights = move |q: &Tensor, k: &Tensor| -> candle_core::Result<Tensor> {
        let (b, g, m, _) = q.dims4()?;
        let s = k.dim(2)?;
        let mut scores = q.matmul(&k.t()?)?.affine(scale, 0.0)?;
        if let Some(mask) = &mask {
            scores = scores
                .reshape((b, g, rep, m / rep.max(1), s))?
                .broadcast_add(mask)?
                .reshape((b, g, m, s))?;
        }
        candle_nn::ops::softmax_last_dim(&scores)
    };
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let out = weights(&qd, &kd)?.matmul(&vd)?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    let bwd: Backward3 = Box::new(move |q, k, v, g| {
        let want = (q.track_op(), k.track_op(), v.track_op());
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        let p = weights(&q, &k)?;
        let dv = if want.2 {
            Some(p.t()?.matmul(g)?)
        } else {
            None
        };
        if !(want.0 || want.1) {
            return Ok((None, None, dv));
        }
        // Softmax backward, then the scale: d(scores) = p * (dp - sum(dp * p)) * scale.
        let dp = g.matmul(&v.t()?)?;
        let dot = (&dp * &p)?.sum_keepdim(D::Minus1)?;
        let ds = ((p * dp.broadcast_sub(&dot)?)? * scale)?;
        let dq = if want.0 { Some(ds.matmul(&k)?) } else { None };
        let dk = if want.1 {
            Some(ds.t()?.matmul(&q)?)
        } else {
            None
        };
        Ok((dq, dk, dv))
    });
    q.apply_op3(
        k,
        v,
        Attached3 {
            out: handover("hindsight-attention", out)?,
            bwd,
        },
    )
}

/// RMS normalisation over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`, with the
/// gradient for `x` (the weight is frozen).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let xd = x.detach().contiguous()?;
    // The fused kernel has no f64 path (f64 is for numerical checks only).
    let out = if x.dtype() == DType::F64 {
        candle_nn::ops::rms_norm_slow(&xd, weight, eps as f32)?
    } else {
        candle_nn::ops::rms_norm(&xd, weight, eps as f32)?
    };
    let w = weight.clone();
    attach(
        "hindsight-rms-norm",
        x,
        out,
        Box::new(move |x, _res, g| {
            let dtype = x.dtype();
            let cdt = compute_dtype(dtype);
            let x = x.to_dtype(cdt)?;
            let g = g.to_dtype(cdt)?;
            let w = w.to_dtype(cdt)?;
            let r = x
                .sqr()?
                .mean_keepdim(D::Minus1)?
                .affine(1.0, eps)?
                .sqrt()?
                .recip()?;
            let xhat = x.broadcast_mul(&r)?;
            let dxhat = g.broadcast_mul(&w)?;
            let proj = (&dxhat * &xhat)?.mean_keepdim(D::Minus1)?;
            let dx = (dxhat - xhat.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
            Ok(Some(dx.to_dtype(dtype)?))
        }),
    )
}

/// Softmax over the last dimension, with its gradient `s * (g - sum(g * s))`.
pub fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let out = candle_nn::ops::softmax_last_dim(&x.detach().contiguous()?)?;
    attach(
        "hindsight-softmax",
        x,
        out,
        Box::new(|_x, s, g| {
            let gs = (g * s)?.sum_keepdim(D::Minus1)?;
            Ok(Some((s * g.broadcast_sub(&gs)?)?))
        }),
    )
}

/// Rotary position embedding in the HF ("rotate half") layout. `x` is `[b, h, t, d]`, `cos` and
/// `sin` are `[t, d/2]` or `[b, t, d/2]`. The backward is the inverse rotation, `rope(g, cos,
/// -sin)`, so it runs the same fused kernel.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let out = candle_nn::rotary_emb::rope(&x.detach().contiguous()?, cos, sin)?;
    let cos = cos.clone();
    let neg_sin = sin.neg()?;
    attach(
        "hindsight-rope",
        x,
        out,
        Box::new(move |_x, _res, g| {
            Ok(Some(candle_nn::rotary_emb::rope(
                &g.contiguous()?,
                &cos,
                &neg_sin,
            )?))
        }),
    )
}

/// Whether [`frozen_linear`] computes `x @ w^T` for `rows` rows of a `[out, in]` weight as
/// `(w @ x^T)^T`, gemm over the weight's contiguous rows, rather than handing gemm the
/// transposed weight, which it packs whole however few the rows are. Measured on the default
/// model's shapes (`cargo run --release -p hindsight-model --example linear_layouts`, 2 threads,
/// 2026-12-07): up to 16 rows the row-wise layout is as fast or faster for every projection
/// (the MLP's down projection 7x, the LM head 1.2x), and up to 64 rows for weights at least as
/// wide as they are tall (down 2.9x at 64, q and o 1.9x); beyond that, and for the taller
/// weights (gate, up, the LM head) past 16 rows, gemm's own layout wins. Up to 16 rows covers
/// batched decoding of up to 16 streams and the learner's passes over an answer.
pub fn rowwise_layout(rows: usize, out: usize, in_: usize) -> bool {
    rows <= 16 || (rows <= 64 && in_ >= out)
}

/// `x @ w^T (+ b)` for a frozen weight `w` of shape `[out, in]`: the backward computes only the
/// gradient of `x` (`g @ w`), never the `[out, in]` gradient of the weight that candle's matmul
/// backward would compute and throw away.
pub fn frozen_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let in_dim = *dims
        .last()
        .ok_or_else(|| candle_core::Error::Msg("frozen_linear: scalar input".into()))?;
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.reshape((rows, in_dim))?;
    // For a few rows (decoding, an answer's positions) `W @ x^T` runs over W's contiguous rows;
    // `x @ W^T` would have gemm pack the whole transposed weight first ([`rowwise_layout`]).
    let mut out = if rowwise_layout(rows, w.dim(0)?, in_dim) {
        w.matmul(&x2.detach().t()?)?.t()?.contiguous()?
    } else {
        x2.detach().matmul(&w.t()?)?
    };
    if let Some(b) = b {
        out = out.broadcast_add(b)?;
    }
    let out_features = w.dim(0)?;
    let w = w.clone();
    let y = attach(
        "hindsight-frozen-linear",
        &x2,
        out,
        Box::new(move |_x, _res, g| Ok(Some(g.matmul(&w)?))),
    )?;
    let mut out_dims = dims;
    let last = out_dims.len() - 1;
    out_dims[last] = out_features;
    y.reshape(out_dims)
}

/// A LoRA-adapted frozen projection, `x @ w^T (+ bias) + scale * (x @ a^T) @ b^T`, with `w`
/// `[out, in]` frozen and the adapter's `a` `[r, in]` and `b` `[out, r]` trained. Autograd
/// through the plain ops keeps four `[rows, out]` tensors per projection (the base product, the
/// low-rank product, its scaled copy and the sum); here only the result is kept, and the
/// backward recomputes the `[rows, r]` product `x @ a^T` it needs. The forward runs the same ops
/// as [`frozen_linear`] plus the low-rank product, so its values are identical.
pub fn lora_linear(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let in_dim = *dims
        .last()
        .ok_or_else(|| candle_core::Error::Msg("lora_linear: scalar input".into()))?;
    let rows = x.elem_count() / in_dim.max(1);
    let x2 = x.reshape((rows, in_dim))?;
    let y = frozen_linear(&x2.detach(), w, bias)?;
    let (ad, bd) = (a.detach(), b.detach());
    let delta = x2
        .detach()
        .matmul(&ad.t()?)?
        .matmul(&bd.t()?)?
        .affine(scale, 0.0)?;
    let out = (y + delta)?;
    let mut out_dims = dims;
    let last = out_dims.len() - 1;
    out_dims[last] = w.dim(0)?;
    if !(x2.track_op() || a.track_op() || b.track_op()) {
        return out.reshape(out_dims);
    }
    let w = w.clone();
    let bwd: Backward3 = Box::new(move |x, a, b, g| {
        let want = (x.track_op(), a.track_op(), b.track_op());
        let (x, a, b) = (x.detach(), a.detach(), b.detach());
        // The low-rank path's upstream gradient, scaled as the forward scaled its output.
        let gs = (g * scale)?;
        let gb = gs.matmul(&b)?;
        let dx = if want.0 {
            Some((g.matmul(&w)? + gb.matmul(&a)?)?)
        } else {
            None
        };
        let da = if want.1 {
            Some(gb.t()?.matmul(&x)?)
        } else {
            None
        };
        let db = if want.2 {
            Some(gs.t()?.matmul(&x.matmul(&a.t()?)?)?)
        } else {
            None
        };
        Ok((dx, da, db))
    });
    x2.apply_op3(
        a,
        b,
        Attached3 {
            out: handover("hindsight-lora-linear", out)?,
            bwd,
        },
    )?
    .reshape(out_dims)
}

/// Row count above which [`cross_entropy_with_head`] recomputes the logits in the backward pass
/// instead of keeping `rows x vocab` gradients in memory.
const CE_STORE_MAX_ELEMS: usize = 64 << 20;
/// Rows of logits materialised at once.
const CE_CHUNK_ROWS: usize = 256;

/// Per-row cross-entropy of `softmax(h @ head^T)` against `targets`, fused with the LM head so the
/// full `[rows, vocab]` logits never exist at once: the logits are computed in chunks of rows,
/// reduced to a log-sum-exp, and `softmax - onehot` is kept for the backward only while it fits
/// under a fixed budget (otherwise it is recomputed). `h` is `[n, d]`, `head` `[vocab, d]`
/// (frozen), `targets` `[n]` u32. Returns the per-row loss `[n]` in f32 (f64 for f64 inputs); only `h` gets a
/// gradient.
/// Rows to be ignored should be removed beforehand (`index_select`), which also skips their
/// logits entirely.
pub fn cross_entropy_with_head(
    h: &Tensor,
    head: &Tensor,
    targets: &Tensor,
) -> candle_core::Result<Tensor> {
    let (n, _d) = h.dims2()?;
    let vocab = head.dim(0)?;
    let store = n * vocab <= CE_STORE_MAX_ELEMS && h.track_op();
    let hd = h.detach();
    let mut losses = Vec::new();
    let mut dlogits = Vec::new();
    let mut start = 0;
    while start < n {
        let len = CE_CHUNK_ROWS.min(n - start);
        let hc = hd.narrow(0, start, len)?;
        let tc = targets.narrow(0, start, len)?;
        let (loss, dl) = ce_chunk(&hc, head, &tc, store)?;
        losses.push(loss);
        if let Some(dl) = dl {
            dlogits.push(dl);
        }
        start += len;
    }
    let loss = Tensor::cat(&losses, 0)?;
    let head = head.clone();
    let targets = targets.clone();
    attach(
        "hindsight-cross-entropy",
        h,
        loss,
        Box::new(move |h, _res, g| {
            let dtype = h.dtype();
            let g = g.to_dtype(compute_dtype(dtype))?;
            let mut parts = Vec::new();
            let mut start = 0;
            let mut chunk = 0;
            while start < n {
                let len = CE_CHUNK_ROWS.min(n - start);
                let dl = match dlogits.get(chunk) {
                    Some(dl) => dl.clone(),
                    None => {
                        let hc = h.detach().narrow(0, start, len)?;
                        let tc = targets.narrow(0, start, len)?;
                        match ce_chunk(&hc, &head, &tc, true)?.1 {
                            Some(dl) => dl,
                            None => candle_core::bail!("cross-entropy: missing gradient"),
                        }
                    }
                };
                let gc = g.narrow(0, start, len)?.unsqueeze(1)?;
                let dl = dl.broadcast_mul(&gc)?.to_dtype(head.dtype())?;
                parts.push(dl.matmul(&head)?);
                start += len;
                chunk += 1;
            }
            Ok(Some(Tensor::cat(&parts, 0)?.to_dtype(dtype)?))
        }),
    )
}

/// Loss `[len]` and, if asked, `softmax - onehot` `[len, vocab]` (f32) for one chunk of rows.
fn ce_chunk(
    h: &Tensor,
    head: &Tensor,
    targets: &Tensor,
    want_grad: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let logits = h.matmul(&head.t()?)?.to_dtype(compute_dtype(h.dtype()))?;
    let max = logits.max_keepdim(D::Minus1)?;
    let shifted = logits.broadcast_sub(&max)?;
    let sum_exp = shifted.exp()?.sum_keepdim(D::Minus1)?;
    let idx = targets.unsqueeze(1)?;
    let target_logit = shifted.gather(&idx, 1)?;
    let loss = (sum_exp.log()? - target_logit)?.squeeze(1)?;
    let dl = if want_grad {
        let p = candle_nn::ops::softmax_last_dim(&logits)?;
        let minus_one =
            Tensor::full(-1f32, (idx.dim(0)?, 1), h.device())?.to_dtype(logits.dtype())?;
        Some(p.scatter_add(&idx, &minus_one, 1)?)
    } else {
        None
    };
    Ok((loss, dl))
}

/// SiLU-gated product `silu(gate) * up`, the Llama MLP activation (plain differentiable ops).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    gate.silu()? * up
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::max_abs_diff;
    use candle_core::{Device, Var};

    /// Central finite differences of `sum(f(x) * probe)` against the analytic gradient.
    fn check_grad(shape: &[usize], f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>, tol: f64) {
        let dev = Device::Cpu;
        let x = Var::randn(0f64, 1.0, shape, &dev).unwrap();
        let y0 = f(x.as_tensor()).unwrap();
        let probe = Tensor::randn(0f64, 1.0, y0.shape(), &dev).unwrap();
        let loss = (f(x.as_tensor()).unwrap() * &probe)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let analytic: Vec<f64> = grads
            .get(x.as_tensor())
            .expect("no gradient reached x")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let base: Vec<f64> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let eps = 1e-5;
        for i in 0..base.len() {
            let eval = |delta: f64| {
                let mut v = base.clone();
                v[i] += delta;
                let xt = Tensor::from_vec(v, shape, &dev).unwrap();
                (f(&xt).unwrap() * &probe)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            let err = (numeric - analytic[i]).abs() / (1.0 + numeric.abs());
            assert!(
                err < tol,
                "element {i}: numeric {numeric} vs analytic {}",
                analytic[i]
            );
        }
    }

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let w = Tensor::randn(0f64, 1.0, 6, &Device::Cpu).unwrap();
        check_grad(&[3, 6], &|x| rms_norm(x, &w, 1e-5), 1e-6);
    }

    #[test]
    fn softmax_backward_matches_finite_differences() {
        check_grad(&[2, 3, 5], &softmax_last_dim, 1e-6);
    }

    #[test]
    fn rope_backward_matches_finite_differences() {
        let cos = Tensor::randn(0f64, 1.0, (4, 3), &Device::Cpu).unwrap();
        let sin = Tensor::randn(0f64, 1.0, (4, 3), &Device::Cpu).unwrap();
        check_grad(&[1, 2, 4, 6], &|x| rope(x, &cos, &sin), 1e-6);
        let cos_b = Tensor::randn(0f64, 1.0, (2, 4, 3), &Device::Cpu).unwrap();
        let sin_b = Tensor::randn(0f64, 1.0, (2, 4, 3), &Device::Cpu).unwrap();
        check_grad(&[2, 2, 4, 6], &|x| rope(x, &cos_b, &sin_b), 1e-6);
    }

    #[test]
    fn frozen_linear_backward_matches_finite_differences() {
        let w = Tensor::randn(0f64, 1.0, (5, 4), &Device::Cpu).unwrap();
        let b = Tensor::randn(0f64, 1.0, 5, &Device::Cpu).unwrap();
        check_grad(&[2, 3, 4], &|x| frozen_linear(x, &w, Some(&b)), 1e-6);
    }

    /// Both layouts compute `x @ w^T` (only the summation order differs): on each side of
    /// [`rowwise_layout`]'s thresholds, for a tall and a wide weight, in f32 as served.
    #[test]
    fn frozen_linear_equals_the_plain_product_on_both_sides_of_the_layout_thresholds() {
        let dev = Device::Cpu;
        for (out, in_) in [(96, 32), (32, 96)] {
            let w = Tensor::randn(0f32, 1.0, (out, in_), &dev).unwrap();
            for rows in [1, 16, 17, 64, 65] {
                let x = Tensor::randn(0f32, 1.0, (rows, in_), &dev).unwrap();
                let got = frozen_linear(&x, &w, None).unwrap();
                let want = x.matmul(&w.t().unwrap()).unwrap();
                assert_eq!(got.dims(), &[rows, out]);
                let err = max_abs_diff(&got, &want).unwrap();
                assert!(err < 1e-4, "rows {rows}, w [{out}, {in_}]: {err}");
            }
        }
        // The rule itself, as measured (docs/experiments/2026-12-07-linear-layouts.md).
        assert!(rowwise_layout(16, 1536, 576) && !rowwise_layout(17, 1536, 576));
        assert!(rowwise_layout(64, 576, 1536) && !rowwise_layout(65, 576, 1536));
    }

    #[test]
    fn cross_entropy_backward_matches_finite_differences() {
        let head = Tensor::randn(0f64, 1.0, (11, 4), &Device::Cpu).unwrap();
        let targets = Tensor::new(&[3u32, 0, 10], &Device::Cpu).unwrap();
        check_grad(
            &[3, 4],
            &|h| cross_entropy_with_head(h, &head, &targets),
            1e-6,
        );
    }

    #[test]
    fn cross_entropy_matches_log_softmax() {
        let dev = Device::Cpu;
        let h = Tensor::randn(0f32, 1.0, (5, 8), &dev).unwrap();
        let head = Tensor::randn(0f32, 1.0, (13, 8), &dev).unwrap();
        let targets = Tensor::new(&[1u32, 12, 0, 7, 7], &dev).unwrap();
        let ours: Vec<f32> = cross_entropy_with_head(&h, &head, &targets)
            .unwrap()
            .to_vec1()
            .unwrap();
        let logits = h.matmul(&head.t().unwrap()).unwrap();
        let lsm = candle_nn::ops::log_softmax(&logits, 1).unwrap();
        let reference: Vec<f32> = lsm
            .gather(&targets.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .neg()
            .unwrap()
            .squeeze(1)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in ours.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    /// Grouped-query attention through the plain ops (autograd keeps every intermediate).
    fn attention_reference(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        rep: usize,
        scale: f64,
    ) -> candle_core::Result<Tensor> {
        let (b, g, m, _) = q.dims4()?;
        let s = k.dim(2)?;
        let scores = q
            .matmul(&k.t()?)?
            .affine(scale, 0.0)?
            .reshape((b, g, rep, m / rep, s))?
            .broadcast_add(mask)?
            .reshape((b, g, m, s))?;
        softmax_last_dim(&scores)?.matmul(v)
    }

    /// A causal mask `[b, 1, 1, t, s]` over `s - t` past keys, with one past key of row 1
    /// masked (padding).
    fn causal_mask(b: usize, t: usize, s: usize) -> Tensor {
        let mut m = vec![0f64; b * t * s];
        for r in 0..b {
            for i in 0..t {
                for j in 0..s {
                    if j > s - t + i || (r == 1 && j == 0 && s > t) {
                        m[(r * t + i) * s + j] = f64::NEG_INFINITY;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, 1, t, s), &Device::Cpu).unwrap()
    }

    #[test]
    fn attention_backward_matches_finite_differences() {
        // 2 rows, 2 key heads with 2 query heads each, 3 new queries after 2 past keys.
        let (b, g, rep, t, s, d) = (2, 2, 2, 3, 5, 4);
        let dev = Device::Cpu;
        let q = Tensor::randn(0f64, 1.0, (b, g, rep * t, d), &dev).unwrap();
        let k = Tensor::randn(0f64, 1.0, (b, g, s, d), &dev).unwrap();
        let v = Tensor::randn(0f64, 1.0, (b, g, s, d), &dev).unwrap();
        let mask = causal_mask(b, t, s);
        let scale = 0.5;
        check_grad(
            &[b, g, rep * t, d],
            &|x| attention(x, &k, &v, Some(&mask), rep, scale),
            1e-6,
        );
        check_grad(
            &[b, g, s, d],
            &|x| attention(&q, x, &v, Some(&mask), rep, scale),
            1e-6,
        );
        check_grad(
            &[b, g, s, d],
            &|x| attention(&q, &k, x, Some(&mask), rep, scale),
            1e-6,
        );
    }

    #[test]
    fn attention_equals_the_plain_ops_in_value_and_gradient() {
        let (b, g, rep, t, s, d) = (2, 3, 3, 4, 7, 8);
        let dev = Device::Cpu;
        let q = Var::randn(0f64, 1.0, (b, g, rep * t, d), &dev).unwrap();
        let k = Var::randn(0f64, 1.0, (b, g, s, d), &dev).unwrap();
        let v = Var::randn(0f64, 1.0, (b, g, s, d), &dev).unwrap();
        let mask = causal_mask(b, t, s);
        let probe = Tensor::randn(0f64, 1.0, (b, g, rep * t, d), &dev).unwrap();
        let run = |f: &dyn Fn() -> candle_core::Result<Tensor>| {
            let out = f().unwrap();
            let grads = (&out * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
            let g_of = |x: &Var| flat(grads.get(x.as_tensor()).expect("no gradient"));
            (flat(&out), g_of(&q), g_of(&k), g_of(&v))
        };
        let ours = run(&|| attention(&q, &k, &v, Some(&mask), rep, 0.3));
        let plain = run(&|| attention_reference(&q, &k, &v, &mask, rep, 0.3));
        assert_eq!(ours.0, plain.0, "the forward runs the same ops");
        for (name, a, r) in [
            ("q", &ours.1, &plain.1),
            ("k", &ours.2, &plain.2),
            ("v", &ours.3, &plain.3),
        ] {
            for (x, y) in a.iter().zip(r.iter()) {
                assert!((x - y).abs() < 1e-12, "d{name}: {x} vs {y}");
            }
        }
        // Without a graph the op is a plain forward (nothing attached).
        let (qd, kd, vd) = (
            q.as_detached_tensor(),
            k.as_detached_tensor(),
            v.as_detached_tensor(),
        );
        let out = attention(&qd, &kd, &vd, Some(&mask), rep, 0.3).unwrap();
        assert!(!out.track_op());
    }

    #[test]
    fn lora_linear_backward_matches_finite_differences() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f64, 1.0, (5, 4), &dev).unwrap();
        let bias = Tensor::randn(0f64, 1.0, 5, &dev).unwrap();
        let x = Tensor::randn(0f64, 1.0, (2, 3, 4), &dev).unwrap();
        let a = Tensor::randn(0f64, 1.0, (2, 4), &dev).unwrap();
        let b = Tensor::randn(0f64, 1.0, (5, 2), &dev).unwrap();
        check_grad(
            &[2, 3, 4],
            &|x| lora_linear(x, &w, Some(&bias), &a, &b, 1.5),
            1e-6,
        );
        check_grad(&[2, 4], &|a| lora_linear(&x, &w, None, a, &b, 1.5), 1e-6);
        check_grad(&[5, 2], &|b| lora_linear(&x, &w, None, &a, b, 1.5), 1e-6);
    }

    #[test]
    fn lora_linear_equals_the_plain_ops_in_value_and_gradient() {
        let dev = Device::Cpu;
        // 7 rows: above frozen_linear's matrix-vector threshold.
        let w = Tensor::randn(0f64, 1.0, (6, 5), &dev).unwrap();
        let x = Var::randn(0f64, 1.0, (7, 5), &dev).unwrap();
        let a = Var::randn(0f64, 1.0, (3, 5), &dev).unwrap();
        let b = Var::randn(0f64, 1.0, (6, 3), &dev).unwrap();
        let probe = Tensor::randn(0f64, 1.0, (7, 6), &dev).unwrap();
        let run = |f: &dyn Fn() -> candle_core::Result<Tensor>| {
            let out = f().unwrap();
            let grads = (&out * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let flat = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
            let g_of = |v: &Var| flat(grads.get(v.as_tensor()).expect("no gradient"));
            (flat(&out), g_of(&x), g_of(&a), g_of(&b))
        };
        let ours = run(&|| lora_linear(&x, &w, None, &a, &b, 2.0));
        let plain = run(&|| {
            let delta = x.matmul(&a.t()?)?.matmul(&b.t()?)?.affine(2.0, 0.0)?;
            frozen_linear(&x, &w, None)? + delta
        });
        assert_eq!(ours.0, plain.0, "the forward runs the same ops");
        for (name, o, p) in [
            ("x", &ours.1, &plain.1),
            ("a", &ours.2, &plain.2),
            ("b", &ours.3, &plain.3),
        ] {
            for (u, v) in o.iter().zip(p.iter()) {
                assert!((u - v).abs() < 1e-12, "d{name}: {u} vs {v}");
            }
        }
    }

    #[test]
    fn fused_forwards_match_reference_ops() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 4, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, 8, &dev).unwrap();
        let a = rms_norm(&x, &w, 1e-6).unwrap();
        let r = x
            .broadcast_div(
                &x.sqr()
                    .unwrap()
                    .mean_keepdim(D::Minus1)
                    .unwrap()
                    .affine(1.0, 1e-6)
                    .unwrap()
                    .sqrt()
                    .unwrap(),
            )
            .unwrap()
            .broadcast_mul(&w)
            .unwrap();
        assert!(max_abs_diff(&a, &r).unwrap() < 1e-5);
        let cos = Tensor::randn(0f32, 1.0, (4, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (4, 4), &dev).unwrap();
        let a = rope(&x, &cos, &sin).unwrap();
        let r = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
        assert!(max_abs_diff(&a, &r).unwrap() < 1e-5);
    }
}
