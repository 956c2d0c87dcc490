//! `hindsight rollout run|start|status|pause|resume|promote|rollback|kill|pin|unpin|history|
//! set-stable`: argument parsing over `hindsight_control::rollout`.

use std::path::PathBuf;

use anyhow::Context;
use std::sync::Arc;

use hindsight_control::registry::Registry;
use hindsight_control::rollout::admin::AdminState;
use hindsight_control::rollout::commands::{self, Actor, Command, Outcome};
use hindsight_control::rollout::{self, CandidatePolicy, RolloutFile};
use hindsight_routing::RoutingStore;
use serde_json::json;

/// `hindsight rollout`.
#[derive(Debug, clap::Args)]
pub struct RolloutArgs {
    /// TOML config with `[routing]`, `[rollout]`, `[log]` and `[registry]` sections (env:
    /// HINDSIGHT_ROUTING__*, HINDSIGHT_ROLLOUT__*, ...).
    #[arg(long, short = 'c', global = true)]
    pub config: Option<PathBuf>,
    /// Who is acting, recorded in the audit trail (`operator:<name>`).
    #[arg(long, global = true, env = "USER", default_value = "operator")]
    pub by: String,
    /// Why, recorded in the audit trail.
    #[arg(long, global = true, default_value = "")]
    pub reason: String,
    /// Refuse the command if the route's generation moved on from this one.
    #[arg(long, global = true)]
    pub generation: Option<u64>,
    #[command(subcommand)]
    pub command: RolloutCommand,
}

