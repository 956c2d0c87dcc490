//! Peak memory and time of one learner step on the default model, by example length and
//! objective mix: what a long (e.g. degenerate, max-tokens) logged answer costs the trainer.
//!
//! ```sh
//! cargo run --release -p hindsight-bench --example step_memory -- \
//!     --context 500 --answer 30,128,256 --objectives distill-dense --steps 2
//! ```
//! Each answer length runs in its own child process so the peak resident set (VmHWM) is that
//! length's alone. `--trace` instead runs `--steps` steps in one process, cycling through the
//! answer lengths with prompts of varying length, and prints the resident set after each step
//! (does memory creep over a run?). `--prefix-grad false` runs the trainer with the prompt's pass detached
//! (`TrainerConfig::prefix_grad`). The trainer distils on the logged answer
//! (`distill_target = "logged"`), so every step runs the same passes.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use hindsight_bench::learning::Objective;
use hindsight_bench::procfs::Proc;
use hindsight_learner::example::TrainExample;
use hindsight_learner::trainer::{DistillTarget, Trainer, TrainerConfig};
use hindsight_model::candle_core::{DType, Device};
use hindsight_model::ModelBundle;
use rand::{Rng, SeedableRng};

struct Args {
    context: usize,
    answers: Vec<usize>,
    objective: Objective,
    steps: usize,
    prefix_grad: bool,
    child: bool,
    trace: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        context: 500,
        answers: vec![30, 128, 256],
        objective: Objective::DistillDense,
        steps: 2,
        prefix_grad: true,
        child: false,
        trace: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--context" => a.context = v()?.parse()?,
            "--answer" => {
                a.answers = v()?
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            "--objectives" => {
                let s = v()?;
                a.objective = <Objective as clap::ValueEnum>::from_str(&s, true)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("unknown objective {s}"))?
            }
            "--steps" => a.steps = v()?.parse()?,
            "--prefix-grad" => a.prefix_grad = v()?.parse()?,
            "--child" => a.child = true,
            "--trace" => a.trace = true,
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(a)
}

fn main() -> Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let a = parse()?;
    if !a.child && !a.trace {
        // One child per length: each peak is its own.
        println!(
            "| context | answer | objectives | prefix grad | s/step | peak RSS MB |\n| ---: | ---: | --- | --- | ---: | ---: |"
        );
        for n in &a.answers {
            let out = std::process::Command::new(std::env::current_exe()?)
                .args([
                    "--child",
                    "--context",
                    &a.context.to_string(),
                    "--answer",
                    &n.to_string(),
                    "--objectives",
                    a.objective.as_str(),
                    "--steps",
                    &a.steps.to_string(),
                    "--prefix-grad",
                    &a.prefix_grad.to_string(),
                ])
                .output()?;
            if !out.status.success() {
                println!(
                    "| {} | {n} | {} | {} | failed ({}) | |",
                    a.context,
                    a.objective.as_str(),
                    a.prefix_grad,
                    out.status
                );
                eprintln!("{}", String::from_utf8_lossy(&out.stderr));
                continue;
            }
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
        return Ok(());
    }

    let path = hindsight_model::testing::default_model_path()?;
    let bundle = ModelBundle::load(&path, DType::F32, &Device::Cpu)
        .with_context(|| format!("{} (run deploy/fetch-model.sh)", path.display()))?;
    let vocab = bundle.config.vocab_size as u32;
    // Distilled on the logged answer: every step runs the same passes (the teacher's own
    // answer, the default, would add a decoding of varying length and a second student pass).
    let mut cfg = TrainerConfig {
        prefix_grad: a.prefix_grad,
        distill_target: DistillTarget::Logged,
        ..TrainerConfig::default()
    };
    cfg.objectives = a.objective.weights(cfg.objectives);
    let mut trainer = Trainer::new(Arc::new(bundle.model), cfg, "probe")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut ids = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let mut example = |context: usize, n: usize| {
        let context_ids = ids(context);
        let mut teacher = context_ids.clone();
        teacher.extend(ids(40));
        TrainExample {
            record_id: uuid::Uuid::now_v7(),
            turn: uuid::Uuid::now_v7(),
            route: "default".into(),
            adapter: None,
            context_ids,
            answer_ids: ids(n),
            behaviour_logprobs: None,
            sampling: Default::default(),
            teacher_context_ids: Some(teacher),
            control_context_ids: None,
            correction_ids: Some(ids(n.min(30))),
            answer_format: None,
            thumbs: Some(false),
            reward: Some(-1.0),
            feedback_text: Some("probe".into()),
            feedback_ids: vec![],
        }
    };
    if a.trace {
        println!("| step | prompt | answer | s | RSS MB | peak RSS MB |\n| ---: | ---: | ---: | ---: | ---: | ---: |");
        for i in 0..a.steps {
            let n = a.answers[i % a.answers.len()];
            let context = a.context + (i * 37) % 100;
            let ex = example(context, n);
            let t0 = Instant::now();
            trainer.step(std::slice::from_ref(&ex))?;
            println!(
                "| {i} | {context} | {n} | {:.2} | {:.0} | {:.0} |",
                t0.elapsed().as_secs_f64(),
                Proc::This.rss_mib(),
                Proc::This.peak_rss_mib()
            );
        }
        return Ok(());
    }
    let n = a.answers[0];
    let ex = example(a.context, n);
    let mut times = Vec::new();
    for _ in 0..a.steps.max(1) {
        let t0 = Instant::now();
        let r = trainer.step(std::slice::from_ref(&ex))?;
        if let Some(why) = r.skipped {
            bail!("step skipped: {why}");
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    println!(
        "| {} | {n} | {} | {} | {:.2} | {:.0} |",
        a.context,
        a.objective.as_str(),
        a.prefix_grad,
        times[times.len() / 2],
        Proc::This.peak_rss_mib()
    );
    Ok(())
}
