//! Candidates waiting for their route's running rollout to end (`on_new_candidate = "queue"`).
//! One slot per route in Redis (`<prefix>:queued:<route>`): a newer candidate replaces an
//! older waiting one, since the newer adapter contains the older one's learning.

use hindsight_routing::{Route, RoutingError, RoutingStore};

/// Queues `version` for `route` (replacing any waiting candidate).
pub async fn enqueue(store: &RoutingStore, route: &str, version: &str) -> Result<(), RoutingError> {
    store.put_queued(route, Some(version)).await
}

/// The queued candidate to start now, if the route has no active rollout; taken off the queue.
pub async fn next_queued(
    store: &RoutingStore,
    route: &Route,
) -> Result<Option<String>, RoutingError> {
    if route.active_rollout().is_some() {
        return Ok(None);
    }
    let Some(v) = store.get_queued(&route.route).await? else {
        return Ok(None);
    };
    store.put_queued(&route.route, None).await?;
    if v == route.stable {
        return Ok(None);
    }
    Ok(Some(v))
}
