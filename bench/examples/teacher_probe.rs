//! Does the hindsight teacher know better **at the token level**? Self-distillation only moves
//! the student where the teacher's next-token distribution on the logged answer differs from the
//! student's, so this probe measures exactly that on the simulated environment.
//!
//! For `N` training tickets, the logged answer is the base model's typical answer (the correct
//! department, `"priority": "low"`, `"refund": "none"`, which is what the
//! default model answers almost every ticket with); the simulated user's critique of it names
//! the broken rules. At the position of each **wrong** field value, it compares the student
//! (original prompt) with the teacher (prompt plus the critique, for each placement): the
//! probability of the correct value's first token, and whether it is the argmax.
//!
//! ```sh
//! cargo run --release -p hindsight-bench --example teacher_probe -- [N] [rule-and-value|rule]
//! ```
use anyhow::Context;
use hindsight_learner::teacher_prompt::{hindsight_messages, HindsightPlacement};
use hindsight_model::candle_core::{DType, Device, Tensor, D};
use hindsight_model::{encode, AdapterSelection, BatchLayout, ModelBundle};
use hindsight_sim::{critique, messages, resolve, CritiqueStyle, PromptOptions, Rng, Split, World};
use serde_json::{json, Value};

/// Log-softmax of the next-token logits after `text`.
fn next_logprobs(bundle: &ModelBundle, text: &str) -> anyhow::Result<Vec<f32>> {
    let ids = encode(&bundle.tokenizer, text)?;
    let len = ids.len();
    let input = Tensor::from_vec(ids, (1, len), &Device::Cpu)?;
    let logits = bundle
        .model
        .forward(
            &input,
            &BatchLayout::dense(1, len, 0),
            None,
            &AdapterSelection::None,
        )?
        .squeeze(0)?
        .narrow(0, len - 1, 1)?
        .squeeze(0)?;
    let lp = hindsight_model::candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    Ok(lp.to_vec1()?)
}

