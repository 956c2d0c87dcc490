//! The environment end to end through the REAL proxy, feedback webhook, Kafka broker, Redis and
//! joiner: the simulated user's signed feedback must land joined to the right answer in
//! `hindsight.episodes`. Only the model endpoint is a mock (it is outside the system).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use hindsight_feedback::{JoinerConfig, LogConfig, Secret, Topic, TopicReader};
use hindsight_proxy::{Extensions, RawConfig};
use hindsight_sim::{
    run_env, CritiqueStyle, EnvRunConfig, FeedbackConfig, PromptOptions, UserConfig,
};
use serde_json::{json, Value};
use tokio::sync::oneshot;

const SECRET: &str = "e2e-secret";

fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn unique(what: &str) -> String {
    format!("test-{what}-{}", uuid::Uuid::now_v7().simple())
}

/// An agent that always routes to returns with a full refund at normal priority: right on
/// some tickets, wrong (hidden rules) on most — both kinds of feedback occur.
async fn agent(_headers: HeaderMap, Json(_body): Json<Value>) -> Response {
    let decision = json!({"department": "returns", "priority": "normal", "refund": "full"});
    Json(json!({
        "id": "chatcmpl-e2e", "object": "chat.completion", "created": 1_700_000_000, "model": "mock-agent",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": decision.to_string()}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    }))
    .into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simulated_feedback_through_the_proxy_lands_joined_in_episodes() {
    // Model endpoint (mock).
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            upstream,
            Router::new().route("/v1/chat/completions", post(agent)),
        )
        .await
        .unwrap()
    });

    // Real proxy with the feedback API, on fresh topics and Redis keys.
    let spill = tempfile::tempdir().unwrap();
    let mut raw = RawConfig::default();
    raw.proxy.upstream_url = format!("http://{upstream_addr}");
    raw.proxy.listen_addr = "127.0.0.1:0".into();
    raw.proxy.admin_addr = "127.0.0.1:0".into();
    raw.log = LogConfig {
        brokers: brokers(),
        topic_prefix: unique("env"),
        spill_dir: spill.path().to_path_buf(),
        ..LogConfig::default()
    };
    raw.feedback.redis_url = redis_url();
    raw.feedback.redis_key_prefix = format!("{}:", unique("idem"));
    raw.feedback.signing.secrets = vec![Secret::new(SECRET)];
    let config = raw.validate().unwrap();
    let log_config = config.log.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_addr = listener.local_addr().unwrap();
    let (stop_proxy, proxy_stopped) = oneshot::channel::<()>();
    let proxy = tokio::spawn(async move {
        hindsight_proxy::run(config, listener, admin, Extensions::default(), async {
            let _ = proxy_stopped.await;
        })
        .await
        .unwrap()
    });

    // Real joiner on the same topics.
    let joiner_cfg = JoinerConfig {
        group_id: unique("joiner"),
        redis_url: redis_url(),
        redis_key_prefix: format!("{}:", unique("join")),
        ..JoinerConfig::default()
    }
    .validate()
    .unwrap();
    let (stop_joiner, joiner_stopped) = oneshot::channel::<()>();
    let joiner_log = log_config.clone();
    let joiner = tokio::spawn(async move {
        hindsight_feedback::run_joiner(joiner_cfg, joiner_log, async {
            let _ = joiner_stopped.await;
        })
        .await
        .unwrap()
    });

    // The environment: 12 episodes through the proxy, feedback signed to the proxy's webhook.
    let mut cfg = EnvRunConfig::new(format!("http://{proxy_addr}/v1"), "mock");
    cfg.episodes = 12;
    cfg.rate_per_s = 50.0;
    cfg.seed = 17;
    cfg.run_id = unique("run");
    cfg.options = PromptOptions::default();
    cfg.feedback = Some(FeedbackConfig {
        endpoint: format!("http://{proxy_addr}"),
        secret: Some(SECRET.into()),
        delay_ms: 200,
        in_episode_order: false,
    });
    cfg.user = UserConfig {
        noise_rate: 0.0,
        correction_rate: 0.5,
        thanks_rate: 0.0,
        critique_style: CritiqueStyle::RuleAndValue,
    };
    let summary = run_env(cfg).await.unwrap();
    assert_eq!(summary.failed, 0);
    assert_eq!(
        summary.feedback_failures,
        0,
        "{:?}",
        summary
            .outcomes
            .iter()
            .find_map(|o| o.feedback_error.clone())
    );
    assert!(summary
        .outcomes
        .iter()
        .all(|o| o.interaction_ids.len() == 1));
    assert!(
        summary.outcomes.iter().any(|o| o.correct) || summary.outcomes.iter().any(|o| !o.correct)
    );

    // Every answered turn shows up in hindsight.episodes with its thumbs (and critique).
    let want: HashMap<String, (String, bool, Option<String>)> = summary
        .outcomes
        .iter()
        .map(|o| {
            let r = o.reaction.as_ref().unwrap();
            (
                o.interaction_ids[0].clone(),
                (o.episode_id.clone(), r.thumbs_up, r.comment.clone()),
            )
        })
        .collect();
    let reader = TopicReader::new(&log_config, &unique("reader"), &[Topic::Episodes]).unwrap();
    let mut got: HashMap<String, Value> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while got.len() < want.len() || !complete(&got, &want) {
        assert!(
            Instant::now() < deadline,
            "joined {} of {} turns: {got:?}",
            got.len(),
            want.len()
        );
        if let Some(rec) = reader.recv_timeout(Duration::from_secs(1)).await.unwrap() {
            let v: Value = rec.decode().unwrap();
            let turn = v["turn"].as_str().unwrap().to_string();
            if want.contains_key(&turn) {
                // Later records for a turn carry more feedback; keep the fullest.
                let n = v["feedback"].as_array().map_or(0, Vec::len);
                let old = got
                    .get(&turn)
                    .and_then(|o| o["feedback"].as_array().map(Vec::len))
                    .unwrap_or(0);
                if n >= old {
                    got.insert(turn, v);
                }
            }
        }
    }
    for (turn, (episode_id, thumbs, comment)) in &want {
        let rec = &got[turn];
        assert_eq!(rec["episode_id"], json!(episode_id));
        let fb = rec["feedback"].as_array().unwrap();
        let text = fb
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        assert!(text.contains("thumbs"), "{text}");
        assert!(text.contains(&format!("{thumbs}")), "{text}");
        if let Some(c) = comment {
            assert!(
                text.contains(&serde_json::to_string(c).unwrap()[1..c.len()]),
                "{text}"
            );
        }
        // The context as sent includes the ticket and its order record (compact records, the
        // default); the answer is the agent's decision.
        assert!(rec["context"]["messages"].to_string().contains("Order: "));
        assert!(rec["answer"].to_string().contains("department"));
    }

    let _ = stop_joiner.send(());
    let _ = stop_proxy.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), joiner).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), proxy).await;
}

/// Every wanted turn has as many feedback events as the user sent (thumbs + comment + correction).
fn complete(
    got: &HashMap<String, Value>,
    want: &HashMap<String, (String, bool, Option<String>)>,
) -> bool {
    want.iter().all(|(turn, (_, _, comment))| {
        got.get(turn).is_some_and(|rec| {
            let n = rec["feedback"].as_array().map_or(0, Vec::len);
            n > usize::from(comment.is_some())
        })
    })
}
