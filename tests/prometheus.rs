//! Prometheus and Grafana (deploy/prometheus/, deploy/grafana/): a real Prometheus (Debian's
//! package, installed by `deploy/services.sh`) scrapes `hindsight proxy`, `hindsight join` and
//! `hindsight rollout run` processes on the real broker and Redis, with deploy/prometheus's job
//! names and rules, and the key series are read back through its HTTP API; promtool checks the
//! config and the rules and runs the rules' unit tests; the dashboard validates against
//! Grafana's schema (deploy/grafana/dashboard.schema.json, from npm's @grafana/schema) and every
//! panel's query is parsed and evaluated by that Prometheus.
//!
//! The learner is not started here (it loads a model and trains); its `/metrics` listener is
//! the one `hindsight join` uses, and its series are checked by name against the code.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hindsight_routing::{RoutingStore, StoreConfig};
use serde_json::{json, Value};
use support::{brokers, check, free_port, start_chat_upstream};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}

fn deploy(path: &str) -> PathBuf {
    Path::new(ROOT).join("deploy").join(path)
}

/// Every `hindsight_*` name written as a string literal in the crates' sources: the metrics
/// the code can export.
fn exported_metric_names() -> BTreeSet<String> {
    fn walk(dir: &Path, names: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, names);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                for (i, _) in text.match_indices("\"hindsight_") {
                    let name: String = text[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if text[i + 1 + name.len()..].starts_with('"') {
                        names.insert(name);
                    }
                }
            }
        }
    }
    let mut names = BTreeSet::new();
    for krate in [
        "src", "core", "routing", "proxy", "feedback", "learner", "control", "serve",
    ] {
        let dir = Path::new(ROOT).join(krate);
        walk(
            &if krate == "src" { dir } else { dir.join("src") },
            &mut names,
        );
    }
    names
}

/// The `hindsight_*` series names a PromQL text (or a whole rules file) mentions.
fn series_named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("hindsight_") {
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

/// Names in `used` that the code does not export (a histogram's `_bucket`, `_sum` and
/// `_count` series count as their histogram).
fn unknown_series(used: &BTreeSet<String>, exported: &BTreeSet<String>) -> Vec<String> {
    used.iter()
        .filter(|n| {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n);
            !exported.contains(*n) && !exported.contains(base)
        })
        .cloned()
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&std::fs::read_to_string(deploy("grafana/hindsight.json")).unwrap())
        .unwrap()
}

/// Every panel query of the dashboard, rows' nested panels included.
fn dashboard_exprs(d: &Value) -> Vec<String> {
    fn panels(list: &Value, out: &mut Vec<String>) {
        for p in list.as_array().into_iter().flatten() {
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push(e.to_string());
                }
            }
            panels(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&d["panels"], &mut out);
    out
}

