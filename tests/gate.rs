//! The eval gate end to end, on real parts: `hindsight serve` in-process on the real default
//! model (SmolLM2-135M-Instruct Q4_1), the real Redis, the adapter registry and
//! `gate_and_publish`. A candidate that wrecks the answers is rejected and never serves; a
//! harmless one passes the gate and goes live; with `publish.rollout = "canary"` the next one
//! is handed to the rollout controller, which promotes it on traffic through a proxy process.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "rollout/common.rs"]
#[allow(dead_code)]
mod common;
#[path = "support/serve.rs"]
mod serve;
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hindsight_control::guard::{builtin_capability_set, GuardConfig};
use hindsight_control::publish::{gate_and_publish, GateConfig, GateVerdict, PublishConfig};
use hindsight_control::registry::{
    sha256_file, NewVersion, OffsetRange, Registry, RegistryConfig, VersionEntry, VersionStatus,
};
use hindsight_model::candle_core::{DType, Device};
use hindsight_model::{load_gguf, Adapter, LoraConfig, LoraInit, ModelConfig};
use serde_json::{json, Value};

const MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
const BASE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";
const NAME: &str = "support";

/// Questions the base model answers right with greedy decoding (checked with `hindsight eval`:
/// it misses Italy and Spain, so they are not here).
const ITEMS: [(&str, &str, &str); 6] = [
    ("france", "What is the capital of France?", "Paris"),
    ("germany", "What is the capital of Germany?", "Berlin"),
    ("japan", "What is the capital of Japan?", "Tokyo"),
    ("uk", "What is the capital of the United Kingdom?", "London"),
    ("russia", "What is the capital of Russia?", "Moscow"),
    ("china", "What is the capital of China?", "Beijing"),
];

fn model_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(MODEL);
    if !p.is_file() {
        panic!(
            "{} is missing: run deploy/fetch-model.sh to fetch the default model",
            p.display()
        );
    }
    p
}

