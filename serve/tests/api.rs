//! The OpenAI surface on a tiny random model: shapes, streaming, log-probs, errors, guided JSON.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};

fn chat(model: &str, extra: Value) -> Value {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "hello there"}],
                          "temperature": 0, "max_tokens": 12});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn chat_completion_has_openai_shape_and_provenance() {
    let (_s, app) = tiny_app();
    let r = post(&app, "/v1/chat/completions", chat("tiny", json!({}))).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.headers["x-hindsight-adapter"], "base");
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(c["logprobs"].is_null(), "no logprobs unless asked");
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion));
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 5);

    // The behaviour header adds token ids and log-probs without `logprobs: true`.
    let r = call(
        &app,
        "/v1/chat/completions",
        &chat("tiny", json!({"temperature": 0.9, "seed": 4})).to_string(),
        &[("x-hindsight-behaviour", "1")],
    )
    .await;
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for t in content {
        assert!(t["token_id"].as_u64().is_some());
        let lp = t["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0 && lp.is_finite());
    }
}

#[tokio::test]
async fn seeded_sampling_is_reproducible_and_n_gives_several_choices() {
    let (_s, app) = tiny_app();
    let body = chat(
        "tiny",
        json!({"temperature": 1.0, "seed": 11, "n": 3, "logprobs": true, "top_logprobs": 2}),
    );
    let a = post(&app, "/v1/chat/completions", body.clone())
        .await
        .json();
    let b = post(&app, "/v1/chat/completions", body).await.json();
    assert_eq!(a["choices"].as_array().unwrap().len(), 3);
    for i in 0..3 {
        assert_eq!(a["choices"][i]["message"], b["choices"][i]["message"]);
        let ids_a: Vec<u64> = a["choices"][i]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token_id"].as_u64().unwrap())
            .collect();
        assert!(!ids_a.is_empty());
        for t in a["choices"][i]["logprobs"]["content"].as_array().unwrap() {
            let top = t["top_logprobs"].as_array().unwrap();
            assert!(!top.is_empty() && top.len() <= 2);
            // The sampled token's log-prob never exceeds the best alternative's.
            assert!(t["logprob"].as_f64().unwrap() <= top[0]["logprob"].as_f64().unwrap() + 1e-6);
        }
    }
    let ids = |c: &Value| -> Vec<u64> {
        c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["token_id"].as_u64().unwrap())
            .collect()
    };
    let distinct: std::collections::HashSet<Vec<u64>> =
        (0..3).map(|i| ids(&a["choices"][i])).collect();
    assert!(distinct.len() > 1, "choices use different seeds");
    // The choices share one prefill of the prompt: choice i is exactly the single-choice
    // request with seed + i, token for token and log-prob for log-prob.
    for i in 0..3 {
        let single = post(
            &app,
            "/v1/chat/completions",
            chat(
                "tiny",
                json!({"temperature": 1.0, "seed": 11 + i, "logprobs": true, "top_logprobs": 2}),
            ),
        )
        .await
        .json();
        let (shared, alone) = (&a["choices"][i as usize], &single["choices"][0]);
        assert_eq!(ids(shared), ids(alone), "choice {i}");
        for (x, y) in shared["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .zip(alone["logprobs"]["content"].as_array().unwrap())
        {
            let (x, y) = (
                x["logprob"].as_f64().unwrap(),
                y["logprob"].as_f64().unwrap(),
            );
            assert!((x - y).abs() < 1e-4, "choice {i}: {x} vs {y}");
        }
    }
}

