//! Per-request adapters, vLLM's load/unload semantics, hot-swap under load and the bounded queue,
//! on a tiny random model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use hindsight_serve::{app, ServeState};
use serde_json::{json, Value};

fn greedy(model: &str, content: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 10, "logprobs": true})
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t["token_id"].as_u64().unwrap())
        .collect()
}

async fn load(app: &axum::Router, name: &str, path: &std::path::Path, extra: Value) -> Resp {
    let mut body = json!({"lora_name": name, "lora_path": path});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    post(app, "/v1/load_lora_adapter", body).await
}

#[tokio::test]
async fn concurrent_requests_on_two_adapters_match_single_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let (_s, app) = tiny_app();
    let a = write_adapter(tmp.path(), "alpha", 1);
    let b = write_adapter(tmp.path(), "beta", 2);
    assert_eq!(load(&app, "alpha", &a, json!({})).await.status, 200);
    assert_eq!(load(&app, "beta", &b, json!({})).await.status, 200);
    let cases = [
        ("alpha", "hi"),
        ("beta", "hello world"),
        ("tiny", "hey"),
        ("alpha", "a longer prompt here"),
        ("beta", "hi"),
    ];
    // Reference: one request at a time.
    let mut single = Vec::new();
    for (m, p) in cases {
        let r = post(&app, "/v1/chat/completions", greedy(m, p)).await;
        assert_eq!(r.status, 200, "{}", r.text);
        single.push(ids(&r.json()));
    }
    // Adapters really change the output, or the comparison proves nothing.
    assert_ne!(
        single[0], single[4],
        "alpha and beta differ on the same prompt"
    );
    // Concurrently: all admitted into shared batches with per-row adapters.
    for _round in 0..2 {
        let futs = cases.iter().map(|(m, p)| {
            let app = app.clone();
            let body = greedy(m, p);
            async move { post(&app, "/v1/chat/completions", body).await }
        });
        let got = futures::future::join_all(futs).await;
        for (i, r) in got.iter().enumerate() {
            assert_eq!(r.status, 200);
            let v = r.json();
            assert_eq!(ids(&v), single[i], "case {i} ({})", cases[i].0);
            let want = if cases[i].0 == "tiny" {
                "base".to_string()
            } else {
                format!("{}@1", cases[i].0)
            };
            assert_eq!(r.headers["x-hindsight-adapter"], want.as_str());
            assert_eq!(
                v["model"],
                if cases[i].0 == "tiny" {
                    "tiny"
                } else {
                    want.as_str()
                }
            );
        }
    }
}

/// `n > 1` requests on different adapters and prompts, admitted together: each job's prompt is
/// prefilled once and its choices continue copies of that row, so choice i of each must be the
/// single-choice request with seed + i on the same adapter.
#[tokio::test]
async fn choices_of_concurrent_requests_continue_their_own_prompt_and_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let (_s, app) = tiny_app();
    let a = write_adapter(tmp.path(), "alpha", 1);
    assert_eq!(load(&app, "alpha", &a, json!({})).await.status, 200);
    let cases = [
        ("alpha", "hi", 2u64),
        ("tiny", "a longer prompt here", 3),
        ("alpha", "hello world", 1),
        ("tiny", "hey", 2),
    ];
    let sampled = |m: &str, p: &str, n: u64, seed: u64| {
        json!({"model": m, "messages": [{"role": "user", "content": p}], "temperature": 1.0,
               "seed": seed, "n": n, "max_tokens": 8, "logprobs": true})
    };
    let choice_ids = |v: &Value, i: usize| -> Vec<u64> {
        v["choices"][i]["logprobs"]["content"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|t| t["token_id"].as_u64().unwrap())
            .collect()
    };
    let mut single = Vec::new();
    for (m, p, n) in cases {
        let mut choices = Vec::new();
        for i in 0..n {
            let r = post(&app, "/v1/chat/completions", sampled(m, p, 1, 40 + i)).await;
            assert_eq!(r.status, 200, "{}", r.text);
            choices.push(choice_ids(&r.json(), 0));
        }
        single.push(choices);
    }
    for _round in 0..2 {
        let futs = cases.iter().map(|(m, p, n)| {
            let app = app.clone();
            let body = sampled(m, p, *n, 40);
            async move { post(&app, "/v1/chat/completions", body).await }
        });
        let got = futures::future::join_all(futs).await;
        for (c, r) in got.iter().enumerate() {
            assert_eq!(r.status, 200, "{}", r.text);
            let v = r.json();
            for (i, want) in single[c].iter().enumerate() {
                assert_eq!(&choice_ids(&v, i), want, "case {c} choice {i}");
            }
        }
    }
}

