//! Deploy manifests (deploy/compose.yaml, deploy/k8s/, deploy/Dockerfile's runtime layout):
//! the Kubernetes manifests validate strictly against the Kubernetes API's schemas
//! (`kubernetes-validate --strict`, a pinned release), the compose file against the Compose
//! specification (`check-jsonschema --builtin-schema vendor.compose-spec`), the ConfigMap holds
//! the example configs byte for byte, and every container's config is loaded the way its
//! process loads it: the example file plus the container's `HINDSIGHT_<SECTION>__<KEY>`
//! variables, through the same config types (unknown keys refused), then validated. From the
//! loaded config the test takes each process's listeners and the addresses it connects to, and
//! checks them against the manifests: declared ports, Services, probes, scrape annotations,
//! the compose stack's Prometheus targets.
//!
//! Nothing here starts a container or a cluster (deploy/README.md, "Compose and Kubernetes").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::Value;
use support::check;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The Kubernetes release the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.32.0";

fn deploy(path: &str) -> PathBuf {
    Path::new(ROOT).join("deploy").join(path)
}

/// The documents of a YAML file as JSON, read by PyYAML (installed with the checkers of
/// deploy/requirements-test.txt); merge keys (`<<: *anchor`) resolved.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let script = "import json, sys, yaml\n\
                  docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
                  print(json.dumps(docs))";
    let out = check("python3", &["-c", script, path.to_str().unwrap()]);
    serde_json::from_str(&out).unwrap()
}

fn yaml_doc(path: &Path) -> Value {
    let mut docs = yaml_docs(path);
    assert_eq!(docs.len(), 1, "{} holds one document", path.display());
    docs.remove(0)
}

/// A list of strings, or a single string as a list of one (compose's short forms).
fn str_list(v: &Value) -> Vec<String> {
    if let Some(s) = v.as_str() {
        return vec![s.to_string()];
    }
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|x| match x {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Where each path a container gives as `--config` comes from.
fn config_source(container_path: &str) -> (&'static str, PathBuf) {
    match container_path {
        "/etc/hindsight/hindsight.toml" => {
            ("hindsight.example.toml", deploy("hindsight.example.toml"))
        }
        "/etc/hindsight/learner.toml" => ("learner.example.toml", deploy("learner.example.toml")),
        other => panic!("--config {other}: not a path the manifests mount an example config at"),
    }
}

/// One Hindsight container: its arguments (after the `hindsight` entrypoint) and environment.
struct Process {
    name: String,
    args: Vec<String>,
    env: BTreeMap<String, String>,
}

/// What a process's loaded config says about the network.
#[derive(Debug)]
struct Loaded {
    /// The config file mounted for it, and where.
    config_path: String,
    /// Every address it listens on.
    listens: Vec<SocketAddr>,
    /// The port serving `/metrics`, if any.
    metrics: Option<u16>,
    /// `host:port` of every server it connects to (Kafka, Redis, upstream, endpoints).
    connects: Vec<(String, u16)>,
    /// `hindsight-<subcommand>`: the Prometheus job name of its metrics.
    job: String,
    /// It trains or serves on a GPU.
    gpu: bool,
}

/// `scheme://host:port/...` or `host:port` → (host, port).
fn host_port(url: &str, default_port: u16) -> (String, u16) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap();
    match authority.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().unwrap()),
        None => (authority.to_string(), default_port),
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .map(|i| args.get(i + 1).cloned().unwrap_or_default())
}

