//! Phase 3, throughput on the GPU: trainer steps, LoRA training steps, greedy generation.

use super::*;

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

fn train_throughput(
    model: &Model,
    adapter: &Adapter,
    batch: usize,
    seq: usize,
    steps: usize,
) -> Result<(f64, f64)> {
    let dev = model.device();
    let cfg = model.config();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let tokens: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let all = Tensor::from_vec(tokens, (batch, seq + 1), dev)?;
    let input = all.narrow(1, 0, seq)?.contiguous()?;
    let targets = all.narrow(1, 1, seq)?.flatten_all()?.contiguous()?;
    let layout = BatchLayout::dense(batch, seq, 0);
    let sel = AdapterSelection::All(adapter);
    let mut opt = AdamW::new(
        adapter.vars(),
        ParamsAdamW {
            lr: 1e-4,
            ..Default::default()
        },
    )?;
    let mut step = || -> Result<f32> {
        let h = model.hidden(&input, &layout, None, &sel, true)?;
        let h = h.reshape((batch * seq, h.dim(D::Minus1)?))?;
        let loss = ops::cross_entropy_with_head(&h, model.lm_head(), &targets)?
            .to_dtype(DType::F32)?
            .mean_all()?;
        opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    };
    step()?; // warm-up: kernel loading, cuBLAS handles, allocator
    sync(dev)?;
    let mut times = Vec::new();
    for _ in 0..steps {
        let t0 = Instant::now();
        step()?;
        sync(dev)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    Ok((med, (batch * seq) as f64 / med))
}

fn gen_throughput(model: &Model, prompt: &[u32], new: usize) -> Result<f64> {
    let dev = model.device();
    // Warm-up (kernel loading).
    generate(
        model,
        prompt,
        4,
        &[],
        &AdapterSelection::None,
        &Sampling::greedy(),
    )?;
    sync(dev)?;
    let t0 = Instant::now();
    let out = generate(
        model,
        prompt,
        new,
        &[],
        &AdapterSelection::None,
        &Sampling::greedy(),
    )?;
    sync(dev)?;
    Ok(out.len() as f64 / t0.elapsed().as_secs_f64())
}

/// Phase 3, throughput on the GPU: trainer steps, LoRA training steps and greedy generation.
pub(super) fn measure_throughput(
    r: &mut Report,
    rng: &mut rand::rngs::StdRng,
    m: &Models,
    tcfg: &TrainerConfig,
    gpu: &Device,
) -> Result<()> {
    println!("== throughput on the GPU");
    for (label, model) in [("trainer_f32", &m.gpu), ("trainer_bf16", &m.gpu_bf16)] {
        let ex = train_example(rng, m.cfg.vocab_size, 448, 64);
        let mut tr = Trainer::new(Arc::new(model.clone()), tcfg.clone(), "bench")?;
        tr.step(std::slice::from_ref(&ex))?; // warm-up
        let mut times = Vec::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            tr.step(std::slice::from_ref(&ex))?;
            sync(model.device())?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!(
            "{label}: one example (448-token context, 64-token answer, all objectives): {:.1} ms median of 5, {:.1} examples/s",
            med * 1e3,
            1.0 / med
        );
        r.figure(label, json!({"step_s": med, "examples_per_s": 1.0 / med}));
    }
    let mut figures = BTreeMap::new();
    for (label, model, batch, seq, steps) in [
        ("train_f32_4x256", &m.gpu, 4, 256, 10),
        ("train_bf16_4x256", &m.gpu_bf16, 4, 256, 10),
        ("train_bf16_16x512", &m.gpu_bf16, 16, 512, 5),
    ] {
        let adapter = Adapter::new("bench", m.lora.clone(), &m.cfg, LoraInit::Peft, 0, gpu)?;
        let (s, tps) = train_throughput(model, &adapter, batch, seq, steps)?;
        println!(
            "{label}: {:.2} ms/step median of {steps}, {tps:.0} tokens/s",
            s * 1e3
        );
        figures.insert(label.to_string(), json!({"step_s": s, "tokens_per_s": tps}));
    }
    let prompt: Vec<u32> = (0..40)
        .map(|_| rng.random_range(0..m.cfg.vocab_size as u32))
        .collect();
    for (label, model) in [("generate_f32", &m.gpu), ("generate_bf16", &m.gpu_bf16)] {
        let tps = gen_throughput(model, &prompt, 128)?;
        println!("{label}: {tps:.1} tokens/s (single stream, greedy, 128 new tokens)");
        figures.insert(label.to_string(), json!({"tokens_per_s": tps}));
    }
    r.figure("throughput", json!(figures));
    Ok(())
}
