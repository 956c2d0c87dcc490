//! The real default model (SmolLM2-135M-Instruct Q4_1): guided JSON with enums always parses,
//! the official `openai` Python client works against `run_serve` on a real socket, and a given
//! answer is scored with the log-probs it was generated with.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::OnceLock;

use common::*;
use hindsight_model::testing::default_model_path;
use hindsight_serve::{app, run_serve, ServeArgs, ServeState};
use serde_json::{json, Value};

fn real_args() -> ServeArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let model = default_model_path().unwrap();
    Cli::parse_from([
        "x",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ])
    .serve
}

fn real_state() -> ServeState {
    static STATE: OnceLock<ServeState> = OnceLock::new();
    STATE
        .get_or_init(|| ServeState::load(&real_args().load().unwrap()).unwrap())
        .clone()
}

#[tokio::test]
async fn json_schema_with_enums_always_parses_on_the_real_model() {
    let app = app(real_state());
    let schema = r#"{"type": "object", "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "urgency": {"enum": ["low", "medium", "high"]},
        "summary": {"type": "string", "maxLength": 60},
        "needs_refund": {"type": "boolean"}
    }, "required": ["sentiment", "urgency", "summary", "needs_refund"]}"#;
    let prompts = [
        "My order arrived broken and nobody answers my emails. I want my money back now!",
        "Thanks, the new app update is great.",
        "What are your opening hours on Sunday?",
    ];
    // Six requests at once: they share batches in the worker.
    let mut reqs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        for seed in [1u64, 2] {
            let temperature = if seed == 1 { 0.0 } else { 0.8 };
            // Raw JSON text so the schema's property order survives (json! sorts keys).
            let body = format!(
                r#"{{"model": "SmolLM2-135M-Instruct.Q4_1",
                    "messages": [{{"role": "system", "content": "Classify the customer message. Answer in JSON."}},
                                 {{"role": "user", "content": {}}}],
                    "temperature": {temperature}, "seed": {}, "max_tokens": 120, "logprobs": true,
                    "response_format": {{"type": "json_schema", "json_schema": {{"name": "ticket", "schema": {schema}}}}}}}"#,
                json!(p),
                seed + i as u64
            );
            let app = app.clone();
            reqs.push(async move {
                (
                    temperature,
                    call(&app, "/v1/chat/completions", &body, &[]).await,
                )
            });
        }
    }
    let t0 = std::time::Instant::now();
    let results = futures::future::join_all(reqs).await;
    eprintln!("6 guided requests in {:.1}s", t0.elapsed().as_secs_f64());
    for (temperature, r) in &results {
        assert_eq!(r.status, 200, "{}", r.text);
        let v = r.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        eprintln!(
            "T={temperature} {} tokens: {text}",
            v["usage"]["completion_tokens"]
        );
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(
            ["positive", "negative", "neutral"].contains(&parsed["sentiment"].as_str().unwrap()),
            "{text}"
        );
        assert!(
            ["low", "medium", "high"].contains(&parsed["urgency"].as_str().unwrap()),
            "{text}"
        );
        assert!(parsed["summary"].as_str().unwrap().chars().count() <= 60);
        assert!(parsed["needs_refund"].is_boolean());
        // Properties come in the order the schema lists them.
        assert!(text.starts_with("{\"sentiment\": "), "{text}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    assert_eq!(results.len(), 6);
}

#[tokio::test]
async fn openai_python_client_against_a_real_socket() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    // The test setup installs the official client when it is missing.
    let have = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .unwrap();
    if !have.success() {
        let st = std::process::Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "openai"])
            .status()
            .unwrap();
        assert!(st.success(), "pip install openai failed");
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run_serve(real_args().load().unwrap(), listener, async {
        let _ = rx.await;
    }));
    // Wait until the model is loaded and serving.
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        if let Ok(r) = client.get(format!("http://{addr}/v1/models")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "server did not come up"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let out = tokio::process::Command::new(&python)
        .arg(script)
        .env("OPENAI_BASE_URL", format!("http://{addr}/v1"))
        .env("OPENAI_API_KEY", "unused")
        .env("HINDSIGHT_MODEL_NAME", "SmolLM2-135M-Instruct.Q4_1")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("ALL OK"), "{stdout}");
    eprintln!("{stdout}");
    let _ = tx.send(());
    server.await.unwrap().unwrap();
}