/// Loads a container's config as its process does (src/main.rs, src/rollout.rs and the
/// crates' `load`): file, then the container's variables, then validation.
fn load(p: &Process) -> Loaded {
    let who = &p.name;
    let sub = p.args.first().map(String::as_str).unwrap_or_default();
    let sections: &[&str] = match sub {
        "proxy" => &["proxy", "log", "feedback", "routing"],
        "serve" => &["serve"],
        "join" => hindsight_feedback::JoinFile::SECTIONS,
        "learner" => hindsight_learner::online::LearnerFile::SECTIONS,
        "rollout" => hindsight_control::rollout::RolloutFile::SECTIONS,
        other => panic!("{who}: `hindsight {other}` is not a process these manifests run"),
    };
    // Every HINDSIGHT_ variable must reach the process: a section it does not read would be
    // ignored silently.
    for name in p.env.keys().filter(|k| k.starts_with("HINDSIGHT_")) {
        if name == "HINDSIGHT_LOG_FORMAT" {
            continue;
        }
        let rest = &name["HINDSIGHT_".len()..];
        let section = rest.split("__").next().unwrap().to_ascii_lowercase();
        assert!(
            rest.contains("__") && sections.contains(&section.as_str()),
            "{who}: {name} names no section `hindsight {sub}` reads ({sections:?})"
        );
    }
    let config_path = flag(&p.args, "--config").unwrap_or_else(|| panic!("{who}: no --config"));
    let (_, file) = config_source(&config_path);
    let file = Some(file.as_path());
    let env = || p.env.clone().into_iter();
    let bad = |e: &dyn std::fmt::Display| -> ! { panic!("{who} (`hindsight {sub}`): {e}") };
    let metrics_listen = flag(&p.args, "--metrics-listen").map(|a| {
        a.parse::<SocketAddr>()
            .unwrap_or_else(|e| bad(&format!("--metrics-listen {a}: {e}")))
    });
    let brokers = |log: &hindsight_feedback::LogConfig| -> Vec<(String, u16)> {
        log.brokers.split(',').map(|b| host_port(b, 9092)).collect()
    };
    let redis = |url: &str| host_port(url, 6379);
    let mut loaded = Loaded {
        config_path: config_path.clone(),
        listens: Vec::new(),
        metrics: metrics_listen.map(|a| a.port()),
        connects: Vec::new(),
        job: format!("hindsight-{sub}"),
        gpu: false,
    };
    loaded.listens.extend(metrics_listen);
    match sub {
        "proxy" => {
            let raw = hindsight_proxy::RawConfig::load(file, env()).unwrap_or_else(|e| bad(&e));
            loaded.connects.extend(brokers(&raw.log));
            loaded.connects.push(redis(&raw.feedback.redis_url));
            loaded.connects.push(redis(&raw.routing.redis_url));
            loaded.connects.push(host_port(&raw.proxy.upstream_url, 80));
            let cfg = raw.validate().unwrap_or_else(|e| bad(&e));
            loaded.listens.push(cfg.proxy.listen_addr);
            loaded.listens.push(cfg.proxy.admin_addr);
            loaded.metrics = Some(cfg.proxy.admin_addr.port());
        }
        "serve" => {
            let raw =
                hindsight_serve::RawServeSection::load(file, env()).unwrap_or_else(|e| bad(&e));
            loaded.gpu = format!("{:?}", raw.device).to_lowercase().contains("cuda");
            let cfg = raw.validate().unwrap_or_else(|e| bad(&e));
            loaded.listens.push(cfg.listen);
        }
        "join" => {
            let f: hindsight_feedback::JoinFile =
                hindsight_core::load_toml(file, env(), sections).unwrap_or_else(|e| bad(&e));
            loaded.connects.extend(brokers(&f.log));
            loaded.connects.push(redis(&f.joiner.redis_url));
            f.log.validate().unwrap_or_else(|e| bad(&e));
            f.joiner.validate().unwrap_or_else(|e| bad(&e));
        }
        "learner" => {
            let f: hindsight_learner::online::LearnerFile =
                hindsight_core::load_toml(file, env(), sections).unwrap_or_else(|e| bad(&e));
            f.learner.validate().unwrap_or_else(|e| bad(&e));
            loaded.gpu = format!("{:?}", f.learner.device)
                .to_lowercase()
                .contains("cuda");
            loaded.connects.extend(brokers(&f.log));
            if let Some(r) = &f.registry {
                loaded.connects.push(redis(&r.redis_url));
            }
            if let Some(p) = &f.publish {
                loaded
                    .connects
                    .extend(p.endpoints.iter().map(|e| host_port(e, 80)));
            }
            if let Some(r) = &f.routing {
                loaded.connects.push(redis(&r.redis_url));
            }
            f.log.validate().unwrap_or_else(|e| bad(&e));
        }
        _ => {
            assert_eq!(
                p.args.get(1).map(String::as_str),
                Some("run"),
                "{who}: the controller is `hindsight rollout run`"
            );
            let f: hindsight_control::rollout::RolloutFile =
                hindsight_core::load_toml(file, env(), sections).unwrap_or_else(|e| bad(&e));
            f.routing.validate().unwrap_or_else(|e| bad(&e));
            f.rollout.validate().unwrap_or_else(|e| bad(&e));
            loaded.connects.extend(brokers(&f.log));
            loaded.connects.push(redis(&f.routing.redis_url));
            loaded.connects.push(redis(&f.registry.redis_url));
            let admin: SocketAddr = f.rollout.admin_addr.parse().unwrap();
            loaded.listens.push(admin);
            loaded.metrics = Some(admin.port());
            f.log.validate().unwrap_or_else(|e| bad(&e));
        }
    }
    // In a container, a loopback listener is unreachable from every other one.
    for a in &loaded.listens {
        assert!(
            a.ip().is_unspecified(),
            "{who}: listens on {a}, unreachable from outside its container (bind 0.0.0.0)"
        );
    }
    loaded
}

