// LoRA training-step and generation throughput of the default model (SmolLM2-135M-Instruct).
//
// `cargo bench -p hindsight-bench --bench train_step` (run deploy/fetch-model.sh first).
// Training: LoRA r=16, alpha=32 on q,k,v,o,gate,up,down, frozen base in f32, AdamW, batch
// 4 x 256 tokens, fused cross-entropy; median of `HINDSIGHT_BENCH_STEPS` (default 3) steps after
// one warm-up (0 = generation only). Generation: single stream, greedy, 128 new tokens after the chat prompt, KV cache.
// Writes `target/hindsight-bench/train_step_candle.json`, which
// bench/python/torch_train_step.py reads to print the candle/PyTorch ratio.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use hindsight_model::candle_core::{DType, Device, Tensor, D};
use hindsight_model::candle_nn::{AdamW, Optimizer, ParamsAdamW};
use hindsight_model::{
    encode, generate, ops, Adapter, AdapterSelection, BatchLayout, LoraConfig, LoraInit,
    ModelBundle, Sampling,
};
use rand::{Rng, SeedableRng};

const BATCH: usize = 4;
const SEQ: usize = 256;
const NEW_TOKENS: usize = 128;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

// The two /proc readers below repeat `hindsight_bench::procfs` on purpose: this file also
// builds as hindsight-learner's example (learner/examples/train_step.rs), without this crate.

