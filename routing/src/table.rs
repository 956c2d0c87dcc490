//! The routing table: per route (a logical model name clients send, e.g. `support`), the stable
//! version, at most one canary rollout, per-user pins, a generation number and the last change.
//! This is the contract between the control plane (which writes it) and every proxy (which
//! reads it); both validate it with [`Route::validate`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::RoutingError;

/// Pins per route at most: pins are for operators and test users, not a second routing table.
pub const MAX_PINS: usize = 1_000;

/// The state of a route's rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutState {
    /// The controller advances it stage by stage.
    Running,
    /// An operator paused it: the canary keeps its weight, the controller waits.
    Paused,
    /// A drift alarm froze it: the canary keeps its weight until an operator decides.
    Frozen,
    /// The canary became the stable version.
    Promoted,
    /// The controller or an operator sent all traffic back to stable.
    RolledBack,
    /// An operator's emergency stop: all traffic to stable.
    Killed,
}

impl RolloutState {
    /// Whether the canary still receives traffic.
    pub fn is_active(self) -> bool {
        matches!(self, Self::Running | Self::Paused | Self::Frozen)
    }

    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Frozen => "frozen",
            Self::Promoted => "promoted",
            Self::RolledBack => "rolled_back",
            Self::Killed => "killed",
        }
    }
}

impl std::fmt::Display for RolloutState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A canary rollout of one version against the route's stable version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    /// Unique id; also salts the assignment hash, so each rollout draws a fresh canary cohort.
    pub id: String,
    /// The version under test (`name@version`).
    pub canary: String,
    /// Share of traffic sent to the canary, in [0, 1].
    pub weight: f64,
    /// Index of the current stage in `stages`.
    pub stage: usize,
    /// The canary weight of each stage, strictly increasing, ending at 1.0 (promotion).
    pub stages: Vec<f64>,
    /// Where the rollout is.
    pub state: RolloutState,
    /// When it started, ms since the Unix epoch.
    pub started_ms: i64,
    /// When the current stage started, ms since the Unix epoch.
    pub stage_started_ms: i64,
}

/// Who changed a route last, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Change {
    /// Unique id of the change (also the audit record's id).
    pub id: String,
    /// `operator:<name>`, `controller`, `learner`, ...
    pub by: String,
    /// The action (`start`, `advance`, `rollback`, ...).
    pub action: String,
    /// Why, in words.
    pub reason: String,
    /// When, ms since the Unix epoch.
    pub at_ms: i64,
}

/// One route of the table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// The logical model name clients send in `model`.
    pub route: String,
    /// The version every request gets outside a canary: `name@version`, or the base model.
    pub stable: String,
    /// The current or last rollout.
    #[serde(default)]
    pub rollout: Option<Rollout>,
    /// User (`x-hindsight-user`) → the version that user always gets.
    #[serde(default)]
    pub pins: BTreeMap<String, String>,
    /// Incremented by every write; writes are compare-and-set on it.
    pub generation: u64,
    /// The last change.
    pub last_change: Change,
}

impl Route {
    /// A route serving `stable` with no rollout (generation 0: not yet written anywhere).
    pub fn new(route: &str, stable: &str, change: Change) -> Self {
        Self {
            route: route.to_string(),
            stable: stable.to_string(),
            rollout: None,
            pins: BTreeMap::new(),
            generation: 0,
            last_change: change,
        }
    }

    /// The rollout whose canary currently receives traffic, if any.
    pub fn active_rollout(&self) -> Option<&Rollout> {
        self.rollout.as_ref().filter(|r| r.state.is_active())
    }

    /// Checks every rule a route must satisfy; the error names the field.
    pub fn validate(&self) -> Result<(), RoutingError> {
        let bad = |field: &str, reason: String| RoutingError::Invalid {
            field: field.to_string(),
            reason,
        };
        valid_name("route", &self.route)?;
        valid_name("stable", &self.stable)?;
        if let Some(r) = &self.rollout {
            valid_name("rollout.canary", &r.canary)?;
            if r.id.is_empty() {
                return Err(bad("rollout.id", "must not be empty".into()));
            }
            if r.canary == self.stable && r.state.is_active() {
                return Err(bad(
                    "rollout.canary",
                    format!("`{}` is already the stable version", r.canary),
                ));
            }
            if !(r.weight.is_finite() && (0.0..=1.0).contains(&r.weight)) {
                return Err(bad(
                    "rollout.weight",
                    format!("{} is outside [0, 1]", r.weight),
                ));
            }
            validate_stages(&r.stages)?;
            if r.stage >= r.stages.len() {
                return Err(bad(
                    "rollout.stage",
                    format!("{} but there are {} stages", r.stage, r.stages.len()),
                ));
            }
        }
        if self.pins.len() > MAX_PINS {
            return Err(bad(
                "pins",
                format!("{} pins; at most {MAX_PINS}", self.pins.len()),
            ));
        }
        for (user, version) in &self.pins {
            if user.is_empty() {
                return Err(bad("pins", "a pinned user id is empty".into()));
            }
            valid_name(&format!("pins.{user}"), version)?;
        }
        Ok(())
    }
}