/// The job names of a Prometheus config and their `host:port` targets.
fn scrape_jobs(path: &Path) -> BTreeMap<String, Vec<String>> {
    let doc = yaml_doc(path);
    doc["scrape_configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            let targets = j["static_configs"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| str_list(&s["targets"]))
                .collect();
            (j["job_name"].as_str().unwrap().to_string(), targets)
        })
        .collect()
}

#[test]
fn compose_file_follows_the_compose_specification() {
    check(
        "check-jsonschema",
        &[
            "--builtin-schema",
            "vendor.compose-spec",
            deploy("compose.yaml").to_str().unwrap(),
        ],
    );
}

#[test]
fn kubernetes_manifests_validate_strictly() {
    let dir = deploy("k8s");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    files.sort();
    // kustomization.yaml is kustomize's, not an API object: it must list every other file.
    let kustomization = yaml_doc(&dir.join("kustomization.yaml"));
    let listed: BTreeSet<String> = str_list(&kustomization["resources"]).into_iter().collect();
    files.retain(|f| f != "kustomization.yaml");
    assert_eq!(
        listed,
        files.iter().cloned().collect::<BTreeSet<_>>(),
        "deploy/k8s/kustomization.yaml must list every manifest"
    );
    let paths: Vec<String> = files
        .iter()
        .map(|f| dir.join(f).to_string_lossy().into_owned())
        .collect();
    let mut args = vec!["--strict", "--quiet", "-k", KUBERNETES_VERSION];
    args.extend(paths.iter().map(String::as_str));
    let said = check("kubernetes-validate", &args);
    assert!(
        !said.contains("ERROR") && !said.contains("WARN"),
        "kubernetes-validate: {said}"
    );
}

/// Every object of deploy/k8s, by kind.
fn k8s_objects() -> Vec<Value> {
    let mut all = Vec::new();
    for e in std::fs::read_dir(deploy("k8s")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml") && !p.ends_with("kustomization.yaml") {
            all.extend(yaml_docs(&p));
        }
    }
    all
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

#[test]
fn configmap_holds_the_example_configs_byte_for_byte() {
    let objects = k8s_objects();
    let maps = of_kind(&objects, "ConfigMap");
    assert_eq!(maps.len(), 1);
    let data = &maps[0]["data"];
    for (key, file) in [
        ("hindsight.toml", "hindsight.example.toml"),
        ("learner.toml", "learner.example.toml"),
    ] {
        let want = std::fs::read_to_string(deploy(file)).unwrap();
        let got = data[key]
            .as_str()
            .unwrap_or_else(|| panic!("ConfigMap has no {key}"));
        assert!(
            got == want,
            "deploy/k8s/configmap.yaml's {key} differs from deploy/{file}: run deploy/k8s/gen-configmap.sh"
        );
    }
}

