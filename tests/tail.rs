//! `hindsight tail --last N` against the real broker: exactly the topic's last N records, in
//! order, read from N before the end (and every record when the topic holds fewer).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Command;
use std::time::Duration;

use hindsight_feedback::{LogConfig, RecordLog, Topic};
use support::brokers;
use uuid::Uuid;

fn tail(prefix: &str, last: usize) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_hindsight"))
        .args(["tail", "interactions", "--topic-prefix", prefix, "--last"])
        .arg(last.to_string())
        .env("KAFKA_BROKERS", brokers())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tail failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_n_prints_the_topics_last_records_in_order() {
    let spill = tempfile::tempdir().unwrap();
    let prefix = format!("test-tail-{}", Uuid::now_v7().simple());
    let cfg = LogConfig {
        brokers: brokers(),
        topic_prefix: prefix.clone(),
        spill_dir: spill.path().to_path_buf(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (log, handle) = RecordLog::start(cfg).await.unwrap();
    let lines: Vec<String> = (0..30).map(|i| format!("{{\"n\":{i}}}")).collect();
    for i in 0..30 {
        // One key: one partition, so "the last" is well defined.
        let value = serde_json::json!({ "n": i });
        handle.submit_json(Topic::Interactions, "k".into(), Uuid::now_v7(), &value);
    }
    let report = log.shutdown(Duration::from_secs(60)).await;
    assert!(report.complete, "{report:?}");

    let got = tokio::task::spawn_blocking({
        let prefix = prefix.clone();
        move || (tail(&prefix, 5), tail(&prefix, 100))
    })
    .await
    .unwrap();
    assert_eq!(got.0, lines[25..].to_vec());
    assert_eq!(got.1, lines);
}
