//! The operator's page (issue 38) in a real browser against a running loop: `hindsight rollout
//! run` as a process on the real Redis and broker, with a route whose canary is running, traffic
//! and feedback for both arms in Kafka, a registry with lineage and a learner's run log. Headless
//! Chromium (Debian's package, installed by `deploy/services.sh`) loads the page: it shows both
//! versions, the per-arm metrics with their intervals and the learning curve as an SVG plot,
//! without the token and without the feedback's free text. An action with a wrong token is
//! refused with the server's 401 message and changes nothing; with the token the page pauses
//! the rollout, and the routing table in Redis says so. Screenshots go to
//! `target/test-artifacts/operator-page/`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_control::registry::{OffsetRange, VersionEntry, VersionStatus};
use hindsight_control::rollout::{self, Op};
use hindsight_feedback::{
    AssignmentRecord, FeedbackRecord, FeedbackTarget, FeedbackValue, InteractionRecord, LogConfig,
    Timings, Topic, FEEDBACK_SCHEMA,
};
use hindsight_routing::{RoutingStore, StoreConfig};
use serde_json::{json, Value};
use support::{brokers, free_port};

const TOKEN: &str = "operator-page-token-0123456789";
/// Written as a comment; the page must not show it without the token.
const PRIVATE_TEXT: &str = "private-critique-7f3a";

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

/// Debian's chromium; a missing browser fails the test (it is part of the test environment).
fn chromium() -> PathBuf {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .flat_map(|d| [d.join("chromium"), d.join("chromium-browser")])
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("chromium is not installed: run deploy/services.sh install (it installs Debian's chromium package)")
        })
}

fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts/operator-page");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Loads `url` in headless Chromium (a fresh profile, so no sessionStorage survives between
/// loads), lets the page's script run for five seconds of virtual time, saves a screenshot as
/// `<name>.png` and returns the rendered DOM.
fn browse(browser: &Path, url: &str, name: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let shot = artifacts().join(format!("{name}.png"));
    let _ = std::fs::remove_file(&shot);
    let mut child = Command::new(browser)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1280,3000",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("chromium did not finish loading {name} in 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && dom.contains("</html>"),
        "chromium on {name}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(shot.is_file(), "no screenshot {}", shot.display());
    std::fs::write(artifacts().join(format!("{name}.html")), &dom).unwrap();
    dom
}

/// The controller process; killed when dropped.
struct Controller(Child);

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn entry(version: u64, parent: Option<u64>, status: VersionStatus, eval: Option<Value>) -> String {
    serde_json::to_string(&VersionEntry {
        name: "support".into(),
        version,
        parent,
        base_model: "SmolLM2-135M-Instruct".into(),
        base_model_sha256: "0".repeat(64),
        path: PathBuf::from(format!("/nowhere/support/v{version}")),
        files_sha256: BTreeMap::new(),
        training_config: json!({}),
        offsets: vec![OffsetRange {
            topic: "hindsight.episodes".into(),
            partition: 0,
            from: 16 * (version as i64 - 1),
            to: 16 * version as i64,
        }],
        examples: 16 * version,
        tokens: 1_500 * version,
        eval,
        status,
        created_at_ms: 1_765_000_000_000 + version as i64,
        updated_at_ms: 1_765_000_000_000 + version as i64,
        note: Some(format!("test version {version}")),
    })
    .unwrap()
}