#[test]
fn kubernetes_containers_config_ports_services_and_probes_agree() {
    let objects = k8s_objects();
    let config_map = &of_kind(&objects, "ConfigMap")[0];
    let secrets: BTreeMap<String, &Value> = of_kind(&objects, "Secret")
        .into_iter()
        .map(|s| (s["metadata"]["name"].as_str().unwrap().to_string(), s))
        .collect();
    let services = of_kind(&objects, "Service");
    let service_ports: BTreeMap<&str, BTreeSet<u64>> = services
        .iter()
        .map(|s| {
            let ports = s["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["port"].as_u64().unwrap())
                .collect();
            (s["metadata"]["name"].as_str().unwrap(), ports)
        })
        .collect();
    let jobs = scrape_jobs(&deploy("prometheus/prometheus.yml"));
    let mut seen = BTreeSet::new();
    let workloads: Vec<&Value> = ["Deployment", "StatefulSet"]
        .iter()
        .flat_map(|k| of_kind(&objects, k))
        .collect();
    for w in workloads {
        let template = &w["spec"]["template"];
        let labels = &template["metadata"]["labels"];
        let annotations = &template["metadata"]["annotations"];
        let spec = &template["spec"];
        let volumes: BTreeMap<&str, &Value> = spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| (v["name"].as_str().unwrap(), v))
            .collect();
        for c in spec["containers"].as_array().unwrap() {
            let name = format!(
                "k8s {}/{}",
                w["metadata"]["name"].as_str().unwrap(),
                c["name"].as_str().unwrap()
            );
            let mut env = BTreeMap::new();
            for e in c["env"].as_array().into_iter().flatten() {
                let key = e["name"].as_str().unwrap().to_string();
                let value = if let Some(v) = e["value"].as_str() {
                    v.to_string()
                } else {
                    let r = &e["valueFrom"]["secretKeyRef"];
                    let secret = secrets
                        .get(r["name"].as_str().unwrap())
                        .unwrap_or_else(|| panic!("{name}: {key} from a Secret not in deploy/k8s"));
                    secret["stringData"][r["key"].as_str().unwrap()]
                        .as_str()
                        .unwrap_or_else(|| panic!("{name}: {key}: the Secret has no such key"))
                        .to_string()
                };
                env.insert(key, value);
            }
            let p = Process {
                name: name.clone(),
                args: str_list(&c["args"]),
                env,
            };
            let loaded = load(&p);
            seen.insert(p.args[0].clone());
            // The config file is the ConfigMap's key, mounted where --config says.
            let (dir, key) = loaded.config_path.rsplit_once('/').unwrap();
            let mount = c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["mountPath"] == dir)
                .unwrap_or_else(|| panic!("{name}: nothing mounted at {dir}"));
            let volume = volumes[mount["name"].as_str().unwrap()];
            assert_eq!(
                volume["configMap"]["name"], config_map["metadata"]["name"],
                "{name}: {dir} is not the ConfigMap"
            );
            assert!(
                config_map["data"][key].is_string(),
                "{name}: the ConfigMap has no {key}"
            );
            // Declared ports are exactly the listeners.
            let ports: BTreeMap<String, u64> = c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    (
                        p["name"].as_str().unwrap_or_default().to_string(),
                        p["containerPort"].as_u64().unwrap(),
                    )
                })
                .collect();
            let declared: BTreeSet<u64> = ports.values().copied().collect();
            let listening: BTreeSet<u64> = loaded.listens.iter().map(|a| a.port().into()).collect();
            assert_eq!(
                declared, listening,
                "{name}: containerPorts vs the ports its config listens on"
            );
            let resolve = |port: &Value| -> u64 {
                match port {
                    Value::String(n) => *ports
                        .get(n)
                        .unwrap_or_else(|| panic!("{name}: no container port named {n}")),
                    v => v.as_u64().unwrap(),
                }
            };
            for probe in ["readinessProbe", "livenessProbe"] {
                let get = &c[probe]["httpGet"];
                if !get.is_null() {
                    assert!(
                        listening.contains(&resolve(&get["port"])),
                        "{name}: {probe} on a port nothing listens on"
                    );
                }
            }
            if p.args[0] == "proxy" {
                let admin = u64::from(loaded.metrics.unwrap());
                assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{name}");
                assert_eq!(resolve(&c["readinessProbe"]["httpGet"]["port"]), admin);
                assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{name}");
                assert_eq!(resolve(&c["livenessProbe"]["httpGet"]["port"]), admin);
            }
            // Scraped where it exports metrics, on that port, as the job the rules expect.
            match loaded.metrics {
                Some(port) => {
                    assert_eq!(annotations["prometheus.io/scrape"], "true", "{name}");
                    assert_eq!(
                        annotations["prometheus.io/port"],
                        port.to_string(),
                        "{name}: scrape annotation vs its metrics port"
                    );
                    assert_eq!(
                        labels["app.kubernetes.io/name"], loaded.job,
                        "{name}: the label relabelled into `job`"
                    );
                    assert!(
                        jobs.contains_key(&loaded.job),
                        "{name}: {} is no job of deploy/prometheus/prometheus.yml",
                        loaded.job
                    );
                }
                None => assert!(annotations["prometheus.io/scrape"].is_null(), "{name}"),
            }
            // Every server it connects to is a Service on that port.
            for (host, port) in &loaded.connects {
                assert!(
                    service_ports
                        .get(host.as_str())
                        .is_some_and(|ps| ps.contains(&u64::from(*port))),
                    "{name}: connects to {host}:{port}, which no Service of deploy/k8s offers"
                );
            }
            let gpus = &c["resources"]["limits"]["nvidia.com/gpu"];
            assert_eq!(
                loaded.gpu,
                !gpus.is_null(),
                "{name}: a GPU limit exactly where the config runs on cuda"
            );
        }
    }
    // Each Service selecting a workload targets a port its container declares.
    for s in &services {
        if s["spec"]["type"] == "ExternalName" {
            continue;
        }
        let sel = &s["spec"]["selector"];
        let target = objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
            .find(|o| {
                sel.as_object()
                    .unwrap()
                    .iter()
                    .all(|(k, v)| o["spec"]["template"]["metadata"]["labels"][k] == *v)
            })
            .unwrap_or_else(|| panic!("Service {} selects no workload", s["metadata"]["name"]));
        let c = &target["spec"]["template"]["spec"]["containers"][0];
        for p in s["spec"]["ports"].as_array().unwrap() {
            let t = &p["targetPort"];
            let ok = c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|cp| (t.is_string() && cp["name"] == *t) || cp["containerPort"] == *t);
            assert!(
                ok,
                "Service {}: targetPort {t} is no container port",
                s["metadata"]["name"]
            );
        }
    }
    assert_eq!(
        seen,
        BTreeSet::from(["join", "learner", "proxy", "rollout", "serve"].map(String::from)),
        "deploy/k8s runs every long-running process"
    );
}

