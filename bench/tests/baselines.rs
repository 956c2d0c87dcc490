//! The baselines against an in-process mock of the model endpoint: every run and placement is
//! measured, and hindsight helps exactly where the critique carries the fix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use hindsight_bench::baselines::{render_table, run_baselines, BaselineConfig, CONFIRMATION};
use hindsight_learner::teacher_prompt::HindsightPlacement;
use hindsight_sim::{CritiqueStyle, Records, Variant};
use serde_json::{json, Value};

/// A "model" that knows the SOP for gold customers only, and gives high priority whenever
/// feedback it is shown says so.
#[derive(Default)]
struct Agent {
    hindsight_seen: AtomicUsize,
}

fn record_after(text: &str, label: &str) -> Value {
    let start = text.find(label).map(|i| i + label.len()).unwrap_or(0);
    let line = text[start..].lines().next().unwrap_or("");
    serde_json::from_str(line.trim()).unwrap_or(Value::Null)
}

async fn agent_chat(State(agent): State<Arc<Agent>>, Json(body): Json<Value>) -> Response {
    let messages = body["messages"].as_array().unwrap();
    let all_text: String = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let with_feedback = all_text.contains("Feedback on") || all_text.contains("# Hindsight");
    if with_feedback {
        agent.hindsight_seen.fetch_add(1, Ordering::SeqCst);
    }
    let user = messages.iter().find(|m| m["role"] == "user").unwrap()["content"]
        .as_str()
        .unwrap();
    let customer = record_after(user, "Customer record: ");
    let priority =
        if customer["tier"] == "gold" || (with_feedback && all_text.contains("high priority")) {
            "high"
        } else {
            "normal"
        };
    let decision = json!({"department": "returns", "priority": priority, "refund": "full"});
    Json(
        json!({"model": "mock-agent", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": decision.to_string()}}]}),
    )
    .into_response()
}

async fn spawn(agent: Arc<Agent>) -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(agent_chat))
        .with_state(agent);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn baselines_run_all_variants() {
    let agent = Arc::new(Agent::default());
    let base = spawn(agent.clone()).await;
    let cfg = BaselineConfig {
        endpoint: format!("{base}/v1"),
        model: "mock".into(),
        api_key: None,
        seed: 3,
        tickets: 20,
        samples: 2,
        temperature: 0.0,
        max_tokens: Some(100),
        concurrency: 4,
        variant: Variant::Single,
        records: Records::Json,
        response_format: true,
        placements: HindsightPlacement::ALL.to_vec(),
        critique_style: CritiqueStyle::Rule,
        reuse: None,
        timeout_ms: 30_000,
        progress: false,
    };
    let report = run_baselines(&cfg).await.unwrap();
    assert_eq!(report.rows.len(), 2 + 4);
    assert_eq!(report.runs.len(), 2 + 4);
    let a = &report.rows[0];
    // The mock agent uses "high priority" feedback, so hindsight helps exactly where the
    // broken rule was a high-priority one; it never hurts.
    for row in &report.rows[2..] {
        assert!(
            row.exact_match >= a.exact_match,
            "{} vs {}",
            row.name,
            a.name
        );
        assert!(row.field_accuracy >= a.field_accuracy);
    }
    // High-value tickets the mock got wrong are fixed by a "high priority" critique.
    assert!(
        report.rows[2..]
            .iter()
            .all(|r| r.field_accuracy > a.field_accuracy),
        "{}",
        render_table(&report)
    );
    assert!(agent.hindsight_seen.load(Ordering::SeqCst) >= 4 * 20 * 2);
    let table = render_table(&report);
    assert!(table.contains("(c) hindsight: user-turn"));
    assert!(table.contains("pass@2"));
    let _ = CONFIRMATION;
}
