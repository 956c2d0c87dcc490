//! Phase 2, the model: logits, loss and LoRA gradients, AdamW steps, the KV cache, greedy
//! decoding, the learner's `Trainer` and (with real weights) the sanity answer, GPU against
//! CPU.

use super::*;

fn smollm2_135m() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        eos_token_ids: vec![2],
        bos_token_id: Some(1),
    }
}

/// The loss, the detached logits and every LoRA gradient by PEFT key (sorted).
type LossGrads = (Tensor, Tensor, Vec<(String, Tensor)>);

/// Masked mean cross-entropy of next-token prediction over a right-padded batch, LoRA
/// gradients, on `model`'s device.
fn loss_and_grads(
    model: &Model,
    adapter: &Adapter,
    ids: &Tensor,
    layout: &BatchLayout,
    targets: &Tensor,
    weights: &Tensor,
) -> Result<LossGrads> {
    let dev = model.device();
    let (b, t) = ids.dims2()?;
    let ids = ids.to_device(dev)?;
    let h = model.hidden(&ids, layout, None, &AdapterSelection::All(adapter), true)?;
    let logits = model.logits(&h.detach())?;
    let h = h.reshape((b * t, h.dim(D::Minus1)?))?;
    let per = ops::cross_entropy_with_head(&h, model.lm_head(), &targets.to_device(dev)?)?;
    let w = weights.to_device(dev)?;
    let loss = ((per.to_dtype(DType::F32)? * &w)?.sum_all()? / w.sum_all()?)?;
    let g = loss.backward()?;
    let data = adapter
        .varmap()
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned var map"))?
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.as_tensor().clone())))
        .collect::<Result<Vec<_>>>()?;
    let mut grads = Vec::new();
    for (k, v) in data {
        let gv = g
            .get(&v)
            .with_context(|| format!("no gradient for {k}"))?
            .clone();
        grads.push((k, gv));
    }
    grads.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((loss, logits, grads))
}

/// A logged turn judged thumbs-down with a critique and a correction, so every objective
/// applies: random ids, `ctx` context tokens, `ans` answer tokens.
pub(super) fn train_example(
    rng: &mut rand::rngs::StdRng,
    vocab: usize,
    ctx: usize,
    ans: usize,
) -> TrainExample {
    let mut ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..vocab as u32)).collect() };
    let context_ids = ids(ctx);
    let answer_ids = ids(ans);
    let correction_ids = ids(ans);
    let mut teacher = context_ids[..ctx - 1].to_vec();
    teacher.extend(ids(12));
    teacher.push(context_ids[ctx - 1]);
    TrainExample {
        record_id: uuid::Uuid::now_v7(),
        turn: uuid::Uuid::now_v7(),
        route: "default".into(),
        adapter: None,
        context_ids,
        behaviour_logprobs: Some(vec![-2.5; answer_ids.len()]),
        sampling: Default::default(),
        answer_ids,
        teacher_context_ids: Some(teacher),
        control_context_ids: None,
        correction_ids: Some(correction_ids),
        answer_format: None,
        thumbs: Some(false),
        reward: Some(-1.0),
        feedback_text: Some("wrong department".into()),
        feedback_ids: vec![],
    }
}

/// Prompt ids and greedy answer ids for the sanity question, through the model's own chat
/// template.
fn paris(
    model: &Model,
    tokenizer: &hindsight_model::tokenizers::Tokenizer,
    template: &ChatTemplate,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let prompt = template.render(
        &json!([{"role": "user", "content": "What is the capital of France?"}]),
        None,
        true,
    )?;
    let ids = encode(tokenizer, &prompt)?;
    let out = generate(
        model,
        &ids,
        24,
        &model.config().eos_token_ids,
        &AdapterSelection::None,
        &Sampling::greedy(),
    )?;
    Ok((ids, out))
}

/// The model under check on the three devices and precisions compared, with its adapter
/// settings, and the tokenizer and chat template when real weights were given.
pub(super) struct Models {
    pub(super) cfg: ModelConfig,
    pub(super) lora: LoraConfig,
    pub(super) cpu: Model,
    pub(super) gpu: Model,
    pub(super) gpu_bf16: Model,
    pub(super) chat: Option<(hindsight_model::tokenizers::Tokenizer, ChatTemplate)>,
}

