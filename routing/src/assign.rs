//! Sticky weighted assignment of one request to a route's stable or canary version.
//!
//! A request's sticky key (the user, else the episode, else the interaction) is hashed with the
//! rollout id into a point `u` in [0, 1); the request goes to the canary when `u < weight`.
//! The same key always lands on the same point, so a user keeps their arm; raising the weight
//! only adds points to the canary (monotone: everyone on the canary at 5% is still on it at
//! 25%); and a new rollout id draws a fresh cohort, so the same users are not always first.
//! An episode additionally keeps the version it started with for as long as its rollout runs
//! ([`EpisodeMemory`]), even when the weight moves under it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::table::Route;

/// Which arm a request was assigned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arm {
    /// The route's stable version.
    Stable,
    /// The rollout's canary version.
    Canary,
    /// A per-user pin chose the version.
    Pinned,
}

impl Arm {
    /// `stable`, `canary` or `pinned`, as recorded.
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Stable => "stable",
            Arm::Canary => "canary",
            Arm::Pinned => "pinned",
        }
    }
}

/// The decision for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    /// The route (logical model) the request named.
    pub route: String,
    /// The arm.
    pub arm: Arm,
    /// The version sent upstream (`name@version` or the base model).
    pub version: String,
    /// The active rollout, if one was running.
    pub rollout_id: Option<String>,
    /// Probability that this request's key gets this arm under the current table (the weight
    /// for the canary, 1 − weight for stable, 1 when pinned or no rollout is running), for
    /// off-policy evaluation from logged traffic.
    pub probability: f64,
}

/// The point in [0, 1) of `key` for `rollout_id`: the first 53 bits of SHA-256 over
/// `rollout_id NUL key`. A documented hash, so every proxy (any build, any language) agrees.
pub fn bucket(rollout_id: &str, key: &str) -> f64 {
    let mut h = Sha256::new();
    h.update(rollout_id.as_bytes());
    h.update([0u8]);
    h.update(key.as_bytes());
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    (u64::from_be_bytes(first) >> 11) as f64 / (1u64 << 53) as f64
}

/// Assigns a request with sticky `key` (and, when it has one, `user`) on `route`.
pub fn assign(route: &Route, user: Option<&str>, key: &str) -> Assignment {
    let base = |arm, version: &str, probability| Assignment {
        route: route.route.clone(),
        arm,
        version: version.to_string(),
        rollout_id: route.active_rollout().map(|r| r.id.clone()),
        probability,
    };
    if let Some(pinned) = user.and_then(|u| route.pins.get(u)) {
        return base(Arm::Pinned, pinned, 1.0);
    }
    match route.active_rollout() {
        None => base(Arm::Stable, &route.stable, 1.0),
        Some(r) if bucket(&r.id, key) < r.weight => base(Arm::Canary, &r.canary, r.weight),
        Some(r) => base(Arm::Stable, &route.stable, 1.0 - r.weight),
    }
}

/// Episode → what it was first assigned (its `rollout_id` is the rollout it started in), so
/// its later turns keep the version; and the keys oldest first. A key is allocated once and
/// shared by both.
type Remembered = (HashMap<Arc<str>, Assignment>, VecDeque<Arc<str>>);

/// Bounded memory of episode → assignment for episodes that started during a rollout. The
/// oldest entries are forgotten first; an episode forgotten mid-way falls back to its sticky
/// key, which keeps it on its arm unless the weight moved in between.
pub struct EpisodeMemory {
    capacity: usize,
    inner: Mutex<Remembered>,
}

impl EpisodeMemory {
    /// Remembers up to `capacity` episodes (0 remembers none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }

    /// The assignment for a request of `episode` (when known) with sticky `key`: the
    /// episode's earlier version while its rollout still runs and that version still serves
    /// the route (a pin always wins), else a fresh [`assign`], remembered for the episode.
    pub fn assign(
        &self,
        route: &Route,
        user: Option<&str>,
        episode: Option<&str>,
        key: &str,
    ) -> Assignment {
        let fresh = assign(route, user, key);
        let (Some(episode), Some(rollout), true) = (
            episode,
            route.active_rollout(),
            fresh.arm != Arm::Pinned && self.capacity > 0,
        ) else {
            return fresh;
        };
        let mem_key = format!("{}\u{0}{episode}", route.route);
        let Ok(mut guard) = self.inner.lock() else {
            return fresh;
        };
        let (map, order) = &mut *guard;
        if let Some(prev) = map.get(mem_key.as_str()) {
            let still_served = prev.version == route.stable || prev.version == rollout.canary;
            if prev.rollout_id.as_deref() == Some(rollout.id.as_str()) && still_served {
                // The probability the episode's *first* turn had; it decided the arm.
                return prev.clone();
            }
        }
        if map.len() >= self.capacity {
            while let Some(old) = order.pop_front() {
                if map.remove(&old).is_some() {
                    break;
                }
            }
        }
        let mem_key: Arc<str> = Arc::from(mem_key);
        if map.insert(mem_key.clone(), fresh.clone()).is_none() {
            order.push_back(mem_key);
        }
        fresh
    }

