//! What do `[learner.trainer]`'s `top_k`, `gap_clip` and `ratio_clip` do on the default model
//! and the simulated tickets? Minutes of CPU instead of a learning curve.
//!
//! The base model answers train tickets as `hindsight serve` samples them (the scenario's
//! temperature under the `response_format` grammar, with behaviour log-probs), the simulated
//! user critiques the wrong ones, and the first `N` go through the learner's example builder.
//! The base model is then the frozen teacher (shown the critique) and the student, as at the
//! first training step:
//! - on the teacher's own greedy answer (`distill_target = "teacher"`), per k: the teacher's mass
//!   in its top k tokens, and the trainer's top-k + tail forward KL (`objectives::distill_loss`)
//!   and its gradient in the student's logits against the exact, full-vocabulary ones;
//! - on the logged answer: the teacher − student log-prob gap (what `gap_clip` clips) and the
//!   importance ratio against the behaviour log-probs (what `ratio_clip` clips), at step 1 and
//!   after `STEPS` default training steps (one event each).
//!
//! ```sh
//! RAYON_NUM_THREADS=2 CARGO_INCREMENTAL=0 cargo run -p hindsight-bench --profile dev \
//!   --example distill_fidelity -- [N=24] [STEPS=8]
//! ```
//! Config as the learning bench reads it: the file in `CONFIG` (optional) and
//! `HINDSIGHT_SCENARIO__*` / `HINDSIGHT_LEARNER__*` overrides. JSON to `OUT`.
use std::sync::Arc;

use anyhow::{anyhow, Context};
use hindsight_bench::learning::{single_turn, BenchFile};
use hindsight_feedback::{
    Behaviour, EpisodeContext, EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue,
};
use hindsight_learner::example::build_example;
use hindsight_learner::objectives::{distill_loss, kl_exact, token_logprobs, Divergence};
use hindsight_learner::trainer::{TeacherDecoding, Trainer};
use hindsight_model::candle_core::{DType, Device, Tensor, Var};
use hindsight_model::grammar::{allowed_by_grammar, best_allowed, grammar_vocab};
use hindsight_model::grammar::{response_format_grammar, JsonState, OJson};
use hindsight_model::{decode, encode, AdapterSelection, BatchLayout, KvCache, Model, ModelBundle};
use hindsight_sim::{messages, react, resolve, response_format, Rng, Split, UserConfig, World};
use serde::Serialize;
use serde_json::{json, Value};

const KS: [usize; 6] = [8, 16, 32, 64, 128, 256];
const GAPS: [f64; 4] = [0.5, 1.0, 2.0, 4.0];

/// Log-probs of `answer` after `prefix` under `a`, and the logits `[n, V]` that predict it.
fn pass(
    m: &Model,
    prefix: &[u32],
    answer: &[u32],
    a: &AdapterSelection,
) -> anyhow::Result<(Vec<f64>, Tensor)> {
    let (p, n) = (prefix.len(), answer.len());
    let ids = Tensor::from_vec([prefix, answer].concat(), (1, p + n), m.device())?;
    let logits = m.forward(&ids, &BatchLayout::dense(1, p + n, 0), None, a)?;
    let logits = logits.narrow(1, p - 1, n)?.squeeze(0)?;
    let lp: Vec<f32> =
        token_logprobs(&logits, &Tensor::from_slice(answer, n, m.device())?)?.to_vec1()?;
    Ok((lp.into_iter().map(f64::from).collect(), logits))
}

