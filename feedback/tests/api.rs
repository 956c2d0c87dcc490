//! The feedback API against the real broker and Redis: every kind, signatures, idempotent
//! retries, limits, and a property test throwing malformed requests at it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use hindsight_feedback::{FeedbackRecord, FeedbackTarget, FeedbackValue, Topic};
use serde_json::json;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_is_accepted_and_written_to_kafka() {
    let (log, handle, lcfg, _spill) = log().await;
    let app = app(feedback_config(&[]), handle);
    let iid = Uuid::now_v7();
    let events = vec![
        json!({"interaction_id": iid, "kind": "thumbs", "value": false, "rater": "u1", "tags": ["ui"]}),
        json!({"interaction_id": iid, "kind": "score", "metric": "quality", "value": 0.75, "source": "grader"}),
        json!({"interaction_id": iid, "kind": "comment", "value": "too long"}),
        json!({"interaction_id": iid, "kind": "correction", "value": "Paris."}),
        json!({"interaction_id": iid, "kind": "correction", "value": {"content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]}}),
        json!({"episode_id": "ep-1", "kind": "tool_outcome", "value": {"success": false, "detail": "HTTP 404", "tool_call_id": "call_1"}}),
    ];
    let mut expected = Vec::new();
    for ev in &events {
        let a = post(&app, "/hindsight/v1/feedback", ev.to_string(), &[]).await;
        assert_eq!(a.status, 202, "{ev} -> {}", a.json);
        let id = Uuid::parse_str(a.json["feedback_id"].as_str().unwrap()).unwrap();
        expected.push((id, ev.clone()));
    }
    let batch = json!({"events": [
        {"interaction_id": iid, "kind": "thumbs", "value": true},
        {"episode_id": "ep-1", "kind": "comment", "value": "good run"}
    ]});
    let a = post(&app, "/hindsight/v1/feedback/batch", batch.to_string(), &[]).await;
    assert_eq!(a.status, 202, "{}", a.json);
    let ids = a.json["feedback_ids"].as_array().unwrap();
    assert_eq!(ids.len(), 2);
    for (i, id) in ids.iter().enumerate() {
        expected.push((
            Uuid::parse_str(id.as_str().unwrap()).unwrap(),
            batch["events"][i].clone(),
        ));
    }
    let got = read_until(&lcfg, Topic::Feedback, |r| r.len() >= expected.len()).await;
    let got = by_id(&got);
    for (id, ev) in &expected {
        let rec: FeedbackRecord = serde_json::from_value(got[id].clone()).unwrap();
        assert_eq!(rec.feedback_id, *id);
        assert_eq!(rec.value.kind(), ev["kind"].as_str().unwrap());
        match (&rec.target, ev.get("interaction_id")) {
            (FeedbackTarget::Interaction(t), Some(_)) => assert_eq!(*t, iid),
            (FeedbackTarget::Episode(e), None) => assert_eq!(e, "ep-1"),
            other => panic!("wrong target {other:?}"),
        }
        if let FeedbackValue::Score(x) = rec.value {
            assert_eq!(x, 0.75);
            assert_eq!(rec.metric.as_deref(), Some("quality"));
        }
    }
    log.shutdown(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signatures_valid_rotated_wrong_stale_tampered_missing() {
    let (log, handle, _lcfg, _spill) = log().await;
    // "new" is the current secret, "old" still active during the rotation.
    let app = app(feedback_config(&["new-secret", "old-secret"]), handle);
    let body =
        json!({"interaction_id": Uuid::now_v7(), "kind": "thumbs", "value": true}).to_string();
    let now = now_s();
    let ok = post(
        &app,
        "/hindsight/v1/feedback",
        body.clone(),
        &signed("new-secret", body.as_bytes(), now),
    )
    .await;
    assert_eq!(ok.status, 202, "{}", ok.json);
    let rotated = post(
        &app,
        "/hindsight/v1/feedback",
        body.clone(),
        &signed("old-secret", body.as_bytes(), now),
    )
    .await;
    assert_eq!(rotated.status, 202, "{}", rotated.json);
    // Several v1= values: one bad, one good.
    let mut multi = signed("new-secret", body.as_bytes(), now);
    multi[1].1 = format!("v1={},{}", "ab".repeat(32), multi[1].1);
    assert_eq!(
        post(&app, "/hindsight/v1/feedback", body.clone(), &multi)
            .await
            .status,
        202
    );

    let wrong = post(
        &app,
        "/hindsight/v1/feedback",
        body.clone(),
        &signed("guess", body.as_bytes(), now),
    )
    .await;
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json["error"]["param"], "x-hindsight-signature");
    let stale = post(
        &app,
        "/hindsight/v1/feedback",
        body.clone(),
        &signed("new-secret", body.as_bytes(), now - 301),
    )
    .await;
    assert_eq!(stale.status, 401);
    assert_eq!(stale.json["error"]["param"], "x-hindsight-timestamp");
    let future = post(
        &app,
        "/hindsight/v1/feedback",
        body.clone(),
        &signed("new-secret", body.as_bytes(), now + 301),
    )
    .await;
    assert_eq!(future.status, 401);
    let tampered_body = body.replace("true", "false");
    let tampered = post(
        &app,
        "/hindsight/v1/feedback",
        tampered_body,
        &signed("new-secret", body.as_bytes(), now),
    )
    .await;
    assert_eq!(tampered.status, 401);
    assert_eq!(tampered.json["error"]["param"], "x-hindsight-signature");
    let missing = post(&app, "/hindsight/v1/feedback", body.clone(), &[]).await;
    assert_eq!(missing.status, 401);
    assert!(missing.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("missing"));
    // The timestamp is part of what is signed.
    let mut moved = signed("new-secret", body.as_bytes(), now);
    moved[0].1 = (now - 1).to_string();
    assert_eq!(
        post(&app, "/hindsight/v1/feedback", body.clone(), &moved)
            .await
            .status,
        401
    );
    log.shutdown(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_retry_is_accepted_once_and_answered_the_same() {
    let (log, handle, lcfg, _spill) = log().await;
    let app = app(feedback_config(&[]), handle);
    let iid = Uuid::now_v7();
    let body = json!({"interaction_id": iid, "kind": "score", "metric": "quality", "value": 1})
        .to_string();
    let key = vec![("idempotency-key", unique("key"))];
    let first = post(&app, "/hindsight/v1/feedback", body.clone(), &key).await;
    let second = post(&app, "/hindsight/v1/feedback", body.clone(), &key).await;
    assert_eq!(first.status, 202);
    assert_eq!(second.status, first.status);
    assert_eq!(second.json, first.json, "same answer both times");
    assert_eq!(second.headers.get("idempotent-replayed").unwrap(), "true");
    // Same key, different body: refused, naming the header.
    let other = json!({"interaction_id": iid, "kind": "thumbs", "value": true}).to_string();
    let clash = post(&app, "/hindsight/v1/feedback", other, &key).await;
    assert_eq!(clash.status, 422);
    assert_eq!(clash.json["error"]["param"], "Idempotency-Key");
    // A sentinel written after the retries: once it arrives, everything before it has too.
    let sentinel = post(
        &app,
        "/hindsight/v1/feedback",
        json!({"interaction_id": iid, "kind": "comment", "value": "sentinel"}).to_string(),
        &[],
    )
    .await;
    let sentinel_id = Uuid::parse_str(sentinel.json["feedback_id"].as_str().unwrap()).unwrap();
    let got = read_until(&lcfg, Topic::Feedback, |r| {
        r.iter().any(|(id, _, _)| *id == sentinel_id)
    })
    .await;
    let scores = got.iter().filter(|(_, _, v)| v["kind"] == "score").count();
    assert_eq!(scores, 1, "the retried webhook is written once");
    let first_id = Uuid::parse_str(first.json["feedback_id"].as_str().unwrap()).unwrap();
    assert!(got.iter().any(|(id, _, _)| *id == first_id));
    log.shutdown(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_answer_4xx_naming_field_and_reason() {
    let (log, handle, _lcfg, _spill) = log().await;
    let app = app(feedback_config(&[]), handle);
    let iid = Uuid::now_v7();
    let huge = json!({"interaction_id": iid, "kind": "comment", "value": "x".repeat(70 * 1024)})
        .to_string();
    let a = post(&app, "/hindsight/v1/feedback", huge, &[]).await;
    assert_eq!(a.status, 413);
    assert_eq!(a.json["error"]["param"], "body");
    let long =
        json!({"interaction_id": iid, "kind": "comment", "value": "x".repeat(20_000)}).to_string();
    let a = post(&app, "/hindsight/v1/feedback", long, &[]).await;
    assert_eq!(a.status, 422);
    assert_eq!(a.json["error"]["param"], "value");
    assert!(a.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("longer than"));
    let events: Vec<_> = (0..11)
        .map(|_| json!({"interaction_id": iid, "kind": "thumbs", "value": true}))
        .collect();
    let a = post(
        &app,
        "/hindsight/v1/feedback/batch",
        json!({"events": events}).to_string(),
        &[],
    )
    .await;
    assert_eq!(a.status, 422);
    assert_eq!(a.json["error"]["param"], "events");
    let a = post(
        &app,
        "/hindsight/v1/feedback/batch",
        json!({"events": [{"interaction_id": iid, "kind": "thumbs", "value": true}, {"interaction_id": iid, "kind": "score", "metric": "quality", "value": 7}]}).to_string(),
        &[],
    )
    .await;
    assert_eq!(a.status, 422);
    assert_eq!(a.json["error"]["param"], "events[1].value");
    assert!(a.json["error"]["message"]
        .as_str()
        .unwrap()
        .contains("[0, 1]"));
    let a = post(&app, "/hindsight/v1/feedback", "{not json", &[]).await;
    assert_eq!(a.status, 400);
    assert_eq!(a.json["error"]["param"], "body");
    log.shutdown(Duration::from_secs(10)).await;
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    struct Env {
        rt: tokio::runtime::Runtime,
        app: axum::Router,
        signed_app: axum::Router,
    }

    fn env() -> &'static Env {
        static ENV: OnceLock<Env> = OnceLock::new();
        ENV.get_or_init(|| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let (app, signed_app) = rt.block_on(async {
                let (log, handle, _cfg, spill) = log().await;
                // Keep the log and its spill alive for the whole test binary.
                std::mem::forget(log);
                std::mem::forget(spill);
                (
                    app(feedback_config(&[]), handle.clone()),
                    app(feedback_config(&["s3cret"]), handle),
                )
            });
            Env {
                rt,
                app,
                signed_app,
            }
        })
    }

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(|f| serde_json::Number::from_f64(f)
                .map_or(serde_json::Value::Null, serde_json::Value::Number)),
            ".{0,40}".prop_map(serde_json::Value::from),
            Just(serde_json::Value::from(Uuid::now_v7().to_string())),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map(
                    prop_oneof![
                        Just("interaction_id".to_string()),
                        Just("episode_id".to_string()),
                        Just("kind".to_string()),
                        Just("value".to_string()),
                        Just("metric".to_string()),
                        Just("tags".to_string()),
                        Just("retracts".to_string()),
                        Just("events".to_string()),
                        Just("success".to_string()),
                        Just("content".to_string()),
                        Just("tool_calls".to_string()),
                        "[a-z_]{1,10}",
                    ],
                    inner,
                    0..6,
                )
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn kind() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("thumbs".to_string()),
            Just("score".to_string()),
            Just("comment".to_string()),
            Just("correction".to_string()),
            Just("tool_outcome".to_string()),
            Just("retraction".to_string()),
            ".{0,12}",
        ]
    }

    /// Near-valid events with one part replaced by arbitrary JSON.
    fn event() -> impl Strategy<Value = serde_json::Value> {
        (
            kind(),
            json_value(),
            json_value(),
            proptest::option::of(json_value()),
        )
            .prop_map(|(k, v, t, extra)| {
                let mut e =
                    json!({"interaction_id": Uuid::now_v7(), "kind": k, "value": v, "tags": t});
                if let Some(x) = extra {
                    e["metric"] = x;
                }
                e
            })
    }

    fn body() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..300),
            json_value().prop_map(|v| v.to_string().into_bytes()),
            event().prop_map(|v| v.to_string().into_bytes()),
            prop::collection::vec(event(), 0..4)
                .prop_map(|e| json!({"events": e}).to_string().into_bytes()),
        ]
    }

    fn header_pair() -> impl Strategy<Value = (String, Vec<u8>)> {
        (
            prop_oneof![
                Just("x-hindsight-timestamp".to_string()),
                Just("x-hindsight-signature".to_string()),
                Just("idempotency-key".to_string()),
                Just("content-type".to_string()),
                Just("content-length".to_string()),
                "x-[a-z]{1,8}",
            ],
            prop::collection::vec(prop_oneof![32u8..127, any::<u8>()], 0..80),
        )
    }

    fn send(
        app: &axum::Router,
        path: &str,
        body: Vec<u8>,
        headers: Vec<(String, Vec<u8>)>,
    ) -> (u16, serde_json::Value) {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let mut req = http::Request::post(path);
        for (k, v) in headers {
            if let Ok(v) = http::HeaderValue::from_bytes(&v) {
                req = req.header(k, v);
            }
        }
        let Ok(req) = req.body(axum::body::Body::from(body)) else {
            return (
                400,
                json!({"error": {"param": "test", "message": "unbuildable"}}),
            );
        };
        env().rt.block_on(async {
            let resp = app.clone().oneshot(req).await.unwrap();
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
            )
        })
    }

    fn check(status: u16, json: &serde_json::Value) -> Result<(), TestCaseError> {
        prop_assert!(
            status == 202 || (400..500).contains(&status),
            "status {status}: {json}"
        );
        if status != 202 {
            prop_assert!(json["error"]["param"].is_string(), "no param: {json}");
            prop_assert!(json["error"]["message"].is_string(), "no message: {json}");
        }
        Ok(())
    }

    #[test]
    fn malformed_bodies_and_headers_get_only_4xx_and_the_server_stays_alive() {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 3000,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let strategy = (
            body(),
            prop::collection::vec(header_pair(), 0..4),
            any::<bool>(),
            any::<bool>(),
        );
        runner
            .run(&strategy, |(body, headers, batch, signed)| {
                let path = if batch {
                    "/hindsight/v1/feedback/batch"
                } else {
                    "/hindsight/v1/feedback"
                };
                let app = if signed {
                    &env().signed_app
                } else {
                    &env().app
                };
                let (status, json) = send(app, path, body, headers);
                check(status, &json)
            })
            .unwrap();
        // Afterwards the same router still serves over a real socket.
        let e = env();
        let app = e.app.clone();
        e.rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
            let client = reqwest::Client::new();
            let mut seen = HashSet::new();
            for i in 0..50 {
                let r = client
                    .post(format!("http://{addr}/hindsight/v1/feedback"))
                    .header("content-type", "application/json")
                    .body(if i % 2 == 0 {
                        "\u{0}garbage".to_string()
                    } else {
                        json!({"interaction_id": Uuid::now_v7(), "kind": "thumbs", "value": true})
                            .to_string()
                    })
                    .send()
                    .await
                    .unwrap();
                seen.insert(r.status().as_u16());
            }
            assert_eq!(seen, HashSet::from([400, 202]));
        });
    }
}

