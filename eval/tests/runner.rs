//! The runner against an in-process mock OpenAI-compatible server (the model endpoint is
//! outside the system, so a mock is the right double here).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use hindsight_eval::{
    evaluate, run_eval_cli, EvalArgs, EvalError, EvalItem, EvalSet, RunConfig, ScorerKind,
};
use serde_json::{json, Value};

type Behaviour = dyn Fn(&Value, usize) -> Response + Send + Sync;

struct Mock {
    calls: AtomicUsize,
    behaviour: Box<Behaviour>,
    no_log_headers: Mutex<Vec<String>>,
}

async fn chat(
    State(mock): State<Arc<Mock>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let n = mock.calls.fetch_add(1, Ordering::SeqCst);
    if let Some(v) = headers
        .get("x-hindsight-no-log")
        .and_then(|v| v.to_str().ok())
    {
        mock.no_log_headers.lock().unwrap().push(v.to_string());
    }
    (mock.behaviour)(&body, n)
}

async fn spawn_mock(behaviour: Box<Behaviour>) -> (String, Arc<Mock>) {
    let mock = Arc::new(Mock {
        calls: AtomicUsize::new(0),
        behaviour,
        no_log_headers: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state(mock.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/v1"), mock)
}

fn completion(content: &str, model: &str) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
    })
}

fn ok_with_adapter(content: &str, adapter: &str) -> Response {
    (
        [("x-hindsight-adapter", adapter.to_string())],
        Json(completion(content, "base")),
    )
        .into_response()
}