fn main() -> anyhow::Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20);
    let style = match args.next().as_deref() {
        Some("rule") => CritiqueStyle::Rule,
        _ => CritiqueStyle::RuleAndValue,
    };
    let bundle = ModelBundle::load(
        &hindsight_model::testing::default_model_path()?,
        DType::F32,
        &Device::Cpu,
    )?;
    let template = bundle.chat_template.as_ref().context("chat template")?;
    let world = World::new(0);
    let options = PromptOptions::default();
    let placements = [
        HindsightPlacement::SystemNoAnswer,
        HindsightPlacement::UserNote,
        HindsightPlacement::UserTurn,
    ];
    let mut tally = Tally {
        p_sum: vec![0.0f64; placements.len() + 1],
        hits: vec![0usize; placements.len() + 1],
        positions: 0,
        gaps_right: Vec::new(),
        gaps_wrong: Vec::new(),
    };
    let mut rng = Rng::new(7);
    for ticket in world.tickets(Split::Train, n) {
        let res = resolve(&ticket);
        let d = &res.decision;
        let logged = json!({
            "department": d.department,
            "priority": "low",
            "refund": "none",
        });
        let map = logged.as_object().context("object")?;
        let broken = res.broken_rules(Some(map));
        if broken.is_empty() {
            continue;
        }
        let answer_text = logged.to_string();
        let fb = critique(&mut rng, &ticket, &res, &broken, false, style);
        let msgs: Vec<Value> = messages(&ticket, options);
        let mut contexts = vec![template.render_chat(&msgs, &[])?];
        for p in placements {
            let m = hindsight_messages(p, &msgs, &answer_text, &fb);
            contexts.push(template.render_chat(&m, &[])?);
        }
        // Every field: the wrong ones feed the table, and for all of them the teacher's change
        // of log p(logged value's first token) is recorded by whether the field was right.
        let expected = d.to_json();
        for (field, wrong) in [
            ("department", json!(d.department)),
            ("priority", json!("low")),
            ("refund", json!("none")),
        ] {
            let right = expected[field] == wrong;
            // The prefix ends where the value's first token starts: after the opening quote of
            // a string value (`"priority":"` + `normal`), after the colon otherwise.
            let quote = usize::from(expected[field].is_string());
            let prefix = &answer_text[..answer_text
                .find(&format!("\"{field}\":"))
                .context("field")?
                + field.len()
                + 3
                + quote];
            let plain = |v: &Value| match v {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            let (correct, wrong_text) = (plain(&expected[field]), plain(&wrong));
            // First token of the correct and of the logged value, after the prefix; skipped when
            // the tokenizer merges across the boundary.
            let first = |v: &str| -> anyhow::Result<Option<u32>> {
                let with = encode(&bundle.tokenizer, &format!("{}{prefix}{v}", contexts[0]))?;
                let without = encode(&bundle.tokenizer, &format!("{}{prefix}", contexts[0]))?;
                Ok(
                    (with.len() > without.len() && with[..without.len()] == without[..])
                        .then(|| with[without.len()]),
                )
            };
            if right {
                let Some(w) = first(&wrong_text)? else {
                    continue;
                };
                let s = next_logprobs(&bundle, &format!("{}{prefix}", contexts[0]))?;
                let t = next_logprobs(&bundle, &format!("{}{prefix}", contexts[2]))?;
                tally.gaps_right.push(t[w as usize] - s[w as usize]);
                continue;
            }
            let (Some(c), Some(w)) = (first(&correct)?, first(&wrong_text)?) else {
                eprintln!(
                    "{} {field}: token boundary merges; skipped",
                    ticket.ticket_id
                );
                continue;
            };
            tally.positions += 1;
            for (i, ctx) in contexts.iter().enumerate() {
                let lp = next_logprobs(&bundle, &format!("{ctx}{prefix}"))?;
                tally.p_sum[i] += (lp[c as usize] as f64).exp();
                let argmax = lp
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32);
                if argmax == Some(c) {
                    tally.hits[i] += 1;
                }
                if i == 2 {
                    let s = next_logprobs(&bundle, &format!("{}{prefix}", contexts[0]))?;
                    tally.gaps_wrong.push(lp[w as usize] - s[w as usize]);
                }
                if i == 0 {
                    eprint!(
                        "{} {field}: p(correct {correct}) student {:.3} (p(logged) {:.3})",
                        ticket.ticket_id,
                        (lp[c as usize] as f64).exp(),
                        (lp[w as usize] as f64).exp()
                    );
                } else {
                    eprint!(
                        " | {:?} {:.3}",
                        placements[i - 1],
                        (lp[c as usize] as f64).exp()
                    );
                }
            }
            eprintln!();
        }
    }
    print_results(tally, n, style, &placements);
    Ok(())
}

/// What the probe gathers over the tickets: per prompt (index 0 = the student, then each
/// placement) the sum of p(correct value) and the argmax hits over the wrong-field positions;
/// and the teacher (UserNote) minus student log p of the logged value's first token, by whether
/// the logged value was right: what the experimental edit target thresholds on.
struct Tally {
    p_sum: Vec<f64>,
    hits: Vec<usize>,
    positions: usize,
    gaps_right: Vec<f32>,
    gaps_wrong: Vec<f32>,
}

/// Prints the table of p(correct value) per prompt and the teacher-student gaps.
fn print_results(t: Tally, n: usize, style: CritiqueStyle, placements: &[HindsightPlacement]) {
    println!(
        "\n{} wrong-field positions over {n} train tickets, critique style {style:?}:",
        t.positions
    );
    println!("| prompt | mean p(correct value) | correct value is the argmax |");
    println!("| --- | ---: | ---: |");
    let names = std::iter::once("student (as deployed)".to_string())
        .chain(placements.iter().map(|p| format!("teacher, {p:?}")));
    for (i, name) in names.enumerate() {
        println!(
            "| {name} | {:.3} | {}/{} |",
            t.p_sum[i] / t.positions.max(1) as f64,
            t.hits[i],
            t.positions
        );
    }
    for (name, mut g) in [("right", t.gaps_right), ("wrong", t.gaps_wrong)] {
        g.sort_by(f32::total_cmp);
        let q = |f: f64| {
            g.get(((g.len().max(1) - 1) as f64 * f).round() as usize)
                .copied()
        };
        println!(
            "log p(logged value) teacher(UserNote) - student, {name} fields: n={} min {:?} q25 {:?} median {:?} q75 {:?} max {:?}",
            g.len(), q(0.0), q(0.25), q(0.5), q(0.75), q(1.0)
        );
    }
}
