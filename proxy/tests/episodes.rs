//! Episode inference across proxies: an agent's turns, sent without `x-hindsight-episode`,
//! alternate between two proxies in front of one upstream, and the records read back from
//! the real broker must form one episode through the shared store in the real Redis. With the
//! store switched off or unreachable, every call still succeeds and every record arrives.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::{client, read_interactions, start_mock_upstream, start_proxy, TestProxy};
use hindsight_feedback::{EpisodeSource, InteractionRecord, TopicReader};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

/// One call without an episode header: its interaction id and the assistant's answer.
async fn turn(proxy: &TestProxy, messages: &[Value]) -> (String, Value) {
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": messages}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "a call failed: {:?}", r.text().await);
    let id = r.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    let body: Value = r.json().await.unwrap();
    (id, body["choices"][0]["message"].clone())
}

/// Sends a four-turn conversation, turn `i` to `proxies[i % 2]`, each turn once the previous
/// one's record is in Kafka (an agent sends its next turn after reading the answer; waiting
/// for the record makes that gap long enough on any machine). Returns the records in turn order.
async fn four_turns(proxies: [&TestProxy; 2], reader: &TopicReader) -> Vec<InteractionRecord> {
    let topic = uuid::Uuid::now_v7();
    let mut messages = vec![
        json!({"role": "system", "content": "You are a support agent."}),
        json!({"role": "user", "content": format!("order {topic} is late")}),
    ];
    let mut records = Vec::new();
    for i in 0..4 {
        let (id, answer) = turn(proxies[i % 2], &messages).await;
        records.push(record_of(reader, &id).await);
        messages.push(answer);
        messages.push(json!({"role": "user", "content": format!("and then? ({i})")}));
    }
    records
}

/// Reads until the record of interaction `id` arrives (skipping redelivered earlier ones).
async fn record_of(reader: &TopicReader, id: &str) -> InteractionRecord {
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        let got = read_interactions(reader, 1, Duration::from_secs(1)).await;
        if let Some(r) = got.into_iter().find(|r| r.interaction_id.to_string() == id) {
            return r;
        }
    }
    panic!("the record of {id} did not arrive within {WAIT:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_alternating_between_two_proxies_form_one_episode() {
    let up = start_mock_upstream().await;
    let a = start_proxy(up, |_| {}).await;
    // Same topics, hence (by default) the same episode keys in Redis.
    let topics = a.topic_prefix.clone();
    let b = start_proxy(up, |c| c.log.topic_prefix = topics).await;
    let reader = a.reader();
    let recs = four_turns([&a, &b], &reader).await;
    assert_eq!(recs[0].episode_source, EpisodeSource::New);
    for (i, r) in recs.iter().enumerate().skip(1) {
        assert_eq!(
            (r.episode_id.as_str(), r.episode_source),
            (recs[0].episode_id.as_str(), EpisodeSource::Inferred),
            "turn {i} (proxy {}) left the episode",
            ["a", "b"][i % 2]
        );
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_shared_store_calls_succeed_and_records_arrive() {
    let up = start_mock_upstream().await;
    // `a` does not share; `b` shares through a Redis that is not there (a closed port).
    let a = start_proxy(up, |c| c.proxy.episode_sharing = false).await;
    let topics = a.topic_prefix.clone();
    let b = start_proxy(up, |c| {
        c.log.topic_prefix = topics;
        c.proxy.episode_redis_url = Some(format!(
            "redis://127.0.0.1:{}/",
            common::support::free_port()
        ));
        c.proxy.episode_redis_timeout_ms = 200;
    })
    .await;
    let reader = a.reader();
    let errors_before = lookups(&b, "error").await;
    let recs = four_turns([&a, &b], &reader).await;
    // Each proxy knows only its own turns: `b` never saw turn 0, so turn 1 starts an episode.
    assert_eq!(recs[0].episode_source, EpisodeSource::New);
    assert_eq!(recs[1].episode_source, EpisodeSource::New);
    assert_ne!(recs[1].episode_id, recs[0].episode_id);
    // Turn 2 is back on `a`, which remembers turn 0's answer.
    assert_eq!(recs[2].episode_id, recs[0].episode_id);
    assert!(lookups(&b, "error").await > errors_before);
    a.stop().await;
    let report = b.stop().await;
    assert_eq!(report.log.dropped_records, 0, "{report:?}");
}

async fn lookups(proxy: &TestProxy, result: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", proxy.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let series = format!("hindsight_episode_lookups_total{{result=\"{result}\"}}");
    text.lines()
        .filter_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok())
        .sum()
}