/// Stage weights: non-empty, each in (0, 1], strictly increasing, the last 1.0.
pub fn validate_stages(stages: &[f64]) -> Result<(), RoutingError> {
    let bad = |reason: String| RoutingError::Invalid {
        field: "stages".into(),
        reason,
    };
    if stages.is_empty() {
        return Err(bad("no stages".into()));
    }
    for (i, w) in stages.iter().enumerate() {
        if !(w.is_finite() && *w > 0.0 && *w <= 1.0) {
            return Err(bad(format!("stage {i} weight {w} is outside (0, 1]")));
        }
        if i > 0 && *w <= stages[i - 1] {
            return Err(bad(format!(
                "stage weights must increase: {} then {w}",
                stages[i - 1]
            )));
        }
    }
    if stages.last() != Some(&1.0) {
        return Err(bad("the last stage must be 1.0 (it promotes)".into()));
    }
    Ok(())
}

/// A model or version name: non-empty, printable, no whitespace, at most 256 bytes.
fn valid_name(field: &str, name: &str) -> Result<(), RoutingError> {
    if name.is_empty()
        || name.len() > 256
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(RoutingError::Invalid {
            field: field.to_string(),
            reason: format!("`{name}` is not a model name (non-empty, no whitespace)"),
        });
    }
    Ok(())
}

/// An immutable snapshot of every route, as a proxy holds it in memory.
#[derive(Debug, Default, Clone)]
pub struct RoutingTable {
    routes: HashMap<String, Arc<Route>>,
}

impl RoutingTable {
    /// A table of these routes.
    pub fn new(routes: impl IntoIterator<Item = Route>) -> Self {
        Self {
            routes: routes
                .into_iter()
                .map(|r| (r.route.clone(), Arc::new(r)))
                .collect(),
        }
    }

    /// The route clients reach by sending `model`.
    pub fn get(&self, model: &str) -> Option<&Arc<Route>> {
        self.routes.get(model)
    }

    /// Whether no route is configured (the proxy then skips routing entirely).
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// Every route.
    pub fn routes(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.values()
    }

    /// This table with `route` replaced.
    pub fn with(&self, route: Route) -> Self {
        let mut routes = self.routes.clone();
        routes.insert(route.route.clone(), Arc::new(route));
        Self { routes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn change() -> Change {
        Change {
            id: "c1".into(),
            by: "test".into(),
            action: "start".into(),
            reason: "test".into(),
            at_ms: 0,
        }
    }

    fn route_with(weight: f64, stages: Vec<f64>) -> Route {
        let mut r = Route::new("support", "support@1", change());
        r.rollout = Some(Rollout {
            id: "r1".into(),
            canary: "support@2".into(),
            weight,
            stage: 0,
            stages,
            state: RolloutState::Running,
            started_ms: 0,
            stage_started_ms: 0,
        });
        r
    }

    #[test]
    fn a_valid_route_passes_and_each_rule_names_its_field() {
        route_with(0.05, vec![0.05, 1.0]).validate().unwrap();
        let err = |r: Route| r.validate().unwrap_err().to_string();
        assert!(err(route_with(1.5, vec![0.05, 1.0])).contains("rollout.weight"));
        assert!(err(route_with(f64::NAN, vec![0.05, 1.0])).contains("rollout.weight"));
        assert!(err(route_with(0.1, vec![0.5, 0.25, 1.0])).contains("increase"));
        assert!(err(route_with(0.1, vec![0.5])).contains("last stage"));
        assert!(err(route_with(0.1, vec![])).contains("stages"));
        let mut same = route_with(0.1, vec![0.1, 1.0]);
        same.rollout.as_mut().unwrap().canary = "support@1".into();
        assert!(err(same).contains("already the stable"));
        let mut r = route_with(0.1, vec![0.1, 1.0]);
        r.stable = "has space".into();
        assert!(err(r).contains("stable"));
        let mut r = route_with(0.1, vec![0.1, 1.0]);
        r.rollout.as_mut().unwrap().stage = 2;
        assert!(err(r).contains("rollout.stage"));
    }

    #[test]
    fn a_route_round_trips_through_json_and_unknown_fields_are_refused() {
        let r = route_with(0.25, vec![0.01, 0.25, 1.0]);
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Route>(&text).unwrap(), r);
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["surprise"] = 1.into();
        assert!(serde_json::from_value::<Route>(v).is_err());
    }

    #[test]
    fn only_running_paused_and_frozen_rollouts_take_traffic() {
        let mut r = route_with(0.5, vec![0.5, 1.0]);
        for (state, active) in [
            (RolloutState::Running, true),
            (RolloutState::Paused, true),
            (RolloutState::Frozen, true),
            (RolloutState::Promoted, false),
            (RolloutState::RolledBack, false),
            (RolloutState::Killed, false),
        ] {
            r.rollout.as_mut().unwrap().state = state;
            assert_eq!(r.active_rollout().is_some(), active, "{state}");
        }
    }
}
