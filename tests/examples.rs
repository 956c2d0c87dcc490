//! The examples a user copies, run against the local loop: `hindsight serve` on the real
//! default model (CPU) and `hindsight proxy` in front of it with the feedback API and a webhook
//! signing secret, both as processes, on the real broker (a fresh topic prefix) and Redis.
//!
//! * `examples/agent/agent.py` (the official `openai` package, streamed) and
//!   `examples/agent_client/` (Rust, reqwest) each run a tool-call turn and an answer turn
//!   through the proxy by base URL alone, then post signed feedback for the answer.
//! * Kafka must then hold each agent's turns as one inferred episode (no header was sent) and
//!   its feedback events aimed at its answer; a wrong secret is refused with 401.
//!
//! The Rust example is a thin `main.rs` over `examples/agent_client/agent.rs`, which this test
//! includes with `#[path]` and calls directly: no nested `cargo run` (it would wait for the
//! cargo lock this test runs under), and cargo gives tests no path to example binaries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

#[path = "../examples/agent_client/agent.rs"]
mod agent_client;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_feedback::{InteractionRecord, LogConfig, Topic, TopicReader};
use serde_json::{json, Value};
use support::{brokers, free_port};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const SECRET: &str = "examples-test-secret";
/// Per call: enough for a tool call's JSON and a short answer, small for 2 CPU cores.
const MAX_TOKENS: u32 = 64;

fn model_path() -> PathBuf {
    let p = Path::new(ROOT).join(MODEL);
    if !p.is_file() {
        panic!(
            "{} is missing: run deploy/fetch-model.sh to fetch the default model",
            p.display()
        );
    }
    p
}

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

