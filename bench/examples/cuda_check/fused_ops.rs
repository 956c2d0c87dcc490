//! Phase 1, the fused ops: every differentiable op of `hindsight_model::ops`, forward values
//! and input gradients on the GPU against the CPU on the same f32 inputs.

use super::*;

/// One op on both devices: `f` builds the output from the (variable) inputs; the loss is
/// `sum(out * w)` with a fixed random `w`, so every output element gets its own gradient.
fn op_parity(
    r: &mut Report,
    name: &str,
    inputs: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> candle_core_result::R,
    gpu: &Device,
) -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut outs = Vec::new();
    let mut grads = Vec::new();
    let mut w_cpu = None;
    for dev in [&Device::Cpu, gpu] {
        let vars = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_device(dev)?))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts)?;
        let w = match &w_cpu {
            Some(w) => w,
            None => {
                w_cpu = Some(randn(&mut rng, out.dims(), 1.0)?);
                w_cpu.as_ref().context("w")?
            }
        };
        let loss = (out.to_dtype(DType::F32)? * w.to_device(dev)?)?.sum_all()?;
        let g = loss.backward()?;
        grads.push(
            vars.iter()
                .map(|v| g.get(v.as_tensor()).cloned())
                .collect::<Vec<_>>(),
        );
        outs.push(out);
    }
    r.check(
        &format!("op {name} forward"),
        rel_max(&outs[1], &outs[0])?,
        1e-5,
        false,
    );
    for (i, (gc, gg)) in grads[0].iter().zip(&grads[1]).enumerate() {
        match (gc, gg) {
            (Some(c), Some(g)) => {
                r.check(&format!("op {name} grad[{i}]"), rel_max(g, c)?, 1e-4, false)
            }
            (None, None) => {}
            _ => {
                println!("FAIL op {name} grad[{i}]: present on one device only");
                r.failures.push(format!("op {name} grad[{i}]"));
            }
        }
    }
    Ok(())
}

/// `candle_core::Result<Tensor>` under a short name for the closure type above.
mod candle_core_result {
    pub type R = hindsight_model::candle_core::Result<hindsight_model::candle_core::Tensor>;
}

/// Phase 1: every differentiable fused op, forward values and input gradients, `gpu` vs the CPU.
pub(super) fn check_ops(r: &mut Report, rng: &mut rand::rngs::StdRng, gpu: &Device) -> Result<()> {
    println!("== ops: cuda:0 vs CPU, f32");
    let x = randn(rng, &[4, 37, 576], 1.0)?;
    let w = (randn(rng, &[576], 0.1)? + 1.0)?;
    op_parity(
        r,
        "rms_norm",
        &[x.clone(), w],
        &|t| ops::rms_norm(&t[0], &t[1], 1e-5),
        gpu,
    )?;
    let s = randn(rng, &[4, 9, 37, 37], 3.0)?;
    op_parity(
        r,
        "softmax_last_dim",
        &[s],
        &|t| ops::softmax_last_dim(&t[0]),
        gpu,
    )?;
    let q = randn(rng, &[2, 9, 37, 64], 1.0)?;
    let cos = randn(rng, &[2, 37, 32], 1.0)?;
    let sin = randn(rng, &[2, 37, 32], 1.0)?;
    op_parity(
        r,
        "rope",
        &[q, cos, sin],
        &|t| ops::rope(&t[0], &t[1], &t[2]),
        gpu,
    )?;
    let wl = randn(rng, &[1536, 576], 0.05)?;
    let bl = randn(rng, &[1536], 0.05)?;
    op_parity(
        r,
        "frozen_linear",
        &[x.clone(), wl, bl],
        &|t| ops::frozen_linear(&t[0], &t[1].detach(), Some(&t[2].detach())),
        gpu,
    )?;
    let a = randn(rng, &[8, 576], 0.05)?;
    let b = randn(rng, &[1536, 8], 0.05)?;
    let wl = randn(rng, &[1536, 576], 0.05)?;
    op_parity(
        r,
        "lora_linear",
        &[x.clone(), a, b, wl],
        &|t| ops::lora_linear(&t[0], &t[3].detach(), None, &t[1], &t[2], 2.0),
        gpu,
    )?;
    // Grouped-query attention: 3 key heads of 3 query heads each, 37 new queries after 8 past
    // keys, causal.
    let (past, t, s) = (8usize, 37usize, 45usize);
    let mask: Vec<f32> = (0..2 * t * s)
        .map(|i| {
            let (qi, j) = ((i / s) % t, i % s);
            if j > past + qi {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (2, 1, 1, t, s), &Device::Cpu)?;
    let q = randn(rng, &[2, 3, 3 * t, 64], 1.0)?;
    let k = randn(rng, &[2, 3, s, 64], 1.0)?;
    let v = randn(rng, &[2, 3, s, 64], 1.0)?;
    op_parity(
        r,
        "attention",
        &[q, k, v],
        &|t| {
            let m = mask.to_device(t[0].device())?;
            ops::attention(&t[0], &t[1], &t[2], Some(&m), 3, 0.125)
        },
        gpu,
    )?;
    let h = randn(rng, &[148, 576], 1.0)?;
    let head = randn(rng, &[49152, 576], 0.05)?;
    let targets: Vec<u32> = (0..148).map(|_| rng.random_range(0..49152u32)).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu)?;
    op_parity(
        r,
        "cross_entropy_with_head",
        &[h, head],
        &|t| {
            ops::cross_entropy_with_head(&t[0], &t[1].detach(), &targets.to_device(t[0].device())?)
        },
        gpu,
    )?;
    let g1 = randn(rng, &[4, 37, 1536], 1.0)?;
    let g2 = randn(rng, &[4, 37, 1536], 1.0)?;
    op_parity(r, "swiglu", &[g1, g2], &|t| ops::swiglu(&t[0], &t[1]), gpu)?;
    Ok(())
}
