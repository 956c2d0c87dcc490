//! The dense term's importance ratio on what `hindsight serve` really logs: answers sampled at
//! temperature 0.7 under the simulated tickets' `response_format` grammar, with the behaviour
//! log-probs serve reports for them (those of the tempered distribution renormalised over the
//! tokens the grammar allowed). Before the policy moves, `π(y)/μ(y)` must be 1 on every logged
//! token; compared with the policy's full-vocabulary log-probs at temperature 1 (what
//! `behaviour_logprobs = "raw"` assumes) most tokens fall outside the clip.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/serve.rs"]
mod serve;

use std::path::Path;
use std::sync::Arc;

use hindsight_feedback::{
    Behaviour, EpisodeContext, EpisodeRecord, FeedbackRecord, FeedbackTarget, FeedbackValue,
};
use hindsight_learner::example::{build_example, ExampleConfig, TrainExample};
use hindsight_learner::trainer::{
    BehaviourLogprobs, ObjectiveWeights, TeacherDecoding, Trainer, TrainerConfig,
};
use hindsight_model::candle_core::{DType, Device};
use hindsight_model::grammar::grammar_vocab;
use hindsight_model::{Model, ModelBundle};
use serde_json::{json, Value};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

const TICKETS: [&str; 4] = [
    "My parcel arrived with the screen cracked. I want my money back.",
    "I was charged twice for order ORD-100231, please fix it.",
    "How do I change the delivery address of an order I placed an hour ago?",
    "The blender stopped working after two months. Is it under warranty?",
];

/// One chat completion from serve at temperature 0.7 under the tickets' grammar, as the
/// joiner would log it (request context, answer, behaviour), with a thumb on it.
async fn logged_turn(endpoint: &str, ticket: &str, up: bool) -> EpisodeRecord {
    let messages = json!([
        {"role": "system", "content": "You route customer-support tickets. Answer with the department, priority and refund decision as JSON."},
        {"role": "user", "content": ticket}
    ]);
    let body = json!({
        "model": "base", "messages": messages, "temperature": 0.7, "max_tokens": 48,
        "logprobs": true, "response_format": hindsight_sim::response_format(),
    });
    let resp: Value = reqwest::Client::new()
        .post(format!("{endpoint}/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let choice = &resp["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    let behaviour = Behaviour {
        tokens: content
            .iter()
            .map(|c| c["token"].as_str().unwrap().to_string())
            .collect(),
        token_ids: Some(
            content
                .iter()
                .map(|c| c["token_id"].as_u64().unwrap() as u32)
                .collect(),
        ),
        logprobs: content
            .iter()
            .map(|c| c["logprob"].as_f64().unwrap() as f32)
            .collect(),
    };
    let context = EpisodeContext {
        messages,
        model: Some("base".into()),
        response_format: Some(body["response_format"].clone()),
        temperature: Some(0.7),
        ..Default::default()
    };
    let feedback = vec![FeedbackRecord::new(
        FeedbackTarget::Episode("e".into()),
        FeedbackValue::Thumbs(up),
        0,
    )];
    EpisodeRecord {
        behaviour: Some(behaviour),
        ..EpisodeRecord::turn("e", context, Some(choice["message"].clone()), feedback)
    }
}

/// The share of logged tokens whose ratio falls outside `[1 − ε, 1 + ε]` in the dense term's
/// first step (before any update) with `mode`.
fn clip_fraction(
    bundle: &ModelBundle,
    model: &Arc<Model>,
    examples: &[TrainExample],
    mode: BehaviourLogprobs,
    ratio_clip: f64,
) -> f64 {
    let cfg = TrainerConfig {
        objectives: ObjectiveWeights {
            dense: 1.0,
            distill: 0.0,
            sft: 0.0,
            kto: 0.0,
        },
        behaviour_logprobs: mode,
        ratio_clip,
        kl_penalty: 0.0,
        ..Default::default()
    };
    let mut trainer = Trainer::new(model.clone(), cfg, "ratio").unwrap();
    trainer.set_decoding(TeacherDecoding {
        vocab: Arc::new(grammar_vocab(&bundle.tokenizer, bundle.config.vocab_size)),
        end_of_turn: bundle.tokenizer.token_to_id("<|im_end|>").unwrap(),
        tokenizer: None,
    });
    let report = trainer.step(examples).unwrap();
    assert_eq!(
        report.applied.get("dense"),
        Some(&examples.len()),
        "{report:?}"
    );
    report.clip_fraction.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_importance_ratio_is_one_on_served_tokens_before_the_policy_moves() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(MODEL);
    assert!(
        path.is_file(),
        "{} is missing: run deploy/fetch-model.sh",
        path.display()
    );
    let (endpoint, stop) = serve::start_serve(&path, "base").await;
    let mut records = Vec::new();
    for (i, t) in TICKETS.iter().enumerate() {
        records.push(logged_turn(&endpoint, t, i % 2 == 0).await);
    }
    let _ = stop.send(());

    let bundle = ModelBundle::load(&path, DType::F32, &Device::Cpu).unwrap();
    let template = bundle.chat_template.as_ref().unwrap();
    let end = bundle.tokenizer.token_to_id("<|im_end|>").unwrap();
    let examples: Vec<TrainExample> = records
        .iter()
        .map(|r| {
            build_example(
                r,
                &bundle.tokenizer,
                template,
                end,
                &ExampleConfig::default(),
            )
            .unwrap()
        })
        .collect();
    for ex in &examples {
        assert_eq!(ex.sampling.temperature, 0.7);
        assert!(ex.answer_format.is_some() && ex.behaviour_logprobs.is_some());
    }
    let model = Arc::new(bundle.model.clone());

    // Like with like: every ratio within 0.1% of 1 (serve and learner run the same f32 weights;
    // what remains is the order of floating-point sums).
    let sampled = clip_fraction(
        &bundle,
        &model,
        &examples,
        BehaviourLogprobs::Sampled,
        0.001,
    );
    assert_eq!(
        sampled, 0.0,
        "ratios off 1 by more than 0.1% before any update"
    );
    // The serve's log-probs read as the raw distribution: most ratios outside the default clip.
    let raw = clip_fraction(&bundle, &model, &examples, BehaviourLogprobs::Raw, 0.2);
    assert!(raw > 0.3, "raw clip fraction {raw}");
    println!("clip fraction before any update: sampled (ε 0.001) {sampled}, raw (ε 0.2) {raw:.3}");
}
