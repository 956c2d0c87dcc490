//! How good are the targets of the experimental edit (`[learner.trainer.experimental]
//! edit_target = true`), per way of building them, before any training? A few minutes instead
//! of an hour-long learning run. The edit lost every learning comparison
//! (docs/experiments/2026-12-02-edit-control-and-confident-edits.md); this probe is what its
//! knobs are kept for.
//!
//! For `N` training tickets of the simulated environment (single turn, guided JSON, as in the
//! learning-curve bench) the logged answer is the default model's greedy answer with each field
//! replaced, with probability ½, by another value of its enum (traffic is sampled at
//! temperature 0.7, so logged answers vary around the greedy one). The simulated user's
//! critique (rule and value) names every wrong field and no right one. The episode goes through
//! the learner's own example builder and [`Trainer::edit_preview`] (the step's code), for each
//! configuration: the reference the teacher's log-probability of a logged value is compared
//! with (`student`, or the teacher shown a content-free `control` critique) and the contrast α
//! of the teacher's decoding against the control.
//!
//! The trainer runs with margin 0, so the teacher's own answer is decoded whenever any field's
//! shift is negative; the targets at larger margins are derived from the same shifts and
//! answers (a field flagged at margin m takes the teacher's value), as the trainer builds them.
//! Printed per configuration and margin: recall (wrong fields flagged), false alarms (right
//! fields flagged), and the share of target fields and of whole targets that are right, next
//! to the logged answers'. Then, per configuration, how well the teacher's confidence in a
//! target (margin 0) tells right targets from wrong ones: the targets ranked by their joint
//! value log-probability ([`EditPreview::target_logprob`], what the confidence floor of
//! those runs, since removed, filtered on) and by their least likely value, and for the most
//! confident 100/75/50/25% the floor that keeps them and how many of their fields and whole
//! targets are right.
//!
//! ```sh
//! cargo run --release -p hindsight-bench --example edit_probe -- [N] [REF:α,…]
//! # e.g. only the control reference with contrast 1 and the student with none:
//! cargo run --release -p hindsight-bench --example edit_probe -- 24 control:1,student:0
//! ```
use std::sync::Arc;

use anyhow::Context;
use hindsight_feedback::{
    EpisodeContext, EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue,
};
use hindsight_learner::example::{build_example, ExampleConfig, TrainExample};
use hindsight_learner::trainer::{
    EditBaseline, EditPreview, ExperimentalTrainer, TeacherDecoding, Trainer, TrainerConfig,
};
use hindsight_model::candle_core::{DType, Device};
use hindsight_model::grammar::{grammar_vocab, object_value_spans, OJson};
use hindsight_model::{decode, encode, ModelBundle};
use hindsight_sim::{
    critique, messages, resolve, response_format, CritiqueStyle, PromptOptions, Rng, Split, World,
    DEPARTMENTS, PRIORITIES, REFUNDS,
};
use serde_json::{json, Value};

/// One way of building the edit.
struct EditVariant {
    name: String,
    baseline: EditBaseline,
    contrast: f64,
}

/// What one configuration made of one logged answer.
struct Seen {
    /// Per field: the shift and whether the logged value was wrong.
    shifts: Vec<(String, f64, bool)>,
    /// The teacher's own answer (decoded whenever some shift is below 0).
    teacher: Option<String>,
    /// The target the trainer built (margin 0): the edit, else the logged answer.
    target: String,
    /// The teacher's log-probability of each of the target's values.
    confidence: Vec<(String, f64)>,
}

fn episode(msgs: &[Value], answer: &str, fb: &str) -> EpisodeRecord {
    let context = EpisodeContext {
        messages: Value::Array(msgs.to_vec()),
        response_format: Some(response_format()),
        ..Default::default()
    };
    let feedback = FeedbackRecord::new(
        FeedbackTarget::Episode("probe".into()),
        FeedbackValue::Comment(fb.into()),
        0,
    );
    let answer = json!({"role": "assistant", "content": answer});
    EpisodeRecord::turn("probe", context, Some(answer), vec![feedback])
}

/// The JSON value of `field` in `text` as a plain string, if `text` is an object with it.
fn field_of(text: &str, field: &str) -> Option<String> {
    let v: Value = serde_json::from_str(text).ok()?;
    v.get(field)?.as_str().map(str::to_string)
}

/// Whether `text` lacks `field` or has another value there than `expected`.
fn is_wrong(text: &str, field: &str, expected: &Value) -> bool {
    field_of(text, field).as_deref() != expected[field].as_str()
}

