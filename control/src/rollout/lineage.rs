//! The registry follows the rollout: a version whose canary starts is `canary`, a promoted one
//! `live` (the previous live version `retired`), a rolled-back or killed one `rolled_back`,
//! each with a note naming the rollout and the decision, so the version's lineage shows how it
//! reached (or left) traffic.
//!
//! Two paths keep the registry in step, so no decision is lost to a Redis blip: the writer of a
//! change follows it at once ([`follow`], retrying transient errors for up to
//! [`RETRY_FOR`]), and the controller reconciles every route on every tick ([`reconcile`]), which
//! repairs what a writer could not finish (an operator's CLI that gave up, a crash in between).

use std::time::Duration;

use hindsight_routing::{AuditRecord, RolloutState, Route};

use crate::registry::{Registry, RegistryError, VersionStatus};

/// How long a registry update retries transient Redis errors before leaving it to
/// [`reconcile`].
pub const RETRY_FOR: Duration = Duration::from_secs(30);

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
    let note = format!(
        "rollout {} on route `{}`: {} by {} (generation {}): {}",
        rollout.id, route.route, audit.action, audit.by, audit.generation, audit.reason
    );
    let always = audit.action == "start";
    retrying(|| set(reg, &rollout.canary, status, always, &note)).await
}

/// Brings the registry entry of the route's canary in line with the rollout's state
/// (`canary` while it runs, is paused or frozen; `live` once promoted; `rolled_back` after a
/// rollback or kill), noting the route's last change. Does nothing when they agree.
pub async fn reconcile(reg: &Registry, route: &Route) -> Result<(), RegistryError> {
    let Some(rollout) = &route.rollout else {
        return Ok(());
    };
    let status = match rollout.state {
        RolloutState::Running | RolloutState::Paused | RolloutState::Frozen => {
            VersionStatus::Canary
        }
        RolloutState::Promoted => VersionStatus::Live,
        RolloutState::RolledBack | RolloutState::Killed => VersionStatus::RolledBack,
    };
    let c = &route.last_change;
    let note = format!(
        "rollout {} on route `{}`: {} by {} (generation {}): {} (reconciled)",
        rollout.id, route.route, c.action, c.by, route.generation, c.reason
    );
    set(reg, &rollout.canary, status, false, &note).await
}

/// Sets `version`'s status unless it already has it (or `always`).
async fn set(
    reg: &Registry,
    version: &str,
    status: VersionStatus,
    always: bool,
    note: &str,
) -> Result<(), RegistryError> {
    let Some((name, version)) = version
        .rsplit_once('@')
        .and_then(|(n, v)| Some((n, v.parse::<u64>().ok()?)))
    else {
        return Ok(());
    };
    let Some(entry) = reg.get(name, version).await? else {
        return Ok(());
    };
    if entry.status == status && !always {
        return Ok(());
    }
    reg.set_status(name, version, status, None, Some(note.to_string()))
        .await?;
    Ok(())
}

/// Runs `op` until it succeeds, fails for good, or transient Redis errors have lasted
/// [`RETRY_FOR`] (backoff 100 ms doubling to 2 s).
async fn retrying<F, Fut>(mut op: F) -> Result<(), RegistryError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), RegistryError>>,
{
    let deadline = tokio::time::Instant::now() + RETRY_FOR;
    let mut backoff = Duration::from_millis(100);
    loop {
        match op().await {
            Err(RegistryError::Redis(e))
                if hindsight_routing::store::is_transient(&e)
                    && tokio::time::Instant::now() + backoff < deadline =>
            {
                tracing::warn!(error = %e, "Registry unavailable; retrying the rollout's status change.");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}