fn last_user(body: &Value) -> String {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn item(id: &str, prompt: &str, expected: Value) -> EvalItem {
    EvalItem {
        id: id.into(),
        messages: vec![json!({"role": "user", "content": prompt})],
        tools: None,
        response_format: None,
        tool_replay: None,
        scorer: ScorerKind::JsonExact,
        expected,
        metadata: None,
    }
}

fn quiet(endpoint: &str, model: &str) -> RunConfig {
    let mut cfg = RunConfig::new(endpoint, model);
    cfg.progress = false;
    cfg
}

#[tokio::test]
async fn scores_a_set_and_records_identity() {
    let (endpoint, mock) = spawn_mock(Box::new(|body, _| {
        let answer = match last_user(body).as_str() {
            "right" => r#"Sure. <final_output>{"dept": "billing", "refund": true}</final_output>"#,
            "half" => r#"<final_output>{"dept": "billing", "refund": "true"}</final_output>"#,
            _ => r#"{"dept": "billing", "refund": true}"#,
        };
        ok_with_adapter(answer, "v7")
    }))
    .await;
    let expected = json!({"dept": "billing", "refund": true});
    let set = EvalSet::from_items(
        "mini",
        vec![
            item("a", "right", expected.clone()),
            item("b", "half", expected.clone()),
            item("c", "bare", expected.clone()),
        ],
    )
    .unwrap();
    let mut cfg = quiet(&endpoint, "m1");
    cfg.seed = 42;
    let report = evaluate(&set, &cfg).await.unwrap();
    assert_eq!(report.items.len(), 3);
    assert!(report.items[0].samples[0].score.passed);
    assert_eq!(report.items[1].field_accuracy, Some(0.5));
    // Bare JSON without response_format is not the requested format.
    assert_eq!(report.metrics.unparseable.get("no_final_output"), Some(&1));
    assert!((report.metrics.exact_match - 1.0 / 3.0).abs() < 1e-12);
    assert!((report.metrics.field_accuracy.unwrap() - 0.5).abs() < 1e-12);
    assert_eq!(report.adapter_versions, vec!["v7".to_string()]);
    assert_eq!(report.set.sha256, set.sha256);
    assert_eq!(report.seed, 42);
    assert_eq!(report.model, "m1");
    assert_eq!(mock.calls.load(Ordering::SeqCst), 3);
    // Eval traffic asks the proxy not to log it.
    assert_eq!(mock.no_log_headers.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn response_format_allows_bare_json_and_falls_back_to_the_model_field() {
    let (endpoint, _mock) = spawn_mock(Box::new(|body, _| {
        assert!(body["response_format"].is_object());
        Json(completion(r#"{"dept": "billing"}"#, "served-model")).into_response()
    }))
    .await;
    let mut it = item("a", "x", json!({"dept": "billing"}));
    it.response_format = Some(json!({"type": "json_object"}));
    let set = EvalSet::from_items("rf", vec![it]).unwrap();
    let report = evaluate(&set, &quiet(&endpoint, "m")).await.unwrap();
    assert_eq!(report.metrics.exact_match, 1.0);
    assert_eq!(report.adapter_versions, vec!["served-model".to_string()]);
}

#[tokio::test]
async fn retries_429_and_503_honouring_retry_after() {
    let (endpoint, mock) = spawn_mock(Box::new(|_, n| match n {
        0 => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", "1")],
            "slow down",
        )
            .into_response(),
        1 => (
            StatusCode::SERVICE_UNAVAILABLE,
            [("retry-after", "0")],
            "busy",
        )
            .into_response(),
        _ => ok_with_adapter(r#"<final_output>{"x": 1}</final_output>"#, "v1"),
    }))
    .await;
    let set = EvalSet::from_items("r", vec![item("a", "x", json!({"x": 1}))]).unwrap();
    let started = Instant::now();
    let report = evaluate(&set, &quiet(&endpoint, "m")).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "Retry-After: 1 was not honoured"
    );
    assert_eq!(mock.calls.load(Ordering::SeqCst), 3);
    assert_eq!(report.metrics.exact_match, 1.0);
    assert_eq!(report.metrics.request_errors, 0);
}

#[tokio::test]
async fn non_retryable_errors_score_zero_and_are_counted() {
    let (endpoint, mock) = spawn_mock(Box::new(|body, _| {
        if last_user(body) == "bad" {
            (StatusCode::BAD_REQUEST, "no").into_response()
        } else {
            ok_with_adapter(r#"<final_output>{"x": 1}</final_output>"#, "v1")
        }
    }))
    .await;
    let set = EvalSet::from_items(
        "e",
        vec![
            item("a", "bad", json!({"x": 1})),
            item("b", "good", json!({"x": 1})),
        ],
    )
    .unwrap();
    let report = evaluate(&set, &quiet(&endpoint, "m")).await.unwrap();
    assert_eq!(
        mock.calls.load(Ordering::SeqCst),
        2,
        "a 400 must not be retried"
    );
    assert_eq!(report.metrics.request_errors, 1);
    assert_eq!(report.metrics.unparseable.get("request_failed"), Some(&1));
    assert!(report.items[0].samples[0]
        .error
        .as_deref()
        .unwrap()
        .contains("400"));
    assert_eq!(report.metrics.exact_match, 0.5);
}

#[tokio::test]
async fn unreachable_endpoint_is_an_error() {
    // Bind then drop to get a port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let set = EvalSet::from_items("u", vec![item("a", "x", json!({"x": 1}))]).unwrap();
    let mut cfg = quiet(&format!("http://127.0.0.1:{port}/v1"), "m");
    cfg.max_retries = 1;
    let err = evaluate(&set, &cfg).await.unwrap_err();
    assert!(matches!(err, EvalError::AllRequestsFailed { .. }), "{err}");
}

#[tokio::test]
async fn samples_give_pass_at_k_and_use_distinct_seeds() {
    // Correct exactly when the request's seed is even: samples 0 and 2 of 4 (seed base 10).
    let (endpoint, _mock) = spawn_mock(Box::new(|body, _| {
        let seed = body["seed"].as_u64().unwrap();
        let x = if seed % 2 == 0 { 1 } else { 2 };
        ok_with_adapter(
            &format!("<final_output>{{\"x\": {x}}}</final_output>"),
            "v1",
        )
    }))
    .await;
    let set = EvalSet::from_items("k", vec![item("a", "x", json!({"x": 1}))]).unwrap();
    let mut cfg = quiet(&endpoint, "m");
    cfg.samples = 4;
    cfg.pass_k = vec![1, 2, 4];
    cfg.seed = 10;
    cfg.temperature = 0.8;
    let report = evaluate(&set, &cfg).await.unwrap();
    let item = &report.items[0];
    assert_eq!(item.correct, 2);
    assert_eq!(item.pass_at_k["pass@1"], 0.5);
    // n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert!((item.pass_at_k["pass@2"] - 5.0 / 6.0).abs() < 1e-12);
    assert_eq!(item.pass_at_k["pass@4"], 1.0);
    assert_eq!(report.metrics.pass_at_k["pass@4"], 1.0);
    let passed: Vec<bool> = item.samples.iter().map(|s| s.score.passed).collect();
    assert_eq!(passed, vec![true, false, true, false]);
}

#[tokio::test]
async fn tool_calls_are_replayed_from_the_item() {
    let (endpoint, _mock) = spawn_mock(Box::new(|body, _| {
        let messages = body["messages"].as_array().unwrap();
        match messages.iter().rev().find(|m| m["role"] == "tool") {
            None => Json(json!({
                "model": "m",
                "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": null,
                    "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "lookup_order", "arguments": "{ \"order_id\" : \"A1\" }"}}]
                }}]
            }))
            .into_response(),
            Some(tool) => {
                let result: Value = serde_json::from_str(tool["content"].as_str().unwrap()).unwrap();
                let total = result["total"].clone();
                ok_with_adapter(&format!("<final_output>{{\"total\": {total}}}</final_output>"), "v1")
            }
        }
    }))
    .await;
    let mut it = item("a", "x", json!({"total": 12.5}));
    it.tools = Some(vec![
        json!({"type": "function", "function": {"name": "lookup_order"}}),
    ]);
    it.tool_replay = Some(
        [(
            "lookup_order".to_string(),
            [(r#"{"order_id":"A1"}"#.to_string(), json!({"total": 12.5}))]
                .into_iter()
                .collect(),
        )]
        .into_iter()
        .collect(),
    );
    let set = EvalSet::from_items("t", vec![it]).unwrap();
    let report = evaluate(&set, &quiet(&endpoint, "m")).await.unwrap();
    assert_eq!(report.metrics.exact_match, 1.0);
    assert_eq!(report.items[0].samples[0].tool_calls, 1);
}

#[tokio::test]
async fn endless_tool_calls_hit_the_turn_limit() {
    let (endpoint, mock) = spawn_mock(Box::new(|_, _| {
        Json(json!({"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "nope", "arguments": "{}"}}]}}]}))
        .into_response()
    }))
    .await;
    let set = EvalSet::from_items("t", vec![item("a", "x", json!({"x": 1}))]).unwrap();
    let mut cfg = quiet(&endpoint, "m");
    cfg.max_tool_turns = 2;
    let report = evaluate(&set, &cfg).await.unwrap();
    assert_eq!(report.metrics.unparseable.get("tool_turn_limit"), Some(&1));
    assert_eq!(mock.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn cli_compares_two_models_and_writes_results() {
    // "good" answers every item right; "bad" only the first.
    let (endpoint, _mock) = spawn_mock(Box::new(|body, _| {
        let good = body["model"] == "good" || last_user(body) == "q0";
        let x = if good { 1 } else { 0 };
        ok_with_adapter(
            &format!("<final_output>{{\"x\": {x}}}</final_output>"),
            body["model"].as_str().unwrap(),
        )
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let set_path = dir.path().join("set.jsonl");
    let lines: Vec<String> = (0..30)
        .map(|i| {
            serde_json::to_string(&item(&format!("i{i}"), &format!("q{i}"), json!({"x": 1})))
                .unwrap()
        })
        .collect();
    std::fs::write(&set_path, lines.join("\n")).unwrap();
    let out = dir.path().join("out/results.json");
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        eval: EvalArgs,
    }
    let cli = Cli::try_parse_from([
        "eval",
        "--set",
        set_path.to_str().unwrap(),
        "--endpoint",
        &endpoint,
        "--compare",
        "bad",
        "good",
        "--no-progress",
        "--out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let report = run_eval_cli(cli.eval).await.unwrap();
    assert_eq!(report.runs.len(), 2);
    let c = report.comparison.as_ref().unwrap();
    assert_eq!((c.a.as_str(), c.b.as_str()), ("bad", "good"));
    assert!((c.exact_match.diff - 29.0 / 30.0).abs() < 1e-12);
    assert!(c.exact_match.ci95[0] > 0.8, "{:?}", c.exact_match.ci95);
    let written: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(written["schema"], "hindsight.eval.report/v1");
    assert_eq!(written["runs"][1]["adapter_versions"][0], "good");
    assert_eq!(
        written["runs"][0]["set"]["sha256"].as_str().unwrap().len(),
        64
    );

    // --model and --compare are exclusive; one of them is required.
    assert!(Cli::try_parse_from(["eval", "--set", "x"]).is_err());
    assert!(
        Cli::try_parse_from(["eval", "--set", "x", "--model", "a", "--compare", "a", "b"]).is_err()
    );
}
