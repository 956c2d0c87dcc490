//! The operations on a route — by operators (`hindsight rollout …`, the admin API), by the
//! controller and by the learner — each one a compare-and-set write of the route with its
//! audit record. An operation checks its preconditions against the route as read; if another
//! writer moved the route on in between, the operation is re-read and re-checked (so nothing
//! is overwritten silently), except when the caller named the generation it acted on, which
//! makes a moved-on route a refusal.

use hindsight_core::now_ms;
use hindsight_routing::{
    validate_stages, AuditRecord, Change, Rollout, RolloutState, Route, RoutingError, RoutingStore,
};
use serde_json::Value;

/// Attempts when a write races another writer (each after a short random pause, so two
/// writers in lock-step fall out of it).
const CAS_ATTEMPTS: usize = 32;

/// What to do to a route.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Create the route or change its stable version (no rollout may be running).
    SetStable { stable: String },
    /// Start a rollout of `canary` through `stages` (the first stage's weight applies now).
    Start {
        canary: String,
        stages: Vec<f64>,
        rollout_id: Option<String>,
    },
    /// Move to the next stage (the controller, when the stage's minimums are met and no guard
    /// fired); moving to the last stage (weight 1.0) is promotion.
    Advance,
    /// The canary becomes stable.
    Promote,
    /// All traffic back to stable (evidence of harm, or an operator's decision).
    Rollback,
    /// An operator's emergency stop: all traffic to stable; never refused for an active rollout.
    Kill,
    /// Stop advancing; the canary keeps its weight.
    Pause,
    /// Continue a paused or frozen rollout.
    Resume,
    /// A drift alarm: stop advancing until an operator decides.
    Freeze,
    /// Pin a user to a version.
    Pin { user: String, version: String },
    /// Remove a user's pin.
    Unpin { user: String },
}

impl Op {
    /// The audit action name.
    pub fn action(&self) -> &'static str {
        match self {
            Op::SetStable { .. } => "set_stable",
            Op::Start { .. } => "start",
            Op::Advance => "advance",
            Op::Promote => "promote",
            Op::Rollback => "rollback",
            Op::Kill => "kill",
            Op::Pause => "pause",
            Op::Resume => "resume",
            Op::Freeze => "freeze",
            Op::Pin { .. } => "pin",
            Op::Unpin { .. } => "unpin",
        }
    }
}

/// Who asks, why, and on which generation.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// The route.
    pub route: &'a str,
    /// `operator:<name>`, `controller`, `learner`.
    pub by: &'a str,
    /// Why.
    pub reason: &'a str,
    /// Refuse if the route's generation is no longer this one.
    pub expected_generation: Option<u64>,
    /// The statistics behind the decision (recorded in the audit record).
    pub stats: Value,
}