/// A learner's run log: twelve steps of falling loss, a checkpoint and a candidate.
fn run_log(path: &Path) {
    let mut lines = vec![json!({"event": "start", "batches": 0, "time_ms": 1}).to_string()];
    for b in 1..=12u64 {
        let loss = 3.0 / (b as f64).sqrt();
        lines.push(
            json!({"event": "batch", "batch": b, "record_ids": [], "time_ms": 1000 + b,
                   "report": {"step": b, "examples": 1, "tokens": 90, "loss": loss,
                              "terms": {"distill": loss}, "applied": {"distill": 1},
                              "kl_to_base": 0.001 * b as f64, "grad_norm": 1.0,
                              "skipped": null, "duration_ms": 50}})
            .to_string(),
        );
    }
    lines
        .push(json!({"event": "checkpoint", "seq": 1, "batches": 12, "time_ms": 2000}).to_string());
    lines.push(
        json!({"event": "candidate", "time_ms": 2001,
               "candidate": {"version": 2, "examples": 32, "batches": 8, "verdict": null, "status": "canary"}})
        .to_string(),
    );
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn interaction(arm: &str, version: &str, rollout_id: &str) -> InteractionRecord {
    InteractionRecord {
        route: "support".into(),
        timings: Timings {
            upstream_headers_ms: 20.0,
            total_ms: 40.0,
        },
        adapter: Some(version.into()),
        assignment: Some(AssignmentRecord {
            route: "support".into(),
            arm: arm.into(),
            version: version.into(),
            rollout_id: Some(rollout_id.into()),
            probability: 0.5,
        }),
        ..InteractionRecord::chat(
            format!("ep-{}", uuid::Uuid::now_v7()),
            json!({}),
            json!({"choices": [{"message": {"content": "your refund is on its way"}}]}),
            hindsight_feedback::now_ms(),
        )
    }
}

fn feedback(target: uuid::Uuid, value: FeedbackValue) -> FeedbackRecord {
    FeedbackRecord {
        schema: FEEDBACK_SCHEMA.into(),
        feedback_id: uuid::Uuid::now_v7(),
        target: FeedbackTarget::Interaction(target),
        value,
        metric: None,
        source: Some("test".into()),
        rater: None,
        tags: vec![],
        retracts: None,
        event_time_ms: hindsight_feedback::now_ms(),
    }
}

async fn state_and_generation(s: &RoutingStore) -> (String, u64) {
    let r = s.get("support").await.unwrap().unwrap();
    (r.rollout.unwrap().state.to_string(), r.generation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_page_shows_the_loop_and_acts_only_with_the_token() {
    let browser = chromium();
    let started = Instant::now();
    let id = uuid::Uuid::now_v7().simple().to_string();
    let prefix = format!("hindsight:test:operator-page:{id}");
    let registry_prefix = format!("{prefix}:registry");
    let topics = format!("test-operator-page-{id}");
    let dir = tempfile::tempdir().unwrap();
    let url = redis_url();

    // The registry: support@1 live, support@2 its child, accepted by the gate, now the canary.
    let mut redis = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let eval = json!({"verdict": "accepted", "delta": 0.25, "margin": 0.05,
                      "candidate": {"exact_match": 0.45}, "live": {"exact_match": 0.2, "version": 1}});
    let _: () = redis::pipe()
        .set(
            format!("{registry_prefix}:support:v:1"),
            entry(1, None, VersionStatus::Live, None),
        )
        .set(
            format!("{registry_prefix}:support:v:2"),
            entry(2, Some(1), VersionStatus::Canary, Some(eval)),
        )
        .set(format!("{registry_prefix}:support:seq"), 2)
        .set(format!("{registry_prefix}:support:live"), 1)
        .sadd(format!("{registry_prefix}:names"), "support")
        .query_async(&mut redis)
        .await
        .unwrap();

    let log_path = dir.path().join("run.jsonl");
    run_log(&log_path);
    let admin_port = free_port();
    let cfg = dir.path().join("rollout.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[routing]
redis_url = "{url}"
key_prefix = "{prefix}"
[registry]
redis_url = "{url}"
key_prefix = "{registry_prefix}"
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[rollout]
stages = [0.5, 1.0]
min_stage_ms = 0
min_exposures = 100000
maturation_ms = 0
admin_addr = "127.0.0.1:{admin_port}"
eval_interval_ms = 200
run_log = "{run_log}"
"#,
            brokers = brokers(),
            spill = dir.path().join("spill").display(),
            run_log = log_path.display(),
        ),
    )
    .unwrap();

    // The route: stable support@1, canary support@2 at half the traffic.
    let store = RoutingStore::new(StoreConfig {
        redis_url: url.clone(),
        key_prefix: prefix.clone(),
        retry_for_ms: 10_000,
    })
    .unwrap();
    let request = |reason: &'static str| rollout::Request {
        route: "support",
        by: "operator:test",
        reason,
        expected_generation: None,
        stats: json!({}),
    };
    rollout::execute(
        &store,
        &request("init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let (route, _) = rollout::execute(
        &store,
        &request("canary of the test"),
        &Op::Start {
            canary: "support@2".into(),
            stages: vec![0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    let rollout_id = route.rollout.unwrap().id;

    let log_file = std::fs::File::create(dir.path().join("controller.log")).unwrap();
    let _controller = Controller(
        Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .env("HINDSIGHT_ROLLOUT__ADMIN_TOKEN", TOKEN)
            .env("RUST_LOG", "info")
            .args(["rollout", "--config"])
            .arg(&cfg)
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap(),
    );

    // Traffic on both arms with thumbs up, and one comment with private text, through Kafka.
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: dir.path().join("spill-test"),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (record_log, records) = hindsight_feedback::RecordLog::start(log).await.unwrap();
    for i in 0..40 {
        let (arm, version) = if i % 2 == 0 {
            ("stable", "support@1")
        } else {
            ("canary", "support@2")
        };
        let ir = interaction(arm, version, &rollout_id);
        records.submit_json(
            Topic::Interactions,
            ir.episode_id.clone(),
            ir.interaction_id,
            &ir,
        );
        let value = if i == 39 {
            FeedbackValue::Comment(PRIVATE_TEXT.into())
        } else {
            FeedbackValue::Thumbs(true)
        };
        let fb = feedback(ir.interaction_id, value);
        records.submit_json(Topic::Feedback, fb.target.key(), fb.feedback_id, &fb);
    }
    let report = record_log.shutdown(Duration::from_secs(20)).await;
    println!("records written: {report:?}");

    // The controller reads it all: both arms counted, the feedback in its ring.
    let client = reqwest::Client::new();
    let api = format!("http://127.0.0.1:{admin_port}");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let view: Option<Value> = match client.get(format!("{api}/v1/rollouts")).send().await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        let recent: Option<Value> = match client
            .get(format!("{api}/v1/feedback/recent?limit=100"))
            .send()
            .await
        {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        let exposures = view
            .as_ref()
            .and_then(|v| v.pointer("/routes/0/controller/stats/canary/exposures"))
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let read = recent
            .as_ref()
            .and_then(|v| v["feedback"].as_array().map(Vec::len))
            .unwrap_or(0);
        if exposures >= 20 && read >= 40 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the controller did not count the traffic in 90 s ({exposures} canary exposures, {read} feedback); its log: {}",
            std::fs::read_to_string(dir.path().join("controller.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    // Reading is open; the feedback's free text needs the token.
    let page = client.get(format!("{api}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("script-src 'self'"));
    let adapters: Value = client
        .get(format!("{api}/v1/adapters"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(adapters["adapters"][1]["tag"], "support@2", "{adapters}");
    assert_eq!(adapters["adapters"][1]["parent"], 1, "{adapters}");
    let curve: Value = client
        .get(format!("{api}/v1/learning"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(curve["points"].as_array().unwrap().len(), 12, "{curve}");
    let open = client
        .get(format!("{api}/v1/feedback/recent"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!open.contains(PRIVATE_TEXT) && open.contains("\"detail_hidden\":true"));
    let with_token = client
        .get(format!("{api}/v1/feedback/recent"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(with_token.contains(PRIVATE_TEXT), "{with_token}");

    // The page, read-only.
    let dom = browse(&browser, &format!("{api}/"), "overview");
    for shown in [
        "support@1",
        "support@2",
        "running",
        "canary − stable",
        "negative_feedback",
        "training loss",
        "test version 2",
        "hindsight.episodes[0] 16–32",
        "read-only",
    ] {
        assert!(
            dom.contains(shown),
            "the page does not show {shown:?}:\n{dom}"
        );
    }
    assert!(
        dom.contains("<svg") && dom.contains("class=\"curve\"") && dom.contains("<path"),
        "no plot on the page:\n{dom}"
    );
    assert!(
        !dom.contains(PRIVATE_TEXT),
        "feedback text shown without the token"
    );
    assert!(!dom.contains(TOKEN));

    // Without the token nothing changes: the API refuses, and so does the page with a wrong one.
    let before = state_and_generation(&store).await;
    assert_eq!(before.0, "running");
    let r = client
        .post(format!("{api}/v1/rollouts/support"))
        .json(&json!({"action": "pause"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let dom = browse(
        &browser,
        &format!("{api}/#token=wrong-token-0123456789&route=support&action=pause"),
        "refused",
    );
    assert!(
        dom.contains("pause on support refused: 401: a valid bearer token is required"),
        "the page does not show the refusal:\n{dom}"
    );
    assert_eq!(
        state_and_generation(&store).await,
        before,
        "a refused action changed the route"
    );

    // With the token, the page pauses the rollout: the routing table in Redis says so.
    let dom = browse(
        &browser,
        &format!("{api}/#token={TOKEN}&route=support&action=pause"),
        "paused",
    );
    assert!(
        dom.contains("pause on support: done"),
        "the page does not confirm the pause:\n{dom}"
    );
    assert!(!dom.contains(TOKEN), "the token stayed in the page");
    let (state, generation) = state_and_generation(&store).await;
    assert_eq!(state, "paused");
    assert_eq!(generation, before.1 + 1);
    let last = store.audit("support", 1).await.unwrap();
    assert_eq!(
        (last[0].action.as_str(), last[0].by.as_str()),
        ("pause", "operator:page")
    );
    let dom = browse(&browser, &format!("{api}/"), "after-pause");
    assert!(dom.contains("paused"), "{dom}");
    println!(
        "operator page: loaded, refused and paused in {:.1}s; screenshots in {}",
        started.elapsed().as_secs_f64(),
        artifacts().display()
    );

    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
}
