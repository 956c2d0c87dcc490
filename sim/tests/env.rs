//! The environment end to end against in-process mocks of the agent endpoint (a model server
//! is outside the system) and of the feedback webhook's HTTP contract. The run through the
//! real proxy into `hindsight.episodes` is wired once proxy and feedback exist.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use hindsight_eval::to_jsonl;
use hindsight_sim::{
    eval_items, resolve, run_env, sign, CritiqueStyle, EnvRunConfig, FeedbackConfig, PromptOptions,
    Split, UserConfig, Variant, World,
};
use serde_json::{json, Value};

const SECRET: &str = "test-secret";

/// An "agent" that knows the SOP for gold customers only: it answers from the order record
/// in the prompt (single-turn) or after calling both tools (multi-turn).
#[derive(Default)]
struct Agent {
    calls: AtomicUsize,
    /// When each chat request arrived.
    call_times: Mutex<Vec<Instant>>,
    episodes: Mutex<Vec<String>>,
    /// Answer episode `n` of `<run>-<n>` after (10 - n) x 50 ms, so the first episodes finish
    /// last (as a server's timing may make them).
    later_first: bool,
}

fn decide(_order: &Value, customer: &Value, text: &str, with_feedback: bool) -> Value {
    let priority =
        if customer["tier"] == "gold" || (with_feedback && text.contains("high priority")) {
            "high"
        } else {
            "normal"
        };
    json!({"department": "returns", "priority": priority, "refund": "full"})
}

fn record_after(text: &str, label: &str) -> Value {
    let start = text.find(label).map(|i| i + label.len()).unwrap_or(0);
    let line = text[start..].lines().next().unwrap_or("");
    serde_json::from_str(line.trim()).unwrap_or(Value::Null)
}