impl Models {
    /// The weights of HINDSIGHT_MODEL when it names an existing model, else random ones of
    /// SmolLM2-135M's shape; on the CPU (f32) and on `gpu` (f32 and bf16).
    pub(super) fn load(gpu: &Device) -> Result<Self> {
        let model_file = std::env::var_os("HINDSIGHT_MODEL")
            .map(PathBuf::from)
            .filter(|p| p.exists());
        let (cfg, tensors, chat) = match model_file {
            Some(p) => {
                let bundle = ModelBundle::load(&p, DType::F32, &Device::Cpu)
                    .with_context(|| format!("loading {}", p.display()))?;
                let m = bundle.model;
                let chat = bundle.chat_template.map(|t| (bundle.tokenizer, t));
                (m.config().clone(), m.named_tensors(), chat)
            }
            None => {
                let cfg = smollm2_135m();
                let m = Model::random(cfg.clone(), 3, DType::F32, &Device::Cpu)?;
                (cfg, m.named_tensors(), None)
            }
        };
        Ok(Self {
            cpu: Model::from_tensors(cfg.clone(), &tensors, DType::F32, &Device::Cpu)?,
            gpu: Model::from_tensors(cfg.clone(), &tensors, DType::F32, gpu)?,
            gpu_bf16: Model::from_tensors(cfg.clone(), &tensors, DType::BF16, gpu)?,
            cfg,
            lora: LoraConfig {
                rank: 16,
                alpha: 32.0,
                ..LoraConfig::default()
            },
            chat,
        })
    }

    /// The checks' adapter on `dev`. Its initial values are drawn on the host, so the same
    /// seed gives the same weights on every device.
    pub(super) fn adapter(&self, dev: &Device) -> Result<Adapter> {
        Ok(Adapter::new(
            "check",
            self.lora.clone(),
            &self.cfg,
            LoraInit::RandomB(0.02),
            5,
            dev,
        )?)
    }
}

/// A right-padded batch of random tokens with its next-token targets and loss mask.
pub(super) struct Batch {
    lengths: [usize; 4],
    seq: usize,
    layout: BatchLayout,
    input: Tensor,
    targets: Tensor,
    mask: Tensor,
    /// Flat indices of the valid (not padding) positions.
    valid_rows: Tensor,
}

