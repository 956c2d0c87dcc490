use super::*;
use crate::report::{self, render_diff, render_entry, render_table};
use hindsight_model::{Architecture, LoraConfig, LoraInit, LoraTarget, ModelConfig};

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| default_redis_url())
}

/// A registry under a unique prefix and a temporary adapter directory.
async fn registry() -> (Registry, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let reg = Registry::connect(RegistryConfig {
        redis_url: redis_url(),
        key_prefix: format!("hindsight:test:registry:{}", uuid::Uuid::now_v7()),
        adapter_dir: dir.path().join("adapters"),
    })
    .await
    .unwrap();
    (reg, dir)
}

async fn cleanup(reg: &Registry) {
    let mut conn = reg.conn.clone();
    let pattern = format!("{}:*", reg.cfg.key_prefix);
    let keys: Vec<String> = conn.keys(pattern).await.unwrap();
    if !keys.is_empty() {
        let _: () = conn.del(keys).await.unwrap();
    }
}

fn model_cfg() -> ModelConfig {
    ModelConfig::tiny(Architecture::Llama)
}

fn adapter(seed: u64, init: LoraInit) -> Adapter {
    let cfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: vec![LoraTarget::Q, LoraTarget::V, LoraTarget::Down],
        ..LoraConfig::default()
    };
    Adapter::new("t", cfg, &model_cfg(), init, seed, &Device::Cpu).unwrap()
}

fn new_version<'a>(name: &'a str, a: &'a Adapter, parent: Option<u64>) -> NewVersion<'a> {
    NewVersion {
        name,
        adapter: a,
        base_model: "tiny-llama",
        base_model_sha256: "00ff",
        parent,
        training_config: json!({"lr": 1e-4, "objectives": ["sft"], "empty": []}),
        offsets: vec![OffsetRange {
            topic: "hindsight.episodes".into(),
            partition: 0,
            from: 10,
            to: 42,
        }],
        examples: 32,
        tokens: 4096,
    }
}

#[tokio::test]
async fn register_writes_hashed_files_and_verify_catches_tampering() {
    let (reg, _dir) = registry().await;
    let a = adapter(1, LoraInit::RandomB(0.1));
    let e = reg
        .register(new_version("support", &a, None))
        .await
        .unwrap();
    assert_eq!(e.version, 1);
    assert_eq!(e.status, VersionStatus::Candidate);
    assert!(e.path.is_absolute());
    assert!(e.path.ends_with("support/v1"), "{}", e.path.display());
    let files: BTreeSet<&str> = e.files_sha256.keys().map(String::as_str).collect();
    assert_eq!(files, [CONFIG_FILE, WEIGHTS_FILE, METADATA_FILE].into());
    for (f, h) in &e.files_sha256 {
        assert_eq!(&sha256_file(&e.path.join(f)).unwrap(), h);
    }
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(e.path.join(METADATA_FILE)).unwrap())
            .unwrap();
    assert_eq!(
        meta,
        json!({"version": 1, "name": "support", "parent": null})
    );
    // No temporary directory is left behind.
    let siblings: Vec<_> = std::fs::read_dir(e.path.parent().unwrap())
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(siblings, vec!["v1".to_string()]);
    // The stored entry round-trips exactly (empty arrays and floats included).
    assert_eq!(reg.get("support", 1).await.unwrap().unwrap(), e);
    assert!(reg.get("support", 2).await.unwrap().is_none());
    // The files load back as the same adapter.
    let back = Adapter::load_peft(&e.path, "back", &model_cfg(), &Device::Cpu).unwrap();
    let (t0, t1) = (a.tensors().unwrap(), back.tensors().unwrap());
    for (k, v) in &t0 {
        let d = (v - &t1[k]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k}");
    }

    reg.verify(&e).await.unwrap();
    // One flipped byte in the weights fails verification.
    let w = e.path.join(WEIGHTS_FILE);
    let mut bytes = std::fs::read(&w).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&w, bytes).unwrap();
    match reg.verify(&e).await {
        Err(RegistryError::Mismatch { path, .. }) => assert_eq!(path, w),
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // So does a missing file.
    let e2 = reg
        .register(new_version("support", &a, Some(1)))
        .await
        .unwrap();
    std::fs::remove_file(e2.path.join(METADATA_FILE)).unwrap();
    match reg.verify(&e2).await {
        Err(RegistryError::Mismatch { actual, .. }) => assert_eq!(actual, "missing"),
        other => panic!("expected a mismatch, got {other:?}"),
    }
    cleanup(&reg).await;
}