/// The job names deploy/prometheus/prometheus.yml scrapes (commented-out jobs excluded).
fn deploy_jobs() -> BTreeSet<String> {
    std::fs::read_to_string(deploy("prometheus/prometheus.yml"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- job_name:"))
        .map(|j| j.trim().to_string())
        .collect()
}

#[test]
fn promtool_passes_the_config_the_rules_and_their_unit_tests() {
    let said = check(
        "promtool",
        &["check", "config", "deploy/prometheus/prometheus.yml"],
    );
    assert!(said.contains("SUCCESS"), "{said}");
    check(
        "promtool",
        &["check", "rules", "deploy/prometheus/rules.yml"],
    );
    let said = check(
        "promtool",
        &["test", "rules", "deploy/prometheus/rules_test.yml"],
    );
    assert!(said.contains("SUCCESS"), "{said}");
    // Every alert has unit tests.
    let rules = std::fs::read_to_string(deploy("prometheus/rules.yml")).unwrap();
    let tests = std::fs::read_to_string(deploy("prometheus/rules_test.yml")).unwrap();
    for alert in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert:"))
    {
        assert!(
            tests.contains(&format!("alertname: {}", alert.trim())),
            "alert {alert} has no test in rules_test.yml"
        );
    }
}

#[test]
fn rules_and_dashboard_name_only_series_the_code_exports() {
    let exported = exported_metric_names();
    assert!(exported.contains("hindsight_proxy_requests_total"));
    assert!(exported.contains("hindsight_log_broker_unreachable"));
    let rules = std::fs::read_to_string(deploy("prometheus/rules.yml")).unwrap();
    let unknown = unknown_series(&series_named(&rules), &exported);
    assert!(
        unknown.is_empty(),
        "rules.yml names series no code exports: {unknown:?}"
    );
    let exprs = dashboard_exprs(&dashboard());
    assert!(exprs.len() >= 20, "{exprs:?}");
    let unknown = unknown_series(&series_named(&exprs.join("\n")), &exported);
    assert!(
        unknown.is_empty(),
        "hindsight.json names series no code exports: {unknown:?}"
    );
}

#[test]
fn the_dashboard_validates_against_grafanas_dashboard_schema() {
    let said = check(
        "check-jsonschema",
        &[
            "--schemafile",
            "deploy/grafana/dashboard.schema.json",
            "deploy/grafana/hindsight.json",
        ],
    );
    assert!(said.contains("ok"), "{said}");
    // The schema is strict: an unknown panel key is refused.
    let mut broken = dashboard();
    broken["panels"][1]["colour"] = json!("red");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.json");
    std::fs::write(&path, broken.to_string()).unwrap();
    let out = Command::new("check-jsonschema")
        .args(["--schemafile", "deploy/grafana/dashboard.schema.json"])
        .arg(&path)
        .current_dir(ROOT)
        .output()
        .unwrap();
    assert!(!out.status.success(), "an unknown panel key passed");
}

/// A child process, SIGKILLed on drop; its stderr goes to `log`.
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &'static str, dir: &Path, cmd: &mut Command) -> Self {
        let log = dir.join(format!("{name}.log"));
        let child = cmd
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { name, child, log }
    }

    fn hindsight(name: &'static str, dir: &Path, args: &[&str]) -> Self {
        Self::spawn(
            name,
            dir,
            Command::new(env!("CARGO_BIN_EXE_hindsight")).args(args),
        )
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<_> = text.lines().collect();
        let from = lines.len().saturating_sub(15);
        format!("--- {} ---\n{}\n", self.name, lines[from..].join("\n"))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_port(port: u16, what: &Process) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{} did not listen on {port}\n{}",
            what.name,
            what.tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Prometheus's HTTP API.
struct PromApi {
    client: reqwest::Client,
    base: String,
}

impl PromApi {
    /// The raw answer of an instant query.
    async fn raw(&self, q: &str) -> Value {
        self.client
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", q)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// The samples of an instant query: (labels, value).
    async fn query(&self, q: &str) -> Vec<(Value, f64)> {
        let v = self.raw(q).await;
        assert_eq!(v["status"], "success", "{q}: {v}");
        v["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let value = s["value"][1].as_str().unwrap().parse().unwrap();
                (s["metric"].clone(), value)
            })
            .collect()
    }

    /// The single value of a query that sums to one sample (`None` while it has none).
    async fn value(&self, q: &str) -> Option<f64> {
        self.query(q).await.first().map(|(_, v)| *v)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_running_processes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let id = uuid::Uuid::now_v7().simple().to_string();
    let topics = format!("test-prom-{id}");
    let prefix = format!("hindsight:test:prom:{id}");
    let redis = redis_url();
    let brokers = brokers();

    // The proxy in front of the mock model, with the feedback API (unsigned: no secrets) and
    // a routing table for the route `support`.
    let upstream = start_chat_upstream().await;
    let (proxy_port, proxy_admin) = (free_port(), free_port());
    std::fs::write(
        d.join("proxy.toml"),
        format!(
            r#"[proxy]
listen_addr = "127.0.0.1:{proxy_port}"
admin_addr = "127.0.0.1:{proxy_admin}"
upstream_url = "http://{upstream}"
route = "support"
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[routing]
redis_url = "{redis}"
key_prefix = "{prefix}:routing"
[[routing.routes]]
model = "support"
stable = "support@1"
"#,
            spill = d.join("spill-proxy").display(),
        ),
    )
    .unwrap();
    let proxy = Process::hindsight(
        "proxy",
        d,
        &["proxy", "--config", d.join("proxy.toml").to_str().unwrap()],
    );

    // The joiner, scrapeable through --metrics-listen.
    let join_metrics = free_port();
    std::fs::write(
        d.join("join.toml"),
        format!(
            r#"[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
[joiner]
group_id = "prom-joiner-{id}"
redis_url = "{redis}"
redis_key_prefix = "{prefix}:join:"
"#
        ),
    )
    .unwrap();
    let join = Process::hindsight(
        "join",
        d,
        &[
            "join",
            "--config",
            d.join("join.toml").to_str().unwrap(),
            "--metrics-listen",
            &format!("127.0.0.1:{join_metrics}"),
        ],
    );

    // The rollout controller; a canary runs, and a newer candidate supersedes it: two
    // decisions (rollback, cause superseded; start, cause queue) for the counters.
    let rollout_admin = free_port();
    let rollout_cfg = d.join("rollout.toml");
    std::fs::write(
        &rollout_cfg,
        format!(
            r#"[routing]
redis_url = "{redis}"
key_prefix = "{prefix}:routing"
[registry]
redis_url = "{redis}"
key_prefix = "{prefix}:registry"
[log]
brokers = "{brokers}"
topic_prefix = "{topics}"
spill_dir = "{spill}"
[rollout]
admin_addr = "127.0.0.1:{rollout_admin}"
eval_interval_ms = 200
on_new_candidate = "supersede"
"#,
            spill = d.join("spill-rollout").display(),
        ),
    )
    .unwrap();
    for args in [
        ["set-stable", "support", "support@1"],
        ["start", "support", "support@2"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_hindsight"))
            .args(["rollout", "--config"])
            .arg(&rollout_cfg)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "rollout {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rollout = Process::hindsight(
        "rollout",
        d,
        &["rollout", "--config", rollout_cfg.to_str().unwrap(), "run"],
    );
    wait_port(proxy_admin, &proxy);
    wait_port(join_metrics, &join);
    wait_port(rollout_admin, &rollout);

    // Prometheus with deploy/prometheus's job names and rules, scraping every second.
    let jobs = deploy_jobs();
    let started: [(&str, u16); 3] = [
        ("hindsight-proxy", proxy_admin),
        ("hindsight-join", join_metrics),
        ("hindsight-rollout", rollout_admin),
    ];
    for (job, _) in &started {
        assert!(jobs.contains(*job), "deploy's prometheus.yml lacks {job}");
    }
    let mut cfg = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n",
        deploy("prometheus/rules.yml").display()
    );
    for (job, port) in &started {
        cfg += &format!(
            "  - job_name: {job}\n    static_configs:\n      - targets: [\"127.0.0.1:{port}\"]\n"
        );
    }
    std::fs::write(d.join("prometheus.yml"), &cfg).unwrap();
    check(
        "promtool",
        &[
            "check",
            "config",
            d.join("prometheus.yml").to_str().unwrap(),
        ],
    );
    let prom_port = free_port();
    let prometheus = Process::spawn(
        "prometheus",
        d,
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                d.join("prometheus.yml").display()
            ))
            .arg(format!("--storage.tsdb.path={}", d.join("tsdb").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}")),
    );
    let client = reqwest::Client::new();
    let api = PromApi {
        client: client.clone(),
        base: format!("http://127.0.0.1:{prom_port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = client
            .get(format!("{}/-/ready", api.base))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prometheus not ready\n{}",
            prometheus.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Traffic: 5 chat calls, each with a thumbs-up through the proxy's feedback API.
    const CALLS: usize = 5;
    for i in 0..CALLS {
        let r = client
            .post(format!(
                "http://127.0.0.1:{proxy_port}/v1/chat/completions"
            ))
            .header("x-hindsight-episode", format!("prom-{id}-{i}"))
            .json(&json!({"model": "support", "messages": [{"role": "user", "content": format!("hello {i}")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let iid = r.headers()["x-hindsight-interaction-id"]
            .to_str()
            .unwrap()
            .to_string();
        r.bytes().await.unwrap();
        let f = client
            .post(format!(
                "http://127.0.0.1:{proxy_port}/hindsight/v1/feedback"
            ))
            .json(&json!({"interaction_id": iid, "kind": "thumbs", "value": true}))
            .send()
            .await
            .unwrap();
        let status = f.status();
        assert!(
            status.is_success(),
            "feedback: {status} {}",
            f.text().await.unwrap()
        );
    }
    // The learner's hand-over of a newer candidate.
    let store = RoutingStore::new(StoreConfig {
        redis_url: redis.clone(),
        key_prefix: format!("{prefix}:routing"),
        retry_for_ms: 30_000,
    })
    .unwrap();
    hindsight_control::rollout::queue::enqueue(&store, "support", "support@3")
        .await
        .unwrap();

    // What Prometheus must have scraped.
    let n = CALLS as f64;
    let want: Vec<(String, f64)> = vec![
        (r#"up{job="hindsight-proxy"}"#.into(), 1.0),
        (r#"up{job="hindsight-join"}"#.into(), 1.0),
        (r#"up{job="hindsight-rollout"}"#.into(), 1.0),
        // The feedback API's calls go through the proxy's stack too.
        (
            r#"sum(hindsight_proxy_requests_total{job="hindsight-proxy", route="support", status_class="2xx"})"#.into(),
            2.0 * n,
        ),
        (
            r#"sum(hindsight_proxy_routed_total{job="hindsight-proxy"})"#.into(),
            n,
        ),
        (
            r#"sum(hindsight_log_delivered_records_total{job="hindsight-proxy", topic="interactions"})"#.into(),
            n,
        ),
        (
            r#"sum(hindsight_log_delivered_records_total{job="hindsight-proxy", topic="feedback"})"#.into(),
            n,
        ),
        (
            r#"max(hindsight_log_broker_unreachable{job="hindsight-proxy"})"#.into(),
            0.0,
        ),
        (
            r#"max(hindsight_log_spill_pending_records{job="hindsight-proxy"})"#.into(),
            0.0,
        ),
        (
            r#"sum(hindsight_feedback_events_total{job="hindsight-proxy", kind="thumbs"})"#
                .into(),
            n,
        ),
        (
            r#"sum(hindsight_join_interactions_total{job="hindsight-join"})"#.into(),
            n,
        ),
        (
            r#"sum(hindsight_join_feedback_total{job="hindsight-join"})"#.into(),
            n,
        ),
        (
            r#"count(hindsight_join_lag_seconds{job="hindsight-join"} >= 0)"#.into(),
            1.0,
        ),
        (
            r#"sum(hindsight_rollout_decisions_total{job="hindsight-rollout", route="support", action="rollback", cause="superseded"})"#.into(),
            1.0,
        ),
        (
            r#"sum(hindsight_rollout_decisions_total{job="hindsight-rollout", route="support", action="start", cause="queue"})"#.into(),
            1.0,
        ),
        (
            r#"max(hindsight_log_broker_unreachable{job="hindsight-rollout"})"#.into(),
            0.0,
        ),
        // Registered at zero before any alarm, so the first one is an increase.
        (
            r#"sum(hindsight_rollout_decisions_total{job="hindsight-rollout", route="support", action="rollback", cause="alarm"})"#.into(),
            0.0,
        ),
    ];
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let mut missing = Vec::new();
        for (q, v) in &want {
            let got = api.value(q).await;
            if got != Some(*v) {
                missing.push(format!("{q} = {got:?}, want {v}"));
            }
        }
        if missing.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            panic!(
                "Prometheus did not see:\n{}\n{}{}{}{}",
                missing.join("\n"),
                proxy.tail(),
                join.tail(),
                rollout.tail(),
                prometheus.tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The rules loaded into the real server, every group healthy.
    let rules: Value = client
        .get(format!("{}/api/v1/rules", api.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let groups = rules["data"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{rules}");
    for g in groups {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "rule {}: {r}", r["name"]);
        }
    }
    // Healthy traffic fires no alert.
    let firing = api.query(r#"ALERTS{alertstate="firing"}"#).await;
    assert!(firing.is_empty(), "{firing:?}");

    // Every dashboard query parses and evaluates here, with Grafana's variables as Grafana
    // would substitute them; those on series this loop exports return data once a few scrapes
    // are in (a rate needs two samples).
    let deadline = Instant::now() + Duration::from_secs(20);
    while api
        .value(r#"min(count_over_time(up{job=~"hindsight-.*"}[1m]))"#)
        .await
        .is_none_or(|n| n < 3.0)
    {
        assert!(Instant::now() < deadline, "fewer than 3 scrapes in 20 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let key_series = [
        "hindsight_proxy_requests_total",
        "hindsight_proxy_overhead_seconds_bucket",
        "hindsight_log_delivered_records_total",
        "hindsight_feedback_events_total",
        "hindsight_join_interactions_total",
        "hindsight_join_lag_seconds",
        "hindsight_rollout_decisions_total",
    ];
    let mut with_data = BTreeSet::new();
    for expr in dashboard_exprs(&dashboard()) {
        let q = expr
            .replace("$__rate_interval", "1m")
            .replace("$job", "hindsight-.*");
        let v = api.raw(&q).await;
        assert_eq!(v["status"], "success", "dashboard query {expr}: {v}");
        if v["data"]["result"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
        {
            with_data.extend(series_named(&expr));
        }
    }
    for s in key_series {
        assert!(
            with_data.contains(s),
            "no dashboard panel on {s} shows data; panels with data: {with_data:?}"
        );
    }
}