fn write_eval_set(dir: &Path) -> PathBuf {
    let path = dir.join("capitals.jsonl");
    let lines: Vec<String> = ITEMS
        .iter()
        .map(|(id, q, a)| {
            json!({"id": id, "messages": [{"role": "user", "content": q}],
                   "scorer": "contains", "expected": a})
            .to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// The guard on the first `items` of the built-in capability set, with short answers: the same
/// checks as the defaults at a fraction of their CPU time (the full set costs ~2 minutes per
/// gate on two cores).
fn small_guard(dir: &Path, items: usize) -> GuardConfig {
    let mut set = builtin_capability_set().unwrap();
    set.truncate(items);
    let path = dir.join("capability.jsonl");
    std::fs::write(&path, hindsight_eval::to_jsonl(&set.items).unwrap()).unwrap();
    GuardConfig {
        capability_set: Some(path),
        max_tokens: 24,
        probe_max_tokens: 8,
        ..GuardConfig::default()
    }
}

fn adapter(cfg: &ModelConfig, init: LoraInit, seed: u64) -> Adapter {
    let lora = LoraConfig {
        rank: 8,
        alpha: 16.0,
        ..LoraConfig::default()
    };
    Adapter::new(NAME, lora, cfg, init, seed, &Device::Cpu).unwrap()
}

/// Deletes the test's registry and routing keys.
async fn drop_keys(redis_url: &str, prefix: &str) {
    let mut conn = redis::Client::open(redis_url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(keys)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// `/v1/models`: id → version (null for the base model).
async fn served(endpoint: &str) -> Vec<(String, Value)> {
    let body: Value = reqwest::get(format!("{endpoint}/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m["version"].clone()))
        .collect()
}

/// The `x-hindsight-adapter` header of a one-token chat request to `model`.
async fn adapter_header(endpoint: &str, model: &str) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{endpoint}/chat/completions"))
        .json(&json!({"model": model, "max_tokens": 1, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.headers()["x-hindsight-adapter"]
        .to_str()
        .unwrap()
        .to_string()
}

async fn register(
    reg: &Registry,
    a: &Adapter,
    parent: Option<u64>,
    examples: u64,
    base_sha: &str,
) -> VersionEntry {
    reg.register(NewVersion {
        name: NAME,
        adapter: a,
        base_model: BASE_NAME,
        base_model_sha256: base_sha,
        parent,
        training_config: json!({"objective": "test"}),
        offsets: vec![OffsetRange {
            topic: "hindsight.episodes".into(),
            partition: 0,
            from: 0,
            to: examples as i64,
        }],
        examples,
        tokens: examples * 100,
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worse_candidate_is_rejected_and_never_serves_harmless_one_goes_live() {
    let t0 = Instant::now();
    let model = model_path();
    let (endpoint, stop) = serve::start_serve(&model, BASE_NAME).await;
    let model_cfg = load_gguf(&model, DType::F32, &Device::Cpu).unwrap().config;
    let base_sha = sha256_file(&model).unwrap();
    eprintln!(
        "serve up, model config read: {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    let dir = tempfile::tempdir().unwrap();
    let prefix = format!(
        "hindsight:test:gate:{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let reg = Registry::connect(RegistryConfig {
        redis_url: redis_url.clone(),
        key_prefix: prefix.clone(),
        adapter_dir: dir.path().join("adapters"),
    })
    .await
    .unwrap();
    let gate = GateConfig {
        margin: 0.2,
        max_tokens: Some(12),
        concurrency: 6,
        guard: small_guard(dir.path(), 8),
        ..GateConfig::new(write_eval_set(dir.path()))
    };
    let cfg = PublishConfig {
        endpoints: vec![endpoint.clone()],
        api_key: None,
        gate: Some(gate),
        promote: true,
        rollout: Default::default(),
        route: None,
        load_timeout_ms: 60_000,
        load_versions_by_name: false,
    };
    // Live: a zero-B adapter (the base model's behaviour), gated against the base model.
    let live = adapter(&model_cfg, LoraInit::Peft, 1);
    let v1 = register(&reg, &live, None, 0, &base_sha).await;
    let t = Instant::now();
    let out = gate_and_publish(&reg, v1, &cfg, BASE_NAME).await.unwrap();
    eprintln!(
        "gate v1 vs base: {:.1}s {:?}",
        t.elapsed().as_secs_f64(),
        out.verdict
    );
    let eval = out.entry.eval.clone().unwrap();
    assert_eq!(eval["live"]["model"], BASE_NAME, "{eval:#}");
    assert_eq!(
        eval["live"]["exact_match"], 1.0,
        "the base model must answer every gate item: {eval:#}"
    );
    assert!(out.verdict.as_ref().unwrap().accepted(), "{eval:#}");
    assert_eq!(out.entry.status, VersionStatus::Live);
    assert_eq!(adapter_header(&endpoint, NAME).await, "support@1");
    // A zero-B adapter is the base model: the base's answers score the same under it.
    let guard = &eval["guard"];
    let drift = |g: &Value| {
        g["candidate"]["base_answer_logprob"].as_f64().unwrap()
            - g["base"]["base_answer_logprob"].as_f64().unwrap()
    };
    assert!(guard["drift_items"].as_u64().unwrap() >= 6, "{guard:#}");
    assert!(drift(guard).abs() < 1e-3, "{guard:#}");

    // A candidate with large random B: it wrecks the answers and must be rejected.
    let bad = adapter(&model_cfg, LoraInit::RandomB(1.0), 2);
    let v2 = register(&reg, &bad, Some(1), 64, &base_sha).await;
    let t = Instant::now();
    let out = gate_and_publish(&reg, v2, &cfg, BASE_NAME).await.unwrap();
    eprintln!(
        "gate v2 (wrecked) vs v1: {:.1}s {:?}",
        t.elapsed().as_secs_f64(),
        out.verdict
    );
    let eval = out.entry.eval.clone().unwrap();
    match out.verdict {
        Some(GateVerdict::Rejected {
            candidate,
            live,
            items,
            ..
        }) => {
            assert_eq!(items, ITEMS.len());
            assert_eq!(live, 1.0);
            assert!(candidate < live - 0.2, "{eval:#}");
        }
        other => panic!("expected a rejection, got {other:?}: {eval:#}"),
    }
    eprintln!(
        "wrecked: log-prob drift {:.3} nats/token",
        drift(&eval["guard"])
    );
    assert!(
        drift(&eval["guard"]) < -GuardConfig::default().max_logprob_drop,
        "{eval:#}"
    );
    let stored = reg.get(NAME, 2).await.unwrap().unwrap();
    assert_eq!(stored.status, VersionStatus::Rejected);
    assert_eq!(stored.eval, Some(eval.clone()));
    assert_eq!(eval["verdict"], "rejected");
    assert_eq!(eval["live"]["model"], NAME);
    assert_eq!(eval["live"]["version"], 1);
    assert_eq!(eval["candidate"]["model"], "support-candidate");
    assert_eq!(eval["margin"], 0.2);
    assert_eq!(eval["items"], ITEMS.len());
    assert_eq!(eval["set"]["sha256"].as_str().unwrap().len(), 64);
    assert!(
        !eval["regressions"].as_array().unwrap().is_empty(),
        "{eval:#}"
    );
    eprintln!("a regression: {}", eval["regressions"][0]);
    assert!(stored
        .note
        .as_deref()
        .unwrap()
        .starts_with("rejected by the eval gate"));
    // It stays out of serving; the live version still serves.
    let models = served(&endpoint).await;
    assert!(
        !models
            .iter()
            .any(|(id, _)| id.starts_with("support-candidate")),
        "{models:?}"
    );
    assert!(models.contains(&(NAME.to_string(), json!(1))), "{models:?}");
    assert_eq!(adapter_header(&endpoint, NAME).await, "support@1");
    assert_eq!(reg.live(NAME).await.unwrap().unwrap().version, 1);

    // A harmless candidate (zero B again) passes and goes live; v1 retires.
    let good = adapter(&model_cfg, LoraInit::Peft, 3);
    let v3 = register(&reg, &good, Some(1), 128, &base_sha).await;
    let t = Instant::now();
    let out = gate_and_publish(&reg, v3, &cfg, BASE_NAME).await.unwrap();
    eprintln!(
        "gate v3 (harmless) vs v1: {:.1}s {:?}",
        t.elapsed().as_secs_f64(),
        out.verdict
    );
    let eval = out.entry.eval.clone().unwrap();
    assert!(
        matches!(out.verdict, Some(GateVerdict::Accepted { candidate, .. }) if candidate == 1.0),
        "{eval:#}"
    );
    assert_eq!(out.entry.version, 3);
    assert_eq!(out.entry.status, VersionStatus::Live);
    assert_eq!(eval["verdict"], "accepted");
    assert_eq!(reg.live(NAME).await.unwrap().unwrap().version, 3);
    assert_eq!(
        reg.get(NAME, 1).await.unwrap().unwrap().status,
        VersionStatus::Retired
    );
    assert_eq!(
        reg.get(NAME, 2).await.unwrap().unwrap().status,
        VersionStatus::Rejected
    );
    let models = served(&endpoint).await;
    assert!(models.contains(&(NAME.to_string(), json!(3))), "{models:?}");
    assert!(
        !models
            .iter()
            .any(|(id, _)| id.starts_with("support-candidate")),
        "{models:?}"
    );
    assert_eq!(adapter_header(&endpoint, NAME).await, "support@3");

    // Publishing is for candidates only.
    let again = reg.get(NAME, 2).await.unwrap().unwrap();
    assert!(gate_and_publish(&reg, again, &cfg, BASE_NAME)
        .await
        .is_err());

    canary_handover(
        &reg, &cfg, &endpoint, &redis_url, &prefix, &model_cfg, &base_sha,
    )
    .await;

    drop_keys(&redis_url, &prefix).await;
    let _ = stop.send(());
    eprintln!("total {:.1}s", t0.elapsed().as_secs_f64());
}

/// `publish.rollout = "canary"`: an accepted candidate is loaded as `support@4` beside the live
/// `support@3`, queued on the route (created with the live version as stable) and marked
/// `canary`; the controller starts its rollout and, on real answers of the real model through a
/// `hindsight proxy` process (each judged with a thumbs-up), advances it and promotes it by
/// itself: `support@4` goes `live`, v3 is retired, and the audit trail explains each step.
async fn canary_handover(
    reg: &Registry,
    cfg: &PublishConfig,
    endpoint: &str,
    redis_url: &str,
    prefix: &str,
    model_cfg: &ModelConfig,
    base_sha: &str,
) {
    use hindsight_control::rollout::{self, Controller, RolloutConfig};
    let store = common::store(redis_url, &format!("{prefix}:routing"));
    let cfg = PublishConfig {
        promote: false,
        rollout: hindsight_control::publish::PublishRollout::Canary,
        ..cfg.clone()
    };
    let good = adapter(model_cfg, LoraInit::Peft, 4);
    let v4 = register(reg, &good, Some(3), 256, base_sha).await;
    let out =
        hindsight_control::publish::gate_and_publish_with(reg, v4, &cfg, BASE_NAME, Some(&store))
            .await
            .unwrap();
    assert_eq!(
        out.entry.status,
        VersionStatus::Canary,
        "{:?}",
        out.entry.note
    );
    assert_eq!(
        reg.live(NAME).await.unwrap().unwrap().version,
        3,
        "the live version changed before any canary"
    );
    let route = store.get(NAME).await.unwrap().unwrap();
    assert_eq!(route.stable, "support@3");
    assert_eq!(
        store.get_queued(NAME).await.unwrap().as_deref(),
        Some("support@4")
    );
    // Both versions are served by name@version during the canary.
    assert_eq!(adapter_header(endpoint, "support@3").await, "support@3");
    assert_eq!(adapter_header(endpoint, "support@4").await, "support@4");

    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let log = hindsight_feedback::LogConfig {
        brokers: common::brokers(),
        topic_prefix: topics.clone(),
        spill_dir: tempfile::tempdir().unwrap().keep(),
        ..hindsight_feedback::LogConfig::default()
    }
    .validate()
    .unwrap();
    let (audit_log, audit) = rollout::controller::audit_log(log.clone()).await.unwrap();
    // Demo-sized stages, so the test sees a whole rollout in a few dozen real answers.
    let rollout_cfg = RolloutConfig {
        stages: vec![0.5, 1.0],
        min_stage_ms: 0,
        min_exposures: 6,
        min_matured_feedback: 4,
        maturation_ms: 0,
        ..RolloutConfig::default()
    };
    let mut controller = Controller::new(rollout_cfg, store, audit)
        .unwrap()
        .with_registry(Registry::connect(reg.config().clone()).await.unwrap());
    controller.tick().await.unwrap();
    let store = common::store(redis_url, &format!("{prefix}:routing"));
    let route = store.get(NAME).await.unwrap().unwrap();
    let r = route
        .rollout
        .clone()
        .expect("the controller started the queued candidate");
    assert_eq!(
        (r.canary.as_str(), r.state.as_str(), r.weight),
        ("support@4", "running", 0.5)
    );
    let entry = reg.get(NAME, 4).await.unwrap().unwrap();
    assert!(
        entry.note.as_deref().unwrap().contains(&r.id),
        "{:?}",
        entry.note
    );

    // Traffic: users asking the route `support` through a proxy in front of `hindsight serve`;
    // the controller reads what the proxy logged and each answer's thumbs-up.
    let upstream: std::net::SocketAddr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches("/v1")
        .parse()
        .unwrap();
    let proxy = common::Proxy::start(upstream, redis_url, &format!("{prefix}:routing"), &topics);
    let reader = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[hindsight_feedback::Topic::Interactions],
    )
    .unwrap();
    let client = reqwest::Client::new();
    // The proxy has the route from Redis (not just its fallback) before traffic starts.
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.generation(&client).await < route.generation {
        assert!(
            Instant::now() < deadline,
            "the proxy never loaded the route"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut served = std::collections::BTreeMap::<String, usize>::new();
    let started = Instant::now();
    let mut state = String::from("running");
    for n in 0..120 {
        let q = ITEMS[n % ITEMS.len()].1;
        let resp = client
            .post(format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                proxy.port
            ))
            .header("x-hindsight-user", format!("user-{n}"))
            .json(&json!({"model": NAME, "max_tokens": 8, "temperature": 0.0,
                "messages": [{"role": "user", "content": q}]}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        assert_eq!(status, 200, "{}", resp.text().await.unwrap_or_default());
        while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(500)).await {
            let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
            let a = ir.assignment.clone().unwrap();
            *served
                .entry(format!("{} {}", a.arm, a.version))
                .or_default() += 1;
            controller.observe(hindsight_feedback::Topic::Interactions, &rec.payload);
            let fb = common::thumbs(ir.interaction_id, true);
            let fb = serde_json::to_vec(&fb).unwrap();
            controller.observe(hindsight_feedback::Topic::Feedback, &fb);
        }
        controller.tick().await.unwrap();
        state = common::rollout_state(&store, NAME).await;
        if state != "running" {
            break;
        }
    }
    eprintln!(
        "canary rollout on the real model: {state} after {:.1}s; served {served:?}",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(state, "promoted", "served {served:?}");
    let stored = store.get(NAME).await.unwrap().unwrap();
    assert_eq!(stored.stable, "support@4");
    assert_eq!(reg.live(NAME).await.unwrap().unwrap().version, 4);
    assert_eq!(
        reg.get(NAME, 3).await.unwrap().unwrap().status,
        VersionStatus::Retired
    );
    let trail = store.audit(NAME, 10).await.unwrap();
    eprintln!("audit trail, newest first:");
    for a in &trail {
        eprintln!(
            "  gen {} {} by {} weight {}: {}",
            a.generation, a.action, a.by, a.weight, a.reason
        );
    }
    let actions: Vec<&str> = trail.iter().map(|a| a.action.as_str()).collect();
    assert_eq!(actions, ["advance", "start", "set_stable"], "{trail:#?}");
    assert!(trail[0].reason.starts_with("promote"), "{trail:#?}");
    drop(proxy);
    audit_log.shutdown(Duration::from_secs(10)).await;
}

/// Questions about a made-up fact the base model cannot know: the task set of the over-trained
/// candidate below (`contains` "RX-42").
const TASK: [(&str, &str); 4] = [
    ("code-1", "What is the refund code?"),
    ("code-2", "Which code do I use for a refund?"),
    ("code-3", "Tell me the refund code, please."),
    ("code-4", "I need the code for refunds."),
];
const TASK_ANSWER: &str = "The refund code is RX-42.";

/// An adapter trained on nothing but [`TASK`] with a learning rate far too high for far too
/// long, by the learner's own trainer (SFT on a correction, no KL brake): it answers "RX-42"
/// to the task questions, so it *improves* the task set, and says much the same to everything
/// else.
fn overtrained_adapter(model: &Path) -> Adapter {
    use hindsight_learner::example::TrainExample;
    use hindsight_learner::optim::AdamWConfig;
    use hindsight_learner::trainer::{ObjectiveWeights, Trainer, TrainerConfig};
    use hindsight_model::{encode, ModelBundle};

    let bundle = ModelBundle::load(model, DType::F32, &Device::Cpu).unwrap();
    let template = bundle.chat_template.as_ref().unwrap();
    let end = bundle.end_of_turn().unwrap();
    let mut answer = encode(&bundle.tokenizer, TASK_ANSWER).unwrap();
    answer.push(end);
    let examples: Vec<TrainExample> = TASK
        .iter()
        .map(|(_, q)| {
            let prompt = template
                .render(&json!([{"role": "user", "content": q}]), None, true)
                .unwrap();
            TrainExample {
                record_id: uuid::Uuid::now_v7(),
                turn: uuid::Uuid::now_v7(),
                route: NAME.into(),
                adapter: None,
                context_ids: encode(&bundle.tokenizer, &prompt).unwrap(),
                answer_ids: answer.clone(),
                behaviour_logprobs: None,
                sampling: Default::default(),
                teacher_context_ids: None,
                control_context_ids: None,
                correction_ids: Some(answer.clone()),
                answer_format: None,
                thumbs: None,
                reward: None,
                feedback_text: None,
                feedback_ids: vec![],
            }
        })
        .collect();
    let cfg = TrainerConfig {
        objectives: ObjectiveWeights {
            sft: 1.0,
            kto: 0.0,
            distill: 0.0,
            dense: 0.0,
        },
        optimizer: AdamWConfig {
            lr: 3e-3,
            ..Default::default()
        },
        kl_penalty: 0.0,
        ..Default::default()
    };
    // 40 steps on 4 examples, far past memorising the answer (loss under 0.02 nats by step 4):
    // what makes the candidate forget as well as collapse. At 1e-2 the loss spiked (to 7.6 at
    // step 30) and a change in the gradients' round-off was enough to end a run on a spike.
    let mut trainer = Trainer::new(std::sync::Arc::new(bundle.model), cfg, NAME).unwrap();
    for step in 1..=40 {
        let report = trainer.step(&examples).unwrap();
        if step % 10 == 0 {
            eprintln!(
                "over-training step {}: loss {:.4}",
                report.step, report.loss
            );
        }
    }
    trainer.snapshot_policy(NAME).unwrap()
}

/// The forgetting and collapse guard: a candidate over-trained on its task set beats the base
/// model there, yet is rejected because it forgot what the base model knows and answers
/// different prompts alike; the reasons reach the registry. (The candidates of the test above
/// pass the guard: a zero-B adapter is the base model.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overtrained_candidate_that_wins_its_task_is_rejected_for_forgetting_and_collapse() {
    let t0 = Instant::now();
    let model = model_path();
    let adapter = tokio::task::spawn_blocking({
        let model = model.clone();
        move || overtrained_adapter(&model)
    })
    .await
    .unwrap();
    eprintln!("over-trained: {:.1}s", t0.elapsed().as_secs_f64());
    let (endpoint, stop) = serve::start_serve(&model, BASE_NAME).await;
    let base_sha = sha256_file(&model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let task_set = dir.path().join("task.jsonl");
    let lines: Vec<String> = TASK
        .iter()
        .map(|(id, q)| {
            json!({"id": id, "messages": [{"role": "user", "content": q}],
                   "scorer": "contains", "expected": "RX-42"})
            .to_string()
        })
        .collect();
    std::fs::write(&task_set, lines.join("\n")).unwrap();
    let prefix = format!(
        "hindsight:test:guard:{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let reg = Registry::connect(RegistryConfig {
        redis_url: redis_url.clone(),
        key_prefix: prefix.clone(),
        adapter_dir: dir.path().join("adapters"),
    })
    .await
    .unwrap();
    let cfg = PublishConfig {
        endpoints: vec![endpoint.clone()],
        api_key: None,
        gate: Some(GateConfig {
            max_tokens: Some(16),
            concurrency: 6,
            guard: small_guard(dir.path(), 12),
            ..GateConfig::new(&task_set)
        }),
        promote: true,
        rollout: Default::default(),
        route: None,
        load_timeout_ms: 60_000,
        load_versions_by_name: false,
    };
    let v1 = register(&reg, &adapter, None, TASK.len() as u64, &base_sha).await;
    let t = Instant::now();
    let out = gate_and_publish(&reg, v1, &cfg, BASE_NAME).await.unwrap();
    let eval = out.entry.eval.clone().unwrap();
    eprintln!(
        "gate (over-trained) vs base: {:.1}s {:?}\nguard: {:#}",
        t.elapsed().as_secs_f64(),
        out.verdict,
        eval["guard"]
    );
    let Some(GateVerdict::Rejected {
        candidate,
        live,
        reasons,
        ..
    }) = &out.verdict
    else {
        panic!("the over-trained candidate passed the gate: {eval:#}");
    };
    assert!(
        candidate > live,
        "the candidate must win its task set for this test to mean anything: {eval:#}"
    );
    assert!(
        reasons.iter().all(|r| !r.starts_with("task")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with("forgetting")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with("collapse")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with("drift")),
        "{reasons:?}"
    );
    assert_eq!(out.entry.status, VersionStatus::Rejected);
    let note = out.entry.note.clone().unwrap_or_default();
    assert!(note.contains("forgetting"), "{note}");
    let guard = &eval["guard"];
    assert!(
        guard["candidate"]["self_similarity"].as_f64().unwrap()
            > guard["base"]["self_similarity"].as_f64().unwrap(),
        "{guard:#}"
    );
    assert!(
        !served(&endpoint)
            .await
            .iter()
            .any(|(id, _)| id.starts_with(NAME)),
        "a rejected candidate must not stay loaded"
    );

    drop_keys(&redis_url, &prefix).await;
    let _ = stop.send(());
    eprintln!("total {:.1}s", t0.elapsed().as_secs_f64());
}