/// The example senders in examples/webhook sign the way the server verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_senders_are_accepted() {
    let (log, handle, lcfg, _spill) = log().await;
    let app = app(feedback_config(&["example-secret"]), handle);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/webhook");
    let iid = Uuid::now_v7();
    let mut ids = Vec::new();
    for (prog, script, secret) in [
        ("bash", "send.sh", "example-secret"),
        ("python3", "send.py", "example-secret"),
        ("bash", "send.sh", "wrong"),
    ] {
        let event =
            json!({"interaction_id": iid, "kind": "comment", "value": format!("from {script}")})
                .to_string();
        let out = tokio::process::Command::new(prog)
            .arg(dir.join(script))
            .arg(&event)
            .env("HINDSIGHT_URL", &url)
            .env("HINDSIGHT_SECRET", secret)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let mut lines = stdout.lines();
        let answer: serde_json::Value =
            serde_json::from_str(lines.next().unwrap_or("null")).unwrap();
        let status = lines.next().unwrap_or("");
        if secret == "wrong" {
            assert_eq!(status, "401", "{stdout}");
        } else {
            assert_eq!(
                status,
                "202",
                "{script}: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            );
            ids.push(Uuid::parse_str(answer["feedback_id"].as_str().unwrap()).unwrap());
        }
    }
    let got = read_until(&lcfg, Topic::Feedback, |r| {
        ids.iter().all(|id| r.iter().any(|(g, _, _)| g == id))
    })
    .await;
    assert!(got.len() >= 2);
    log.shutdown(Duration::from_secs(10)).await;
}