/// The subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum RolloutCommand {
    /// Run the controller: read traffic and feedback, advance, promote or roll back.
    Run,
    /// Create a route or set its stable version (no rollout may be running).
    SetStable { route: String, version: String },
    /// Start a canary of `version` on `route` (or queue/supersede per `--policy` when one runs).
    Start {
        route: String,
        version: String,
        /// Stage weights, comma-separated (default: `[rollout].stages`).
        #[arg(long, value_delimiter = ',')]
        stages: Option<Vec<f64>>,
        /// When a canary already runs: `queue` or `supersede` (default: `[rollout].on_new_candidate`).
        #[arg(long)]
        policy: Option<String>,
        /// Serving endpoints (`http://host:port/v1`) that must all have the version loaded.
        #[arg(long = "endpoint")]
        endpoints: Vec<String>,
    },
    /// Per route: stable vs canary, weight, stage, metrics with intervals, the controller's view.
    Status {
        /// Only this route.
        route: Option<String>,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Stop advancing (the canary keeps its weight).
    Pause { route: String },
    /// Continue a paused or frozen rollout.
    Resume { route: String },
    /// Make the canary stable now.
    Promote { route: String },
    /// Send all traffic back to stable.
    Rollback { route: String },
    /// Emergency stop: all traffic to stable within a second.
    Kill { route: String },
    /// Pin a user to a version.
    Pin {
        route: String,
        user: String,
        version: String,
    },
    /// Remove a user's pin.
    Unpin { route: String, user: String },
    /// The route's audit trail, newest first.
    History {
        route: String,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// Runs one `hindsight rollout` command.
pub async fn run(
    args: RolloutArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let file: RolloutFile = hindsight_core::load_toml(
        args.config.as_deref(),
        std::env::vars(),
        RolloutFile::SECTIONS,
    )?;
    file.routing.validate()?;
    file.rollout.validate()?;
    let store = RoutingStore::new(file.routing.store())?;
    let by = if args.by.contains(':') {
        args.by.clone()
    } else {
        format!("operator:{}", args.by)
    };
    let (route, cmd) = match args.command.clone() {
        RolloutCommand::Run => return run_controller(file, store, shutdown).await,
        RolloutCommand::Status { route, json } => return status(&store, route, json).await,
        RolloutCommand::History { route, limit, json } => {
            return history(&store, &route, limit, json).await
        }
        RolloutCommand::SetStable { route, version } => (route, Command::SetStable { version }),
        RolloutCommand::Start {
            route,
            version,
            stages,
            policy,
            endpoints,
        } => {
            let policy = match policy.as_deref() {
                None => None,
                Some("queue") => Some(CandidatePolicy::Queue),
                Some("supersede") => Some(CandidatePolicy::Supersede),
                Some(other) => anyhow::bail!("--policy `{other}`: use `queue` or `supersede`"),
            };
            (
                route,
                Command::Start {
                    version,
                    stages,
                    policy,
                    endpoints,
                },
            )
        }
        RolloutCommand::Pause { route } => (route, Command::Pause),
        RolloutCommand::Resume { route } => (route, Command::Resume),
        RolloutCommand::Promote { route } => (route, Command::Promote),
        RolloutCommand::Rollback { route } => (route, Command::Rollback),
        RolloutCommand::Kill { route } => (route, Command::Kill),
        RolloutCommand::Pin {
            route,
            user,
            version,
        } => (route, Command::Pin { user, version }),
        RolloutCommand::Unpin { route, user } => (route, Command::Unpin { user }),
    };
    // The registry is consulted and kept in step when it answers; the routing table is the
    // authority, so a command is not refused because the registry is away.
    let registry = Registry::connect(file.registry.clone()).await.ok();
    let actor = Actor {
        by: &by,
        reason: &args.reason,
        generation: args.generation,
    };
    match commands::run(
        &store,
        registry.as_ref(),
        &file.rollout,
        &route,
        &actor,
        cmd,
    )
    .await?
    {
        Outcome::Queued { version, behind } => {
            println!("{route}: the rollout of {behind} is running; {version} is queued and starts when it ends");
        }
        Outcome::Done {
            route: stored,
            audit,
        } => {
            let weight = stored.active_rollout().map_or(0.0, |r| r.weight);
            println!(
                "{route}: {} done (generation {}); stable {}, canary {} at weight {weight}",
                audit.action,
                stored.generation,
                stored.stable,
                stored
                    .rollout
                    .as_ref()
                    .map_or("-".to_string(), |r| format!("{} ({})", r.canary, r.state)),
            );
        }
    }
    Ok(())
}

/// `hindsight rollout run`: the controller, with its admin API and `/metrics`.
async fn run_controller(
    file: RolloutFile,
    store: RoutingStore,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let log = file.log.validate()?;
    let (audit_log, handle) = rollout::controller::audit_log(log.clone()).await?;
    // The last feedback events the controller reads, for the operator page.
    let recent_feedback = rollout::RecentFeedback::new();
    let registry = Registry::connect(file.registry.clone())
        .await
        .context("connecting to the adapter registry ([registry].redis_url)")?;
    let admin = Arc::new(AdminState {
        store: RoutingStore::new(file.routing.store())?,
        registry: Some(Registry::connect(file.registry.clone()).await?),
        cfg: file.rollout.clone(),
        token: file
            .rollout
            .admin_token
            .as_ref()
            .map(|t| t.0.clone())
            .unwrap_or_default(),
        prometheus: hindsight_proxy::prometheus()
            .map(|h| Box::new(move || h.render()) as Box<dyn Fn() -> String + Send + Sync>),
        recent_feedback: recent_feedback.clone(),
    });
    let addr = file.rollout.admin_addr.clone();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding rollout.admin_addr {addr}"))?;
    if file.rollout.admin_token.is_none() {
        tracing::warn!(
            "rollout.admin_token is not set: the admin API refuses every command (401)."
        );
    }
    tracing::info!(%addr, page = %format!("http://{addr}/"), "Rollout admin API and operator page listening.");
    let app = rollout::admin::router(admin);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let controller = rollout::Controller::new(file.rollout, store, handle)?
        .with_registry(registry)
        .with_recent_feedback(recent_feedback);
    tracing::info!("Rollout controller running.");
    controller.run(&log, shutdown).await?;
    audit_log.shutdown(std::time::Duration::from_secs(10)).await;
    Ok(())
}

async fn history(
    store: &RoutingStore,
    route: &str,
    limit: usize,
    json: bool,
) -> anyhow::Result<()> {
    for a in store.audit(route, limit).await? {
        if json {
            println!("{}", serde_json::to_string(&a)?);
        } else {
            println!(
                "gen {:>4}  {}  {:<10} {:<20} weight {:.2}  {}",
                a.generation, a.at_ms, a.action, a.by, a.weight, a.reason
            );
        }
    }
    Ok(())
}

async fn status(store: &RoutingStore, only: Option<String>, as_json: bool) -> anyhow::Result<()> {
    let mut routes: Vec<_> = store.load_all().await?.into_iter().collect();
    routes.sort_by_key(|r| r.as_ref().map(|r| r.route.clone()).unwrap_or_default());
    for parsed in routes {
        let route = match parsed {
            Ok(r) => r,
            Err(e) => {
                println!("malformed entry: {e}");
                continue;
            }
        };
        if only.as_ref().is_some_and(|o| *o != route.route) {
            continue;
        }
        let view = store.get_status(&route.route).await?;
        if as_json {
            println!("{}", json!({"route": route, "controller": view}));
            continue;
        }
        println!("route {} (generation {})", route.route, route.generation);
        println!("  stable  {}", route.stable);
        match &route.rollout {
            None => println!("  no rollout"),
            Some(r) => {
                println!(
                    "  canary  {}  state {}  stage {}/{}  weight {}  rollout {}",
                    r.canary,
                    r.state,
                    r.stage + 1,
                    r.stages.len(),
                    r.weight,
                    r.id
                );
            }
        }
        if !route.pins.is_empty() {
            println!("  pins    {:?}", route.pins);
        }
        println!(
            "  last    {} by {}: {}",
            route.last_change.action, route.last_change.by, route.last_change.reason
        );
        if let Some(v) = view {
            let arm = |a: &str, k: &str| {
                v.pointer(&format!("/stats/{a}/{k}"))
                    .cloned()
                    .unwrap_or_default()
            };
            println!("  {:<22} {:>14} {:>14}", "metric", "stable", "canary");
            for k in [
                "exposures",
                "matured",
                "negative_rate",
                "error_rate",
                "empty_rate",
                "latency_p99_ms",
                "mean_length_tokens",
                "tool_calls_per_turn",
            ] {
                println!(
                    "  {k:<22} {:>14} {:>14}",
                    fmt(&arm("stable", k)),
                    fmt(&arm("canary", k))
                );
            }
            if let Some(g) = v.pointer("/stats/guards").and_then(|g| g.as_object()) {
                for (name, g) in g {
                    println!(
                        "  test {name:<18} {} {}",
                        g.get("verdict").and_then(|v| v.as_str()).unwrap_or(""),
                        g.get("canary_minus_stable")
                            .map(|i| format!("canary−stable {i}"))
                            .unwrap_or_default()
                    );
                }
            }
            println!(
                "  controller: {}",
                v.get("decision").and_then(|d| d.as_str()).unwrap_or("-")
            );
        }
    }
    Ok(())
}

fn fmt(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if f.fract() != 0.0 => format!("{f:.4}"),
            _ => n.to_string(),
        },
        serde_json::Value::Null => "-".into(),
        other => other.to_string(),
    }
}
