// The model core on a CUDA GPU: checked against the CPU, then measured.
//
// Build (needs a CUDA toolkit; model/README.md, "GPU", says how it was done without one installed):
//   cargo build --release -p hindsight-bench --features cuda --example cuda_check
// Run on the GPU machine:
//   target/release/examples/cuda_check [OUT.json]
//
// 1. Every differentiable fused op of `hindsight_model::ops` (rms_norm, softmax, rope,
//    frozen_linear, cross_entropy_with_head, swiglu): forward values and input gradients on
//    cuda:0 against the CPU on the same f32 inputs.
// 2. The SmolLM2-135M-shaped model (random weights unless HINDSIGHT_MODEL names an existing
//    GGUF/HF dir; then also the "capital of France" answer on the GPU in f32 and bf16) with an
//    r=16 adapter on all seven projections: logits of a right-padded batch, the loss, and every
//    LoRA gradient on GPU vs CPU; the same in bf16 on the GPU against f32 on the CPU; five AdamW
//    steps on both; the KV cache path (incremental decoding = full forward) on the GPU; the
//    learner's `Trainer` (sft + kto + distill + dense, EMA teacher, KL guard) step by step.
// 3. Throughput on the GPU: the training step of bench/benches/train_step.rs (batch 4 x 256,
//    r=16 on all projections, AdamW) in f32 and bf16, a larger 16 x 512 bf16 step, and
//    single-stream greedy generation of 128 tokens in f32 and bf16, and one learner `Trainer`
//    step (all objectives) on a 448 + 64-token example.
//
// Without the `cuda` feature it stops at once: candle answers "not compiled with cuda support";
// `CUDA_CHECK_DEVICE=cpu` runs the checks with the CPU in the GPU's place (a dry run).
// Exit status 1 when a parity check fails (tolerances printed with each line).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hindsight_learner::example::TrainExample;
use hindsight_learner::trainer::{
    DistillTarget, ObjectiveWeights, StepReport, Trainer, TrainerConfig,
};
use hindsight_model::candle_core::{DType, Device, Tensor, Var, D};
use hindsight_model::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hindsight_model::{
    decode, encode, generate, ops, Adapter, AdapterSelection, Architecture, BatchLayout,
    ChatTemplate, KvCache, LoraConfig, LoraInit, Model, ModelBundle, ModelConfig, PaddingSide,
    Sampling,
};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::sync::Arc;

mod fused_ops;
mod model;
mod serve;
mod throughput;

use fused_ops::check_ops;
use model::{
    all_objectives, check_adamw, check_kv_cache_and_greedy, check_lora_parity, check_real_answer,
    check_trainer, train_example, Batch, Models,
};
use serve::serve_check;
use throughput::measure_throughput;

/// `t` as a flat f64 vector on the host, for comparisons.
fn host_f64(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?)
}

/// Relative max error: max |a - b| / max |b| (b is the CPU reference).
fn rel_max(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (host_f64(a)?, host_f64(b)?);
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f64>()?.max(1e-30);
    Ok(diff / scale)
}

/// Cosine similarity of two tensors (as flat vectors).
fn cosine(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (host_f64(a)?, host_f64(b)?);
    let dot = (&a * &b)?.sum_all()?.to_scalar::<f64>()?;
    let na = a.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let nb = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(dot / (na * nb).max(1e-30))
}