#[tokio::test]
async fn versions_increment_list_is_sorted_and_one_version_is_live() {
    let (reg, _dir) = registry().await;
    let a = adapter(2, LoraInit::Peft);
    // Interleave two names; concurrent registrations get distinct versions.
    let (x, y, z) = tokio::join!(
        reg.register(new_version("beta", &a, None)),
        reg.register(new_version("beta", &a, None)),
        reg.register(new_version("alpha", &a, None)),
    );
    let mut beta = [x.unwrap().version, y.unwrap().version];
    beta.sort();
    assert_eq!(beta, [1, 2]);
    assert_eq!(z.unwrap().version, 1);
    let b3 = reg
        .register(new_version("beta", &a, Some(2)))
        .await
        .unwrap();
    assert_eq!((b3.version, b3.parent), (3, Some(2)));

    let all: Vec<(String, u64)> = reg
        .list(None)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.version))
        .collect();
    let want = [("alpha", 1), ("beta", 1), ("beta", 2), ("beta", 3)];
    assert_eq!(
        all,
        want.iter()
            .map(|(n, v)| (n.to_string(), *v))
            .collect::<Vec<_>>()
    );
    assert_eq!(reg.list(Some("beta")).await.unwrap().len(), 3);
    assert!(reg.list(Some("nobody")).await.unwrap().is_empty());

    assert!(reg.live("beta").await.unwrap().is_none());
    let l1 = reg
        .set_status("beta", 1, VersionStatus::Live, None, Some("first".into()))
        .await
        .unwrap();
    assert_eq!(l1.status, VersionStatus::Live);
    assert_eq!(reg.live("beta").await.unwrap().unwrap().version, 1);
    // Setting v2 live retires v1.
    let eval = json!({"verdict": "accepted", "candidate": {"exact_match": 0.5}, "live": {"exact_match": 0.25}});
    let l2 = reg
        .set_status("beta", 2, VersionStatus::Live, Some(eval.clone()), None)
        .await
        .unwrap();
    assert_eq!(l2.eval, Some(eval));
    assert_eq!(reg.live("beta").await.unwrap().unwrap().version, 2);
    let v1 = reg.get("beta", 1).await.unwrap().unwrap();
    assert_eq!(v1.status, VersionStatus::Retired);
    assert_eq!(v1.note.as_deref(), Some("replaced by version 2"));
    // Rejecting a candidate leaves the live one alone.
    reg.set_status(
        "beta",
        3,
        VersionStatus::Rejected,
        None,
        Some("worse".into()),
    )
    .await
    .unwrap();
    assert_eq!(reg.live("beta").await.unwrap().unwrap().version, 2);
    // Concurrent promotions: exactly one live version in the end.
    let (p, q) = tokio::join!(
        reg.set_status("beta", 1, VersionStatus::Live, None, None),
        reg.set_status("beta", 3, VersionStatus::Live, None, None),
    );
    p.unwrap();
    q.unwrap();
    let lives: Vec<u64> = reg
        .list(Some("beta"))
        .await
        .unwrap()
        .iter()
        .filter(|e| e.status == VersionStatus::Live)
        .map(|e| e.version)
        .collect();
    assert_eq!(lives.len(), 1, "{lives:?}");
    assert_eq!(reg.live("beta").await.unwrap().unwrap().version, lives[0]);
    // Retiring the live version leaves none live.
    reg.set_status("beta", lives[0], VersionStatus::Retired, None, None)
        .await
        .unwrap();
    assert!(reg.live("beta").await.unwrap().is_none());
    assert!(matches!(
        reg.set_status("beta", 9, VersionStatus::Live, None, None)
            .await,
        Err(RegistryError::NotFound { version: 9, .. })
    ));
    assert!(matches!(
        reg.register(new_version("../x", &a, None)).await,
        Err(RegistryError::Invalid(_))
    ));
    cleanup(&reg).await;
}

