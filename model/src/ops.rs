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
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Storage, Tensor, D};

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

/// A graph node whose forward value was computed elsewhere and whose backward is `bwd(arg, res,
/// grad_res)`.
struct Attached {
    name: &'static str,
    out: Mutex<Option<Tensor>>,
    bwd: Backward,
}

impl Attached {
    fn take(&self) -> candle_core::Result<Tensor> {
        let mut slot = self
            .out
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: poisoned lock", self.name)))?;
        slot.take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }
}

impl CustomOp1 for Attached {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, out.shape().clone())),
            _ => candle_core::bail!("{}: result is not on the CPU", self.name),
        }
    }

    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take()?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, out.shape().clone())),
            _ => candle_core::bail!("{}: result is not on the CUDA device", self.name),
        }
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
    let out = if out.is_contiguous() && out.layout().start_offset() == 0 {
        out
    } else {
        out.force_contiguous()?
    };
    arg.apply_op1(Attached {
        name,
        out: Mutex::new(Some(out)),
        bwd,
    })
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

/// Row count up to which [`frozen_linear`] uses the matrix-vector layout.
const DECODE_ROWS: usize = 4;

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
    // For a few rows (decoding), `W @ x^T` runs as dot products over W's contiguous rows;
    // `x @ W^T` would hand gemm a transposed matrix-vector product, several times slower.
    let mut out = if rows <= DECODE_ROWS {
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
        let diff = (a - r).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        let cos = Tensor::randn(0f32, 1.0, (4, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (4, 4), &dev).unwrap();
        let a = rope(&x, &cos, &sin).unwrap();
        let r = candle_nn::rotary_emb::rope_slow(&x, &cos, &sin).unwrap();
        let diff = (a - r).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
    }
}
