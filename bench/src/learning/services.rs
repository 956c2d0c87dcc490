//! The services the harness runs in process — `hindsight serve`, the capturing proxy with the
//! feedback webhook, the joiner — the learner's settings, and the check that the broker and
//! Redis they need are up.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hindsight_control::publish::PublishConfig;
use hindsight_control::registry::RegistryConfig;
use hindsight_feedback::{
    FeedbackError, JoinerConfig, JoinerStats, LogConfig, Secret, ValidatedLogConfig,
};
use hindsight_learner::online::LearnerSetup;
use hindsight_proxy::{Extensions, RawConfig, ShutdownReport};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::LearningConfig;

pub(super) const SECRET: &str = "learning-curve-secret";

/// A name no earlier run used (topic prefixes, group ids, Redis keys).
pub(super) fn unique(what: &str) -> String {
    format!("lc-{what}-{}", uuid::Uuid::now_v7().simple())
}

/// Starts `hindsight serve` on a free port; returns its API base and a stopper.
pub(super) async fn start_serve(
    model: &Path,
) -> anyhow::Result<(String, String, oneshot::Sender<()>)> {
    use clap::Parser;
    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        serve: hindsight_serve::ServeArgs,
    }
    let args = Args::try_parse_from([
        "serve".to_string(),
        "--model".to_string(),
        model.display().to_string(),
        "--listen".to_string(),
        "127.0.0.1:0".to_string(),
    ])?;
    let config = args.serve.load()?;
    let base = config.served_model_name.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        let r = hindsight_serve::run_serve(config, listener, async {
            let _ = rx.await;
        })
        .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "serve stopped");
        }
    });
    let url = format!("http://{addr}/v1");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(r) = client.get(format!("{url}/models")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!("hindsight serve did not come up within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok((url, base, tx))
}

/// The capture side of the loop, running in this process: the proxy in front of serve (with
/// the signed feedback webhook) and the joiner, on topics and Redis keys under `prefix`.
pub(super) struct Capture {
    /// Where the proxy listens.
    pub(super) proxy_addr: SocketAddr,
    /// The log settings the proxy validated (topics under the run's prefix).
    pub(super) log_cfg: ValidatedLogConfig,
    stop_proxy: oneshot::Sender<()>,
    proxy: JoinHandle<Result<ShutdownReport, FeedbackError>>,
    stop_joiner: oneshot::Sender<()>,
    joiner: JoinHandle<Result<JoinerStats, FeedbackError>>,
}

/// Starts the proxy (upstream `serve_url`) and the joiner on topics and keys under `prefix`.
pub(super) async fn start_capture(
    cfg: &LearningConfig,
    prefix: &str,
    serve_url: &str,
) -> anyhow::Result<Capture> {
    // Proxy in front of serve, with the signed feedback webhook.
    let mut raw = RawConfig::default();
    raw.proxy.upstream_url = serve_url.trim_end_matches("/v1").to_string();
    raw.proxy.listen_addr = "127.0.0.1:0".into();
    raw.proxy.admin_addr = "127.0.0.1:0".into();
    raw.log = LogConfig {
        brokers: cfg.brokers.clone(),
        topic_prefix: prefix.to_string(),
        spill_dir: cfg.work_dir.join("spill"),
        ..LogConfig::default()
    };
    raw.feedback.redis_url = cfg.redis_url.clone();
    raw.feedback.redis_key_prefix = format!("{prefix}:idem:");
    raw.feedback.signing.secrets = vec![Secret::new(SECRET)];
    let proxy_cfg = raw.validate()?;
    let log_cfg = proxy_cfg.log.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_addr = listener.local_addr()?;
    let (stop_proxy, proxy_stopped) = oneshot::channel::<()>();
    let proxy = tokio::spawn(async move {
        hindsight_proxy::run(proxy_cfg, listener, admin, Extensions::default(), async {
            let _ = proxy_stopped.await;
        })
        .await
    });

    // Joiner.
    let joiner_cfg = JoinerConfig {
        group_id: format!("{prefix}-joiner"),
        redis_url: cfg.redis_url.clone(),
        redis_key_prefix: format!("{prefix}:join:"),
        ..JoinerConfig::default()
    }
    .validate()?;
    let (stop_joiner, joiner_stopped) = oneshot::channel::<()>();
    let joiner_log = log_cfg.clone();
    let joiner = tokio::spawn(async move {
        hindsight_feedback::run_joiner(joiner_cfg, joiner_log, async {
            let _ = joiner_stopped.await;
        })
        .await
    });
    Ok(Capture {
        proxy_addr,
        log_cfg,
        stop_proxy,
        proxy,
        stop_joiner,
        joiner,
    })
}

impl Capture {
    /// Stops the joiner, then the proxy, and waits for each.
    pub(super) async fn stop(self) {
        let _ = self.stop_joiner.send(());
        let _ = self.joiner.await;
        let _ = self.stop_proxy.send(());
        let _ = self.proxy.await;
    }
}

/// The configured learner with the harness's own files, names and candidate schedule:
/// candidates on request, published without a gate (the curve is the measure; the gate has
/// its own test) and promoted so traffic comes from the newest adapter.
pub(super) fn learner_setup(
    cfg: &LearningConfig,
    prefix: &str,
    base_name: &str,
    adapter_name: &str,
    log_cfg: ValidatedLogConfig,
    serve_url: &str,
) -> LearnerSetup {
    let mut learner_cfg = cfg.learner.clone();
    learner_cfg.base_model_name = Some(base_name.to_string());
    learner_cfg.adapter_name = adapter_name.to_string();
    learner_cfg.group_id = format!("{prefix}-learner");
    learner_cfg.checkpoint_dir = cfg.work_dir.join("checkpoints");
    learner_cfg.run_log = cfg.work_dir.join("run.jsonl");
    learner_cfg.max_batch_wait_ms = 1_000;
    learner_cfg.checkpoint_every_batches = 4;
    learner_cfg.candidate_every_batches = 0;
    learner_cfg.candidate_every_examples = 0;
    learner_cfg.candidate_every_ms = 0;
    learner_cfg.trainer.objectives = cfg.objective.weights(cfg.learner.trainer.objectives);
    LearnerSetup {
        learner: learner_cfg,
        log: log_cfg,
        registry: Some(RegistryConfig {
            redis_url: cfg.redis_url.clone(),
            key_prefix: format!("{prefix}:registry"),
            adapter_dir: cfg.work_dir.join("adapters"),
        }),
        routing: None,
        publish: Some(PublishConfig {
            endpoints: vec![serve_url.to_string()],
            api_key: None,
            gate: None,
            promote: true,
            rollout: Default::default(),
            route: None,
            load_timeout_ms: 60_000,
            load_versions_by_name: false,
        }),
    }
}

/// The `host:port` addresses of a broker list and a Redis URL.
pub(super) fn service_addrs(
    brokers: &str,
    redis_url: &str,
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let mut addrs: Vec<(&'static str, String)> = brokers
        .split(',')
        .map(str::trim)
        .filter(|b| !b.is_empty())
        .map(|b| ("Kafka broker", b.to_string()))
        .collect();
    if addrs.is_empty() {
        bail!("KAFKA_BROKERS is empty");
    }
    // The redis crate's own URL parsing (defaults, credentials, schemes).
    let client = redis::Client::open(redis_url)
        .with_context(|| format!("REDIS_URL {redis_url:?} is not a Redis URL"))?;
    let host_port = match &client.get_connection_info().addr {
        redis::ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        other => bail!("REDIS_URL {redis_url:?}: only plain TCP is checked here, not {other}"),
    };
    addrs.push(("Redis", host_port));
    Ok(addrs)
}

/// Fails with what to run when a broker or Redis does not accept connections.
pub(super) async fn services_listen(brokers: &str, redis_url: &str) -> anyhow::Result<()> {
    for (what, addr) in service_addrs(brokers, redis_url)? {
        let connect = tokio::net::TcpStream::connect(addr.as_str());
        match tokio::time::timeout(Duration::from_secs(3), connect).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!(
                "the {what} at {addr} does not accept connections ({e}): start the local \
                 services with deploy/services.sh up"
            ),
            Err(_) => bail!(
                "the {what} at {addr} did not answer within 3 s: start the local services \
                 with deploy/services.sh up"
            ),
        }
    }
    Ok(())
}
