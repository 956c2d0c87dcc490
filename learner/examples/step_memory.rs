//! Peak and retained memory of trainer steps on the default model with production-sized
//! examples (450-token context, 60-token answer, teacher context with feedback):
//! `cargo run --release -p hindsight-learner --example step_memory [-- OBJECTIVES]`
//! where OBJECTIVES is e.g. `distill`, `sft`, `distill,dense,kto,sft` (default `distill`).

use std::sync::Arc;

use hindsight_learner::candle_core::{DType, Device};
use hindsight_learner::example::TrainExample;
use hindsight_learner::trainer::{ObjectiveWeights, Trainer, TrainerConfig};
use hindsight_learner::ModelBundle;

fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        / 1024
}

fn main() -> anyhow::Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_learner::settle_cpu_threads();
    let objectives = std::env::args().nth(1).unwrap_or_else(|| "distill".into());
    let bundle = ModelBundle::load(
        std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        DType::F32,
        &Device::Cpu,
    )?;
    let model = Arc::new(bundle.model);
    let has = |o: &str| objectives.split(',').any(|x| x == o);
    let w = |o: &str| if has(o) { 1.0 } else { 0.0 };
    let cfg = TrainerConfig {
        objectives: ObjectiveWeights {
            sft: w("sft"),
            kto: w("kto"),
            distill: w("distill"),
            dense: w("dense"),
        },
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(model, cfg, "mem")?;
    let ex = TrainExample {
        record_id: uuid::Uuid::now_v7(),
        turn: uuid::Uuid::now_v7(),
        route: "default".into(),
        adapter: None,
        context_ids: (0..450).map(|i| 100 + (i * 7) % 20000).collect(),
        answer_ids: (0..60).map(|i| 200 + (i * 11) % 20000).collect(),
        behaviour_logprobs: None,
        teacher_context_ids: Some((0..500).map(|i| 100 + (i * 5) % 20000).collect()),
        control_context_ids: None,
        correction_ids: Some((0..60).map(|i| 300 + (i * 13) % 20000).collect()),
        answer_format: None,
        thumbs: Some(false),
        reward: Some(-1.0),
        feedback_text: Some("x".into()),
        feedback_ids: vec![],
    };
    println!("objectives {objectives}; after load: {} MiB", rss_mib());
    for i in 0..4 {
        let t = std::time::Instant::now();
        let r = trainer.step(&[ex.clone(), ex.clone()])?;
        println!(
            "step {i}: {} MiB after, {:.1} s, loss {:.4}, tokens {}",
            rss_mib(),
            t.elapsed().as_secs_f64(),
            r.loss,
            r.tokens
        );
    }
    Ok(())
}