#[tokio::test]
async fn stream_matches_non_stream_and_ends_with_done() {
    let (_s, app) = tiny_app();
    let full = post(&app, "/v1/chat/completions", chat("tiny", json!({})))
        .await
        .json();
    let r = post(
        &app,
        "/v1/chat/completions",
        chat(
            "tiny",
            json!({"stream": true, "logprobs": true, "stream_options": {"include_usage": true}}),
        ),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.text);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let mut text = String::new();
    let mut finish = None;
    let mut tokens = 0;
    let mut usage = None;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
        }
        for c in v["choices"].as_array().unwrap() {
            text.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(lp) = c["logprobs"]["content"].as_array() {
                tokens += lp.len();
            }
            if !c["finish_reason"].is_null() {
                finish = Some(c["finish_reason"].clone());
            }
        }
    }
    assert_eq!(
        text,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(finish.unwrap(), full["choices"][0]["finish_reason"]);
    assert_eq!(
        tokens as u64,
        full["usage"]["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        usage.unwrap()["completion_tokens"],
        full["usage"]["completion_tokens"]
    );
}

#[tokio::test]
async fn completions_endpoint_and_models_list() {
    let (_s, app) = tiny_app();
    let r = post(&app, "/v1/completions", json!({"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0, "logprobs": 1})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(
        lp["tokens"].as_array().unwrap().len(),
        lp["token_ids"].as_array().unwrap().len()
    );
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": true}),
    )
    .await;
    assert_eq!(sse_data(&r.text).last().unwrap(), "[DONE]");
    let m = call(&app, "/v1/models", "", &[]).await.json();
    assert_eq!(m["data"][0]["id"], "tiny");
}

#[tokio::test]
async fn client_mistakes_get_openai_errors_never_500() {
    let (_s, app) = tiny_app();
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "body"),
        (json!({"messages": []}).to_string(), 400, "model"),
        (chat("tiny", json!({"messages": []})).to_string(), 400, "messages"),
        (chat("tiny", json!({"messages": [{"content": "x"}]})).to_string(), 400, "messages[0].role"),
        (chat("tiny", json!({"temperature": 9})).to_string(), 400, "temperature"),
        (chat("tiny", json!({"temperature": "hot"})).to_string(), 400, "temperature"),
        (chat("tiny", json!({"max_tokens": 100000})).to_string(), 400, "max_tokens"),
        (chat("tiny", json!({"n": 99})).to_string(), 400, "n"),
        (chat("tiny", json!({"response_format": {"type": "json_schema"}})).to_string(), 400, "response_format"),
        (chat("tiny", json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "tuple"}}}})).to_string(), 400, "response_format"),
        (chat("tiny", json!({"tool_choice": "required"})).to_string(), 400, "tool_choice"),
        (chat("nope", json!({})).to_string(), 404, ""),
        (chat("nope@3", json!({})).to_string(), 404, ""),
    ];
    for (body, status, param) in cases {
        let r = call(&app, "/v1/chat/completions", &body, &[]).await;
        assert_eq!(r.status.as_u16(), status, "{body} -> {}", r.text);
        let v = r.json();
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert!(v["error"]["type"].is_string());
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{body}");
        }
    }
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "tiny", "prompt": ""}),
    )
    .await;
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn guided_json_on_a_random_model_always_parses_with_allowed_enums() {
    let (_s, app) = tiny_app();
    let schema = json!({"type": "object", "properties": {
        "mood": {"type": "string", "enum": ["happy", "sad", "angry"]},
        "score": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
    }, "required": ["mood", "score", "ok", "tags"]});
    for seed in 0..4 {
        let body = chat(
            "tiny",
            json!({
                "temperature": 1.0, "seed": seed, "max_tokens": 200, "logprobs": true,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            }),
        );
        let v = post(&app, "/v1/chat/completions", body).await.json();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let parsed: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(["happy", "sad", "angry"].contains(&parsed["mood"].as_str().unwrap()));
        assert!(parsed["score"].is_i64() || parsed["score"].is_u64());
        assert!(parsed["ok"].is_boolean());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // Provenance is the constrained distribution: forced characters have probability 1.
        let lps: Vec<f64> = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap())
            .collect();
        assert!(lps.iter().all(|l| *l <= 0.0));
        assert!(lps.iter().filter(|l| **l == 0.0).count() >= 5, "{lps:?}");
    }
    // json_object: any object.
    let body = chat(
        "tiny",
        json!({"temperature": 1.0, "seed": 3, "max_tokens": 400, "response_format": {"type": "json_object"}}),
    );
    let v = post(&app, "/v1/chat/completions", body).await.json();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(text).unwrap().is_object(),
            "{text}"
        );
    }
}

#[tokio::test]
async fn forced_tool_call_is_parsed_into_tool_calls() {
    let (_s, app) = tiny_app();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}}}}}]);
    for stream in [false, true] {
        let body = chat(
            "tiny",
            json!({"tools": tools, "tool_choice": "required", "temperature": 0.7, "seed": 1, "max_tokens": 120, "stream": stream}),
        );
        let r = post(&app, "/v1/chat/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let (calls, finish) = if stream {
            let mut calls = None;
            let mut finish = None;
            for d in sse_data(&r.text) {
                if d == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(&d).unwrap();
                let c = &v["choices"][0];
                if let Some(tc) = c["delta"].get("tool_calls") {
                    calls = Some(tc.clone());
                }
                if !c["finish_reason"].is_null() {
                    finish = Some(c["finish_reason"].clone());
                }
            }
            (calls.unwrap(), finish.unwrap())
        } else {
            let v = r.json();
            (
                v["choices"][0]["message"]["tool_calls"].clone(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(finish, "tool_calls");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(["c", "f"].contains(&args["unit"].as_str().unwrap()));
    }
}

#[tokio::test]
async fn stop_strings_cut_the_text_streamed_or_not() {
    let (_s, app) = tiny_app();
    let full = post(
        &app,
        "/v1/chat/completions",
        chat("tiny", json!({"max_tokens": 20})),
    )
    .await
    .json();
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    let stop: String = chars[4..6].iter().collect();
    let want = &text[..text.find(&stop).unwrap()];
    let r = post(
        &app,
        "/v1/chat/completions",
        chat("tiny", json!({"max_tokens": 20, "stop": stop})),
    )
    .await
    .json();
    assert_eq!(r["choices"][0]["message"]["content"], want);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let r = post(
        &app,
        "/v1/chat/completions",
        chat(
            "tiny",
            json!({"max_tokens": 20, "stop": [stop], "stream": true}),
        ),
    )
    .await;
    let mut streamed = String::new();
    for d in sse_data(&r.text) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        streamed.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    assert_eq!(streamed, want);
}