fn main() -> anyhow::Result<()> {
    // First, while this is the only thread: it writes the environment.
    hindsight_model::settle_cpu_threads();
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(40);
    let wanted = args
        .next()
        .unwrap_or_else(|| "student:0,control:0,student:1,control:1".into());
    let bundle = ModelBundle::load(
        &hindsight_model::testing::default_model_path()?,
        DType::F32,
        &Device::Cpu,
    )?;
    let end_of_turn = bundle.end_of_turn().context("end of turn token")?;
    let ModelBundle {
        model,
        tokenizer,
        chat_template,
        config,
        ..
    } = bundle;
    let template = chat_template.context("chat template")?;
    let decoding = TeacherDecoding {
        vocab: Arc::new(grammar_vocab(&tokenizer, config.vocab_size)),
        end_of_turn,
        tokenizer: Some(Arc::new(tokenizer.clone())),
    };
    let model = Arc::new(model);
    let variants = parse_variants(&wanted)?;
    let trainers: Vec<Trainer> = variants
        .iter()
        .map(|v| {
            let cfg = TrainerConfig {
                experimental: ExperimentalTrainer {
                    edit_target: true,
                    edit_margin_nats: 0.0,
                    edit_baseline: v.baseline,
                    teacher_contrast: v.contrast,
                },
                ..TrainerConfig::default()
            };
            let mut tr = Trainer::new(model.clone(), cfg, "probe")?;
            tr.set_decoding(decoding.clone());
            Ok(tr)
        })
        .collect::<anyhow::Result<_>>()?;
    let mut seen: Vec<Vec<Seen>> = variants.iter().map(|_| Vec::new()).collect();
    let mut logged_answers: Vec<(String, Value)> = Vec::new();

    let world = World::new(0);
    let options = PromptOptions::default();
    let format = OJson::from(&response_format());
    let mut rng = Rng::new(11);
    let enums: [(&str, &[&str]); 3] = [
        ("department", &DEPARTMENTS),
        ("priority", &PRIORITIES),
        ("refund", &REFUNDS),
    ];
    let started = std::time::Instant::now();
    for ticket in world.tickets(Split::Train, n) {
        let res = resolve(&ticket);
        let expected = res.decision.to_json();
        let msgs = messages(&ticket, options);
        let prompt = encode(&tokenizer, &template.render_chat(&msgs, &[])?)?;
        let Some(greedy) = trainers[0].teacher_greedy(&prompt, Some(&format))? else {
            eprintln!(
                "{}: greedy answer did not finish; skipped",
                ticket.ticket_id
            );
            continue;
        };
        let greedy = decode(&tokenizer, &greedy[..greedy.len() - 1], false)?;
        // The logged answer: the greedy one with each value replaced by another with p ½,
        // keeping the layout.
        let logged = perturb(&greedy, &mut rng, &enums)?;
        let Some(logged_map) = serde_json::from_str::<Value>(&logged)?.as_object().cloned() else {
            continue;
        };
        let broken = res.broken_rules(Some(&logged_map));
        if broken.is_empty() {
            continue;
        }
        let wrong = |text: &str, field: &str| is_wrong(text, field, &expected);
        let fb = critique(
            &mut rng,
            &ticket,
            &res,
            &broken,
            false,
            CritiqueStyle::RuleAndValue,
        );
        let rec = episode(&msgs, &logged, &fb);
        let ex: TrainExample = build_example(
            &rec,
            &tokenizer,
            &template,
            end_of_turn,
            &ExampleConfig::default(),
        )
        .map_err(|r| anyhow::anyhow!("no example: {}", r.as_str()))?;

        logged_answers.push((logged.clone(), expected.clone()));
        eprintln!("{} logged {logged} | {fb}", ticket.ticket_id);
        for (tr, seen) in trainers.iter().zip(&mut seen) {
            let Some(EditPreview {
                shifts,
                teacher,
                edited,
                confidence,
                ..
            }) = tr.edit_preview(&ex)?
            else {
                continue;
            };
            eprintln!(
                "  {:>3.1} {:?}: shifts {shifts:?} teacher {} confidence {confidence:?}",
                tr.config().experimental.teacher_contrast,
                tr.config().experimental.edit_baseline,
                teacher.as_deref().unwrap_or("-"),
            );
            seen.push(Seen {
                shifts: shifts
                    .into_iter()
                    .map(|(k, x)| {
                        let w = wrong(&logged, &k);
                        (k, x, w)
                    })
                    .collect(),
                teacher,
                target: edited.unwrap_or_else(|| logged.clone()),
                confidence,
            });
        }
    }

    println!(
        "\n{} tickets with a critique ({n} asked), {:.0} s",
        logged_answers.len(),
        started.elapsed().as_secs_f64()
    );
    print_edit_table(&variants, &seen, &logged_answers);
    print_confidence_table(&variants, &seen, &logged_answers);
    Ok(())
}

/// The edit variants named in `wanted` (`REF:α,...`, REF `student` or `control`).
fn parse_variants(wanted: &str) -> anyhow::Result<Vec<EditVariant>> {
    wanted
        .split(',')
        .map(|v| {
            let (name, contrast) = v.split_once(':').context("variants are REF:α")?;
            let baseline = match name {
                "student" => EditBaseline::Student,
                "control" => EditBaseline::Control,
                other => anyhow::bail!("unknown reference {other:?} (student or control)"),
            };
            let contrast: f64 = contrast.parse()?;
            Ok(EditVariant {
                name: format!("reference {name}, contrast α {contrast}"),
                baseline,
                contrast,
            })
        })
        .collect()
}