    /// Episodes remembered now.
    pub fn len(&self) -> usize {
        self.inner.lock().map(|g| g.0.len()).unwrap_or(0)
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{Change, Rollout, RolloutState};
    use proptest::prelude::*;

    fn route(weight: f64) -> Route {
        let change = Change {
            id: "c".into(),
            by: "t".into(),
            action: "start".into(),
            reason: "t".into(),
            at_ms: 0,
        };
        let mut r = Route::new("support", "support@1", change);
        r.rollout = Some(Rollout {
            id: "rollout-1".into(),
            canary: "support@2".into(),
            weight,
            stage: 0,
            stages: vec![weight.max(0.01), 1.0],
            state: RolloutState::Running,
            started_ms: 0,
            stage_started_ms: 0,
        });
        r
    }

    #[test]
    fn the_hash_is_the_documented_one() {
        // SHA-256("r\0k") starts 0x36c78279; the value (computed independently with Python's
        // hashlib) is pinned so every proxy build, and any other implementation, agrees.
        assert_eq!(bucket("r", "k"), 0.213_981_775_944_188_32);
        assert_ne!(bucket("r", "k"), bucket("r2", "k"));
    }

    proptest! {
        #[test]
        fn raising_the_weight_keeps_every_canary_key_on_the_canary(
            key in ".{0,40}", w1 in 0.0f64..1.0, extra in 0.0f64..1.0,
        ) {
            let w2 = (w1 + extra).min(1.0);
            let a1 = assign(&route(w1), None, &key);
            let a2 = assign(&route(w2), None, &key);
            if a1.arm == Arm::Canary {
                prop_assert_eq!(a2.arm, Arm::Canary);
            }
            if a2.arm == Arm::Stable {
                prop_assert_eq!(a1.arm, Arm::Stable);
            }
        }
    }

    #[test]
    fn the_split_matches_the_weight() {
        let r = route(0.05);
        let canary = (0..200_000)
            .filter(|i| assign(&r, None, &format!("user-{i}")).arm == Arm::Canary)
            .count();
        // 200k draws at p = 0.05: sd ≈ 97; 5 sd either side.
        assert!((9_500..=10_500).contains(&canary), "{canary}");
    }

    #[test]
    fn pins_win_and_finished_rollouts_send_everyone_to_stable() {
        let mut r = route(1.0);
        r.pins.insert("alice".into(), "support@1".into());
        let a = assign(&r, Some("alice"), "alice");
        assert_eq!(
            (a.arm, a.version.as_str(), a.probability),
            (Arm::Pinned, "support@1", 1.0)
        );
        assert_eq!(assign(&r, Some("bob"), "bob").arm, Arm::Canary);
        r.rollout.as_mut().unwrap().state = RolloutState::RolledBack;
        let a = assign(&r, Some("bob"), "bob");
        assert_eq!(
            (a.arm, a.version.as_str(), a.rollout_id),
            (Arm::Stable, "support@1", None)
        );
    }

    #[test]
    fn an_episode_keeps_its_version_while_the_weight_moves() {
        let memory = EpisodeMemory::new(100);
        // Find a key that is stable at 5% but canary at 50%.
        let key = (0..10_000)
            .map(|i| format!("ep-{i}"))
            .find(|k| {
                assign(&route(0.05), None, k).arm == Arm::Stable
                    && assign(&route(0.5), None, k).arm == Arm::Canary
            })
            .unwrap();
        let first = memory.assign(&route(0.05), None, Some(&key), &key);
        assert_eq!(first.arm, Arm::Stable);
        let later = memory.assign(&route(0.5), None, Some(&key), &key);
        assert_eq!(
            later.version, "support@1",
            "the episode changed version mid-way"
        );
        // A new episode with the same key at 50% goes to the canary.
        assert_eq!(
            memory.assign(&route(0.5), None, Some("other"), &key).arm,
            Arm::Canary
        );
        // A new rollout id forgets the old decision.
        let mut next = route(0.5);
        next.rollout.as_mut().unwrap().id = "rollout-2".into();
        let fresh = memory.assign(&next, None, Some(&key), &key);
        assert_eq!(fresh, assign(&next, None, &key));
    }

    #[test]
    fn episode_memory_is_bounded() {
        let memory = EpisodeMemory::new(10);
        for i in 0..100 {
            memory.assign(&route(0.5), None, Some(&format!("e{i}")), "k");
        }
        assert_eq!(memory.len(), 10);
    }
}