/// The base model's answer sampled as the serve samples guided JSON: temperature `t` over the
/// tokens the grammar allows (those more than 20 nats / t below the best one ignored), with each
/// pick's log-probability under that renormalised distribution (the behaviour log-prob).
fn sample_logged(
    m: &Model,
    prompt: &[u32],
    mut state: JsonState,
    vocab: &[Option<String>],
    t: f64,
    rng: &mut Rng,
) -> anyhow::Result<Option<(Vec<u32>, Vec<f32>)>> {
    let (mut cache, mut ids, mut lps, mut input) =
        (KvCache::new(), vec![], vec![], prompt.to_vec());
    while ids.len() < 256 {
        if state.finished() {
            return Ok(Some((ids, lps)));
        }
        let x = Tensor::from_slice(&input, (1, input.len()), m.device())?;
        let layout = BatchLayout::dense(1, input.len(), cache.len());
        let row: Vec<f32> = m
            .forward_last(&x, &layout, Some(&mut cache), &AdapterSelection::None)?
            .squeeze(0)?
            .to_vec1()?;
        let allowed = allowed_by_grammar(&state, vocab);
        let best = row[best_allowed(&row, &allowed).context("no token allowed")? as usize];
        let weight = |i: u32| (f64::from(row[i as usize] - best) / t).exp();
        let cands: Vec<u32> = (0..row.len() as u32)
            .filter(|&i| weight(i) > (-20f64).exp() && allowed(i))
            .collect();
        let z: f64 = cands.iter().map(|&i| weight(i)).sum();
        let mut r = rng.unit() * z;
        let id = *cands
            .iter()
            .find(|&&i| {
                r -= weight(i);
                r < 0.0
            })
            .or(cands.last())
            .context("no candidate")?;
        ids.push(id);
        lps.push((weight(id) / z).ln() as f32);
        let text = vocab
            .get(id as usize)
            .cloned()
            .flatten()
            .context("token text")?;
        anyhow::ensure!(state.feed_str(&text), "the grammar refused its own pick");
        input = vec![id];
    }
    Ok(None)
}

/// The episode the joiner would emit: the logged answer with its behaviour, a thumbs down and
/// the critique.
fn episode(
    msgs: &[Value],
    answer: &str,
    ids: Vec<u32>,
    lps: Vec<f32>,
    comment: &str,
) -> EpisodeRecord {
    let fb = |value| FeedbackRecord::new(FeedbackTarget::Episode("probe".into()), value, 0);
    let context = EpisodeContext {
        messages: Value::Array(msgs.to_vec()),
        response_format: Some(response_format()),
        ..Default::default()
    };
    let feedback = vec![
        fb(FeedbackValue::Thumbs(false)),
        fb(FeedbackValue::Comment(comment.into())),
    ];
    let answer = json!({"role": "assistant", "content": answer});
    EpisodeRecord {
        // The token texts are only for display; the example reads the ids.
        behaviour: Some(Behaviour {
            tokens: vec![],
            token_ids: Some(ids),
            logprobs: lps,
        }),
        ..EpisodeRecord::turn("probe", context, Some(answer), feedback)
    }
}

