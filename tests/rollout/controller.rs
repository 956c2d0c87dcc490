//! The rollout controller: its decisions on traffic, as a library and as a process.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_control::rollout::{self, Controller, Op, RolloutConfig};
use hindsight_feedback::{LogConfig, Topic};
use serde_json::{json, Value};

use crate::common::*;

/// The controller on simulated traffic through a proxy process: a harmful canary (errors and
/// complaints) is rolled back by itself; a good one is promoted through every stage; a canary
/// whose answers are much shorter, or that stops calling tools, freezes on the drift alarm
/// though its feedback is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_rolls_back_harm_promotes_good_and_freezes_on_drift() {
    for (mode, expect) in [
        ("error", "rolled_back"),
        ("good", "promoted"),
        ("short", "frozen"),
        ("notools", "frozen"),
    ] {
        let redis = Redis::start();
        let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
        let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
        let upstream = start_upstream(mode).await;
        let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
        let s = store(&redis.url(), &prefix);
        let client = reqwest::Client::new();
        rollout::execute(
            &s,
            &req("test", "init"),
            &Op::SetStable {
                stable: "support@1".into(),
            },
        )
        .await
        .unwrap();
        let cfg = RolloutConfig {
            stages: vec![0.2, 0.5, 1.0],
            min_stage_ms: 0,
            min_exposures: 50,
            min_matured_feedback: 20,
            maturation_ms: 0,
            length_ratio: 1.5,
            // Answers here are a dozen words; a tight honest bound keeps the drift test quick.
            length_bound_tokens: 16.0,
            tool_calls_bound: 2.0,
            ..RolloutConfig::default()
        };
        cfg.validate().unwrap();
        let (route, _) = rollout::execute(
            &s,
            &req("operator:test", "start"),
            &Op::Start {
                canary: "support@2".into(),
                stages: cfg.stages.clone(),
                rollout_id: None,
            },
        )
        .await
        .unwrap();
        while p.generation(&client).await < route.generation {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log = LogConfig {
            brokers: brokers(),
            topic_prefix: topics.clone(),
            spill_dir: tempfile::tempdir().unwrap().keep(),
            ..LogConfig::default()
        }
        .validate()
        .unwrap();
        let (audit_log, handle) = rollout::controller::audit_log(log.clone()).await.unwrap();
        let mut controller =
            Controller::new(cfg.clone(), store(&redis.url(), &prefix), handle).unwrap();
        let reader = hindsight_feedback::TopicReader::new(
            &log,
            &format!("t-{}", uuid::Uuid::now_v7()),
            &[Topic::Interactions],
        )
        .unwrap();
        let mut served_by_canary = 0;
        let mut state = String::new();
        for round in 0..60 {
            for i in 0..20 {
                p.call(&client, &format!("r{round}-u{i}")).await;
            }
            // Read what the proxy logged, answer as the simulated users would, feed both.
            while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(300)).await {
                controller.observe(Topic::Interactions, &rec.payload);
                let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
                let a = ir.assignment.clone().unwrap();
                served_by_canary += usize::from(a.arm == "canary");
                let bad = ir.status != 200;
                let fb = thumbs(ir.interaction_id, !bad);
                controller.observe(Topic::Feedback, &serde_json::to_vec(&fb).unwrap());
            }
            controller.tick().await.unwrap();
            let r = s.get("support").await.unwrap().unwrap();
            state = r.rollout.as_ref().unwrap().state.to_string();
            if state != "running" {
                break;
            }
        }
        audit_log.shutdown(Duration::from_secs(10)).await;
        let trail = s.audit("support", 100).await.unwrap();
        println!(
            "{mode}: {state} after {served_by_canary} canary requests; audit trail (newest first):"
        );
        for a in &trail {
            println!(
                "  gen {} {} by {} at weight {}: {}",
                a.generation, a.action, a.by, a.weight, a.reason
            );
        }
        assert_eq!(state, expect, "{mode} canary");
        assert!(
            trail.iter().any(|a| a.by == "controller"),
            "no controller decision audited"
        );
    }
}