/// CPU seconds (user + system, all threads) this process has used: on a shared machine this
/// is steadier than wall time. Linux only (NaN elsewhere).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return f64::NAN;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|x| x.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// A memory field of /proc/self/status (`VmRSS:`, `VmHWM:`) in MB; NaN off Linux.
fn status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let path = hindsight_model::testing::default_model_path()?;
    // Not hindsight_bench::knobs: learner/examples/train_step.rs includes this file.
    let steps: usize = match std::env::var("HINDSIGHT_BENCH_STEPS") {
        Ok(v) => v
            .parse()
            .with_context(|| format!("HINDSIGHT_BENCH_STEPS={v:?}"))?,
        Err(_) => 3,
    };
    let dev = Device::Cpu;
    let bundle = ModelBundle::load(&path, DType::F32, &dev).context("loading the model")?;
    let model = &bundle.model;
    let cfg = model.config().clone();
    let lora = LoraConfig {
        rank: 16,
        alpha: 32.0,
        ..LoraConfig::default()
    };
    let adapter = Adapter::new("bench", lora, &cfg, LoraInit::Peft, 0, &dev)?;
    let mut opt = AdamW::new(
        adapter.vars(),
        ParamsAdamW {
            lr: 1e-4,
            ..Default::default()
        },
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let tokens: Vec<u32> = (0..BATCH * (SEQ + 1))
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let all = Tensor::from_vec(tokens, (BATCH, SEQ + 1), &dev)?;
    let input = all.narrow(1, 0, SEQ)?.contiguous()?;
    let targets = all.narrow(1, 1, SEQ)?.flatten_all()?.contiguous()?;
    let layout = BatchLayout::dense(BATCH, SEQ, 0);
    let sel = AdapterSelection::All(&adapter);

    let mut step = || -> Result<f32> {
        let h = model.hidden(&input, &layout, None, &sel, true)?;
        let h = h.reshape((BATCH * SEQ, h.dim(D::Minus1)?))?;
        let loss = ops::cross_entropy_with_head(&h, model.lm_head(), &targets)?.mean_all()?;
        opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    };
    let mut times = Vec::new();
    let (mut train_s, mut train_tps, mut train_cpu_s) = (f64::NAN, f64::NAN, f64::NAN);
    // The resident set with the model loaded; the peak after the steps is the training's
    // (generation runs after it is read).
    let loaded_mb = status_mb("VmRSS:");
    let mut peak_mb = f64::NAN;
    if steps > 0 {
        let t0 = Instant::now();
        let first_loss = step()?;
        println!(
            "warm-up step {:.3} s (loss {first_loss:.3})",
            t0.elapsed().as_secs_f64()
        );
        let mut cpu = Vec::new();
        for _ in 0..steps {
            let t0 = Instant::now();
            let c0 = cpu_seconds();
            step()?;
            times.push(t0.elapsed().as_secs_f64());
            cpu.push(cpu_seconds() - c0);
        }
        train_cpu_s = median(cpu.clone());
        train_s = median(times.clone());
        train_tps = (BATCH * SEQ) as f64 / train_s;
        println!(
            "candle LoRA train step (SmolLM2-135M, r=16 all projections, {BATCH}x{SEQ} tokens): \
         {train_s:.3} s median of {steps} ({train_tps:.0} tokens/s), steps {times:.3?}; \
         CPU time {train_cpu_s:.2} s per step"
        );
        peak_mb = status_mb("VmHWM:");
        println!(
            "candle peak RSS {peak_mb:.0} MB (model loaded: {loaded_mb:.0} MB; the step's own: {:.0} MB)",
            peak_mb - loaded_mb
        );
    }

    let template = bundle
        .chat_template
        .as_ref()
        .context("model has no chat template")?;
    let prompt = template.render(
        &serde_json::json!([{"role": "user", "content": "Write a long story about a brave knight."}]),
        None,
        true,
    )?;
    let ids = encode(&bundle.tokenizer, &prompt)?;
    let t0 = Instant::now();
    // No stop tokens: always exactly NEW_TOKENS.
    let out = generate(
        model,
        &ids,
        NEW_TOKENS,
        &[],
        &AdapterSelection::None,
        &Sampling::greedy(),
    )?;
    let gen_s = t0.elapsed().as_secs_f64();
    let gen_tps = out.len() as f64 / gen_s;
    println!(
        "candle generation (single stream, greedy, prompt {} tokens, {} new): {gen_s:.2} s ({gen_tps:.1} tokens/s)",
        ids.len(),
        out.len()
    );
    let t0 = Instant::now();
    let out = generate(model, &ids, NEW_TOKENS, &[], &sel, &Sampling::greedy())?;
    let gen_lora_s = t0.elapsed().as_secs_f64();
    println!(
        "candle generation with an unmerged r=16 adapter: {:.1} tokens/s",
        out.len() as f64 / gen_lora_s
    );

    let mut q8 = model.clone();
    q8.quantize_for_inference(hindsight_model::candle_core::quantized::GgmlDType::Q8_0)?;
    let t0 = Instant::now();
    let out_q = generate(
        &q8,
        &ids,
        NEW_TOKENS,
        &[],
        &AdapterSelection::None,
        &Sampling::greedy(),
    )?;
    let gen_q8_tps = out_q.len() as f64 / t0.elapsed().as_secs_f64();
    println!("candle generation with Q8_0 inference weights: {gen_q8_tps:.1} tokens/s");

    let out_dir = workspace().join("target/hindsight-bench");
    std::fs::create_dir_all(&out_dir)?;
    let json = serde_json::json!({
        "train_step_s": train_s,
        "train_tokens_per_s": train_tps,
        "train_steps_s": times,
        "train_step_cpu_s": train_cpu_s,
        "train_peak_rss_mb": peak_mb,
        "loaded_rss_mb": loaded_mb,
        "generation_tokens_per_s": gen_tps,
        "generation_lora_tokens_per_s": out.len() as f64 / gen_lora_s,
        "generation_q8_0_tokens_per_s": gen_q8_tps,
        "batch": BATCH, "seq": SEQ, "rank": 16,
    });
    if steps > 0 {
        std::fs::write(out_dir.join("train_step_candle.json"), json.to_string())?;
    }
    println!(
        "wrote {}; now run python3 bench/python/torch_train_step.py for the ratio",
        out_dir.join("train_step_candle.json").display()
    );
    Ok(())
}
