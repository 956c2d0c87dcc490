//! The official `openai` Python package as a client through the proxy (streamed and not, with
//! tool calls): it sees exactly what it sees without the proxy, and each call is recorded.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_sees_no_difference() {
    let up = start_mock_upstream().await;
    let proxy = start_proxy(up, |_| {}).await;
    let reader = proxy.reader();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_through_proxy.py"
    );
    let direct = format!("http://{up}/v1");
    let via = proxy.url("/v1");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .arg(direct)
            .arg(via)
            .output()
    })
    .await
    .unwrap()
    .expect("python3 must be installed (deploy/test.sh installs the openai package)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the `openai` package is missing: pip install -r deploy/requirements-test.txt"
    );
    assert!(
        out.status.success(),
        "client saw a difference:\n{stdout}\n{stderr}"
    );

    let ids: HashMap<String, String> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| {
            (
                v["interaction_id"].as_str().unwrap().to_string(),
                v["case"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(ids.len(), 4);
    // 4 cases + 1 error call through the proxy.
    let recs = read_interactions(&reader, 5, Duration::from_secs(60)).await;
    for r in &recs {
        let raw = serde_json::to_string(r).unwrap();
        assert!(!raw.contains("SECRET"), "API key leaked into the record");
    }
    for (id, case) in &ids {
        let r = recs
            .iter()
            .find(|r| &r.interaction_id.to_string() == id)
            .unwrap_or_else(|| panic!("no record for {case}"));
        let msg = &r.response.as_ref().unwrap()["choices"][0]["message"];
        match case.as_str() {
            "plain" | "stream_text" => assert_eq!(msg["content"], "Hello from mock", "{case}"),
            _ => assert_eq!(
                msg["tool_calls"][0]["function"]["arguments"], "{\"order_id\": \"A-17\"}",
                "{case}"
            ),
        }
        assert_eq!(r.streamed, case.starts_with("stream"));
    }
    proxy.stop().await;
}
