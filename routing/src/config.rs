//! `[routing]`: where the table lives and what a proxy does with it. The proxy reads every
//! key; the controller and the `rollout` CLI read the store keys.

use serde::Deserialize;

use crate::store::StoreConfig;
use crate::table::{Change, Route};
use crate::RoutingError;

/// `[routing]` as written in the file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Route logical models through the table (a proxy with `false` forwards `model` as sent).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Redis holding the table.
    #[serde(default = "default_redis_url")]
    pub redis_url: String,
    /// Prefix of the table's keys and channel.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// How long a write (controller, operator) retries transient Redis errors.
    #[serde(default = "default_retry_for_ms")]
    pub retry_for_ms: u64,
    /// A proxy re-reads the whole table this often, in case a change message was missed.
    #[serde(default = "default_resync_ms")]
    pub resync_ms: u64,
    /// Episodes a proxy remembers so their later turns keep their first version (0: none).
    #[serde(default = "default_episode_memory")]
    pub episode_memory: usize,
    /// Routes a proxy serves from its own config until Redis says otherwise (and while Redis
    /// is unreachable at start-up).
    #[serde(default)]
    pub routes: Vec<FallbackRoute>,
}

/// One `[[routing.routes]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackRoute {
    /// The logical model name clients send.
    pub model: String,
    /// The version it gets (`name@version`, or the base model).
    pub stable: String,
}

fn default_true() -> bool {
    true
}
fn default_redis_url() -> String {
    StoreConfig::default().redis_url
}
fn default_key_prefix() -> String {
    StoreConfig::default().key_prefix
}
fn default_retry_for_ms() -> u64 {
    StoreConfig::default().retry_for_ms
}
fn default_resync_ms() -> u64 {
    5_000
}
fn default_episode_memory() -> usize {
    100_000
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            redis_url: default_redis_url(),
            key_prefix: default_key_prefix(),
            retry_for_ms: default_retry_for_ms(),
            resync_ms: default_resync_ms(),
            episode_memory: default_episode_memory(),
            routes: Vec::new(),
        }
    }
}

impl RoutingConfig {
    /// The store part.
    pub fn store(&self) -> StoreConfig {
        StoreConfig {
            redis_url: self.redis_url.clone(),
            key_prefix: self.key_prefix.clone(),
            retry_for_ms: self.retry_for_ms,
        }
    }

    /// Checks the values; the error's field is the key under `routing.`.
    pub fn validate(&self) -> Result<(), RoutingError> {
        let bad = |field: &str, reason: String| RoutingError::Invalid {
            field: format!("routing.{field}"),
            reason,
        };
        if self.key_prefix.is_empty() {
            return Err(bad("key_prefix", "must not be empty".into()));
        }
        if self.resync_ms == 0 {
            return Err(bad("resync_ms", "must be greater than 0".into()));
        }
        redis::Client::open(self.redis_url.as_str())
            .map_err(|e| bad("redis_url", format!("`{}`: {e}", self.redis_url)))?;
        for (i, r) in self.fallback_routes().iter().enumerate() {
            r.validate()
                .map_err(|e| bad(&format!("routes[{i}]"), e.to_string()))?;
        }
        let mut names: Vec<&str> = self.routes.iter().map(|r| r.model.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad("routes", format!("route `{}` is listed twice", w[0])));
        }
        Ok(())
    }

    /// The configured routes as table entries (generation 0: any stored route replaces them).
    pub fn fallback_routes(&self) -> Vec<Route> {
        self.routes
            .iter()
            .map(|r| {
                Route::new(
                    &r.model,
                    &r.stable,
                    Change {
                        id: "config".into(),
                        by: "config".into(),
                        action: "set_stable".into(),
                        reason: "the proxy's own [routing.routes]".into(),
                        at_ms: 0,
                    },
                )
            })
            .collect()
    }
}
