//! Versions under their literal `<name>@<version>` names, for servers that have no adapter
//! versions (vLLM). `hindsight serve` keeps several versions of one name and resolves
//! `<name>@<version>` itself; vLLM knows only the names it was given, so while a canary runs
//! each version the routing table sends traffic to must be loaded under its tag as its own
//! adapter (`publish.load_versions_by_name`). Versions no route needs any more are unloaded
//! again at the next publish, so a server holds at most the stable, the canary, a queued
//! candidate and pinned versions of each adapter, besides `<name>` and `<name>-candidate`.

use std::collections::BTreeSet;

use serde_json::Value;

use super::{load_adapter, served_models, unload_adapter, PublishConfig, PublishError};
use crate::registry::{Registry, VersionEntry};

/// Whether `model` (an entry of `/v1/models`) serves `entry`: the listed version when the
/// server reports one (`hindsight serve`), else the files' directory (vLLM lists an adapter's
/// `lora_path` as its `root`), else only the name.
pub(super) fn serves(model: &Value, entry: &VersionEntry) -> bool {
    if let Some(v) = model.get("version").and_then(Value::as_u64) {
        return v == entry.version;
    }
    match model.get("root").and_then(Value::as_str) {
        Some(root) => std::path::Path::new(root) == entry.path,
        None => true,
    }
}

/// Loads each of `entries` under its tag on every endpoint where `/v1/models` does not already
/// list that tag serving those files. A failure stops at once; tags loaded before it stay
/// (nothing routes to them yet) until [`prune`] removes them.
pub(super) async fn load(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    entries: &[&VersionEntry],
) -> Result<(), PublishError> {
    let key = cfg.api_key.as_deref();
    for ep in &cfg.endpoints {
        let models = served_models(client, ep, key).await?;
        for entry in entries {
            let tag = entry.tag();
            let loaded = models.iter().any(|m| {
                m.get("id").and_then(Value::as_str) == Some(tag.as_str()) && serves(m, entry)
            });
            if !loaded {
                load_adapter(client, ep, key, &tag, entry).await?;
            }
        }
    }
    Ok(())
}

/// The registry entry behind `tag` when it is a version of adapter `name`.
pub(super) async fn entry_of(
    reg: &Registry,
    name: &str,
    tag: &str,
) -> Result<Option<VersionEntry>, PublishError> {
    match tag.rsplit_once('@') {
        Some((n, v)) if n == name => match v.parse::<u64>() {
            Ok(v) => Ok(reg.get(name, v).await?),
            Err(_) => Ok(None),
        },
        _ => Ok(None),
    }
}

/// Every version some route still needs: its stable, the canary of a rollout that has not
/// ended, its pins and its queued candidate.
pub(super) async fn needed(
    store: &hindsight_routing::RoutingStore,
) -> Result<BTreeSet<String>, hindsight_routing::RoutingError> {
    let mut keep = BTreeSet::new();
    // A malformed entry is skipped here as the proxies skip it; it routes nothing.
    for route in store.load_all().await?.into_iter().flatten() {
        keep.insert(route.stable.clone());
        if let Some(r) = route.active_rollout() {
            keep.insert(r.canary.clone());
        }
        keep.extend(route.pins.values().cloned());
        if let Some(q) = store.get_queued(&route.route).await? {
            keep.insert(q);
        }
    }
    Ok(keep)
}

/// Unloads, on every endpoint, the `<name>@<version>` adapters outside `keep`. Best effort:
/// failures are logged and the next publish tries again.
pub(super) async fn prune(
    client: &reqwest::Client,
    cfg: &PublishConfig,
    name: &str,
    keep: &BTreeSet<String>,
) {
    let key = cfg.api_key.as_deref();
    for ep in &cfg.endpoints {
        let models = match served_models(client, ep, key).await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(endpoint = %ep, error = %e, "Could not list models to unload old versions.");
                continue;
            }
        };
        let stale = models
            .iter()
            .filter_map(|m| m.get("id").and_then(Value::as_str))
            .filter(|id| is_version_of(id, name) && !keep.contains(*id));
        for id in stale {
            if let Err(e) = unload_adapter(client, ep, key, id).await {
                tracing::warn!(endpoint = %ep, lora_name = id, error = %e, "Could not unload a version no route needs.");
            }
        }
    }
}

/// `id` is `<name>@<number>`.
fn is_version_of(id: &str, name: &str) -> bool {
    id.rsplit_once('@')
        .is_some_and(|(n, v)| n == name && !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn version_tags_are_recognised_by_name() {
        assert!(is_version_of("support@12", "support"));
        assert!(!is_version_of("support", "support"));
        assert!(!is_version_of("support@", "support"));
        assert!(!is_version_of("support@x1", "support"));
        assert!(!is_version_of("other@3", "support"));
        assert!(!is_version_of("support-candidate", "support"));
    }

    #[test]
    fn a_listed_model_serves_a_version_by_its_version_else_its_files() {
        let entry = VersionEntry {
            name: "support".into(),
            version: 4,
            parent: None,
            base_model: "b".into(),
            base_model_sha256: String::new(),
            path: "/adapters/support/v4".into(),
            files_sha256: Default::default(),
            training_config: json!({}),
            offsets: vec![],
            examples: 0,
            tokens: 0,
            eval: None,
            status: crate::registry::VersionStatus::Canary,
            created_at_ms: 0,
            updated_at_ms: 0,
            note: None,
        };
        // hindsight serve reports versions.
        assert!(serves(&json!({"id": "support", "version": 4}), &entry));
        assert!(!serves(
            &json!({"id": "support", "version": 3, "root": "/adapters/support/v4"}),
            &entry
        ));
        // vLLM reports the directory it loaded as `root`.
        assert!(serves(
            &json!({"id": "support", "root": "/adapters/support/v4"}),
            &entry
        ));
        assert!(!serves(
            &json!({"id": "support", "root": "/adapters/support/v3"}),
            &entry
        ));
        // Nothing to compare: the name is all there is.
        assert!(serves(&json!({"id": "support"}), &entry));
    }
}