/// `greedy` with each enum value replaced by another of its field's values with p ½, keeping
/// the layout.
fn perturb(greedy: &str, rng: &mut Rng, enums: &[(&str, &[&str]); 3]) -> anyhow::Result<String> {
    let spans = object_value_spans(greedy).context("greedy answer is an object")?;
    let (mut logged, mut at) = (String::new(), 0);
    for (key, span) in &spans {
        let values = enums.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
        let (Some(values), true) = (values, rng.chance(0.5)) else {
            continue;
        };
        let current = greedy[span.clone()].trim_matches('"');
        let others: Vec<&str> = values.iter().copied().filter(|v| *v != current).collect();
        let Some(new) = rng.pick(&others) else {
            continue;
        };
        logged.push_str(&greedy[at..span.start]);
        logged.push_str(&format!("\"{new}\""));
        at = span.end;
    }
    logged.push_str(&greedy[at..]);
    Ok(logged)
}

/// Fields of the decision.
const FIELDS: [&str; 3] = ["department", "priority", "refund"];

/// `a` of `b` in percent (0 when `b` is 0).
fn pct(a: usize, b: usize) -> f64 {
    100.0 * a as f64 / b.max(1) as f64
}

/// How many of the decision's fields an answer text has right.
fn right_fields((text, expected): &(String, Value)) -> usize {
    FIELDS
        .iter()
        .filter(|f| !is_wrong(text, f, expected))
        .count()
}

/// Prints how right the logged answers were and, per variant and margin, how the edit's
/// flags and targets score.
fn print_edit_table(
    variants: &[EditVariant],
    seen: &[Vec<Seen>],
    logged_answers: &[(String, Value)],
) {
    println!(
        "logged answers: {:.0}% of fields right, {:.0}% of answers right",
        pct(
            logged_answers.iter().map(right_fields).sum(),
            3 * logged_answers.len()
        ),
        pct(
            logged_answers
                .iter()
                .filter(|a| right_fields(a) == 3)
                .count(),
            logged_answers.len()
        )
    );
    println!(
        "| edit | margin (nats) | recall | false alarms | target fields right | targets right |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (v, seen) in variants.iter().zip(seen) {
        for margin in [0.0, 0.5, 1.0, 2.0] {
            let (mut hits, mut wrongs, mut alarms, mut rights) = (0, 0, 0, 0);
            let (mut fields_right, mut targets_right) = (0, 0);
            for (s, (logged, expected)) in seen.iter().zip(logged_answers) {
                let mut right = 0;
                for (key, shift, was_wrong) in &s.shifts {
                    let flagged = *shift < -margin;
                    if *was_wrong {
                        wrongs += 1;
                        hits += usize::from(flagged);
                    } else {
                        rights += 1;
                        alarms += usize::from(flagged);
                    }
                    // A flagged field takes the teacher's value when it has one.
                    let teacher_value = s.teacher.as_deref().and_then(|t| field_of(t, key));
                    let value = match (flagged, teacher_value) {
                        (true, Some(v)) => Some(v),
                        _ => field_of(logged, key),
                    };
                    right += usize::from(value.as_deref() == expected[key.as_str()].as_str());
                }
                fields_right += right;
                targets_right += usize::from(right == s.shifts.len());
            }
            println!(
                "| {} | {margin} | {:.0}% | {:.0}% | {:.0}% | {:.0}% |",
                v.name,
                pct(hits, wrongs),
                pct(alarms, rights),
                pct(fields_right, wrongs + rights),
                pct(targets_right, seen.len()),
            );
        }
    }
}

/// Prints, per variant and confidence ranking, how right the most confident targets are.
fn print_confidence_table(
    variants: &[EditVariant],
    seen: &[Vec<Seen>],
    logged_answers: &[(String, Value)],
) {
    println!("\nConfidence of the targets (margin 0): the most confident share of them");
    println!("| edit | ranked by | kept | floor (nats) | target fields right | targets right |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    type Score = fn(&[(String, f64)]) -> f64;
    let rankings: [(&str, Score); 2] = [
        ("joint log p", |c| c.iter().map(|(_, x)| x).sum()),
        ("least likely value", |c| {
            c.iter().map(|(_, x)| *x).fold(0.0, f64::min)
        }),
    ];
    for (v, seen) in variants.iter().zip(seen) {
        for (ranking, score) in rankings {
            let mut scored: Vec<(f64, usize)> = seen
                .iter()
                .zip(logged_answers)
                .map(|(s, (_, expected))| {
                    (
                        score(&s.confidence),
                        right_fields(&(s.target.clone(), expected.clone())),
                    )
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0));
            for share in [1.0, 0.75, 0.5, 0.25] {
                let kept = ((scored.len() as f64 * share).round() as usize).max(1);
                let top = &scored[..kept.min(scored.len())];
                let Some(floor) = top.last().map(|(x, _)| *x) else {
                    continue;
                };
                println!(
                    "| {} | {ranking} | {kept} | {floor:.2} | {:.0}% | {:.0}% |",
                    v.name,
                    pct(top.iter().map(|(_, r)| r).sum(), 3 * top.len()),
                    pct(top.iter().filter(|(_, r)| *r == 3).count(), top.len()),
                );
            }
        }
    }
}