/// A `hindsight` child process, SIGKILLed on drop; its stderr goes to `<dir>/<name>.log`.
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn hindsight(name: &'static str, dir: &Path, args: &[&str]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(args)
            .env("RAYON_NUM_THREADS", "2")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { name, child, log }
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<_> = text.lines().collect();
        let from = lines.len().saturating_sub(20);
        format!("--- {} ---\n{}\n", self.name, lines[from..].join("\n"))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `url` answers 2xx (the model loads in a few seconds; 120 s on a loaded machine).
async fn wait_ready(url: &str, p: &mut Process) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = reqwest::get(url).await {
            if r.status().is_success() {
                return;
            }
        }
        if let Ok(Some(st)) = p.child.try_wait() {
            panic!("{} exited with {st}\n{}", p.name, p.tail());
        }
        assert!(
            Instant::now() < deadline,
            "{url} not ready in 120 s\n{}",
            p.tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every record of `topic` decoded as JSON, read until `done` says so or 60 s pass.
async fn read_topic(prefix: &str, topic: Topic, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let cfg = LogConfig {
        brokers: brokers(),
        topic_prefix: prefix.into(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let group = format!("examples-check-{}", uuid::Uuid::now_v7().simple());
    let reader = TopicReader::new(&cfg, &group, &[topic]).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(&got) && Instant::now() < deadline {
        match reader.recv_timeout(Duration::from_millis(500)).await {
            Ok(Some(raw)) => got.push(raw.decode::<Value>().unwrap()),
            Ok(None) => {}
            Err(e) => {
                eprintln!("reader: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    got
}

/// What one agent's summary must show, and the ids to find in Kafka: (turn ids, feedback ids).
fn check_summary(who: &str, s: &Value) -> (Vec<String>, Vec<String>) {
    let calls = s["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{who}: no tool call: {s}");
    assert!(
        s["answer"].as_str().is_some_and(|a| !a.trim().is_empty()),
        "{who}: empty answer: {s}"
    );
    let status = s["feedback"]["status"].as_u64().unwrap();
    assert!((200..300).contains(&status), "{who}: feedback refused: {s}");
    let turns: Vec<String> = match s["turns"].as_array().unwrap().first() {
        // Python's turns are objects, Rust's plain ids.
        Some(Value::Object(_)) => s["turns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["interaction_id"].as_str().unwrap().to_string())
            .collect(),
        _ => serde_json::from_value(s["turns"].clone()).unwrap(),
    };
    assert!(turns.len() >= 2, "{who}: fewer than 2 turns: {s}");
    assert!(
        turns.iter().all(|t| !t.is_empty()),
        "{who}: a turn without x-hindsight-interaction-id: {s}"
    );
    assert_eq!(
        turns.last().unwrap(),
        s["answer_interaction_id"].as_str().unwrap()
    );
    let feedback: Vec<String> =
        serde_json::from_value(s["feedback"]["response"]["feedback_ids"].clone()).unwrap();
    assert!(!feedback.is_empty(), "{who}: no feedback id: {s}");
    (turns, feedback)
}

/// The agent's turns are in Kafka as one episode the proxy inferred, the first turn carrying
/// the tool call; its feedback events are in Kafka aimed at its answer.
fn check_records(
    who: &str,
    turns: &[String],
    feedback: &[String],
    interactions: &HashMap<String, InteractionRecord>,
    feedback_records: &HashMap<String, Value>,
) {
    let recs: Vec<&InteractionRecord> = turns
        .iter()
        .map(|t| {
            interactions
                .get(t)
                .unwrap_or_else(|| panic!("{who}: interaction {t} not in Kafka"))
        })
        .collect();
    let episode = &recs[0].episode_id;
    for (i, r) in recs.iter().enumerate() {
        assert_eq!(&r.episode_id, episode, "{who}: turn {i} in another episode");
        assert_eq!(r.status, 200, "{who}: turn {i}");
        let source = serde_json::to_value(r.episode_source).unwrap();
        let want = if i == 0 { "new" } else { "inferred" };
        assert_eq!(source, want, "{who}: turn {i}'s episode_source");
    }
    let first = &recs[0].response.as_ref().unwrap()["choices"][0];
    assert!(
        first["message"]["tool_calls"]
            .as_array()
            .is_some_and(|c| !c.is_empty()),
        "{who}: the first turn's record has no tool call: {first}"
    );
    let answer = turns.last().unwrap();
    for id in feedback {
        let f = feedback_records
            .get(id)
            .unwrap_or_else(|| panic!("{who}: feedback {id} not in Kafka"));
        assert_eq!(f["target"]["interaction"], json!(answer), "{who}: {f}");
    }
    assert!(
        feedback
            .iter()
            .any(|id| feedback_records[id]["kind"] == "thumbs"),
        "{who}: no thumbs among its feedback"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_examples_run_through_the_proxy_and_their_feedback_is_signed() {
    let started = Instant::now();
    let model = model_path();
    assert!(
        support::broker_port_open(),
        "no broker at {}: deploy/services.sh up",
        brokers()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let topics = format!("test-examples-{}", uuid::Uuid::now_v7().simple());

    // The model server.
    let serve_port = free_port();
    let mut serve = Process::hindsight(
        "serve",
        d,
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{serve_port}"),
            "--default-max-tokens",
            &MAX_TOKENS.to_string(),
        ],
    );
    wait_ready(&format!("http://127.0.0.1:{serve_port}/health"), &mut serve).await;

    // The proxy in front of it, with the feedback API and a signing secret.
    let (proxy_port, admin_port) = (free_port(), free_port());
    std::fs::write(
        d.join("proxy.toml"),
        format!(
            r#"[proxy]
listen_addr = "127.0.0.1:{proxy_port}"
admin_addr = "127.0.0.1:{admin_port}"
upstream_url = "http://127.0.0.1:{serve_port}"
feedback_api = true
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[feedback]
redis_url = "{redis}"
[feedback.signing]
secrets = ["{SECRET}"]
[routing]
enabled = false
"#,
            brokers = brokers(),
            redis = redis_url(),
            spill = d.join("spill").display(),
        ),
    )
    .unwrap();
    let mut proxy = Process::hindsight(
        "proxy",
        d,
        &["proxy", "--config", d.join("proxy.toml").to_str().unwrap()],
    );
    wait_ready(&format!("http://127.0.0.1:{admin_port}/readyz"), &mut proxy).await;
    let base_url = format!("http://127.0.0.1:{proxy_port}/v1");
    let origin = format!("http://127.0.0.1:{proxy_port}");
    eprintln!("loop up in {:.1}s", started.elapsed().as_secs_f64());

    // (a) The Python agent, by base URL alone; the secret from the environment.
    let t = Instant::now();
    let script = Path::new(ROOT).join("examples/agent/agent.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let args = [
        script.to_str().unwrap().to_string(),
        "--base-url".into(),
        base_url.clone(),
        "--max-tokens".into(),
        MAX_TOKENS.to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(args)
            .env("HINDSIGHT_SECRET", SECRET)
            .output()
    })
    .await
    .unwrap()
    .expect("python3 must be installed (pip install -r deploy/requirements-test.txt)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the `openai` package is missing: pip install -r deploy/requirements-test.txt"
    );
    assert!(
        out.status.success(),
        "agent.py failed ({}):\n{stdout}\n{stderr}\n{}{}",
        out.status,
        serve.tail(),
        proxy.tail()
    );
    let py: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("agent.py's summary is not JSON ({e}):\n{stdout}"));
    eprintln!(
        "agent.py in {:.1}s: {py}\n(streamed to the user: {stderr})",
        t.elapsed().as_secs_f64()
    );
    let (py_turns, py_feedback) = check_summary("agent.py", &py);

    // (b) The Rust agent.
    let t = Instant::now();
    let options = agent_client::Options {
        base_url: base_url.clone(),
        feedback_url: origin.clone(),
        secret: Some(SECRET.into()),
        model: None,
        ticket: "Hello, what is the status of my order A-1001?".into(),
        max_tokens: MAX_TOKENS,
    };
    let rs = agent_client::run(&options).await.unwrap();
    eprintln!("agent_client in {:.1}s: {rs}", t.elapsed().as_secs_f64());
    let (rs_turns, rs_feedback) = check_summary("agent_client", &rs);

    // Signing is real: the same kind of event under a wrong secret, or unsigned, is refused.
    let client = reqwest::Client::new();
    let event = [json!({"interaction_id": rs_turns[1], "kind": "thumbs", "value": true})];
    for secret in [Some("not-the-secret"), None] {
        let (status, body) = agent_client::post_feedback(&client, &origin, secret, &event)
            .await
            .unwrap();
        assert_eq!(status, 401, "secret {secret:?}: {body}");
    }

    // Kafka: the turns, one inferred episode per agent, and the feedback on the answers.
    let want: HashSet<String> = py_turns.iter().chain(&rs_turns).cloned().collect();
    let interactions: HashMap<String, InteractionRecord> =
        read_topic(&topics, Topic::Interactions, |got| {
            let seen: HashSet<&str> = got
                .iter()
                .filter_map(|v| v["interaction_id"].as_str())
                .collect();
            want.iter().all(|w| seen.contains(w.as_str()))
        })
        .await
        .into_iter()
        .map(|v| {
            let r: InteractionRecord = serde_json::from_value(v).unwrap();
            (r.interaction_id.to_string(), r)
        })
        .collect();
    let want_fb: HashSet<String> = py_feedback.iter().chain(&rs_feedback).cloned().collect();
    let feedback: HashMap<String, Value> = read_topic(&topics, Topic::Feedback, |got| {
        let seen: HashSet<&str> = got
            .iter()
            .filter_map(|v| v["feedback_id"].as_str())
            .collect();
        want_fb.iter().all(|w| seen.contains(w.as_str()))
    })
    .await
    .into_iter()
    .map(|v| (v["feedback_id"].as_str().unwrap().to_string(), v))
    .collect();
    // Only the accepted events: the refused ones never reached Kafka.
    assert_eq!(feedback.len(), want_fb.len(), "{feedback:?}");
    check_records(
        "agent.py",
        &py_turns,
        &py_feedback,
        &interactions,
        &feedback,
    );
    check_records(
        "agent_client",
        &rs_turns,
        &rs_feedback,
        &interactions,
        &feedback,
    );
    assert_ne!(
        interactions[&py_turns[0]].episode_id, interactions[&rs_turns[0]].episode_id,
        "two conversations, two episodes"
    );
    eprintln!("test done in {:.1}s", started.elapsed().as_secs_f64());
}
