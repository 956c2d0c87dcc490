//! The proxy against a mock OpenAI upstream and the real local Kafka broker: forwarding is
//! transparent, and every captured call lands in `hindsight.interactions` as the client saw it.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use hindsight_feedback::EpisodeSource;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_chat_is_forwarded_unchanged_and_recorded() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let req =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": true});

    let direct = client()
        .post(format!("http://{up}/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    let direct_body = direct.text().await.unwrap();
    let via = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-SECRET-123")
        .header("x-hindsight-episode", "ep-1")
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(via.status(), 200);
    let id = via.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        via.headers()["x-mock-auth-seen"],
        "true",
        "Authorization forwarded"
    );
    let via_body = via.text().await.unwrap();
    assert_eq!(
        via_body, direct_body,
        "the client sees exactly the upstream's bytes"
    );

    let recs = read_interactions(&reader, 1, WAIT).await;
    assert_eq!(recs.len(), 1);
    let r = &recs[0];
    assert_eq!(r.interaction_id.to_string(), id);
    assert_eq!(r.interaction_id.get_version_num(), 7);
    assert_eq!(r.schema, "hindsight.interaction.v1");
    assert_eq!(r.episode_id, "ep-1");
    assert_eq!(r.episode_source, EpisodeSource::Header);
    assert_eq!(r.status, 200);
    assert!(!r.streamed);
    assert_eq!(r.method, "POST");
    assert_eq!(r.path, "/v1/chat/completions");
    assert_eq!(r.request, req);
    assert_eq!(
        r.response.as_ref().unwrap(),
        &serde_json::from_str::<Value>(&direct_body).unwrap()
    );
    let b = r.behaviour.as_ref().unwrap();
    assert_eq!(b.tokens, vec!["Hello", " from", " mock"]);
    assert_eq!(b.token_ids, Some(vec![100, 101, 102]));
    assert!(r.error.is_none());
    assert!(r.timings.total_ms >= r.timings.upstream_headers_ms);
    let raw = serde_json::to_string(r).unwrap();
    assert!(!raw.contains("SECRET"), "credentials never reach Kafka");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chat_with_tool_calls_is_reassembled() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let req = json!({"model": "tools", "stream": true, "messages": [{"role": "user", "content": "where is A-17?"}],
        "tools": [{"type": "function", "function": {"name": "lookup_order", "parameters": {"type": "object"}}}]});
    let direct = client()
        .post(format!("http://{up}/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let via = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(via.headers()["content-type"], "text/event-stream");
    assert_eq!(via.headers()["x-hindsight-adapter"], "mock-adapter@3");
    let id = via.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(via.bytes().await.unwrap(), direct, "stream bytes unchanged");

    let recs = read_interactions(&reader, 1, WAIT).await;
    let r = &recs[0];
    assert_eq!(r.interaction_id.to_string(), id);
    assert!(r.streamed);
    assert_eq!(r.episode_source, EpisodeSource::New);
    assert_eq!(r.adapter.as_deref(), Some("mock-adapter@3"));
    let resp = r.response.as_ref().unwrap();
    assert_eq!(resp["object"], "chat.completion");
    let call = &resp["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["id"], "call_abc");
    assert_eq!(call["function"]["name"], "lookup_order");
    assert_eq!(call["function"]["arguments"], "{\"order_id\": \"A-17\"}");
    assert_eq!(resp["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(resp["usage"]["total_tokens"], 12);
    assert!(r.error.is_none(), "{:?}", r.error);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_content_logprobs_and_legacy_completions_are_recorded() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let chat = json!({"model": "m", "stream": true, "logprobs": true, "messages": [{"role": "user", "content": "hi"}]});
    let r1 = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&chat)
        .send()
        .await
        .unwrap();
    let mut stream = r1.bytes_stream();
    let mut chunks = 0;
    while let Some(c) = stream.next().await {
        c.unwrap();
        chunks += 1;
    }
    assert!(chunks >= 1);
    let comp = json!({"model": "m", "prompt": "The capital of France is", "stream": true});
    let r2 = client()
        .post(proxy.url("/v1/completions"))
        .json(&comp)
        .send()
        .await
        .unwrap();
    assert_eq!(r2.status(), 200);
    r2.bytes().await.unwrap();

    let recs = read_interactions(&reader, 2, WAIT).await;
    assert_eq!(recs.len(), 2);
    let chat_rec = recs
        .iter()
        .find(|r| r.path == "/v1/chat/completions")
        .unwrap();
    let resp = chat_rec.response.as_ref().unwrap();
    assert_eq!(resp["choices"][0]["message"]["content"], "Hello from mock");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    let b = chat_rec.behaviour.as_ref().unwrap();
    assert_eq!(b.logprobs, vec![-0.5, -0.5, -0.5]);
    assert_eq!(b.token_ids, Some(vec![100, 101, 102]));
    let comp_rec = recs.iter().find(|r| r.path == "/v1/completions").unwrap();
    assert_eq!(
        comp_rec.response.as_ref().unwrap()["choices"][0]["text"],
        "Paris"
    );
    assert_eq!(
        comp_rec.response.as_ref().unwrap()["object"],
        "text_completion"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_client_errors_pass_through_and_are_recorded() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let req = json!({"model": "echo-error", "messages": []});
    let direct = client()
        .post(format!("http://{up}/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    let direct_body = direct.text().await.unwrap();
    let via = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(via.status(), 400);
    assert_eq!(via.text().await.unwrap(), direct_body);
    let recs = read_interactions(&reader, 1, WAIT).await;
    assert_eq!(recs[0].status, 400);
    assert_eq!(
        recs[0].response.as_ref().unwrap()["error"]["message"],
        "model echo-error says no"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_method_and_path_is_forwarded_unchanged_without_capture() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let resp = client()
        .put(proxy.url("/some/path?x=1&y=%20z"))
        .header("x-custom", "kept")
        .header("connection", "keep-alive")
        .body("raw body \u{1F600}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 418, "status passes through");
    assert_eq!(
        resp.headers()["x-mock"],
        "echo",
        "response headers pass through"
    );
    assert!(resp.headers().get("x-hindsight-interaction-id").is_none());
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["method"], "PUT");
    assert_eq!(v["uri"], "/some/path?x=1&y=%20z");
    assert_eq!(v["body"], "raw body \u{1F600}");
    assert_eq!(v["headers"]["x-custom"], "kept");
    assert!(
        v["headers"].get("connection").is_none(),
        "hop-by-hop headers are not forwarded"
    );
    // Hindsight's own namespace is never forwarded.
    let r = client()
        .get(proxy.url("/hindsight/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "hindsight_proxy_error");
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_header_skips_capture() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let secret = json!({"model": "m", "messages": [{"role": "user", "content": "private-marker"}]});
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-hindsight-no-log", "1")
        .header("x-hindsight-episode", "ep-same")
        .json(&secret)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-hindsight-interaction-id").is_none());
    r.bytes().await.unwrap();
    let logged = json!({"model": "m", "messages": [{"role": "user", "content": "public"}]});
    client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-hindsight-episode", "ep-same")
        .json(&logged)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let recs = read_interactions(&reader, 2, Duration::from_secs(8)).await;
    assert_eq!(recs.len(), 1, "only the consenting call is recorded");
    assert_eq!(recs[0].request, logged);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gives_502_and_slow_upstream_504() {
    // Nothing listens on this port once the listener is dropped.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let proxy = start_proxy(dead, |_| {}).await;
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_unreachable");
    proxy.stop().await;

    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |c| c.proxy.upstream_timeout_ms = 300).await;
    let reader = proxy.reader();
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "hang", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "upstream_timeout");
    let recs = read_interactions(&reader, 1, WAIT).await;
    assert_eq!(recs[0].status, 504);
    assert!(recs[0].error.as_deref().unwrap().contains("did not answer"));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_is_recorded_and_leaks_nothing() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let req =
        json!({"model": "slow", "stream": true, "messages": [{"role": "user", "content": "long"}]});
    let resp = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    let id = resp.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    let mut stream = resp.bytes_stream();
    // Read a few chunks, then hang up.
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    drop(stream);
    let recs = read_interactions(&reader, 1, WAIT).await;
    assert_eq!(recs[0].interaction_id.to_string(), id);
    assert!(
        recs[0]
            .error
            .as_deref()
            .unwrap_or("")
            .contains("client disconnected"),
        "{:?}",
        recs[0].error
    );
    let partial = recs[0].response.as_ref().unwrap()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        partial.starts_with("Hello"),
        "what was seen is kept: {partial:?}"
    );
    // Shutdown completes without cutting connections: nothing was left hanging.
    let report = proxy.stop().await;
    assert!(!report.connections_cut);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_not_buffered() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let req = json!({"model": "slow", "stream": true, "messages": []});
    let started = std::time::Instant::now();
    let resp = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&req)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    // The whole stream takes >= 2 s upstream; the first chunk must arrive long before that.
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "first chunk after {:?}",
        started.elapsed()
    );
    drop(stream);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_and_metrics() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": []}))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let base = format!("http://{}", proxy.admin);
    assert_eq!(
        client()
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        client()
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // Delivery to Kafka is asynchronous: poll until the log's counter shows the record.
    let mut m = String::new();
    for _ in 0..120 {
        m = client()
            .get(format!("{base}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("hindsight_log_delivered_records_total") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for name in [
        "hindsight_proxy_requests_total",
        "hindsight_proxy_overhead_seconds",
        "hindsight_proxy_response_headers_seconds",
        "hindsight_log_delivered_records_total",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics:\n{m}");
    }
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_captured_request_gets_413_naming_the_key() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |c| c.proxy.max_request_body_bytes = 1024).await;
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(4096)}]});
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_request_body_bytes"));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_are_inferred_from_the_conversation_without_headers() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let mut messages = vec![json!({"role": "user", "content": "order A-17 is late"})];
    let mut ids = Vec::new();
    for turn in 0..3 {
        let resp: Value = {
            let r = client()
                .post(proxy.url("/v1/chat/completions"))
                .json(
                    &json!({"model": if turn == 0 { "tools" } else { "m" }, "messages": messages}),
                )
                .send()
                .await
                .unwrap();
            ids.push(
                r.headers()["x-hindsight-interaction-id"]
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
            r.json().await.unwrap()
        };
        let answer = resp["choices"][0]["message"].clone();
        messages.push(answer.clone());
        if turn == 0 {
            messages.push(json!({"role": "tool", "tool_call_id": "call_abc", "content": "{\"status\": \"shipped\"}"}));
        } else {
            messages.push(json!({"role": "user", "content": format!("thanks {turn}")}));
        }
        // The next turn is only sent after this one's record was encoded in real agents too
        // (they wait for the answer); give the encoder a moment on this loaded machine.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // An unrelated conversation starts its own episode.
    client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "unrelated"}]}))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let recs = read_interactions(&reader, 4, WAIT).await;
    let by_id = |id: &str| {
        recs.iter()
            .find(|r| r.interaction_id.to_string() == id)
            .unwrap()
    };
    let first = by_id(&ids[0]);
    assert_eq!(first.episode_source, EpisodeSource::New);
    for id in &ids[1..] {
        let r = by_id(id);
        assert_eq!(r.episode_source, EpisodeSource::Inferred);
        assert_eq!(r.episode_id, first.episode_id);
    }
    let other = recs
        .iter()
        .find(|r| !ids.contains(&r.interaction_id.to_string()))
        .unwrap();
    assert_ne!(other.episode_id, first.episode_id);
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_api_is_mounted_on_the_data_port() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let id = r.headers()["x-hindsight-interaction-id"]
        .to_str()
        .unwrap()
        .to_string();
    r.bytes().await.unwrap();
    let fb = client()
        .post(proxy.url("/hindsight/v1/feedback"))
        .json(&json!({"interaction_id": id, "kind": "thumbs", "value": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(fb.status(), 202);
    let v: Value = fb.json().await.unwrap();
    assert!(v["feedback_id"].is_string());
    let bad = client()
        .post(proxy.url("/hindsight/v1/feedback"))
        .json(&json!({"interaction_id": id, "kind": "thumbs", "value": "maybe"}))
        .send()
        .await
        .unwrap();
    assert!(bad.status().is_client_error(), "{}", bad.status());
    let v: Value = bad.json().await.unwrap();
    assert_eq!(
        v["error"]["param"], "value",
        "the rejection names the field: {v}"
    );
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviour_logprobs_are_requested_recorded_and_hidden_from_the_client() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    for stream in [false, true] {
        let req = json!({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]});
        let direct = client()
            .post(format!("http://{up}/v1/chat/completions"))
            .json(&req)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let via = client()
            .post(proxy.url("/v1/chat/completions"))
            .json(&req)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            !via.contains("token_id"),
            "client never sees injected log-probs: {via}"
        );
        if stream {
            let events = |s: &str| -> Vec<Value> {
                s.split("\n\n")
                    .filter_map(|e| e.strip_prefix("data: "))
                    .filter(|d| *d != "[DONE]")
                    .map(|d| serde_json::from_str(d).unwrap())
                    .collect()
            };
            assert_eq!(events(&via), events(&direct));
        } else {
            assert_eq!(
                serde_json::from_str::<Value>(&via).unwrap(),
                serde_json::from_str::<Value>(&direct).unwrap()
            );
        }
    }
    let recs = read_interactions(&reader, 2, WAIT).await;
    assert_eq!(recs.len(), 2);
    for r in &recs {
        let b = r.behaviour.as_ref().expect("behaviour recorded");
        assert_eq!(b.token_ids, Some(vec![100, 101, 102]));
        assert!(
            r.response.as_ref().unwrap()["choices"][0]["logprobs"].is_null(),
            "the recorded response is what the client saw"
        );
    }
    proxy.stop().await;
}
