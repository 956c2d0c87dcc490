//! Canaries on a server without adapter versions, as vLLM is: the mock below knows only the
//! adapter names it was given (vLLM's runtime LoRA API: `load_lora_adapter`,
//! `unload_lora_adapter`, `/v1/models` listing each adapter with its `root` directory, 404 for
//! an unknown model). With `publish.load_versions_by_name` the learner's publish step loads the
//! stable and the canary under their tags, so the proxy's `support@1` / `support@2` resolve;
//! versions no route needs any more are unloaded at the next publish.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use hindsight_control::publish::{gate_and_publish_with, PublishConfig, PublishRollout};
use hindsight_control::registry::{
    NewVersion, OffsetRange, Registry, RegistryConfig, VersionEntry, VersionStatus,
};
use hindsight_control::rollout::{self, Op};
use hindsight_model::candle_core::Device;
use hindsight_model::{Adapter, Architecture, LoraConfig, LoraInit, ModelConfig};
use serde_json::{json, Value};

use crate::common::{self, Proxy, Redis};

const BASE: &str = "SmolLM2-135M-Instruct";

/// name → the directory it was loaded from.
type Loaded = Arc<Mutex<BTreeMap<String, String>>>;

/// A server with vLLM's adapter API and only names: a chat call answers with the directory of
/// the adapter it named (`v2`), or `base`.
async fn start_names_only_server() -> (SocketAddr, Loaded) {
    let loaded: Loaded = Arc::default();
    let app = Router::new()
        .route(
            "/v1/load_lora_adapter",
            post(|State(l): State<Loaded>, Json(b): Json<Value>| async move {
                let name = b["lora_name"].as_str().unwrap_or_default().to_string();
                let path = b["lora_path"].as_str().unwrap_or_default().to_string();
                let mut l = l.lock().unwrap();
                if l.contains_key(&name) && b["load_inplace"] != json!(true) {
                    let msg = format!("The lora adapter '{name}' has already been loaded.");
                    return (StatusCode::BAD_REQUEST, msg);
                }
                l.insert(name.clone(), path);
                let msg = format!("Success: LoRA adapter '{name}' added successfully.");
                (StatusCode::OK, msg)
            }),
        )
        .route(
            "/v1/unload_lora_adapter",
            post(|State(l): State<Loaded>, Json(b): Json<Value>| async move {
                let name = b["lora_name"].as_str().unwrap_or_default();
                match l.lock().unwrap().remove(name) {
                    Some(_) => (StatusCode::OK, format!("Success: LoRA adapter '{name}' removed successfully.")),
                    None => (StatusCode::NOT_FOUND, format!("The lora adapter '{name}' cannot be found.")),
                }
            }),
        )
        .route(
            "/v1/models",
            get(|State(l): State<Loaded>| async move {
                let mut data = vec![json!({"id": BASE, "object": "model", "root": "/models/base", "parent": null})];
                for (name, path) in l.lock().unwrap().iter() {
                    data.push(json!({"id": name, "object": "model", "root": path, "parent": BASE}));
                }
                Json(json!({"object": "list", "data": data}))
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|State(l): State<Loaded>, Json(b): Json<Value>| async move {
                let model = b["model"].as_str().unwrap_or_default().to_string();
                let answer = if model == BASE {
                    Some("base".to_string())
                } else {
                    l.lock().unwrap().get(&model).map(|p| {
                        p.rsplit('/').next().unwrap_or_default().to_string()
                    })
                };
                match answer {
                    None => (
                        StatusCode::NOT_FOUND,
                        Json(json!({"error": {"message": format!("The model `{model}` does not exist."), "type": "NotFoundError", "code": 404}})),
                    ),
                    Some(a) => (
                        StatusCode::OK,
                        Json(json!({"id": "x", "object": "chat.completion", "model": model,
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": a}, "finish_reason": "stop"}]})),
                    ),
                }
            }),
        )
        .with_state(loaded.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, loaded)
}

async fn register(reg: &Registry, cfg: &ModelConfig, seed: u64) -> VersionEntry {
    let lora = LoraConfig {
        rank: 2,
        ..LoraConfig::default()
    };
    let adapter = Adapter::new("support", lora, cfg, LoraInit::Peft, seed, &Device::Cpu).unwrap();
    reg.register(NewVersion {
        name: "support",
        adapter: &adapter,
        base_model: BASE,
        base_model_sha256: "0",
        parent: None,
        training_config: json!({"objective": "test"}),
        offsets: vec![OffsetRange {
            topic: "hindsight.episodes".into(),
            partition: 0,
            from: 0,
            to: 1,
        }],
        examples: 1,
        tokens: 1,
    })
    .await
    .unwrap()
}

fn names(l: &Loaded) -> BTreeMap<String, String> {
    l.lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.rsplit('/').next().unwrap().to_string()))
        .collect()
}

/// Publish hands v2 over as a canary: `support@1` (the live version, stable) and `support@2`
/// are loaded by name beside `support` (left on v1), the candidate name is gone; the proxy's
/// canary traffic reaches both by tag and each tag answers from its own files. After a
/// rollback the next candidate's publish unloads `support@2`, which no route needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canaries_reach_a_server_without_versions_by_loading_each_version_under_its_tag() {
    let redis = Redis::start();
    let (server, loaded) = start_names_only_server().await;
    let endpoint = format!("http://{server}/v1");
    let dir = tempfile::tempdir().unwrap();
    let reg = Registry::connect(RegistryConfig {
        redis_url: redis.url(),
        key_prefix: "reg".into(),
        adapter_dir: dir.path().join("adapters"),
    })
    .await
    .unwrap();
    let store = common::store(&redis.url(), "routing");
    let model = ModelConfig::tiny(Architecture::Llama);
    let cfg = PublishConfig {
        endpoints: vec![endpoint.clone()],
        api_key: None,
        gate: None,
        promote: true,
        rollout: PublishRollout::Off,
        route: None,
        load_timeout_ms: 10_000,
        load_versions_by_name: true,
    };

    // v1 goes live the single-machine way: under its name.
    let v1 = register(&reg, &model, 1).await;
    let out = gate_and_publish_with(&reg, v1, &cfg, BASE, Some(&store))
        .await
        .unwrap();
    assert_eq!(out.entry.status, VersionStatus::Live);
    assert_eq!(
        names(&loaded),
        BTreeMap::from([("support".into(), "v1".into())])
    );

    // v2 as a canary.
    let canary = PublishConfig {
        promote: false,
        rollout: PublishRollout::Canary,
        ..cfg.clone()
    };
    let v2 = register(&reg, &model, 2).await;
    let out = gate_and_publish_with(&reg, v2, &canary, BASE, Some(&store))
        .await
        .unwrap();
    assert_eq!(
        out.entry.status,
        VersionStatus::Canary,
        "{:?}",
        out.entry.note
    );
    assert_eq!(
        names(&loaded),
        BTreeMap::from([
            ("support".into(), "v1".into()),
            ("support@1".into(), "v1".into()),
            ("support@2".into(), "v2".into()),
        ]),
        "the stable and the canary by tag, `support` untouched, the candidate name unloaded"
    );
    let route = store.get("support").await.unwrap().unwrap();
    assert_eq!(route.stable, "support@1");
    // The operator's check (`rollout start`) finds the canary on the endpoint.
    rollout::commands::check_version(Some(&reg), "support@2", std::slice::from_ref(&endpoint))
        .await
        .unwrap();

    // The controller's start, done here directly: half the traffic to the canary.
    let queued = store.get_queued("support").await.unwrap().unwrap();
    assert_eq!(queued, "support@2");
    store.put_queued("support", None).await.unwrap();
    rollout::execute(
        &store,
        &common::req("test", "canary on a names-only server"),
        &Op::Start {
            canary: queued,
            stages: vec![0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();

    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let proxy = Proxy::start(server, &redis.url(), "routing", &topics);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.generation(&client).await < 2 {
        assert!(Instant::now() < deadline, "the proxy never saw the rollout");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut served = BTreeMap::<String, usize>::new();
    for i in 0..40 {
        let resp = client
            .post(format!(
                "http://127.0.0.1:{}/v1/chat/completions",
                proxy.port
            ))
            .header("x-hindsight-user", format!("user-{i}"))
            .json(&json!({"model": "support", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
        let tag = resp.headers()["x-hindsight-adapter"]
            .to_str()
            .unwrap()
            .to_string();
        let body: Value = resp.json().await.unwrap();
        let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
        let want = match tag.as_str() {
            "support@1" => "v1",
            "support@2" => "v2",
            other => panic!("routed to {other}"),
        };
        assert_eq!(answer, want, "{tag} answered from another version's files");
        *served.entry(tag).or_default() += 1;
    }
    eprintln!("served by tag: {served:?}");
    assert_eq!(served.len(), 2, "both arms served: {served:?}");

    // Rolled back; the next candidate's publish drops support@2, which nothing routes to.
    rollout::execute(&store, &common::req("test", "harmful"), &Op::Rollback)
        .await
        .unwrap();
    let v3 = register(&reg, &model, 3).await;
    gate_and_publish_with(&reg, v3, &canary, BASE, Some(&store))
        .await
        .unwrap();
    assert_eq!(
        names(&loaded),
        BTreeMap::from([
            ("support".into(), "v1".into()),
            ("support@1".into(), "v1".into()),
            ("support@3".into(), "v3".into()),
        ])
    );
}