/// The `f` quantile of `v`.
fn q(v: &[f64], f: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len().max(1) - 1) as f64 * f).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}
fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}
fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = row.iter().map(|x| f64::from(x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// Values over positions: the share farther than each threshold from a center, and quantiles.
#[derive(Serialize)]
struct Spread {
    positions: usize,
    /// (threshold, share of positions with |x − center| above it)
    beyond: Vec<(f64, f64)>,
    q05: f64,
    median: f64,
    q95: f64,
}

impl Spread {
    fn new(v: &[f64], center: f64, thresholds: &[f64]) -> Self {
        let share = |t: f64| {
            v.iter().filter(|x| (**x - center).abs() > t).count() as f64 / v.len().max(1) as f64
        };
        let beyond = thresholds.iter().map(|t| (*t, share(*t))).collect();
        Self {
            positions: v.len(),
            beyond,
            q05: q(v, 0.05),
            median: q(v, 0.5),
            q95: q(v, 0.95),
        }
    }

    /// A markdown table row.
    fn row(&self, name: &str) -> String {
        let b: Vec<String> = self.beyond.iter().map(|(_, s)| format!("{s:.3}")).collect();
        let (n, b, q05, m, q95) = (
            self.positions,
            b.join(" | "),
            self.q05,
            self.median,
            self.q95,
        );
        format!("| {name} | {n} | {b} | {q05:.3} | {m:.3} | {q95:.3} |")
    }
}

/// Per k, over the teacher's answers' positions: the teacher's mass in its top k, |approx −
/// exact| / exact (where exact > 0.01 nats), Σ approx and Σ exact, the gradient cosine, and
/// Σ dot, Σ |g_k|², Σ |g|² for the cosine of the whole gradient.
#[derive(Default, Clone)]
struct Fidelity {
    mass: Vec<f64>,
    rel_err: Vec<f64>,
    sums: [f64; 2],
    cos: Vec<f64>,
    dots: [f64; 3],
}

fn fidelity(s: &Tensor, t: &Tensor, acc: &mut [Fidelity]) -> anyhow::Result<()> {
    let exact: Vec<f32> = kl_exact(t, s)?.to_vec1()?;
    let (tr, sr): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (t.to_vec2()?, s.to_vec2()?);
    let pt: Vec<Vec<f64>> = tr.iter().map(|r| softmax(r)).collect();
    // The exact gradient of KL(t ‖ s) in the student's logits: softmax(s) − softmax(t).
    let grad: Vec<Vec<f64>> = sr
        .iter()
        .zip(&pt)
        .map(|(r, p)| softmax(r).iter().zip(p).map(|(a, b)| a - b).collect())
        .collect();
    let mut sorted = pt.clone();
    sorted
        .iter_mut()
        .for_each(|p| p.sort_by(|a, b| b.total_cmp(a)));
    for (k, f) in KS.iter().zip(acc) {
        let var = Var::from_tensor(s)?;
        let approx = distill_loss(var.as_tensor(), t, *k, Divergence::ForwardKl)?;
        let grads = approx.sum_all()?.backward()?;
        let g: Vec<Vec<f32>> = grads.get(var.as_tensor()).context("gradient")?.to_vec2()?;
        let approx: Vec<f32> = approx.to_vec1()?;
        for i in 0..exact.len() {
            f.mass.push(sorted[i][..*k].iter().sum());
            let (a, e) = (f64::from(approx[i]), f64::from(exact[i]));
            if e > 0.01 {
                f.rel_err.push((a - e).abs() / e);
            }
            let dot: f64 = g[i]
                .iter()
                .zip(&grad[i])
                .map(|(x, y)| f64::from(*x) * y)
                .sum();
            let n1: f64 = g[i].iter().map(|x| f64::from(*x).powi(2)).sum();
            let n2: f64 = grad[i].iter().map(|x| x * x).sum();
            f.cos.push(dot / (n1 * n2).sqrt().max(1e-30));
            f.sums = [f.sums[0] + a, f.sums[1] + e];
            f.dots = [f.dots[0] + dot, f.dots[1] + n1, f.dots[2] + n2];
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()
        .context("N")?
        .unwrap_or(24);
    let steps: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()
        .context("STEPS")?
        .unwrap_or(8);
    let config = std::env::var_os("CONFIG").map(std::path::PathBuf::from);
    let file = BenchFile::load(config.as_deref(), std::env::vars())?;
    let out = std::env::var("OUT")
        .unwrap_or_else(|_| "target/bench-results/distill_fidelity.json".into());
    let (sc, lc) = (&file.scenario, &file.learner);
    let bundle = ModelBundle::load(&lc.model_path, DType::F32, &Device::Cpu)?;
    let eot = bundle.end_of_turn().context("end of turn token")?;
    let template = bundle.chat_template.context("chat template")?;
    let (model, tokenizer) = (Arc::new(bundle.model), bundle.tokenizer);
    let vocab = Arc::new(grammar_vocab(&tokenizer, bundle.config.vocab_size));
    let mut trainer = Trainer::new(model.clone(), lc.trainer.clone(), "probe")?;
    let tokenizer_arc = Some(Arc::new(tokenizer.clone()));
    trainer.set_decoding(TeacherDecoding {
        vocab: vocab.clone(),
        end_of_turn: eot,
        tokenizer: tokenizer_arc,
    });
    let grammar = response_format_grammar(&OJson::from(&response_format()))
        .map_err(|e| anyhow!("{e:?}"))?
        .context("no grammar")?;
    let (rate, style) = (sc.correction_rate, sc.critique_style);
    let user = UserConfig {
        noise_rate: sc.noise_rate,
        correction_rate: rate,
        thanks_rate: 0.0,
        critique_style: style,
    };
    let started = std::time::Instant::now();

    let (mut examples, mut fid, mut fallbacks) = (vec![], vec![Fidelity::default(); KS.len()], 0);
    let (mut gaps, mut s_lp, mut t_lp, mut b_lp) = (vec![], vec![], vec![], vec![]);
    let none = AdapterSelection::None;
    for (episode_no, ticket) in World::new(sc.seed)
        .tickets(Split::Train, 20 * n)
        .into_iter()
        .enumerate()
    {
        if examples.len() == n {
            break;
        }
        let msgs = messages(&ticket, single_turn(sc.records));
        let prompt = encode(&tokenizer, &template.render_chat(&msgs, &[])?)?;
        let mut rng = Rng::derive(sc.seed, "distill_fidelity", episode_no as u64);
        let state = JsonState::new(&grammar);
        let Some((ids, lps)) =
            sample_logged(&model, &prompt, state, &vocab, sc.temperature, &mut rng)?
        else {
            continue;
        };
        let answer = decode(&tokenizer, &ids, false)?;
        let parsed = serde_json::from_str::<Value>(&answer).ok();
        let map = parsed.as_ref().and_then(Value::as_object);
        let reaction = react(
            &user,
            sc.seed,
            episode_no as u64,
            &ticket,
            &resolve(&ticket),
            map,
        );
        let (false, Some(comment)) = (reaction.correct, &reaction.comment) else {
            continue;
        };
        let rec = episode(&msgs, &answer, ids, lps, comment);
        let ex = build_example(&rec, &tokenizer, &template, eot, &lc.examples)
            .map_err(|r| anyhow!("no example: {}", r.as_str()))?;
        let tctx = ex
            .teacher_context_ids
            .as_deref()
            .context("teacher prompt")?;
        // The teacher's own answer, decoded as the trainer decodes it (else the logged one).
        let own = trainer.teacher_greedy(tctx, ex.answer_format.as_ref())?;
        fallbacks += usize::from(own.is_none());
        let own = own.unwrap_or_else(|| ex.answer_ids.clone());
        eprintln!(
            "{} logged {answer} | teacher {} | {comment}",
            ticket.ticket_id,
            decode(&tokenizer, &own, true)?
        );
        let (s_own, t_own) = (
            pass(&model, &ex.context_ids, &own, &none)?.1,
            pass(&model, tctx, &own, &none)?.1,
        );
        fidelity(&s_own, &t_own, &mut fid)?;
        let s = pass(&model, &ex.context_ids, &ex.answer_ids, &none)?.0;
        let t = pass(&model, tctx, &ex.answer_ids, &none)?.0;
        gaps.extend(t.iter().zip(&s).map(|(a, b)| a - b));
        s_lp.extend(s);
        t_lp.extend(t);
        b_lp.extend(
            ex.behaviour_logprobs
                .iter()
                .flatten()
                .map(|x| f64::from(*x)),
        );
        examples.push(ex);
    }
    anyhow::ensure!(!examples.is_empty(), "no wrong answers with a critique");
    let probe_s = started.elapsed().as_secs_f64();

    // A few default steps, one event each, then the policy on the same logged answers.
    let mut reports = vec![];
    for i in 0..steps {
        let r = trainer.step(std::slice::from_ref(&examples[i % examples.len()]))?;
        eprintln!(
            "step {}: loss {:.3} kl_to_base {:.3} {:?}",
            r.step, r.loss, r.kl_to_base, r.skipped
        );
        reports.push(json!({"step": r.step, "loss": r.loss, "kl_to_base": r.kl_to_base}));
    }
    let policy = AdapterSelection::All(trainer.policy());
    let mut p_lp = vec![];
    for ex in &examples {
        p_lp.extend(pass(&model, &ex.context_ids, &ex.answer_ids, &policy)?.0);
    }
    let gaps_after: Vec<f64> = t_lp.iter().zip(&p_lp).map(|(t, p)| t - p).collect();
    let measured = Measured {
        events: examples.len(),
        fallbacks,
        probe_s,
        fid: &fid,
        gaps: &gaps,
        gaps_after: &gaps_after,
        s_lp: &s_lp,
        p_lp: &p_lp,
        b_lp: &b_lp,
        steps: reports,
    };
    report(&measured, &file, &out)
}

/// What the probe measured, for the tables and the JSON.
struct Measured<'a> {
    events: usize,
    fallbacks: usize,
    probe_s: f64,
    fid: &'a [Fidelity],
    gaps: &'a [f64],
    gaps_after: &'a [f64],
    s_lp: &'a [f64],
    p_lp: &'a [f64],
    b_lp: &'a [f64],
    steps: Vec<Value>,
}

/// Prints the three tables and writes the JSON to `out`.
fn report(m: &Measured, file: &BenchFile, out: &str) -> anyhow::Result<()> {
    let (sc, lc) = (&file.scenario, &file.learner);
    // Unknown behaviour entries (the end-of-turn token: NaN) are left out.
    let ratio = |num: &[f64], den: &[f64]| -> Vec<f64> {
        num.iter()
            .zip(den)
            .filter(|(_, d)| d.is_finite())
            .map(|(n, d)| (n - d).exp())
            .collect()
    };

    println!(
        "\n{} events ({} teacher answers fell back to the logged one), {:.0} s",
        m.events, m.fallbacks, m.probe_s
    );
    println!("| k | teacher mass in top k: mean | 5th pct | KL rel. err. per position: mean | whole-loss rel. err. | grad cosine per position: mean | 5th pct | whole-gradient cosine |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut top_k = vec![];
    for (k, f) in KS.iter().zip(m.fid) {
        let (mass, mass05, rel) = (mean(&f.mass), q(&f.mass, 0.05), mean(&f.rel_err));
        let (loss_err, cos, cos05) = (
            (f.sums[0] - f.sums[1]).abs() / f.sums[1],
            mean(&f.cos),
            q(&f.cos, 0.05),
        );
        let whole = f.dots[0] / (f.dots[1] * f.dots[2]).sqrt();
        println!("| {k} | {mass:.4} | {mass05:.4} | {rel:.4} | {loss_err:.4} | {cos:.4} | {cos05:.4} | {whole:.4} |");
        top_k.push(json!({"k": k, "mass_mean": mass, "mass_q05": mass05, "kl_rel_err_mean": rel, "loss_rel_err": loss_err,
            "grad_cos_mean": cos, "grad_cos_q05": cos05, "grad_cos_whole": whole, "exact_kl_mean": f.sums[1] / f.mass.len() as f64}));
    }
    let gap = [
        ("step 1 (base)", Spread::new(m.gaps, 0.0, &GAPS)),
        ("after the steps", Spread::new(m.gaps_after, 0.0, &GAPS)),
    ];
    println!("\nteacher − student log-prob gap on the logged tokens, share of positions with |gap| above:");
    println!("| when | positions | > 0.5 | > 1 | > 2 | > 4 | 5th pct | median | 95th pct |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    gap.iter().for_each(|(name, g)| println!("{}", g.row(name)));
    let eps = lc.trainer.ratio_clip;
    let ratios = [
        (
            "student / behaviour, step 1",
            Spread::new(&ratio(m.s_lp, m.b_lp), 1.0, &[eps]),
        ),
        (
            "policy / behaviour, after the steps",
            Spread::new(&ratio(m.p_lp, m.b_lp), 1.0, &[eps]),
        ),
        (
            "policy / base, after the steps",
            Spread::new(&ratio(m.p_lp, m.s_lp), 1.0, &[eps]),
        ),
    ];
    println!("\nimportance ratio on the logged tokens, share outside [1 − {eps}, 1 + {eps}]:");
    println!("| ratio | positions | outside | 5th pct | median | 95th pct |\n| --- | ---: | ---: | ---: | ---: | ---: |");
    ratios
        .iter()
        .for_each(|(name, r)| println!("{}", r.row(name)));

    let named = |v: &[(&str, Spread)]| {
        v.iter()
            .map(|(n, s)| json!({"name": n, "spread": s}))
            .collect::<Vec<_>>()
    };
    let doc = json!({"events": m.events, "teacher_fallbacks": m.fallbacks, "top_k": top_k, "gap": named(&gap),
        "ratio_clip": eps, "ratio": named(&ratios), "steps": m.steps, "config": {"scenario": sc, "trainer": lc.trainer}});
    if let Some(dir) = std::path::Path::new(out).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&doc)?)?;
    println!("\nwrote {out}");
    Ok(())
}