/// The whole control plane as processes: `hindsight rollout run` (the controller, reading the
/// proxy's records and the users' feedback from Kafka) rolls back a harmful canary by itself;
/// its admin API refuses commands without the token and kills a rollout with it; the CLI
/// prints the status and the audit trail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_process_rolls_back_from_kafka_and_answers_operators() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("error").await;
    let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    let dir = tempfile::tempdir().unwrap();
    let admin_port = free_port();
    let token = "test-token-0123456789abcdef";
    let cfg = dir.path().join("rollout.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[routing]
redis_url = "{url}"
key_prefix = "{prefix}"
[registry]
redis_url = "{url}"
key_prefix = "{prefix}:registry"
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[rollout]
stages = [0.3, 1.0]
min_stage_ms = 0
min_exposures = 1000
maturation_ms = 0
admin_addr = "127.0.0.1:{admin_port}"
eval_interval_ms = 200
"#,
            url = redis.url(),
            brokers = brokers(),
            spill = dir.path().join("spill").display(),
        ),
    )
    .unwrap();
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["rollout", "--config"])
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = cli(&["set-stable", "support", "support@1"]);
    assert!(ok, "{text}");
    let (ok, text) = cli(&[
        "--reason",
        "bad input",
        "start",
        "support",
        "support@2",
        "--stages",
        "0.5,0.25,1.0",
    ]);
    assert!(
        !ok && text.contains("increase"),
        "stages that do not increase: {text}"
    );
    let (ok, text) = cli(&["start", "nope", "support@2"]);
    assert!(!ok && text.contains("no route"), "unknown route: {text}");
    let (ok, text) = cli(&["start", "support", "support@2"]);
    assert!(ok, "{text}");

    let mut controller = Command::new(env!("CARGO_BIN_EXE_hindsight"))
        .env("HINDSIGHT_ROLLOUT__ADMIN_TOKEN", token)
        .args(["rollout", "--config"])
        .arg(&cfg)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: dir.path().join("spill-feedback"),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let (feedback_log, feedback) = hindsight_feedback::RecordLog::start(log.clone())
        .await
        .unwrap();
    let reader = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Interactions],
    )
    .unwrap();
    let started = Instant::now();
    let mut canary_requests = 0;
    let mut state = String::new();
    while started.elapsed() < Duration::from_secs(60) {
        for i in 0..10 {
            p.call(&client, &format!("u{}-{i}", started.elapsed().as_millis()))
                .await;
        }
        // The simulated users: a thumbs-down for every failed answer, a thumbs-up otherwise.
        while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(200)).await {
            let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
            canary_requests +=
                usize::from(ir.assignment.as_ref().is_some_and(|a| a.arm == "canary"));
            let fb = thumbs(ir.interaction_id, ir.status == 200);
            feedback.submit(
                Topic::Feedback,
                fb.target.key(),
                fb.feedback_id,
                serde_json::to_vec(&fb).unwrap().into(),
            );
        }
        state = rollout_state(&s, "support").await;
        if state != "running" {
            break;
        }
    }
    println!(
        "controller process: {state} after {canary_requests} canary requests, {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(state, "rolled_back");
    let (ok, history) = cli(&["history", "support"]);
    assert!(
        ok && history.contains("rollback")
            && history.contains("controller")
            && history.contains("harm"),
        "{history}"
    );
    println!("{history}");
    // Every decision, the operator's included, is in Kafka's hindsight.rollouts, in order.
    let rollouts = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Rollouts],
    )
    .unwrap();
    let mut in_kafka: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while in_kafka.len() < 3 && Instant::now() < deadline {
        if let Ok(Some(rec)) = rollouts.recv_timeout(Duration::from_millis(500)).await {
            let a: hindsight_routing::AuditRecord = rec.decode().unwrap();
            in_kafka.push(format!("{} by {}", a.action, a.by));
        }
    }
    assert_eq!(
        in_kafka,
        [
            "set_stable by operator:operator",
            "start by operator:operator",
            "rollback by controller"
        ],
        "the audit trail in Kafka"
    );
    let (ok, status) = cli(&["status"]);
    assert!(
        ok && status.contains("support@2") && status.contains("rolled_back"),
        "{status}"
    );

    // The admin API: 401 without the token; with it, a new rollout is started and killed.
    let api = format!("http://127.0.0.1:{admin_port}/v1/rollouts/support");
    let r = client
        .post(&api)
        .json(&json!({"action": "kill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .post(&api)
        .bearer_auth("wrong-token-0123456789")
        .json(&json!({"action": "kill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "start", "version": "support@3", "stages": [1.5]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "{}", r.text().await.unwrap());
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "start", "version": "support@3", "stages": [0.5, 1.0]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let r = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "pause", "generation": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409, "a command on an old generation");
    let killed_at = Instant::now();
    let r: Value = client
        .post(&api)
        .bearer_auth(token)
        .json(&json!({"action": "kill", "by": "oncall", "reason": "test"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let generation = r["route"]["generation"].as_u64().unwrap();
    while p.generation(&client).await < generation {
        assert!(
            killed_at.elapsed() < Duration::from_secs(1),
            "kill took over a second to reach the proxy"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(futures_join(&p, &client, 20)
        .await
        .iter()
        .all(|(_, v)| v == "support@1"));
    let metrics = client
        .get(format!("http://127.0.0.1:{admin_port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("hindsight_rollout_exposures"), "{metrics}");
    feedback_log.shutdown(Duration::from_secs(5)).await;
    let _ = controller.kill();
    let _ = controller.wait();
}

/// A new candidate while a canary runs: queued (it starts when the running one ends), or, with
/// `on_new_candidate = "supersede"`, the running canary is rolled back and the new one started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_candidate_waits_in_the_queue_or_supersedes_the_running_canary() {
    use hindsight_control::rollout::commands::{self, Actor, Command, Outcome};
    use hindsight_control::rollout::CandidatePolicy;
    for policy in [CandidatePolicy::Queue, CandidatePolicy::Supersede] {
        let redis = Redis::start();
        let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
        let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
        let s = store(&redis.url(), &prefix);
        let cfg = RolloutConfig {
            on_new_candidate: policy,
            ..RolloutConfig::default()
        };
        let actor = Actor {
            by: "operator:test",
            reason: "",
            generation: None,
        };
        commands::run(
            &s,
            None,
            &cfg,
            "support",
            &actor,
            Command::SetStable {
                version: "support@1".into(),
            },
        )
        .await
        .unwrap();
        let start = |v: &str| Command::Start {
            version: v.into(),
            stages: None,
            policy: None,
            endpoints: vec![],
        };
        commands::run(&s, None, &cfg, "support", &actor, start("support@2"))
            .await
            .unwrap();
        // The learner's hand-over: the candidate goes into the route's queue slot.
        rollout::queue::enqueue(&s, "support", "support@3")
            .await
            .unwrap();
        let (audit_log, handle) = audit_handle(&topics).await;
        let mut controller =
            Controller::new(cfg.clone(), store(&redis.url(), &prefix), handle).unwrap();
        controller.tick().await.unwrap();
        let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
        match policy {
            CandidatePolicy::Queue => {
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@2", "running"),
                    "a queued candidate displaced the running canary"
                );
                // An operator's `start` while it runs is queued too, not refused.
                let out = commands::run(&s, None, &cfg, "support", &actor, start("support@4"))
                    .await
                    .unwrap();
                assert!(
                    matches!(out, Outcome::Queued { ref version, .. } if version == "support@4"),
                    "{out:?}"
                );
                commands::run(&s, None, &cfg, "support", &actor, Command::Rollback)
                    .await
                    .unwrap();
                controller.tick().await.unwrap();
                let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@4", "running"),
                    "the newest queued candidate starts when the rollout ends"
                );
            }
            CandidatePolicy::Supersede => {
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@2", "rolled_back")
                );
                controller.tick().await.unwrap();
                let r = s.get("support").await.unwrap().unwrap().rollout.unwrap();
                assert_eq!(
                    (r.canary.as_str(), r.state.as_str()),
                    ("support@3", "running")
                );
                let trail = s.audit("support", 10).await.unwrap();
                assert!(
                    trail.iter().any(|a| a.action == "rollback"
                        && a.reason
                            .contains("superseded by the newer candidate support@3")),
                    "{trail:#?}"
                );
            }
        }
        audit_log.shutdown(Duration::from_secs(5)).await;
    }
}

/// Redis SIGKILLed in the middle of a rollout: the controller's decisions wait and resume
/// (nothing is lost: the table, its audit trail and the rollout's progress survive), and the
/// rollout still ends promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_kill_during_a_rollout_loses_no_decision() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("good").await;
    let p = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let s = store(&redis.url(), &prefix);
    let client = reqwest::Client::new();
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let cfg = RolloutConfig {
        stages: vec![0.2, 0.4, 0.6, 1.0],
        min_stage_ms: 0,
        min_exposures: 15,
        min_matured_feedback: 10,
        maturation_ms: 0,
        ..RolloutConfig::default()
    };
    rollout::execute(
        &s,
        &req("operator:test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: cfg.stages.clone(),
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    let (audit_log, handle) = audit_handle(&topics).await;
    let mut controller = Controller::new(cfg, store(&redis.url(), &prefix), handle).unwrap();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: tempfile::tempdir().unwrap().keep(),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let reader = hindsight_feedback::TopicReader::new(
        &log,
        &format!("t-{}", uuid::Uuid::now_v7()),
        &[Topic::Interactions],
    )
    .unwrap();
    let mut redis = Some(redis);
    let mut killed: Option<(u16, tempfile::TempDir)> = None;
    let mut tick_errors = 0;
    let mut state = String::new();
    for round in 0..80 {
        for i in 0..20 {
            let (status, _) = p.call(&client, &format!("r{round}-u{i}")).await;
            assert_eq!(status, 200, "a client error");
        }
        while let Ok(Some(rec)) = reader.recv_timeout(Duration::from_millis(300)).await {
            controller.observe(Topic::Interactions, &rec.payload);
            let ir: hindsight_feedback::InteractionRecord = rec.decode().unwrap();
            let fb = thumbs(ir.interaction_id, true);
            controller.observe(Topic::Feedback, &serde_json::to_vec(&fb).unwrap());
        }
        // Kill Redis once the rollout is past its first stage; bring it back two rounds later.
        let stage = if redis.is_some() {
            s.get("support")
                .await
                .unwrap()
                .unwrap()
                .rollout
                .unwrap()
                .stage
        } else {
            0
        };
        if stage >= 1 && killed.is_none() && redis.is_some() {
            killed = Some(redis.take().unwrap().kill());
            println!("redis killed at stage {stage}");
        } else if let (Some(_), None) = (&killed, &redis) {
            if tick_errors >= 2 {
                let (port, dir) = killed.take().unwrap();
                redis = Some(Redis::start_on(port, dir));
                println!("redis back after {tick_errors} failed ticks");
                killed = Some((0, tempfile::tempdir().unwrap())); // only once
            }
        }
        match tokio::time::timeout(Duration::from_secs(5), controller.tick()).await {
            Ok(Ok(())) => {}
            _ => tick_errors += 1,
        }
        if let Some(r) = &redis {
            let _ = r;
            state = rollout_state(&s, "support").await;
            if state == "promoted" {
                break;
            }
        }
    }
    audit_log.shutdown(Duration::from_secs(5)).await;
    assert!(tick_errors >= 2, "Redis was never away for the controller");
    assert_eq!(state, "promoted");
    let trail = s.audit("support", 100).await.unwrap();
    let actions: Vec<&str> = trail.iter().rev().map(|a| a.action.as_str()).collect();
    println!("audit after the Redis kill: {actions:?}");
    assert_eq!(
        actions,
        ["set_stable", "start", "advance", "advance", "advance"],
        "a decision was lost or repeated"
    );
}

/// A controller (re)started on a backlog — interactions from ten minutes ago, each answered by
/// a thumbs within seconds — matures the exposures by how far it has read the feedback topic,
/// not by the wall clock: every exposure ends with its feedback counted. Maturing by the clock
/// would close them all at the first tick, before their feedback was read, as feedback-free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_catching_up_on_a_backlog_counts_its_feedback() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    const N: usize = 400;
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let s = store(&redis.url(), &prefix);
    let set = Op::SetStable {
        stable: "support@1".into(),
    };
    rollout::execute(&s, &req("test", "init"), &set)
        .await
        .unwrap();
    let start = Op::Start {
        canary: "support@2".into(),
        stages: vec![0.5, 1.0],
        rollout_id: None,
    };
    let (route, _) = rollout::execute(&s, &req("test", "start"), &start)
        .await
        .unwrap();
    let rollout_id = route.rollout.unwrap().id;
    let dir = tempfile::tempdir().unwrap();
    let log = LogConfig {
        brokers: brokers(),
        topic_prefix: topics.clone(),
        spill_dir: dir.path().join("spill"),
        ..LogConfig::default()
    }
    .validate()
    .unwrap();
    let names = [Topic::Interactions, Topic::Feedback].map(|t| log.topics().get(t).to_string());
    hindsight_feedback::ensure_topics(&log.client_config(), &names, 1, 1, Duration::from_secs(20))
        .await
        .unwrap();
    // The canary's answers all get a thumbs-down five seconds later; the stable's a thumbs-up.
    let t0 = hindsight_feedback::now_ms() - 600_000;
    let mut records = Vec::new();
    let mut answers = Vec::new();
    for i in 0..N {
        let arm = if i % 2 == 0 { "canary" } else { "stable" };
        let at = t0 + i as i64 * 100;
        let rec = json!({
            "schema": hindsight_feedback::INTERACTION_SCHEMA,
            "interaction_id": uuid::Uuid::now_v7(),
            "episode_id": format!("ep-{i}"),
            "episode_source": "header",
            "event_time_ms": at,
            "route": "default", "method": "POST", "path": "/v1/chat/completions",
            "request": {}, "status": 200, "streamed": false,
            "response": {"choices": [{"message": {"content": "an answer"}}]},
            "timings": {"upstream_headers_ms": 5.0, "total_ms": 10.0},
            "assignment": {"route": "support", "arm": arm,
                "version": if arm == "canary" { "support@2" } else { "support@1" },
                "rollout_id": rollout_id, "probability": 0.5},
        });
        let ir: hindsight_feedback::InteractionRecord = serde_json::from_value(rec).unwrap();
        let mut fb = thumbs(ir.interaction_id, arm == "stable");
        fb.event_time_ms = at + 5_000;
        records.push((
            0,
            ir.episode_id.clone(),
            serde_json::to_vec(&ir).unwrap(),
            at,
        ));
        answers.push((
            1,
            fb.target.key(),
            serde_json::to_vec(&fb).unwrap(),
            fb.event_time_ms,
        ));
    }
    records.extend(answers);
    // The broker's timestamps are the records' own times, as if written when they happened.
    let producer: FutureProducer = log.client_config().create().unwrap();
    let sent = records.iter().map(|(topic, key, payload, ts)| {
        producer.send(
            FutureRecord::to(&names[*topic])
                .key(key)
                .payload(payload)
                .timestamp(*ts),
            Duration::from_secs(20),
        )
    });
    for r in futures::future::join_all(sent).await {
        r.map_err(|(e, _)| e).unwrap();
    }

    let cfg = RolloutConfig {
        stages: vec![0.5, 1.0],
        min_exposures: 1_000_000, // never advances: the test reads the counts
        maturation_ms: 60_000,
        eval_interval_ms: 20,
        ..RolloutConfig::default()
    };
    let (audit_log, handle) = rollout::controller::audit_log(log.clone()).await.unwrap();
    let controller = Controller::new(cfg, store(&redis.url(), &prefix), handle).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        controller
            .run(&log, async {
                let _ = stopped.await;
            })
            .await
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let canary = loop {
        let status = s.get_status("support").await.unwrap();
        let canary = status.map(|v| v["stats"]["canary"].clone());
        if let Some(c) = canary.filter(|c| c["matured"] == json!(N / 2)) {
            break c;
        }
        assert!(Instant::now() < deadline, "the backlog never matured");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    audit_log.shutdown(Duration::from_secs(10)).await;
    println!("canary after catching up: {canary}");
    assert_eq!(canary["feedback_coverage"], json!(1.0), "{canary}");
    assert_eq!(canary["negative_rate"], json!(1.0), "{canary}");
}