#[tokio::test]
async fn diff_matches_explicit_delta_weights() {
    let (reg, _dir) = registry().await;
    let cfg = model_cfg();
    let a = adapter(3, LoraInit::RandomB(0.2));
    let b = adapter(4, LoraInit::RandomB(0.2));
    let ea = reg.register(new_version("d", &a, None)).await.unwrap();
    let mut nb = new_version("d", &b, Some(1));
    nb.examples = 64;
    let eb = reg.register(nb).await.unwrap();

    let d = diff(&ea, &eb).unwrap();
    assert_eq!(d["summary"]["modules_compared"], 3 * cfg.num_layers);
    assert_eq!(d["summary"]["modules_changed"], 3 * cfg.num_layers);
    assert!(d["metadata"].get("examples").is_some());
    assert!(d["metadata"].get("parent").is_some());
    assert!(d["metadata"].get("training_config").is_none());
    assert_eq!(d["lora_config"], json!({}));
    // Reference: the norms of the explicit [out, in] deltas.
    let fro = |t: &Tensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
            .sqrt()
    };
    for m in d["modules"].as_array().unwrap() {
        let name = m["module"].as_str().unwrap();
        let parts: Vec<&str> = name.split('.').collect();
        let layer: usize = parts[1].parse().unwrap();
        let target = LoraTarget::from_hf_name(parts[3]).unwrap();
        let da = a.delta_weight(layer, target).unwrap().unwrap();
        let db = b.delta_weight(layer, target).unwrap().unwrap();
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * y.abs().max(1e-3);
        assert!(close(m["norm_a"].as_f64().unwrap(), fro(&da)), "{m}");
        assert!(close(m["norm_b"].as_f64().unwrap(), fro(&db)), "{m}");
        let dd = (&db - &da).unwrap();
        assert!(close(m["diff_norm"].as_f64().unwrap(), fro(&dd)), "{m}");
    }
    // A version compared with itself: nothing changed.
    let same = diff(&eb, &eb).unwrap();
    assert_eq!(same["summary"]["modules_changed"], 0);
    assert_eq!(same["summary"]["total_diff_norm"], 0.0);
    assert_eq!(same["metadata"], json!({}));
    // The readable renderings do not fail and name what matters.
    let text = render_diff(&d);
    assert!(
        text.contains("d@1 vs d@2")
            && text.contains("examples: 32 → 64")
            && text.contains("files_sha256.adapter_model.safetensors: ")
            && !text.contains("files_sha256.adapter_config.json"),
        "{text}"
    );
    let table = render_table(&reg.list(Some("d")).await.unwrap(), false);
    assert!(table.starts_with("VERSION"), "{table}");
    assert_eq!(table.lines().count(), 3, "{table}");
    assert!(render_entry(&eb).contains("hindsight.episodes[0] 10..42"));
    // Every view `hindsight adapters` prints, against this registry.
    for json in [false, true] {
        report::list(&reg, None, json).await.unwrap();
        report::list(&reg, Some("d"), json).await.unwrap();
        report::show(&reg, "d", 2, json).await.unwrap();
        report::compare(&reg, "d", 1, 2, json).await.unwrap();
    }
    assert!(matches!(
        report::show(&reg, "d", 7, false).await,
        Err(RegistryError::NotFound { version: 7, .. })
    ));
    cleanup(&reg).await;
}

#[test]
fn config_defaults_and_unknown_fields() {
    let c: RegistryConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(c, RegistryConfig::default());
    assert!(serde_json::from_str::<RegistryConfig>(r#"{"adapter_directory": "x"}"#).is_err());
}

/// The controller's per-tick reconciliation repairs a registry that missed a rollout decision
/// (a writer that gave up during a Redis outage): the canary's status follows the route.
#[tokio::test]
async fn reconcile_brings_the_registry_in_line_with_the_rollout() {
    use hindsight_routing::{Change, Rollout, RolloutState, Route};
    let (reg, _dir) = registry().await;
    let a = adapter(3, LoraInit::Peft);
    let e = reg.register(new_version("recon", &a, None)).await.unwrap();
    assert_eq!(e.status, VersionStatus::Candidate);
    let change = Change {
        id: "c1".into(),
        by: "controller".into(),
        action: "advance".into(),
        reason: "promote: stage minimums met".into(),
        at_ms: 1,
    };
    let mut route = Route::new("support", "base", change);
    route.generation = 4;
    route.rollout = Some(Rollout {
        id: "r1".into(),
        canary: format!("recon@{}", e.version),
        weight: 1.0,
        stage: 2,
        stages: vec![0.25, 0.5, 1.0],
        state: RolloutState::Running,
        started_ms: 1,
        stage_started_ms: 1,
    });
    let status = || async { reg.get("recon", e.version).await.unwrap().unwrap().status };
    crate::rollout::lineage::reconcile(&reg, &route)
        .await
        .unwrap();
    assert_eq!(status().await, VersionStatus::Canary);
    for (state, want) in [
        (RolloutState::Promoted, VersionStatus::Live),
        (RolloutState::RolledBack, VersionStatus::RolledBack),
    ] {
        route.rollout.as_mut().unwrap().state = state;
        crate::rollout::lineage::reconcile(&reg, &route)
            .await
            .unwrap();
        assert_eq!(status().await, want, "{state}");
        let before = reg.get("recon", e.version).await.unwrap().unwrap();
        crate::rollout::lineage::reconcile(&reg, &route)
            .await
            .unwrap();
        let after = reg.get("recon", e.version).await.unwrap().unwrap();
        assert_eq!(
            before.updated_at_ms, after.updated_at_ms,
            "agreeing: no write"
        );
    }
    // A route whose canary is the base model or an unknown version changes nothing.
    route.rollout.as_mut().unwrap().canary = "SmolLM2-135M-Instruct".into();
    crate::rollout::lineage::reconcile(&reg, &route)
        .await
        .unwrap();
    cleanup(&reg).await;
}