impl Batch {
    pub(super) fn random(rng: &mut rand::rngs::StdRng, vocab_size: usize) -> Result<Self> {
        let lengths = [64usize, 40, 17, 64];
        let seq = 64;
        let layout = BatchLayout::padded(&lengths, seq, PaddingSide::Right)?;
        let ids: Vec<u32> = (0..lengths.len() * (seq + 1))
            .map(|_| rng.random_range(0..vocab_size as u32))
            .collect();
        let all = Tensor::from_vec(ids, (lengths.len(), seq + 1), &Device::Cpu)?;
        let input = all.narrow(1, 0, seq)?.contiguous()?;
        let targets = all.narrow(1, 1, seq)?.flatten_all()?.contiguous()?;
        let mask: Vec<f32> = lengths
            .iter()
            .flat_map(|&l| (0..seq).map(move |i| if i + 1 < l { 1.0 } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, lengths.len() * seq, &Device::Cpu)?;
        let valid_rows: Vec<u32> = (0..lengths.len() * seq)
            .filter(|i| layout.valid()[*i])
            .map(|i| i as u32)
            .collect();
        let valid_rows = Tensor::new(valid_rows.as_slice(), &Device::Cpu)?;
        Ok(Self {
            lengths,
            seq,
            layout,
            input,
            targets,
            mask,
            valid_rows,
        })
    }

    /// `logits` at the valid positions, as f32 on the host.
    fn pick(&self, logits: &Tensor) -> Result<Tensor> {
        let v = logits.dim(D::Minus1)?;
        Ok(logits
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape(((), v))?
            .index_select(&self.valid_rows, 0)?)
    }

    fn loss_and_grads(&self, model: &Model, adapter: &Adapter) -> Result<LossGrads> {
        loss_and_grads(
            model,
            adapter,
            &self.input,
            &self.layout,
            &self.targets,
            &self.mask,
        )
    }
}

/// Phase 2: logits, loss and every LoRA gradient of the model on the GPU (f32, and bf16
/// against the f32 CPU reference) vs the CPU.
pub(super) fn check_lora_parity(
    r: &mut Report,
    m: &Models,
    batch: &Batch,
    [a_cpu, a_gpu, a_bf16]: [&Adapter; 3],
) -> Result<()> {
    let (l_cpu, lg_cpu, g_cpu) = batch.loss_and_grads(&m.cpu, a_cpu)?;
    let (l_gpu, lg_gpu, g_gpu) = batch.loss_and_grads(&m.gpu, a_gpu)?;
    let (l_bf, lg_bf, g_bf) = batch.loss_and_grads(&m.gpu_bf16, a_bf16)?;
    let (l_cpu, l_gpu, l_bf) = (
        l_cpu.to_scalar::<f32>()? as f64,
        l_gpu.to_scalar::<f32>()? as f64,
        l_bf.to_scalar::<f32>()? as f64,
    );
    println!("loss: cpu f32 {l_cpu:.6}, gpu f32 {l_gpu:.6}, gpu bf16 {l_bf:.6}");
    r.figure(
        "loss",
        json!({"cpu_f32": l_cpu, "gpu_f32": l_gpu, "gpu_bf16": l_bf}),
    );
    r.check(
        "model f32 logits (valid positions)",
        rel_max(&batch.pick(&lg_gpu)?, &batch.pick(&lg_cpu)?)?,
        1e-4,
        false,
    );
    r.check(
        "model f32 loss",
        (l_gpu - l_cpu).abs() / l_cpu.abs(),
        1e-5,
        false,
    );
    let mut worst = 0f64;
    let mut worst_cos_bf = 1f64;
    let (mut dot, mut nb, mut nc) = (0f64, 0f64, 0f64);
    for ((_, c), ((_, g), (_, b))) in g_cpu.iter().zip(g_gpu.iter().zip(&g_bf)) {
        worst = worst.max(rel_max(g, c)?);
        worst_cos_bf = worst_cos_bf.min(cosine(b, c)?);
        let (b64, c64) = (host_f64(b)?, host_f64(c)?);
        dot += (&b64 * &c64)?.sum_all()?.to_scalar::<f64>()?;
        nb += b64.sqr()?.sum_all()?.to_scalar::<f64>()?;
        nc += c64.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    r.check(
        &format!(
            "model f32 LoRA gradients ({} tensors, worst rel max err)",
            g_cpu.len()
        ),
        worst,
        1e-3,
        false,
    );
    r.check(
        "model bf16 logits vs f32 CPU (cosine)",
        cosine(&batch.pick(&lg_bf)?, &batch.pick(&lg_cpu)?)?,
        0.999,
        true,
    );
    r.check(
        "model bf16 loss vs f32 CPU (rel)",
        (l_bf - l_cpu).abs() / l_cpu.abs(),
        1e-2,
        false,
    );
    // bf16 weights change the function itself, so single small gradient tensors can differ
    // more (0.91 was seen on the real weights with candle's CPU bf16 path, 0.9885 for the whole
    // vector); the whole update direction is what training follows.
    r.check(
        "model bf16 LoRA gradient (all tensors as one vector) vs f32 CPU, cosine",
        dot / (nb * nc).sqrt().max(1e-30),
        0.98,
        true,
    );
    println!("model bf16 LoRA gradients: worst single-tensor cosine {worst_cos_bf:.4}");
    r.figure("bf16_worst_tensor_grad_cosine", json!(worst_cos_bf));
    Ok(())
}

/// Five AdamW steps on both devices from the same adapter: the same losses, falling.
pub(super) fn check_adamw(r: &mut Report, m: &Models, batch: &Batch, gpu: &Device) -> Result<()> {
    let (b_cpu, b_gpu) = (m.adapter(&Device::Cpu)?, m.adapter(gpu)?);
    let mut losses = [Vec::new(), Vec::new()];
    for (k, (model, adapter)) in [(&m.cpu, &b_cpu), (&m.gpu, &b_gpu)].into_iter().enumerate() {
        let mut opt = AdamW::new(
            adapter.vars(),
            ParamsAdamW {
                lr: 1e-3,
                ..Default::default()
            },
        )?;
        let dev = model.device();
        for _ in 0..5 {
            let h = model.hidden(
                &batch.input.to_device(dev)?,
                &batch.layout,
                None,
                &AdapterSelection::All(adapter),
                true,
            )?;
            let h = h.reshape((batch.lengths.len() * batch.seq, m.cfg.hidden_size))?;
            let per =
                ops::cross_entropy_with_head(&h, model.lm_head(), &batch.targets.to_device(dev)?)?;
            let mask = batch.mask.to_device(dev)?;
            let loss = ((per * &mask)?.sum_all()? / mask.sum_all()?)?;
            opt.backward_step(&loss)?;
            losses[k].push(loss.to_scalar::<f32>()? as f64);
        }
    }
    println!(
        "5 AdamW steps: cpu {:.5?}, gpu {:.5?}",
        losses[0], losses[1]
    );
    let step_err = losses[0]
        .iter()
        .zip(&losses[1])
        .map(|(c, g)| (c - g).abs() / c.abs())
        .fold(0f64, f64::max);
    r.check(
        "5 AdamW steps: loss per step, rel err",
        step_err,
        1e-4,
        false,
    );
    r.check(
        "5 AdamW steps: loss falls on the GPU",
        losses[1][0] - losses[1][4],
        1e-6,
        true,
    );
    r.figure("adamw_losses", json!({"cpu": losses[0], "gpu": losses[1]}));
    Ok(())
}

/// KV cache on the GPU: prefill 20 tokens then 12 one at a time == one forward of 32; then
/// greedy generation on both devices.
pub(super) fn check_kv_cache_and_greedy(
    r: &mut Report,
    rng: &mut rand::rngs::StdRng,
    m: &Models,
    a_cpu: &Adapter,
    a_gpu: &Adapter,
    gpu: &Device,
) -> Result<()> {
    let prompt: Vec<u32> = (0..32)
        .map(|_| rng.random_range(0..m.cfg.vocab_size as u32))
        .collect();
    let full = m.gpu.forward(
        &Tensor::new(prompt.as_slice(), gpu)?.unsqueeze(0)?,
        &BatchLayout::dense(1, 32, 0),
        None,
        &AdapterSelection::All(a_gpu),
    )?;
    let mut cache = KvCache::new();
    let mut steps = vec![m.gpu.forward(
        &Tensor::new(&prompt[..20], gpu)?.unsqueeze(0)?,
        &BatchLayout::dense(1, 20, 0),
        Some(&mut cache),
        &AdapterSelection::All(a_gpu),
    )?];
    for (i, &tok) in prompt.iter().enumerate().skip(20) {
        steps.push(m.gpu.forward(
            &Tensor::new(&[tok], gpu)?.unsqueeze(0)?,
            &BatchLayout::dense(1, 1, i),
            Some(&mut cache),
            &AdapterSelection::All(a_gpu),
        )?);
    }
    let inc = Tensor::cat(&steps, 1)?;
    r.check(
        "KV cache: incremental = full forward (GPU)",
        rel_max(&inc, &full)?,
        1e-4,
        false,
    );
    let gen_cpu = generate(
        &m.cpu,
        &prompt,
        16,
        &[],
        &AdapterSelection::All(a_cpu),
        &Sampling::greedy(),
    )?;
    let gen_gpu = generate(
        &m.gpu,
        &prompt,
        16,
        &[],
        &AdapterSelection::All(a_gpu),
        &Sampling::greedy(),
    )?;
    let same = gen_cpu
        .iter()
        .zip(&gen_gpu)
        .take_while(|(a, b)| a == b)
        .count();
    println!("greedy 16 tokens: identical prefix {same}/16 (cpu {gen_cpu:?}, gpu {gen_gpu:?})");
    r.figure("greedy_identical_prefix_of_16", json!(same));
    Ok(())
}

/// The learner's trainer with all four objectives and otherwise the default recipe (its
/// teacher, KL guard and gradient clipping), distilling on the logged answer: the default
/// target, the teacher's own answer, needs a tokenizer to decode with, which random weights
/// do not have.
pub(super) fn all_objectives() -> TrainerConfig {
    TrainerConfig {
        distill_target: DistillTarget::Logged,
        objectives: ObjectiveWeights {
            sft: 1.0,
            kto: 1.0,
            distill: 1.0,
            dense: 1.0,
        },
        ..TrainerConfig::default()
    }
}

/// The learner's trainer ([`all_objectives`]) step by step on both devices from the same
/// adapter and the same examples.
pub(super) fn check_trainer(
    r: &mut Report,
    rng: &mut rand::rngs::StdRng,
    m: &Models,
    tcfg: &TrainerConfig,
) -> Result<()> {
    println!("== trainer: sft + kto + distill + dense, GPU vs CPU (f32)");
    let examples: Vec<TrainExample> = (0..3)
        .map(|i| train_example(rng, m.cfg.vocab_size, 48 + 16 * i, 16))
        .collect();
    let mut reports: [Vec<StepReport>; 2] = [Vec::new(), Vec::new()];
    for (k, model) in [m.cpu.clone(), m.gpu.clone()].into_iter().enumerate() {
        let mut tr = Trainer::new(Arc::new(model), tcfg.clone(), "check")?;
        for ex in &examples {
            reports[k].push(tr.step(std::slice::from_ref(ex))?);
        }
    }
    for (i, (c, g)) in reports[0].iter().zip(&reports[1]).enumerate() {
        if c.skipped.is_some() || g.skipped.is_some() {
            println!(
                "FAIL trainer step {i} skipped: cpu {:?}, gpu {:?}",
                c.skipped, g.skipped
            );
            r.failures.push(format!("trainer step {i} skipped"));
        }
        // The first step compares identical inputs; later ones also carry AdamW's amplification
        // of tiny differences (it normalises each gradient entry).
        let limit = if i == 0 { 1e-3 } else { 1e-2 };
        let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-6);
        let mut worst = rel(g.loss, c.loss).max(rel(g.grad_norm, c.grad_norm));
        for (name, v) in &c.terms {
            worst = worst.max(rel(g.terms.get(name).copied().unwrap_or(f64::NAN), *v));
        }
        println!(
            "step {i}: loss cpu {:.5} gpu {:.5}; terms cpu {:?}",
            c.loss, g.loss, c.terms
        );
        r.check(
            &format!("trainer step {i}: loss, every term, grad norm (worst rel err)"),
            worst,
            limit,
            false,
        );
    }
    Ok(())
}

/// The real model: the sanity answer on the GPU. Greedy decoding in f32 must answer Paris. In
/// bf16 the first token is a near-tie on this model ("The" 25.33 vs "L" 25.24 in f32: the
/// rounding of bf16 weights can flip it, and did on the H200), so bf16 is checked
/// teacher-forced: along the f32 answer, the bf16 model's argmax at the position of " Paris"
/// must be " Paris".
pub(super) fn check_real_answer(
    r: &mut Report,
    m: &Models,
    tokenizer: &hindsight_model::tokenizers::Tokenizer,
    template: &ChatTemplate,
    gpu: &Device,
) -> Result<()> {
    let (prompt, answer) = paris(&m.gpu, tokenizer, template)?;
    let text = decode(tokenizer, &answer, true)?;
    println!("f32: \"What is the capital of France?\" -> {text:?}");
    r.check(
        "real model f32 on the GPU answers Paris (greedy)",
        f64::from(u8::from(text.contains("Paris"))),
        1.0,
        true,
    );
    let (_, free_bf16) = paris(&m.gpu_bf16, tokenizer, template)?;
    println!(
        "bf16 free greedy answer: {:?}",
        decode(tokenizer, &free_bf16, true)?
    );
    let paris_at = answer
        .iter()
        .position(|&id| decode(tokenizer, &[id], true).is_ok_and(|s| s.contains("Paris")));
    let ok = match paris_at {
        Some(i) => {
            let mut ctx = prompt.clone();
            ctx.extend_from_slice(&answer[..i]);
            let input = Tensor::new(ctx.as_slice(), gpu)?.unsqueeze(0)?;
            let logits = m.gpu_bf16.forward_last(
                &input,
                &BatchLayout::dense(1, ctx.len(), 0),
                None,
                &AdapterSelection::None,
            )?;
            let top = hindsight_model::argmax_rows(&logits)?;
            top.first() == Some(&answer[i])
        }
        None => false,
    };
    r.check(
        "real model bf16 on the GPU: argmax is Paris after \"The capital of France is\"",
        f64::from(u8::from(ok)),
        1.0,
        true,
    );
    Ok(())
}
