//! Publishing a registered candidate: load it into the serving endpoints under
//! `<name>-candidate` (vLLM's adapter API, so `hindsight serve` and vLLM both work), run the
//! eval gate (`hindsight_eval::evaluate`, candidate against the live version on the same
//! set, seed and settings), then either reject it (status `rejected`, unloaded) or accept it
//! (eval results stored; promoted to `<name>` and `live`, or left `candidate` "ready for
//! rollout").
//!
//! Endpoint errors never leave a half-published live version: the registry status changes only
//! after every endpoint did what the status claims, and a failed promotion is rolled back on
//! the endpoints that already switched.

use std::time::{Duration, Instant};

use hindsight_eval::EvalError;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

mod gate;
mod version_names;

use gate::run_gate;
pub use gate::{GateConfig, GateVerdict};

use crate::registry::{Registry, RegistryError, VersionEntry, VersionStatus};

fn default_load_timeout_ms() -> u64 {
    60_000
}

/// Where and how candidates are published.
#[derive(Deserialize, Serialize, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PublishConfig {
    /// Serving API bases (`http://127.0.0.1:8000/v1`); the gate evaluates on the first.
    pub endpoints: Vec<String>,
    /// Bearer token for the endpoints.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The eval gate; `None` publishes without one (tests and benchmarks only).
    #[serde(default)]
    pub gate: Option<GateConfig>,
    /// An accepted candidate goes live at once (single-machine demos; `rollout = "canary"` is
    /// the guarded way).
    #[serde(default)]
    pub promote: bool,
    /// `"canary"`: an accepted candidate is loaded on every endpoint (as `<name>@<version>`)
    /// and handed to the rollout controller on `route` (status `canary`); the controller moves
    /// it through its stages and the registry follows (`live` or `rolled_back`). `"off"`:
    /// `promote` decides.
    #[serde(default)]
    pub rollout: PublishRollout,
    /// The route (logical model) a canary runs on; default: the adapter's name.
    #[serde(default)]
    pub route: Option<String>,
    /// Timeout of each adapter load/unload call, in milliseconds.
    #[serde(default = "default_load_timeout_ms")]
    pub load_timeout_ms: u64,
    /// With `rollout = "canary"`: load each version a route sends traffic to under its literal
    /// `<name>@<version>` name, and unload those no route needs any more at the next publish.
    /// For servers without adapter versions (vLLM); `hindsight serve` resolves
    /// `<name>@<version>` itself, so it is off by default.
    #[serde(default)]
    pub load_versions_by_name: bool,
}

impl std::fmt::Debug for PublishConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishConfig")
            .field("endpoints", &self.endpoints)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("gate", &self.gate)
            .field("promote", &self.promote)
            .field("rollout", &self.rollout)
            .field("route", &self.route)
            .field("load_timeout_ms", &self.load_timeout_ms)
            .field("load_versions_by_name", &self.load_versions_by_name)
            .finish()
    }
}

impl PublishConfig {
    fn validate(&self) -> Result<(), PublishError> {
        if self.endpoints.is_empty() {
            return Err(PublishError::Config("no serving endpoints".into()));
        }
        if let Some(e) = self
            .endpoints
            .iter()
            .find(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return Err(PublishError::Config(format!(
                "endpoint {e:?} is not an http(s) URL"
            )));
        }
        if let Some(g) = &self.gate {
            g.validate()?;
        }
        Ok(())
    }
}

/// How an accepted candidate reaches traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PublishRollout {
    /// `promote` decides: live at once, or left `candidate` for an operator.
    #[default]
    Off,
    /// Hand it to the rollout controller.
    Canary,
}

/// What publishing did.
#[derive(Debug, Clone)]
pub struct PublishOutcome {
    /// The entry as the registry now holds it.
    pub entry: VersionEntry,
    /// The gate's decision (`None` without a gate).
    pub verdict: Option<GateVerdict>,
}

/// Publishing failures. None of them changes the candidate's registry status.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The registry failed (or the candidate's files no longer match their hashes).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The evaluation could not run (bad set, every request failed, ...).
    #[error("eval gate: {0}")]
    Eval(#[from] EvalError),
    /// An endpoint could not be reached.
    #[error("{endpoint}: {source}")]
    Http {
        /// The URL called.
        endpoint: String,
        /// The underlying error.
        source: reqwest::Error,
    },
    /// An endpoint answered with an error status.
    #[error("{endpoint} answered {status}: {body}")]
    Endpoint {
        /// The URL called.
        endpoint: String,
        /// HTTP status.
        status: u16,
        /// Start of the response body.
        body: String,
    },
    /// The version is not a candidate (already published, rejected or retired).
    #[error("{tag} is {status}, only candidates are published")]
    NotCandidate {
        /// `name@version`.
        tag: String,
        /// Its status.
        status: VersionStatus,
    },
    /// Invalid settings.
    #[error("invalid publish config: {0}")]
    Config(String),
}

