//! The registry follows the rollout: a version whose canary starts is `canary`, a promoted one
//! `live` (the previous live version `retired`), a rolled-back or killed one `rolled_back`,
//! each with a note naming the rollout and the decision, so the version's lineage shows how it
//! reached (or left) traffic.

use hindsight_routing::{AuditRecord, RolloutState, Route};

use crate::registry::{Registry, RegistryError, VersionStatus};

/// Updates the registry entry of the route's canary after the change `audit` made; versions
/// that are not `name@N` of a registered adapter (the base model) are left alone.
pub async fn follow(
    reg: &Registry,
    route: &Route,
    audit: &AuditRecord,
) -> Result<(), RegistryError> {
    let Some(rollout) = &route.rollout else {
        return Ok(());
    };
    let status = match (audit.action.as_str(), rollout.state) {
        ("start", _) => VersionStatus::Canary,
        (_, RolloutState::Promoted) => VersionStatus::Live,
        (_, RolloutState::RolledBack | RolloutState::Killed) => VersionStatus::RolledBack,
        _ => return Ok(()),
    };
    let Some((name, version)) = rollout
        .canary
        .rsplit_once('@')
        .and_then(|(n, v)| Some((n, v.parse::<u64>().ok()?)))
    else {
        return Ok(());
    };
    let Some(entry) = reg.get(name, version).await? else {
        return Ok(());
    };
    if entry.status == status && audit.action != "start" {
        return Ok(());
    }
    let note = format!(
        "rollout {} on route `{}`: {} by {} (generation {}): {}",
        rollout.id, route.route, audit.action, audit.by, audit.generation, audit.reason
    );
    reg.set_status(name, version, status, None, Some(note))
        .await?;
    Ok(())
}