fn randn(rng: &mut rand::rngs::StdRng, shape: &[usize], std: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(1e-7);
            let u2: f32 = rng.random::<f32>();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Collects pass/fail lines and the JSON report.
struct Report {
    failures: Vec<String>,
    json: BTreeMap<String, Value>,
}

impl Report {
    fn check(&mut self, name: &str, value: f64, limit: f64, higher_is_better: bool) {
        let ok = if higher_is_better {
            value >= limit
        } else {
            value <= limit
        };
        let op = if higher_is_better { ">=" } else { "<=" };
        println!(
            "{} {name}: {value:.3e} (want {op} {limit:.1e})",
            if ok { "ok  " } else { "FAIL" }
        );
        if !ok {
            self.failures.push(name.to_string());
        }
        self.json.insert(
            name.to_string(),
            json!({"value": value, "limit": limit, "ok": ok}),
        );
    }
    fn figure(&mut self, name: &str, value: Value) {
        self.json.insert(name.to_string(), value);
    }
}

/// Writes the report, with the names of the failed checks, to `out_path`.
fn write_report(r: &mut Report, out_path: &Path) -> Result<()> {
    r.figure("failures", json!(r.failures.clone()));
    std::fs::write(out_path, serde_json::to_string_pretty(&r.json)?)?;
    Ok(())
}

/// An error (exit status 1) when a check failed.
fn fail_on_failures(r: &Report) -> Result<()> {
    if !r.failures.is_empty() {
        bail!("{} check(s) failed: {:?}", r.failures.len(), r.failures);
    }
    Ok(())
}

fn main() -> Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let out_path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("cuda_check.json"));
    // CUDA_CHECK_DEVICE=cpu: a dry run of the checks with the CPU standing in for the GPU (no
    // throughput section), to try the program on a machine without one.
    let dry_run = std::env::var("CUDA_CHECK_DEVICE").as_deref() == Ok("cpu");
    let gpu = if dry_run {
        Device::Cpu
    } else {
        Device::new_cuda(0).context("opening cuda:0")?
    };
    let mut r = Report {
        failures: Vec::new(),
        json: BTreeMap::new(),
    };
    // One random stream for the whole run, drawn from in this order.
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let t_all = Instant::now();

    // 1. The fused ops.
    check_ops(&mut r, &mut rng, &gpu)?;

    // 2. The model.
    let m = Models::load(&gpu)?;
    let real = m.chat.is_some();
    println!(
        "== model: SmolLM2-135M shape ({} weights), LoRA r=16 on all projections",
        if real { "real" } else { "random" }
    );
    r.figure("model_weights", json!(if real { "real" } else { "random" }));
    let (a_cpu, a_gpu, a_bf16) = (m.adapter(&Device::Cpu)?, m.adapter(&gpu)?, m.adapter(&gpu)?);
    let batch = Batch::random(&mut rng, m.cfg.vocab_size)?;
    check_lora_parity(&mut r, &m, &batch, [&a_cpu, &a_gpu, &a_bf16])?;
    check_adamw(&mut r, &m, &batch, &gpu)?;
    check_kv_cache_and_greedy(&mut r, &mut rng, &m, &a_cpu, &a_gpu, &gpu)?;
    let tcfg = all_objectives();
    check_trainer(&mut r, &mut rng, &m, &tcfg)?;
    if let Some((tokenizer, template)) = &m.chat {
        check_real_answer(&mut r, &m, tokenizer, template, &gpu)?;
    }

    // `hindsight serve` on the device, through its OpenAI API (real model only: it needs the
    // tokenizer and chat template).
    if let Some(path) = std::env::var_os("HINDSIGHT_MODEL").filter(|_| real) {
        let figures = serve_check(
            &mut r,
            PathBuf::from(path),
            if dry_run { "cpu" } else { "cuda:0" },
        )?;
        r.figure("serve", figures);
    }

    // 3. Throughput.
    if dry_run {
        println!("dry run on the CPU: no throughput section");
        write_report(&mut r, &out_path)?;
        return fail_on_failures(&r);
    }
    measure_throughput(&mut r, &mut rng, &m, &tcfg, &gpu)?;
    r.figure("wall_s", json!(t_all.elapsed().as_secs_f64()));
    write_report(&mut r, &out_path)?;
    println!("wrote {}", out_path.display());
    fail_on_failures(&r)?;
    println!("all checks passed");
    Ok(())
}