/// The serving name of a name's candidate.
pub fn candidate_name(name: &str) -> String {
    format!("{name}-candidate")
}

fn base(endpoint: &str) -> &str {
    endpoint.trim_end_matches('/')
}

async fn post_json(
    client: &reqwest::Client,
    url: String,
    api_key: Option<&str>,
    body: &Value,
) -> Result<reqwest::Response, PublishError> {
    let mut req = client.post(&url).json(body);
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    req.send().await.map_err(|source| PublishError::Http {
        endpoint: url,
        source,
    })
}

async fn error_of(url: String, resp: reqwest::Response) -> PublishError {
    let status = resp.status().as_u16();
    let body: String = resp
        .text()
        .await
        .unwrap_or_default()
        .chars()
        .take(500)
        .collect();
    PublishError::Endpoint {
        endpoint: url,
        status,
        body,
    }
}

/// Loads a version into one endpoint as `lora_name` (vLLM's `POST /v1/load_lora_adapter`,
/// `load_inplace: true`, with the sha256 of `adapter_model.safetensors` so the server refuses
/// files that changed). The version directory's `hindsight.json` gives `hindsight serve` the
/// registry's version number.
pub async fn load_adapter(
    client: &reqwest::Client,
    endpoint: &str,
    api_key: Option<&str>,
    lora_name: &str,
    entry: &VersionEntry,
) -> Result<(), PublishError> {
    let url = format!("{}/load_lora_adapter", base(endpoint));
    let mut body = json!({
        "lora_name": lora_name,
        "lora_path": entry.path.display().to_string(),
        "load_inplace": true,
    });
    if let Some(sha) = entry.weights_sha256() {
        body["sha256"] = json!(sha);
    }
    let resp = post_json(client, url.clone(), api_key, &body).await?;
    if !resp.status().is_success() {
        return Err(error_of(url, resp).await);
    }
    tracing::info!(
        endpoint,
        lora_name,
        version = entry.version,
        "Adapter loaded into serving."
    );
    Ok(())
}

/// Unloads `lora_name` from one endpoint (`POST /v1/unload_lora_adapter`); an adapter that is
/// not loaded (404) counts as unloaded.
pub async fn unload_adapter(
    client: &reqwest::Client,
    endpoint: &str,
    api_key: Option<&str>,
    lora_name: &str,
) -> Result<(), PublishError> {
    let url = format!("{}/unload_lora_adapter", base(endpoint));
    let resp = post_json(
        client,
        url.clone(),
        api_key,
        &json!({"lora_name": lora_name}),
    )
    .await?;
    if resp.status().is_success() || resp.status() == reqwest::StatusCode::NOT_FOUND {
        tracing::info!(endpoint, lora_name, "Adapter unloaded from serving.");
        Ok(())
    } else {
        Err(error_of(url, resp).await)
    }
}

/// The `data` list of `GET /v1/models`.
pub async fn served_models(
    client: &reqwest::Client,
    endpoint: &str,
    api_key: Option<&str>,
) -> Result<Vec<Value>, PublishError> {
    let url = format!("{}/models", base(endpoint));
    let mut req = client.get(&url);
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|source| PublishError::Http {
        endpoint: url.clone(),
        source,
    })?;
    if !resp.status().is_success() {
        return Err(error_of(url, resp).await);
    }
    let body: Value = resp.json().await.map_err(|source| PublishError::Http {
        endpoint: url.clone(),
        source,
    })?;
    Ok(body
        .get("data")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default())
}

/// Unloads `lora_name` everywhere, logging (not returning) failures.
async fn unload_everywhere_best_effort(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    lora_name: &str,
) {
    for ep in &cfg.endpoints {
        if let Err(e) = unload_adapter(client, ep, cfg.api_key.as_deref(), lora_name).await {
            tracing::warn!(endpoint = %ep, lora_name, error = %e, "Could not unload adapter.");
        }
    }
}