async fn agent_chat(
    State(agent): State<Arc<Agent>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let n = agent.calls.fetch_add(1, Ordering::SeqCst);
    agent.call_times.lock().unwrap().push(Instant::now());
    if let Some(ep) = headers
        .get("x-hindsight-episode")
        .and_then(|v| v.to_str().ok())
    {
        agent.episodes.lock().unwrap().push(ep.to_string());
        if agent.later_first {
            let n: u64 = ep.rsplit('-').next().unwrap().parse().unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(
                10u64.saturating_sub(n) * 50,
            ))
            .await;
        }
    }
    let messages = body["messages"].as_array().unwrap();
    let all_text: String = messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let with_feedback = all_text.contains("Feedback on") || all_text.contains("# Hindsight");
    let reply = |content: String| {
        (
            [("x-hindsight-interaction-id", format!("0190000{n:05}-0000-7000-8000-000000000000"))],
            Json(json!({"model": "mock-agent", "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})),
        )
            .into_response()
    };
    if body["tools"].is_array() {
        // Multi-turn: call both tools (retrying failed ones), then decide from their results.
        let tool_results: Vec<Value> = messages
            .iter()
            .filter(|m| m["role"] == "tool")
            .filter_map(|m| serde_json::from_str(m["content"].as_str().unwrap_or("")).ok())
            .collect();
        let order = tool_results
            .iter()
            .find(|r| r["order_id"].is_string())
            .cloned();
        let customer = tool_results.iter().find(|r| r["tier"].is_string()).cloned();
        match (order, customer) {
            (Some(o), Some(c)) => reply(decide(&o, &c, &all_text, with_feedback).to_string()),
            (o, _) => {
                let user = messages.iter().find(|m| m["role"] == "user").unwrap()["content"]
                    .as_str()
                    .unwrap();
                let words: Vec<&str> = user.split_whitespace().collect();
                let order_id = words
                    .iter()
                    .find(|w| w.starts_with("ORD-"))
                    .unwrap()
                    .trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
                let customer_id = words.iter().find(|w| w.starts_with("C-")).unwrap();
                let (name, args) = if o.is_none() {
                    ("lookup_order", json!({"order_id": order_id}))
                } else {
                    ("lookup_customer", json!({"customer_id": customer_id}))
                };
                Json(
                    json!({"model": "mock-agent", "choices": [{"index": 0, "message": {
                    "role": "assistant", "content": null,
                    "tool_calls": [{"id": format!("call_{n}"), "type": "function",
                        "function": {"name": name, "arguments": args.to_string()}}]}}]}),
                )
                .into_response()
            }
        }
    } else {
        let user = messages.iter().find(|m| m["role"] == "user").unwrap()["content"]
            .as_str()
            .unwrap();
        let order = record_after(user, "Order record: ");
        let customer = record_after(user, "Customer record: ");
        reply(decide(&order, &customer, &all_text, with_feedback).to_string())
    }
}

#[derive(Default)]
struct Webhook {
    batches: Mutex<Vec<Value>>,
    keys: Mutex<Vec<String>>,
    /// When each accepted batch arrived.
    key_times: Mutex<Vec<Instant>>,
    bad_signatures: AtomicUsize,
}

async fn feedback_batch(
    State(hook): State<Arc<Webhook>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ts: u64 = headers["x-hindsight-timestamp"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let sig = headers["x-hindsight-signature"].to_str().unwrap();
    if sig != sign(SECRET, ts, &body) {
        hook.bad_signatures.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::UNAUTHORIZED, "bad signature").into_response();
    }
    hook.keys
        .lock()
        .unwrap()
        .push(headers["idempotency-key"].to_str().unwrap().to_string());
    hook.key_times.lock().unwrap().push(Instant::now());
    let v: Value = serde_json::from_slice(&body).unwrap();
    let n = v["events"].as_array().unwrap().len();
    hook.batches.lock().unwrap().push(v);
    let ids: Vec<String> = (0..n).map(|i| format!("fb-{i}")).collect();
    (StatusCode::ACCEPTED, Json(json!({"feedback_ids": ids}))).into_response()
}

async fn spawn(agent: Arc<Agent>, hook: Arc<Webhook>) -> String {
    let app = Router::new()
        .route("/v1/chat/completions", post(agent_chat))
        .with_state(agent)
        .merge(
            Router::new()
                .route("/hindsight/v1/feedback/batch", post(feedback_batch))
                .with_state(hook),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn run_config(base: &str, variant: Variant, failure_rate: f64) -> EnvRunConfig {
    let mut cfg = EnvRunConfig::new(format!("{base}/v1"), "mock");
    cfg.episodes = 30;
    cfg.rate_per_s = 200.0;
    cfg.concurrency = 8;
    cfg.seed = 5;
    cfg.run_id = "test-run".into();
    cfg.options = PromptOptions {
        variant,
        ..PromptOptions::default()
    };
    cfg.tool_failure_rate = failure_rate;
    cfg.max_turns = 12;
    cfg.feedback = Some(FeedbackConfig {
        endpoint: base.to_string(),
        secret: Some(SECRET.into()),
        delay_ms: 10,
        in_episode_order: false,
    });
    cfg.user = UserConfig {
        noise_rate: 0.0,
        correction_rate: 0.5,
        thanks_rate: 0.0,
        critique_style: CritiqueStyle::Rule,
    };
    cfg
}

#[tokio::test]
async fn run_sends_signed_feedback_for_each_answer() {
    let (agent, hook) = (Arc::new(Agent::default()), Arc::new(Webhook::default()));
    let base = spawn(agent.clone(), hook.clone()).await;
    let summary = run_env(run_config(&base, Variant::Single, 0.0))
        .await
        .unwrap();
    assert_eq!(summary.episodes, 30);
    assert_eq!(summary.failed, 0);
    assert_eq!(hook.bad_signatures.load(Ordering::SeqCst), 0);
    let batches = hook.batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 30);
    assert_eq!(summary.feedback_failures, 0);
    // Feedback targets the interaction id the "proxy" returned, thumbs match correctness,
    // wrong answers carry a critique naming a rule.
    for (o, _) in summary.outcomes.iter().zip(0..) {
        let batch = batches
            .iter()
            .find(|b| b["events"][0]["interaction_id"] == json!(o.interaction_ids.last().unwrap()))
            .expect("feedback for every episode's last interaction");
        let events = batch["events"].as_array().unwrap();
        assert_eq!(events[0]["kind"], "thumbs");
        assert_eq!(events[0]["value"], json!(o.correct));
        if !o.correct {
            assert_eq!(events[1]["kind"], "comment");
            assert!(!events[1]["value"].as_str().unwrap().is_empty());
        }
    }
    // The mock agent ignores every hidden rule but "gold is high": some right, most wrong.
    assert!(summary.exact_match < 0.5, "{}", summary.exact_match);
    assert!(summary
        .outcomes
        .iter()
        .all(|o| o.episode_id.starts_with("test-run-")));
    assert!(agent
        .episodes
        .lock()
        .unwrap()
        .iter()
        .all(|e| e.starts_with("test-run-")));
    let keys = hook.keys.lock().unwrap();
    let unique: std::collections::HashSet<_> = keys.iter().collect();
    assert_eq!(unique.len(), keys.len());
}

#[tokio::test]
async fn feedback_in_episode_order_follows_the_episodes_not_the_answers() {
    // Episodes 0..9 all in flight at once; the first ones are answered last.
    let sent_order = |in_episode_order: bool| async move {
        let agent = Arc::new(Agent {
            later_first: true,
            ..Agent::default()
        });
        let hook = Arc::new(Webhook::default());
        let base = spawn(agent, hook.clone()).await;
        let mut cfg = run_config(&base, Variant::Single, 0.0);
        cfg.episodes = 10;
        cfg.concurrency = 10;
        if let Some(f) = cfg.feedback.as_mut() {
            f.in_episode_order = in_episode_order;
        }
        let summary = run_env(cfg).await.unwrap();
        assert_eq!(summary.feedback_failures, 0);
        // The idempotency key starts with the episode id, `test-run-<n>:`.
        let keys = hook.keys.lock().unwrap().clone();
        keys.iter()
            .map(|k| {
                let episode = k.split(':').next().unwrap();
                episode.rsplit('-').next().unwrap().parse::<u64>().unwrap()
            })
            .collect::<Vec<_>>()
    };
    let in_order = sent_order(true).await;
    assert_eq!(in_order, (0..10).collect::<Vec<_>>());
    // As the answers finish: the server's order, here (close to) the reverse.
    let as_answered = sent_order(false).await;
    assert_eq!(as_answered.len(), 10);
    assert_ne!(as_answered, in_order, "{as_answered:?}");
}

#[tokio::test]
async fn feedback_in_episode_order_goes_out_while_later_episodes_run() {
    // One episode at a time: episode 0's feedback must not wait for the run's last answer, so
    // a learner trains while the traffic goes on.
    let (agent, hook) = (Arc::new(Agent::default()), Arc::new(Webhook::default()));
    let base = spawn(agent.clone(), hook.clone()).await;
    let mut cfg = run_config(&base, Variant::Single, 0.0);
    cfg.episodes = 6;
    cfg.concurrency = 1;
    if let Some(f) = cfg.feedback.as_mut() {
        f.in_episode_order = true;
    }
    let summary = run_env(cfg).await.unwrap();
    assert_eq!(summary.feedback_failures, 0);
    let first_feedback = hook.key_times.lock().unwrap()[0];
    let last_call = *agent.call_times.lock().unwrap().last().unwrap();
    assert!(
        first_feedback < last_call,
        "the first feedback waited for the last episode's request"
    );
}

#[tokio::test]
async fn multi_turn_run_calls_tools_and_survives_injected_failures() {
    let (agent, hook) = (Arc::new(Agent::default()), Arc::new(Webhook::default()));
    let base = spawn(agent.clone(), hook.clone()).await;
    let summary = run_env(run_config(&base, Variant::Multi, 0.3))
        .await
        .unwrap();
    assert_eq!(summary.failed, 0);
    assert!(summary.tool_calls >= 60, "{}", summary.tool_calls);
    assert!(summary.tool_failures > 0);
    // Each episode's answer is the agent's final turn (after its tool calls).
    assert!(summary
        .outcomes
        .iter()
        .all(|o| o.turns >= 3 && o.answer.is_some()));
    assert_eq!(hook.batches.lock().unwrap().len(), 30);
}

#[tokio::test]
async fn the_run_is_deterministic_for_a_seed() {
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let (agent, hook) = (Arc::new(Agent::default()), Arc::new(Webhook::default()));
        let base = spawn(agent, hook.clone()).await;
        let mut cfg = run_config(&base, Variant::Multi, 0.2);
        cfg.user = UserConfig::default();
        let summary = run_env(cfg).await.unwrap();
        // Per episode: ticket, answer, tool failures, thumbs, comment.
        type Key = (String, Option<Value>, u64, Option<bool>, Option<String>);
        let key: Vec<Key> = summary
            .outcomes
            .iter()
            .map(|o| {
                (
                    o.ticket_id.clone(),
                    o.answer.clone(),
                    o.tool_failures,
                    o.reaction.as_ref().map(|r| r.thumbs_up),
                    o.reaction.as_ref().and_then(|r| r.comment.clone()),
                )
            })
            .collect();
        outcomes.push(key);
    }
    assert_eq!(outcomes[0], outcomes[1]);
}

#[test]
fn eval_set_is_deterministic_and_disjoint_from_train() {
    let w = World::new(7);
    let opts = PromptOptions::default();
    let a = to_jsonl(&eval_items(&w, Split::Eval, 50, opts)).unwrap();
    let b = to_jsonl(&eval_items(&World::new(7), Split::Eval, 50, opts)).unwrap();
    assert_eq!(a, b);
    let train = eval_items(&w, Split::Train, 200, opts);
    let eval = eval_items(&w, Split::Eval, 50, opts);
    assert!(eval.iter().all(|e| train.iter().all(|t| t.id != e.id)));
    // Expected objects are the SOP's decisions.
    let tickets = w.tickets(Split::Eval, 50);
    for (item, t) in eval.iter().zip(&tickets) {
        assert_eq!(item.expected, resolve(t).decision.to_json());
        assert!(item.response_format.is_some());
    }
    let multi = eval_items(
        &w,
        Split::Eval,
        5,
        PromptOptions {
            variant: Variant::Multi,
            ..opts
        },
    );
    assert!(multi
        .iter()
        .all(|i| i.tools.is_some() && i.tool_replay.is_some()));
    let rules = eval_items(
        &w,
        Split::Eval,
        1,
        PromptOptions {
            with_rules: true,
            ..opts
        },
    );
    assert!(rules[0].messages[0]["content"]
        .as_str()
        .unwrap()
        .contains("final-sale"));
}
