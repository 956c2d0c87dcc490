//! The routing table on the request path: propagation, stickiness, Redis outages, writers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hindsight_control::rollout::{self, Op};
use serde_json::json;

use crate::common::*;

/// Two proxy processes; 100 weight changes; the time until both hold each one. Then a user's
/// requests stay on one arm while the weight rises, and the split matches the weight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_changes_reach_two_proxies_within_a_second_and_assignment_is_sticky() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let topics = format!("test-{}", uuid::Uuid::now_v7().simple());
    let upstream = start_upstream("good").await;
    let p1 = Proxy::start(upstream, &redis.url(), &prefix, &topics);
    let p2 = Proxy::start(upstream, &redis.url(), &prefix, &topics);
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
    rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: (1..=100)
                .map(|i| f64::from(i) / 101.0)
                .chain([1.0])
                .collect(),
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    // Let both proxies pick up the start.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut lags_ms = Vec::new();
    for i in 0..100 {
        let (route, _) = if i < 99 {
            rollout::execute(&s, &req("test", "advance"), &Op::Advance)
                .await
                .unwrap()
        } else {
            rollout::execute(&s, &req("test", "rollback"), &Op::Rollback)
                .await
                .unwrap()
        };
        let written = Instant::now();
        for p in [&p1, &p2] {
            loop {
                if p.generation(&client).await >= route.generation {
                    break;
                }
                assert!(
                    written.elapsed() < Duration::from_secs(5),
                    "change {i} not applied in 5 s"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        lags_ms.push(written.elapsed().as_secs_f64() * 1e3);
    }
    let (p50, p99) = (quantile(&mut lags_ms, 0.5), quantile(&mut lags_ms, 0.99));
    println!("propagation to both proxies over 100 changes: p50 {p50:.1} ms, p99 {p99:.1} ms");
    assert!(p99 < 1000.0, "p99 {p99} ms");

    // Stickiness and split: a new rollout at 10%, then 50%.
    rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: vec![0.1, 0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let users: Vec<String> = (0..400).map(|i| format!("user-{i}")).collect();
    let mut first: HashMap<String, String> = HashMap::new();
    for u in &users {
        let (status, v) = p1.call(&client, u).await;
        assert_eq!(status, 200);
        // The same user through the other proxy lands on the same version.
        assert_eq!(
            p2.call(&client, u).await.1,
            v,
            "{u} changed arm between proxies"
        );
        first.insert(u.clone(), v);
    }
    let canary_10 = first.values().filter(|v| *v == "support@2").count() as f64;
    rollout::execute(&s, &req("test", "advance"), &Op::Advance)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut canary_50 = 0.0;
    for u in &users {
        // The same conversation keeps its version while the rollout runs ...
        assert_eq!(
            p1.call(&client, u).await.1,
            first[u],
            "{u}'s episode changed version mid-way"
        );
        // ... and a new one follows the new weight, monotonically.
        let v = p1.call_in(&client, u, "a new question").await.1;
        if first[u] == "support@2" {
            assert_eq!(v, "support@2", "{u} left the canary when the weight rose");
        }
        canary_50 += f64::from(v == "support@2");
    }
    // Chi-square (1 dof) of the observed split against the weight: below 10.83 (p = 0.001).
    let chi = |k: f64, p: f64| {
        let n = users.len() as f64;
        (k - n * p).powi(2) / (n * p) + ((n - k) - n * (1.0 - p)).powi(2) / (n * (1.0 - p))
    };
    println!("split at 10%: {canary_10}/400, at 50%: {canary_50}/400");
    assert!(chi(canary_10, 0.1) < 10.83, "10% split: {canary_10}/400");
    assert!(chi(canary_50, 0.5) < 10.83, "50% split: {canary_50}/400");
    // Users who open their conversations identically still get their own arms.
    let mut same_opening = 0.0;
    for u in &users {
        let resp = client
            .post(format!("http://127.0.0.1:{}/v1/chat/completions", p1.port))
            .header("x-hindsight-user", u.as_str())
            .json(&json!({"model": "support", "messages": [{"role": "system", "content": "You are support."}, {"role": "user", "content": "Hi"}]}))
            .send()
            .await
            .unwrap();
        same_opening += f64::from(resp.headers()["x-hindsight-adapter"] == "support@2");
    }
    println!("identical openings at 50%: {same_opening}/400 on the canary");
    assert!(
        chi(same_opening, 0.5) < 10.83,
        "identical openings: {same_opening}/400"
    );
}

/// Redis SIGKILLed during traffic: no client error, the last table kept (canary users stay on
/// the canary), and changes made after Redis returns reach the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_costs_no_request_and_the_proxy_catches_up() {
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
    let (route, _) = rollout::execute(
        &s,
        &req("test", "start"),
        &Op::Start {
            canary: "support@2".into(),
            stages: vec![0.5, 1.0],
            rollout_id: None,
        },
    )
    .await
    .unwrap();
    while p.generation(&client).await < route.generation {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before: Vec<(u16, String)> = futures_join(&p, &client, 100).await;
    let (port, dir) = redis.kill();
    let mut errors = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let during = futures_join(&p, &client, 100).await;
        errors += during.iter().filter(|(s, _)| *s != 200).count();
        assert_eq!(
            during.iter().map(|x| &x.1).collect::<Vec<_>>(),
            before.iter().map(|x| &x.1).collect::<Vec<_>>(),
            "the table held during the outage changed"
        );
    }
    assert_eq!(errors, 0, "client errors during the Redis outage");
    assert_eq!(p.table(&client).await["stale"], true);
    let redis = Redis::start_on(port, dir);
    let s = store(&redis.url(), &prefix);
    let (route, _) = rollout::execute(&s, &req("test", "kill"), &Op::Kill)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.generation(&client).await < route.generation {
        assert!(
            Instant::now() < deadline,
            "the proxy did not catch up after Redis returned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(p.table(&client).await["stale"], false);
    let after = futures_join(&p, &client, 100).await;
    assert!(
        after.iter().all(|(s, v)| *s == 200 && v == "support@1"),
        "kill did not send everyone to stable"
    );
    // A malformed entry written behind the control plane's back: counted, logged, ignored; the
    // proxy keeps the last good route.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(format!("{prefix}:table"))
        .arg("support")
        .arg("{not json")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .unwrap();
    let _: () = redis::cmd("PUBLISH")
        .arg(format!("{prefix}:changes"))
        .arg("support")
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        p.generation(&client).await,
        route.generation,
        "the proxy dropped its last good route"
    );
    assert!(futures_join(&p, &client, 20)
        .await
        .iter()
        .all(|(s, v)| *s == 200 && v == "support@1"));
    let metrics = client
        .get(format!("http://127.0.0.1:{}/metrics", p.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("hindsight_routing_invalid_entries_total"),
        "{metrics}"
    );
}

/// An operator and the controller writing at once: every write lands or is refused, none is
/// lost (compare-and-set on the generation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_lose_no_update() {
    let redis = Redis::start();
    let prefix = format!("hindsight:test:{}", uuid::Uuid::now_v7().simple());
    let s = Arc::new(store(&redis.url(), &prefix));
    rollout::execute(
        &s,
        &req("test", "init"),
        &Op::SetStable {
            stable: "support@1".into(),
        },
    )
    .await
    .unwrap();
    let mut tasks = Vec::new();
    for w in 0..2 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..40 {
                let user = format!("w{w}-u{i}");
                rollout::execute(
                    &s,
                    &req("w", "pin"),
                    &Op::Pin {
                        user,
                        version: "support@1".into(),
                    },
                )
                .await
                .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let r = s.get("support").await.unwrap().unwrap();
    assert_eq!(r.pins.len(), 80, "a concurrent write was lost");
    assert_eq!(r.generation, 81);
    assert_eq!(s.audit("support", 1000).await.unwrap().len(), 81);
    // A command based on an old generation is refused and changes nothing.
    let mut stale = req("op", "late");
    stale.expected_generation = Some(3);
    let err = rollout::execute(
        &s,
        &stale,
        &Op::Unpin {
            user: "w0-u0".into(),
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("changed since"), "{err}");
    assert_eq!(s.get("support").await.unwrap().unwrap().generation, 81);
}