#[tokio::test]
async fn load_unload_replace_semantics_and_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let (_s, app) = tiny_app();
    let v1 = write_adapter(tmp.path(), "ad", 1);
    let v2 = write_adapter(tmp.path(), "ad", 2);
    let v3 = write_adapter(tmp.path(), "ad", 3);
    let r = load(&app, "ad", &v1, json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@1");
    let out_v1 = ids(&post(&app, "/v1/chat/completions", greedy("ad", "hi"))
        .await
        .json());

    // Same name without load_inplace: refused, v1 keeps serving.
    let r = load(&app, "ad", &v2, json!({})).await;
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("already been loaded"));
    let r = post(&app, "/v1/chat/completions", greedy("ad", "hi")).await;
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@1");

    // Refusals leave the serving version untouched.
    let other_cfg = {
        let mut c = tiny_config();
        c.hidden_size = 16;
        c.head_dim = 4;
        c
    };
    let wrong_shape = write_adapter_for(tmp.path(), "wrong", 9, &other_cfg);
    let r = load(&app, "ad", &wrong_shape, json!({"load_inplace": true})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shape"),
        "{}",
        r.text
    );
    // One NaN in one matrix would poison every token: refused, naming where it is.
    let poisoned = write_adapter(tmp.path(), "nan", 4);
    {
        use hindsight_model::candle_core::{safetensors, Device, Tensor};
        let file = poisoned.join("adapter_model.safetensors");
        let mut tensors = safetensors::load(&file, &Device::Cpu).unwrap();
        let key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
        let mut values = tensors[key]
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        values[3] = f32::NAN;
        let shape = tensors[key].shape().clone();
        tensors.insert(
            key.into(),
            Tensor::from_vec(values, shape, &Device::Cpu).unwrap(),
        );
        safetensors::save(&tensors, &file).unwrap();
    }
    let r = load(&app, "ad", &poisoned, json!({"load_inplace": true})).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.json()["error"]["param"], "lora_path");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("non-finite weights in layer 1 V"),
        "{}",
        r.text
    );
    let r = load(
        &app,
        "ad",
        &v2,
        json!({"load_inplace": true, "sha256": "00".repeat(32)}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "sha256");
    let r = load(
        &app,
        "ad",
        &tmp.path().join("missing"),
        json!({"load_inplace": true}),
    )
    .await;
    assert_eq!(r.status, 400);
    let r = post(&app, "/v1/load_lora_adapter", json!({"lora_path": v2})).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "lora_name");
    let r = load(&app, "tiny", &v2, json!({})).await;
    assert_eq!(r.status, 400, "the base model's name is reserved");
    let r = post(&app, "/v1/chat/completions", greedy("ad", "hi")).await;
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@1");
    assert_eq!(ids(&r.json()), out_v1);

    // In place with the right checksum: v2 serves new requests; v1 stays reachable pinned.
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(
            std::fs::read(v2.join("adapter_model.safetensors")).unwrap(),
        ))
    };
    let r = load(
        &app,
        "ad",
        &v2,
        json!({"load_inplace": true, "sha256": sha}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@2");
    let r = post(&app, "/v1/chat/completions", greedy("ad", "hi")).await;
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@2");
    assert_ne!(ids(&r.json()), out_v1);
    let r = post(&app, "/v1/chat/completions", greedy("ad@1", "hi")).await;
    assert_eq!(r.headers["x-hindsight-adapter"], "ad@1");
    assert_eq!(ids(&r.json()), out_v1);
    let models = call(&app, "/v1/models", "", &[]).await.json();
    let listed: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(
        listed.contains(&"ad") && listed.contains(&"ad@1") && listed.contains(&"ad@2"),
        "{listed:?}"
    );

    // A third version drops v1 (two kept): pinned v1 is now 404.
    assert_eq!(
        load(&app, "ad", &v3, json!({"load_inplace": true}))
            .await
            .status,
        200
    );
    let r = post(&app, "/v1/chat/completions", greedy("ad@1", "hi")).await;
    assert_eq!(r.status, 404);
    assert_eq!(
        post(&app, "/v1/chat/completions", greedy("ad@2", "hi"))
            .await
            .status,
        200
    );

    // Unload: gone; unloading again is 404.
    let r = post(&app, "/v1/unload_lora_adapter", json!({"lora_name": "ad"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        post(&app, "/v1/chat/completions", greedy("ad", "hi"))
            .await
            .status,
        404
    );
    assert_eq!(
        post(&app, "/v1/unload_lora_adapter", json!({"lora_name": "ad"}))
            .await
            .status,
        404
    );
    // After an unload the name is free again (no load_inplace needed), versions continue from 1.
    assert_eq!(load(&app, "ad", &v1, json!({})).await.status, 200);
}

#[tokio::test]
async fn hot_swap_under_load_fails_nothing_and_new_version_serves_after_load_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let (_s, app) = tiny_app();
    let dirs: Vec<_> = (0..3)
        .map(|i| write_adapter(tmp.path(), "live", 10 + i))
        .collect();
    assert_eq!(load(&app, "live", &dirs[0], json!({})).await.status, 200);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let failures = Arc::new(AtomicUsize::new(0));
    let served = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..4 {
        let (app, stop, failures, served) =
            (app.clone(), stop.clone(), failures.clone(), served.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let body = json!({"model": "live", "messages": [{"role": "user", "content": format!("client {c}")}], "max_tokens": 6, "stream": c % 2 == 0});
                let r = post(&app, "/v1/chat/completions", body).await;
                if r.status != 200 || !r.headers.contains_key("x-hindsight-adapter") {
                    failures.fetch_add(1, Ordering::Relaxed);
                } else {
                    served.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for swap in 1..=12u64 {
        let dir = &dirs[swap as usize % dirs.len()];
        let r = load(&app, "live", dir, json!({"load_inplace": true})).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let tag = format!("live@{}", swap + 1);
        assert_eq!(r.headers["x-hindsight-adapter"], tag.as_str());
        // Any request started after the load returned runs on the new version.
        let r = post(&app, "/v1/chat/completions", json!({"model": "live", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})).await;
        assert_eq!(r.headers["x-hindsight-adapter"], tag.as_str());
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    assert!(served.load(Ordering::Relaxed) >= 4);
}

#[tokio::test]
async fn full_queue_answers_429_with_retry_after_and_never_hangs() {
    let state = ServeState::new(tiny_bundle(), &tiny_config_for(engine(1, 1, 1))).unwrap();
    let app = app(state);
    let futs = (0..12).map(|i| {
        let app = app.clone();
        async move {
            post(&app, "/v1/chat/completions", json!({"model": "tiny", "messages": [{"role": "user", "content": format!("q{i}")}], "max_tokens": 40, "temperature": 0})).await
        }
    });
    let got = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        futures::future::join_all(futs),
    )
    .await
    .expect("requests hung");
    let busy: Vec<_> = got.iter().filter(|r| r.status == 429).collect();
    let ok = got.iter().filter(|r| r.status == 200).count();
    assert!(
        !busy.is_empty(),
        "a queue of 1 must overflow with 12 concurrent requests"
    );
    assert!(ok >= 1);
    assert_eq!(busy.len() + ok, 12);
    for r in busy {
        assert!(
            r.headers["retry-after"]
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
                >= 1
        );
        assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    }
}
