//! Operator commands, shared by the `hindsight rollout` CLI and the admin HTTP API: each checks
//! its input (a version must be registered, not rejected, and loaded on every endpoint named;
//! stages must increase; the route must exist; the generation must not have moved on), then
//! makes one compare-and-set change with its audit record, and keeps the registry in step.
//! A refused command changes nothing.

use hindsight_routing::{AuditRecord, Route, RoutingError, RoutingStore};
use serde::Deserialize;
use serde_json::json;

use super::config::{CandidatePolicy, RolloutConfig};
use super::ops::{self, Op};
use crate::registry::{Registry, RegistryError, VersionStatus};

/// What an operator asks for.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Create the route or change its stable version.
    SetStable {
        version: String,
    },
    /// Start a canary (or queue / supersede per `policy` when one runs).
    Start {
        version: String,
        #[serde(default)]
        stages: Option<Vec<f64>>,
        #[serde(default)]
        policy: Option<CandidatePolicy>,
        /// Serving endpoints (`http://host:port/v1`) that must all serve the version.
        #[serde(default)]
        endpoints: Vec<String>,
    },
    Pause,
    Resume,
    Promote,
    Rollback,
    Kill,
    Pin {
        user: String,
        version: String,
    },
    Unpin {
        user: String,
    },
}

/// Why a command was refused.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The routing table refused it (invalid, unknown route, conflict) or Redis failed.
    #[error(transparent)]
    Routing(#[from] RoutingError),
    /// The registry failed.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The version cannot be rolled out; `field` names the input.
    #[error("{field}: {reason}")]
    Refused { field: String, reason: String },
}

/// What a command did.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The route changed.
    Done {
        route: Box<Route>,
        audit: Box<AuditRecord>,
    },
    /// The version waits for the running rollout to end.
    Queued { version: String, behind: String },
}

/// Who acts, why, and on which generation.
#[derive(Debug, Clone)]
pub struct Actor<'a> {
    pub by: &'a str,
    pub reason: &'a str,
    pub generation: Option<u64>,
}

/// Runs `cmd` on `route`.
pub async fn run(
    store: &RoutingStore,
    registry: Option<&Registry>,
    cfg: &RolloutConfig,
    route: &str,
    actor: &Actor<'_>,
    cmd: Command,
) -> Result<Outcome, CommandError> {
    let op = match cmd {
        Command::Start {
            version,
            stages,
            policy,
            endpoints,
        } => {
            check_version(registry, &version, &endpoints).await?;
            let stages = stages.unwrap_or_else(|| cfg.stages.clone());
            hindsight_routing::validate_stages(&stages)?;
            let current = store.get(route).await?;
            if let Some(active) = current.as_ref().and_then(|r| r.active_rollout()) {
                match policy.unwrap_or(cfg.on_new_candidate) {
                    CandidatePolicy::Queue => {
                        super::queue::enqueue(store, route, &version).await?;
                        return Ok(Outcome::Queued {
                            version,
                            behind: active.canary.clone(),
                        });
                    }
                    CandidatePolicy::Supersede => {
                        let why = format!("superseded by {version}");
                        let actor = Actor {
                            reason: &why,
                            ..actor.clone()
                        };
                        apply(store, registry, route, &actor, &Op::Rollback).await?;
                    }
                }
            }
            Op::Start {
                canary: version,
                stages,
                rollout_id: None,
            }
        }
        Command::SetStable { version } => {
            check_version(registry, &version, &[]).await?;
            Op::SetStable { stable: version }
        }
        Command::Pause => Op::Pause,
        Command::Resume => Op::Resume,
        Command::Promote => Op::Promote,
        Command::Rollback => Op::Rollback,
        Command::Kill => Op::Kill,
        Command::Pin { user, version } => Op::Pin { user, version },
        Command::Unpin { user } => Op::Unpin { user },
    };
    let (route, audit) = apply(store, registry, route, actor, &op).await?;
    Ok(Outcome::Done {
        route: Box::new(route),
        audit: Box::new(audit),
    })
}

async fn apply(
    store: &RoutingStore,
    registry: Option<&Registry>,
    route: &str,
    actor: &Actor<'_>,
    op: &Op,
) -> Result<(Route, AuditRecord), CommandError> {
    let default_reason = format!("{} by {}", op.action(), actor.by);
    let req = ops::Request {
        route,
        by: actor.by,
        reason: if actor.reason.is_empty() {
            &default_reason
        } else {
            actor.reason
        },
        expected_generation: actor.generation,
        stats: json!({}),
    };
    let (stored, audit) = ops::execute(store, &req, op).await?;
    if let Some(reg) = registry {
        if let Err(e) = super::lineage::follow(reg, &stored, &audit).await {
            tracing::warn!(error = %e, "The registry could not follow a rollout change; the rollout controller reconciles it.");
        }
    }
    Ok((stored, audit))
}

/// A `name@N` version of an adapter the registry manages must be registered and not rejected,
/// and every endpoint given must list it.
pub async fn check_version(
    registry: Option<&Registry>,
    version: &str,
    endpoints: &[String],
) -> Result<(), CommandError> {
    let refuse = |reason: String| CommandError::Refused {
        field: "version".into(),
        reason,
    };
    if let (Some(reg), Some((name, n))) = (registry, version.rsplit_once('@')) {
        let n: u64 = n
            .parse()
            .map_err(|_| refuse(format!("`{version}`: `{n}` is not a version number")))?;
        // Versions of adapters this registry does not manage at all (served by other means)
        // are not checked here; the endpoints check below still applies.
        let managed = !reg.list(Some(name)).await?.is_empty();
        match reg.get(name, n).await? {
            None if managed => {
                return Err(refuse(format!(
                    "{version} is not registered (see `hindsight adapters list --name {name}`)"
                )))
            }
            None => {}
            Some(e) if e.status == VersionStatus::Rejected => {
                return Err(refuse(format!(
                    "{version} was rejected{}; it cannot be rolled out",
                    e.note.map(|n| format!(" ({n})")).unwrap_or_default()
                )))
            }
            Some(_) => {}
        }
    }
    let client = reqwest::Client::new();
    for e in endpoints {
        let models = crate::publish::served_models(&client, e, None)
            .await
            .map_err(|err| refuse(format!("cannot list the models of {e}: {err}")))?;
        let loaded = models
            .iter()
            .any(|m| m.get("id").and_then(serde_json::Value::as_str) == Some(version));
        if !loaded {
            return Err(refuse(format!(
                "{version} is not loaded on {e}; load it there first"
            )));
        }
    }
    Ok(())
}