/// Scoring a given answer (vLLM's `continue_final_message` with `prompt_logprobs`, what the eval
/// gate's log-prob drift check sends): every prompt token after the first is scored, the
/// answer's tokens get the log-probs they were sampled with at temperature 1, and a greedy
/// answer is the most likely token at every position.
#[tokio::test]
async fn a_given_answer_scores_the_log_probs_it_was_generated_with() {
    let app = app(real_state());
    let model = "SmolLM2-135M-Instruct.Q4_1";
    let question = json!([{"role": "user", "content": "Name three colours of the rainbow."}]);
    for (temperature, top) in [(1.0, 0), (0.0, 2)] {
        let r = post(
            &app,
            "/v1/chat/completions",
            json!({"model": model, "messages": question, "temperature": temperature,
                   "seed": 7, "max_tokens": 12, "logprobs": true}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let v: Value = serde_json::from_str(&r.text).unwrap();
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
        let sampled: Vec<(String, f64)> = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["token_id"].to_string(), e["logprob"].as_f64().unwrap()))
            .collect();
        let asked = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let mut messages = question.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": answer}));
        let r = post(
            &app,
            "/v1/chat/completions",
            json!({"model": model, "messages": messages, "continue_final_message": true,
                   "add_generation_prompt": false, "prompt_logprobs": top, "max_tokens": 1,
                   "temperature": 0}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let v: Value = serde_json::from_str(&r.text).unwrap();
        let scored = v["prompt_logprobs"].as_array().unwrap();
        assert_eq!(
            scored.len(),
            v["usage"]["prompt_tokens"].as_u64().unwrap() as usize
        );
        assert!(scored[0].is_null());
        let answer_entries = &scored[asked..];
        eprintln!("T={temperature}: {answer:?}, {} tokens", sampled.len());
        assert_eq!(answer_entries.len(), sampled.len(), "{answer:?}");
        let mut worst: f64 = 0.0;
        for (entry, (id, lp)) in answer_entries.iter().zip(&sampled) {
            let own = &entry[id.as_str()];
            // The token itself and the `top` best, which may include it.
            let keys = entry.as_object().unwrap().len();
            let rank = own["rank"].as_u64().unwrap() as usize;
            assert!(keys == top + 1 || (keys == top && rank <= top), "{entry}");
            if temperature == 0.0 {
                assert_eq!(own["rank"], 1, "a greedy token is the most likely: {entry}");
            } else {
                let got = own["logprob"].as_f64().unwrap();
                worst = worst.max((got - lp).abs());
                assert!(
                    (got - lp).abs() < 1e-3,
                    "scored {got}, sampled with {lp}: {entry}"
                );
            }
        }
        eprintln!("largest |scored - sampled| log-prob: {worst:.5}");
    }
    // Bad combinations name the field.
    for (body, field) in [
        (
            json!({"model": model, "messages": question, "continue_final_message": true}),
            "messages[0].role",
        ),
        (
            json!({"model": model, "messages": question, "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            json!({"model": model, "messages": question, "prompt_logprobs": 21}),
            "prompt_logprobs",
        ),
        (
            json!({"model": model, "messages": question, "prompt_logprobs": 0, "stream": true}),
            "prompt_logprobs",
        ),
    ] {
        let r = post(&app, "/v1/chat/completions", body).await;
        assert_eq!(r.status, 400, "{}", r.text);
        assert!(r.text.contains(field), "{field}: {}", r.text);
    }
}