fn refuse(field: &str, reason: impl Into<String>) -> RoutingError {
    RoutingError::Invalid {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// `route` with `op` applied, or why it cannot be.
pub fn apply(
    route: Option<&Route>,
    name: &str,
    op: &Op,
    change: Change,
) -> Result<Route, RoutingError> {
    let now = change.at_ms;
    if let Op::SetStable { stable } = op {
        let mut r = route
            .cloned()
            .unwrap_or_else(|| Route::new(name, stable, change.clone()));
        if r.active_rollout().is_some() {
            return Err(refuse(
                "stable",
                "a rollout is running; promote, roll back or kill it first",
            ));
        }
        r.stable = stable.clone();
        r.last_change = change;
        return Ok(r);
    }
    let mut r = route
        .cloned()
        .ok_or_else(|| RoutingError::UnknownRoute(name.to_string()))?;
    r.last_change = change;
    let active = |r: &mut Route| -> Result<(), RoutingError> {
        if r.active_rollout().is_none() {
            return Err(refuse("rollout", "no rollout is running on this route"));
        }
        Ok(())
    };
    match op {
        Op::SetStable { .. } => {}
        Op::Start {
            canary,
            stages,
            rollout_id,
        } => {
            if let Some(a) = r.active_rollout() {
                return Err(refuse(
                    "rollout",
                    format!(
                        "rollout {} of {} is {}; finish it first",
                        a.id, a.canary, a.state
                    ),
                ));
            }
            validate_stages(stages)?;
            if *canary == r.stable {
                return Err(refuse("canary", format!("`{canary}` is already stable")));
            }
            r.rollout = Some(Rollout {
                id: rollout_id
                    .clone()
                    .unwrap_or_else(|| uuid::Uuid::now_v7().to_string()),
                canary: canary.clone(),
                weight: stages[0],
                stage: 0,
                stages: stages.clone(),
                state: RolloutState::Running,
                started_ms: now,
                stage_started_ms: now,
            });
        }
        Op::Advance => {
            active(&mut r)?;
            if let Some(ro) = r.rollout.as_mut() {
                if ro.state != RolloutState::Running {
                    return Err(refuse(
                        "rollout",
                        format!("rollout is {}, not running", ro.state),
                    ));
                }
                let next = ro.stages.get(ro.stage + 1).copied().unwrap_or(1.0);
                if next >= 1.0 {
                    ro.stage = ro.stages.len() - 1;
                    ro.state = RolloutState::Promoted;
                    ro.weight = 1.0;
                    r.stable = ro.canary.clone();
                } else {
                    ro.stage += 1;
                    ro.weight = ro.stages[ro.stage];
                    ro.stage_started_ms = now;
                }
            }
        }
        Op::Promote => {
            active(&mut r)?;
            if let Some(ro) = r.rollout.as_mut() {
                ro.state = RolloutState::Promoted;
                ro.weight = 1.0;
                r.stable = ro.canary.clone();
            }
        }
        Op::Rollback | Op::Kill => {
            active(&mut r)?;
            if let Some(ro) = r.rollout.as_mut() {
                ro.state = if *op == Op::Kill {
                    RolloutState::Killed
                } else {
                    RolloutState::RolledBack
                };
                ro.weight = 0.0;
            }
        }
        Op::Pause | Op::Freeze => {
            active(&mut r)?;
            if let Some(ro) = r.rollout.as_mut() {
                if ro.state != RolloutState::Running {
                    return Err(refuse(
                        "rollout",
                        format!("rollout is {}, not running", ro.state),
                    ));
                }
                ro.state = if *op == Op::Pause {
                    RolloutState::Paused
                } else {
                    RolloutState::Frozen
                };
            }
        }
        Op::Resume => {
            active(&mut r)?;
            if let Some(ro) = r.rollout.as_mut() {
                if ro.state == RolloutState::Running {
                    return Err(refuse("rollout", "rollout is already running"));
                }
                ro.state = RolloutState::Running;
                ro.stage_started_ms = now;
            }
        }
        Op::Pin { user, version } => {
            r.pins.insert(user.clone(), version.clone());
        }
        Op::Unpin { user } => {
            if r.pins.remove(user).is_none() {
                return Err(refuse("user", format!("`{user}` is not pinned")));
            }
        }
    }
    r.validate()?;
    Ok(r)
}

/// Applies `op` to the stored route and writes it (compare-and-set), with its audit record.
/// Returns the route as stored and the audit record written.
pub async fn execute(
    store: &RoutingStore,
    req: &Request<'_>,
    op: &Op,
) -> Result<(Route, AuditRecord), RoutingError> {
    let mut last = None;
    for _ in 0..CAS_ATTEMPTS {
        let current = store.get(req.route).await?;
        let generation = current.as_ref().map_or(0, |r| r.generation);
        if let Some(expected) = req.expected_generation {
            if expected != generation {
                return Err(RoutingError::Conflict {
                    route: req.route.to_string(),
                    expected,
                    actual: generation,
                });
            }
        }
        let change = Change {
            id: uuid::Uuid::now_v7().to_string(),
            by: req.by.to_string(),
            action: op.action().to_string(),
            reason: req.reason.to_string(),
            at_ms: now_ms(),
        };
        let next = apply(current.as_ref(), req.route, op, change.clone())?;
        let audit = AuditRecord {
            id: change.id.clone(),
            route: req.route.to_string(),
            rollout_id: next.rollout.as_ref().map(|r| r.id.clone()),
            by: change.by.clone(),
            action: change.action.clone(),
            reason: change.reason.clone(),
            at_ms: change.at_ms,
            generation: next.generation + 1,
            weight: next.rollout.as_ref().map_or(0.0, |r| {
                if r.state == RolloutState::Promoted {
                    1.0
                } else if r.state.is_active() {
                    r.weight
                } else {
                    0.0
                }
            }),
            stats: req.stats.clone(),
        };
        match store.write(&next, &audit).await {
            Ok(stored) => return Ok((stored, audit)),
            Err(e @ RoutingError::Conflict { .. }) => {
                metrics::counter!("hindsight_rollout_cas_conflicts_total").increment(1);
                last = Some(e);
                // 1–16 ms, from the random bits of a v7 uuid.
                let jitter = (uuid::Uuid::now_v7().as_u128() & 0xf) as u64 + 1;
                tokio::time::sleep(std::time::Duration::from_millis(jitter)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| RoutingError::UnknownRoute(req.route.to_string())))
}