/// Makes every endpoint serve the registry's live version as `<name>`, loading it where it is
/// missing or another version serves (by the listed version, or by the listed files' directory
/// where the server has no versions, as vLLM; e.g. after a serving restart or a canary
/// promoted since), so the gate compares against what the registry calls live.
async fn ensure_live_served(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    live: &VersionEntry,
) -> Result<(), PublishError> {
    let key = cfg.api_key.as_deref();
    for ep in &cfg.endpoints {
        let models = served_models(client, ep, key).await?;
        let served = models
            .iter()
            .find(|m| m.get("id").and_then(Value::as_str) == Some(live.name.as_str()));
        let ok = served.is_some_and(|m| version_names::serves(m, live));
        if !ok {
            tracing::warn!(endpoint = %ep, name = %live.name, version = live.version, "Live version not served; loading it.");
            load_adapter(client, ep, key, &live.name, live).await?;
        }
    }
    Ok(())
}

/// The base model's name from `/v1/models` (the entry without a parent).
async fn discover_base(
    client: &reqwest::Client,
    cfg: &PublishConfig,
) -> Result<String, PublishError> {
    let ep = cfg
        .endpoints
        .first()
        .map(String::as_str)
        .unwrap_or_default();
    let models = served_models(client, ep, cfg.api_key.as_deref()).await?;
    models
        .iter()
        .find(|m| m.get("parent").is_none_or(Value::is_null))
        .and_then(|m| m.get("id").and_then(Value::as_str))
        .map(str::to_string)
        .ok_or_else(|| PublishError::Config(format!("{ep}/models lists no base model")))
}

/// Gates and publishes a registered candidate:
/// 1. loads it into every endpoint as `<name>-candidate` (`load_inplace`, with its sha256);
/// 2. with a gate: evaluates `<name>-candidate` and the live model (`<name>`, made to serve the
///    registry's live version, or without one the base model: `base_model_name`, or when that
///    is empty the parentless entry of `/v1/models`) on the same set and seed; the candidate is
///    rejected when its exact match is below live − margin: unloaded, status `rejected` with
///    the eval results;
/// 3. accepted (or no gate): eval results stored; with `promote` it is loaded as `<name>` on
///    every endpoint, then marked `live` (the previous live version `retired`) and unloaded as
///    `<name>-candidate`; without `promote` it stays `candidate` with note "ready for rollout"
///    and stays loaded as `<name>-candidate`.
///
/// On an error the registry status is unchanged (a failed promotion is rolled back on the
/// endpoints that had switched) and the error is returned.
pub async fn gate_and_publish(
    reg: &Registry,
    entry: VersionEntry,
    cfg: &PublishConfig,
    base_model_name: &str,
) -> Result<PublishOutcome, PublishError> {
    gate_and_publish_with(reg, entry, cfg, base_model_name, None).await
}

/// [`gate_and_publish`] with the routing table, needed by `rollout = "canary"`.
pub async fn gate_and_publish_with(
    reg: &Registry,
    entry: VersionEntry,
    cfg: &PublishConfig,
    base_model_name: &str,
    routing: Option<&hindsight_routing::RoutingStore>,
) -> Result<PublishOutcome, PublishError> {
    let started = Instant::now();
    let result = publish_inner(reg, entry, cfg, base_model_name, routing).await;
    let label = match &result {
        Ok(PublishOutcome {
            verdict: Some(v), ..
        }) => Some(v.as_str()),
        Ok(_) => None,
        Err(_) => Some("error"),
    };
    if let (Some(label), Some(_)) = (label, &cfg.gate) {
        metrics::counter!("hindsight_learner_gate_total", "verdict" => label).increment(1);
        metrics::histogram!("hindsight_learner_gate_duration_seconds")
            .record(started.elapsed().as_secs_f64());
    }
    if let Err(e) = &result {
        tracing::error!(error = %e, "Publishing failed; registry status unchanged.");
    }
    result
}