#[test]
fn compose_services_config_ports_and_prometheus_agree() {
    let compose = yaml_doc(&deploy("compose.yaml"));
    let services = compose["services"].as_object().unwrap();
    let exposed = |svc: &Value| -> BTreeSet<u16> {
        str_list(&svc["expose"])
            .iter()
            .map(|p| p.parse().unwrap())
            .collect()
    };
    // Every bind-mounted file exists (an env file: its committed .example).
    for (name, svc) in services {
        for v in str_list(&svc["volumes"]) {
            let source = v.split(':').next().unwrap();
            if let Some(rel) = source.strip_prefix("./") {
                assert!(
                    deploy(rel).exists(),
                    "{name}: mounts {source}, which is missing"
                );
            }
        }
        for f in str_list(&svc["env_file"]) {
            let example = deploy(&format!("{}.example", f.trim_start_matches("./")));
            assert!(
                example.exists(),
                "{name}: env_file {f} has no {}",
                example.display()
            );
        }
    }
    let mut loaded = BTreeMap::new();
    for (name, svc) in services {
        if !svc["image"]
            .as_str()
            .unwrap_or_default()
            .starts_with("hindsight:")
        {
            continue;
        }
        let mut env: BTreeMap<String, String> = svc["environment"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().map_or(v.to_string(), str::to_string)))
            .collect();
        for f in str_list(&svc["env_file"]) {
            let example = deploy(&format!("{}.example", f.trim_start_matches("./")));
            for line in std::fs::read_to_string(example).unwrap().lines() {
                if let Some((k, v)) = line.split_once('=').filter(|_| !line.starts_with('#')) {
                    env.insert(k.to_string(), v.to_string());
                }
            }
        }
        let p = Process {
            name: format!("compose {name}"),
            args: str_list(&svc["command"]),
            env,
        };
        let l = load(&p);
        let (source, _) = config_source(&l.config_path);
        let mount = format!("./{source}:{}:ro", l.config_path);
        assert!(
            str_list(&svc["volumes"]).contains(&mount),
            "compose {name}: needs the volume {mount}"
        );
        let listening: BTreeSet<u16> = l.listens.iter().map(SocketAddr::port).collect();
        assert_eq!(
            exposed(svc),
            listening,
            "compose {name}: `expose` vs the ports its config listens on"
        );
        for (host, port) in &l.connects {
            assert!(
                services
                    .get(host)
                    .is_some_and(|s| exposed(s).contains(port)),
                "compose {name}: connects to {host}:{port}, which no service exposes"
            );
        }
        let reserves_gpu = svc["deploy"]["resources"]["reservations"]["devices"]
            .as_array()
            .is_some_and(|d| {
                d.iter()
                    .any(|d| str_list(&d["capabilities"]).contains(&"gpu".into()))
            });
        assert_eq!(
            l.gpu, reserves_gpu,
            "compose {name}: a GPU exactly where it runs on cuda"
        );
        loaded.insert(name.clone(), l);
    }
    assert_eq!(
        loaded
            .values()
            .map(|l| l.job.clone())
            .collect::<BTreeSet<_>>(),
        BTreeSet::from(
            [
                "hindsight-join",
                "hindsight-learner",
                "hindsight-proxy",
                "hindsight-rollout",
                "hindsight-serve"
            ]
            .map(String::from)
        ),
        "compose runs every long-running process"
    );

    // The stack's Prometheus: deploy/prometheus's job names, each scraping the service that
    // exports that job's metrics on its metrics port, and every such service scraped.
    let jobs = scrape_jobs(&deploy("compose/prometheus.yml"));
    let reference = scrape_jobs(&deploy("prometheus/prometheus.yml"));
    assert_eq!(
        jobs.keys().collect::<Vec<_>>(),
        reference.keys().collect::<Vec<_>>(),
        "deploy/compose/prometheus.yml keeps deploy/prometheus/prometheus.yml's job names"
    );
    let mut scraped = BTreeSet::new();
    for (job, targets) in &jobs {
        for t in targets {
            let (host, port) = host_port(t, 80);
            let l = loaded
                .get(&host)
                .unwrap_or_else(|| panic!("job {job}: target {t} is no Hindsight service"));
            assert_eq!(&l.job, job, "job {job}: target {t} runs {}", l.job);
            assert_eq!(
                l.metrics,
                Some(port),
                "job {job}: {t} is not {host}'s metrics port"
            );
            scraped.insert(host);
        }
    }
    for (name, l) in &loaded {
        assert!(
            l.metrics.is_none() || scraped.contains(name),
            "compose {name} exports metrics that no job scrapes"
        );
    }
    let prom = &services["prometheus"];
    for (file, at) in [
        ("compose/prometheus.yml", "/etc/prometheus/prometheus.yml"),
        ("prometheus/rules.yml", "/etc/prometheus/rules.yml"),
    ] {
        assert!(
            str_list(&prom["volumes"]).contains(&format!("./{file}:{at}:ro")),
            "prometheus mounts ./{file} at {at}"
        );
    }
    // promtool reads the config with its rule file beside it, as in the container.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        deploy("compose/prometheus.yml"),
        dir.path().join("prometheus.yml"),
    )
    .unwrap();
    std::fs::copy(deploy("prometheus/rules.yml"), dir.path().join("rules.yml")).unwrap();
    check(
        "promtool",
        &[
            "check",
            "config",
            dir.path().join("prometheus.yml").to_str().unwrap(),
        ],
    );
}