/// Loads the candidate `entry` as `cand_name` into every endpoint; when one refuses, unloads
/// it from those that took it (best effort) and returns that endpoint's error.
async fn load_candidate_everywhere(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    cand_name: &str,
    entry: &VersionEntry,
) -> Result<(), PublishError> {
    let key = cfg.api_key.as_deref();
    for (i, ep) in cfg.endpoints.iter().enumerate() {
        if let Err(e) = load_adapter(client, ep, key, cand_name, entry).await {
            for done in &cfg.endpoints[..i] {
                let _ = unload_adapter(client, done, key, cand_name).await;
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Loads `entry` under the adapter's own `name` into every endpoint; when one refuses, puts
/// the endpoints that took it back as they were (the `live` version reloaded, or the name
/// unloaded when nothing was live; failures to do so are logged) and returns that endpoint's
/// error.
async fn promote_everywhere(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    name: &str,
    entry: &VersionEntry,
    live: Option<&VersionEntry>,
) -> Result<(), PublishError> {
    let key = cfg.api_key.as_deref();
    for (i, ep) in cfg.endpoints.iter().enumerate() {
        if let Err(e) = load_adapter(client, ep, key, name, entry).await {
            for done in &cfg.endpoints[..i] {
                let undo = match live {
                    Some(l) => load_adapter(client, done, key, name, l).await,
                    None => unload_adapter(client, done, key, name).await,
                };
                if let Err(u) = undo {
                    tracing::error!(endpoint = %done, name = %name, error = %u, "Could not roll back a partial promotion.");
                }
            }
            return Err(e);
        }
    }
    Ok(())
}

/// The steps of [`gate_and_publish`], without its metrics and error log.
async fn publish_inner(
    reg: &Registry,
    entry: VersionEntry,
    cfg: &PublishConfig,
    base_model_name: &str,
    routing: Option<&hindsight_routing::RoutingStore>,
) -> Result<PublishOutcome, PublishError> {
    cfg.validate()?;
    if cfg.rollout == PublishRollout::Canary && routing.is_none() {
        return Err(PublishError::Config(
            "publish.rollout = \"canary\" needs the routing table ([routing])".into(),
        ));
    }
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(cfg.load_timeout_ms))
        .build()
        .map_err(|source| PublishError::Http {
            endpoint: "client".into(),
            source,
        })?;
    let entry = registered_candidate(reg, &entry).await?;
    let cand_name = candidate_name(&entry.name);

    // 1. The candidate into every endpoint.
    load_candidate_everywhere(&client, cfg, &cand_name, &entry).await?;

    // 2. The gate.
    let live = reg.live(&entry.name).await?;
    let (verdict, eval) = match &cfg.gate {
        None => (None, None),
        Some(gate) => {
            match gate_step(
                reg,
                &client,
                cfg,
                gate,
                entry.clone(),
                live.as_ref(),
                base_model_name,
            )
            .await?
            {
                GateStep::Rejected(outcome) => return Ok(*outcome),
                GateStep::Passed(v, e) => (Some(v), Some(e)),
            }
        }
    };

    // 3. Accepted.
    if let (PublishRollout::Canary, Some(store)) = (cfg.rollout, routing) {
        return hand_to_rollout(
            reg,
            store,
            &client,
            cfg,
            &entry,
            live.as_ref(),
            base_model_name,
            (verdict, eval),
        )
        .await;
    }
    if !cfg.promote {
        let entry = reg
            .set_status(
                &entry.name,
                entry.version,
                VersionStatus::Candidate,
                eval,
                Some("ready for rollout".into()),
            )
            .await?;
        tracing::info!(name = %entry.name, version = entry.version, "Candidate ready for rollout.");
        return Ok(PublishOutcome { entry, verdict });
    }
    promote_live(reg, &client, cfg, entry, live.as_ref(), (verdict, eval)).await
}

/// The registry's own entry for `entry` (the registry's view, not the caller's copy, decides),
/// which must be a candidate whose files match their recorded hashes.
async fn registered_candidate(
    reg: &Registry,
    entry: &VersionEntry,
) -> Result<VersionEntry, PublishError> {
    let found =
        reg.get(&entry.name, entry.version)
            .await?
            .ok_or_else(|| RegistryError::NotFound {
                name: entry.name.clone(),
                version: entry.version,
            })?;
    if found.status != VersionStatus::Candidate {
        return Err(PublishError::NotCandidate {
            tag: found.tag(),
            status: found.status,
        });
    }
    reg.verify(&found).await?;
    Ok(found)
}

/// What the eval gate made of a loaded candidate.
enum GateStep {
    /// Rejected: unloaded everywhere and marked `rejected` in the registry.
    Rejected(Box<PublishOutcome>),
    /// Accepted, with the gate's evaluation for the registry.
    Passed(GateVerdict, Value),
}

/// Runs the eval gate on the loaded candidate against the live version (or the base model when
/// nothing is live). On any error the candidate is unloaded (best effort) before returning it.
#[allow(clippy::too_many_arguments)]
async fn gate_step(
    reg: &Registry,
    client: &reqwest::Client,
    cfg: &PublishConfig,
    gate: &GateConfig,
    entry: VersionEntry,
    live: Option<&VersionEntry>,
    base_model_name: &str,
) -> Result<GateStep, PublishError> {
    let name = entry.name.clone();
    let cand_name = candidate_name(&name);
    let gated = async {
        // The base model is the reference of the guard, and of the task runs when nothing is
        // live; only then is it looked up.
        let needs_base = gate.guard.enabled || live.is_none();
        let base_model = match base_model_name {
            "" if needs_base => discover_base(client, cfg).await?,
            known => known.to_string(),
        };
        let live_model = match live {
            Some(l) => {
                ensure_live_served(client, cfg, l).await?;
                name.clone()
            }
            None => base_model.clone(),
        };
        let live = (live_model.as_str(), live.map(|l| l.version));
        run_gate(gate, cfg, &entry, live, &base_model).await
    }
    .await;
    let (v, e) = match gated {
        Ok(x) => x,
        Err(err) => {
            unload_everywhere_best_effort(client, cfg, &cand_name).await;
            return Err(err);
        }
    };
    tracing::info!(name = %name, version = entry.version, verdict = v.as_str(), candidate = e["candidate"]["exact_match"].as_f64(), live = e["live"]["exact_match"].as_f64(), live_model = e["live"]["model"].as_str(), margin = gate.margin, "Eval gate decided.");
    let GateVerdict::Rejected { reasons, .. } = &v else {
        return Ok(GateStep::Passed(v, e));
    };
    let note = format!("rejected by the eval gate: {}", reasons.join("; "));
    tracing::warn!(name = %name, version = entry.version, reasons = %note, "Candidate rejected.");
    for ep in &cfg.endpoints {
        unload_adapter(client, ep, cfg.api_key.as_deref(), &cand_name).await?;
    }
    let entry = reg
        .set_status(
            &name,
            entry.version,
            VersionStatus::Rejected,
            Some(e),
            Some(note),
        )
        .await?;
    Ok(GateStep::Rejected(Box::new(PublishOutcome {
        entry,
        verdict: Some(v),
    })))
}

/// `promote = true` without a canary: the candidate replaces the live version under the
/// adapter's name on every endpoint (put back as it was where one refuses) and becomes `live`.
async fn promote_live(
    reg: &Registry,
    client: &reqwest::Client,
    cfg: &PublishConfig,
    entry: VersionEntry,
    live: Option<&VersionEntry>,
    (verdict, eval): (Option<GateVerdict>, Option<Value>),
) -> Result<PublishOutcome, PublishError> {
    let name = entry.name.clone();
    let cand_name = candidate_name(&name);
    if let Err(e) = promote_everywhere(client, cfg, &name, &entry, live).await {
        unload_everywhere_best_effort(client, cfg, &cand_name).await;
        return Err(e);
    }
    let note = match &verdict {
        Some(GateVerdict::Accepted {
            candidate, live: l, ..
        }) => format!(
            "promoted by the eval gate: exact match {:.1}% vs live {:.1}%",
            candidate * 100.0,
            l * 100.0
        ),
        _ => "promoted without an eval gate".to_string(),
    };
    let entry = reg
        .set_status(&name, entry.version, VersionStatus::Live, eval, Some(note))
        .await?;
    unload_everywhere_best_effort(client, cfg, &cand_name).await;
    tracing::info!(name = %name, version = entry.version, previous = ?live.map(|l| l.version), "Adapter version live.");
    Ok(PublishOutcome { entry, verdict })
}

/// `rollout = "canary"`: the accepted candidate is made servable as `<name>@<version>` on
/// every endpoint while the previous versions stay served (loaded under its name, which
/// `hindsight serve` keeps as a new version; or with `load_versions_by_name` loaded under the
/// tag itself, with the route's stable version beside it), the route is created with the live
/// version as stable if it does not exist, the candidate is queued for the rollout controller
/// (which starts it with its own stages, or per `on_new_candidate` when a canary runs) and its
/// status becomes `canary`. With `load_versions_by_name`, versions no route needs any more
/// are then unloaded.
#[allow(clippy::too_many_arguments)]
async fn hand_to_rollout(
    reg: &Registry,
    store: &hindsight_routing::RoutingStore,
    client: &reqwest::Client,
    cfg: &PublishConfig,
    entry: &VersionEntry,
    live: Option<&VersionEntry>,
    base_model_name: &str,
    (verdict, eval): (Option<GateVerdict>, Option<Value>),
) -> Result<PublishOutcome, PublishError> {
    let name = entry.name.clone();
    let cand_name = candidate_name(&name);
    let route = cfg.route.clone().unwrap_or_else(|| name.clone());
    let routing_err =
        |e: hindsight_routing::RoutingError| PublishError::Config(format!("routing table: {e}"));
    let existing = match store.get(&route).await {
        Ok(r) => r,
        Err(e) => {
            unload_everywhere_best_effort(client, cfg, &cand_name).await;
            return Err(routing_err(e));
        }
    };
    let servable = if cfg.load_versions_by_name {
        // The stable version must answer under its tag too: the route's, or the live version
        // that becomes the stable of a new route.
        let stable = match &existing {
            Some(r) => version_names::entry_of(reg, &name, &r.stable).await,
            None => Ok(live.cloned()),
        };
        match stable {
            Ok(stable) => {
                let mut entries: Vec<&VersionEntry> = stable.iter().collect();
                entries.push(entry);
                version_names::load(client, cfg, &entries).await
            }
            Err(e) => Err(e),
        }
    } else {
        promote_everywhere(client, cfg, &name, entry, live).await
    };
    unload_everywhere_best_effort(client, cfg, &cand_name).await;
    servable?;
    if existing.is_none() {
        let stable = match live {
            Some(l) => l.tag(),
            None if !base_model_name.is_empty() => base_model_name.to_string(),
            None => discover_base(client, cfg).await?,
        };
        crate::rollout::execute(
            store,
            &crate::rollout::Request {
                route: &route,
                by: "learner",
                reason: "first canary on this route: stable is the live version",
                expected_generation: Some(0),
                stats: serde_json::json!({}),
            },
            &crate::rollout::Op::SetStable { stable },
        )
        .await
        .map_err(routing_err)?;
    }
    crate::rollout::queue::enqueue(store, &route, &entry.tag())
        .await
        .map_err(routing_err)?;
    let entry = reg
        .set_status(
            &name,
            entry.version,
            VersionStatus::Canary,
            eval,
            Some(format!(
                "handed to the rollout controller on route `{route}`"
            )),
        )
        .await?;
    tracing::info!(name = %name, version = entry.version, route = %route, "Candidate handed to the rollout controller.");
    if cfg.load_versions_by_name {
        match version_names::needed(store).await {
            Ok(keep) => version_names::prune(client, cfg, &name, &keep).await,
            Err(e) => {
                tracing::warn!(error = %e, "Could not read the routing table; old versions stay loaded until the next publish.")
            }
        }
    }
    Ok(PublishOutcome { entry, verdict })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_have_defaults_and_refuse_unknown_fields() {
        let g: GateConfig = serde_json::from_str(r#"{"eval_set": "eval.jsonl"}"#).unwrap();
        assert_eq!(g, GateConfig::new("eval.jsonl"));
        assert!(serde_json::from_str::<GateConfig>(r#"{"eval_set": "x", "margn": 0.1}"#).is_err());
        let p: PublishConfig = serde_json::from_str(
            r#"{"endpoints": ["http://127.0.0.1:8000/v1"], "api_key": "sk-secret", "promote": true}"#,
        )
        .unwrap();
        assert!(p.validate().is_ok());
        assert!(!format!("{p:?}").contains("sk-secret"));
        let mut bad = p.clone();
        bad.endpoints.clear();
        assert!(bad.validate().is_err());
        bad.endpoints = vec!["127.0.0.1:8000".into()];
        assert!(bad.validate().is_err());
        let mut bad = p;
        bad.gate = Some(GateConfig {
            margin: -0.1,
            ..GateConfig::new("x")
        });
        assert!(bad.validate().is_err());
    }

    #[test]
    fn verdict_serializes_with_its_tag() {
        let v = GateVerdict::Rejected {
            candidate: 0.0,
            live: 1.0,
            delta: -1.0,
            items: 6,
            reasons: vec!["task: exact match 0.0% < live 100.0% − margin 2.0 points".into()],
        };
        assert_eq!(serde_json::to_value(&v).unwrap()["verdict"], "rejected");
        assert!(!v.accepted());
        assert_eq!(candidate_name("support"), "support-candidate");
    }
}
