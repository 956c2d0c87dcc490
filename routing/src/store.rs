//! The routing table in Redis.
//!
//! Keys (under `key_prefix`, default `hindsight:routing`):
//! - `<prefix>:table` — hash, route → the route's JSON;
//! - `<prefix>:generation` — hash, route → generation (the compare-and-set counter, kept apart
//!   from the JSON so a malformed entry cannot wedge writes);
//! - `<prefix>:audit:<route>` — list, newest first, of [`AuditRecord`]s (bounded);
//! - channel `<prefix>:changes` — the route name, published after every write.
//!
//! A write is one Lua script: check the generation, store the route, bump the generation,
//! append the audit record, publish. Either all of it happens or none. Transient errors
//! (connection refused or dropped, timeouts, Redis loading) are retried with backoff for up to
//! `retry_for_ms`; a write whose outcome was lost with its connection is recognised on retry
//! by its change id, so a decision is neither lost nor applied twice.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Mutex;

use crate::table::Route;
use crate::RoutingError;

/// Audit records kept per route in Redis (Kafka keeps them all).
pub const AUDIT_KEPT: usize = 10_000;

/// Where the table lives.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Redis holding the table.
    #[serde(default = "default_redis_url")]
    pub redis_url: String,
    /// Prefix of every key and of the change channel.
    #[serde(default = "default_key_prefix")]
    pub key_prefix: String,
    /// How long a write keeps retrying transient Redis errors before it gives up.
    #[serde(default = "default_retry_for_ms")]
    pub retry_for_ms: u64,
}

fn default_redis_url() -> String {
    "redis://127.0.0.1:6379/".into()
}
fn default_key_prefix() -> String {
    "hindsight:routing".into()
}
fn default_retry_for_ms() -> u64 {
    30_000
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            redis_url: default_redis_url(),
            key_prefix: default_key_prefix(),
            retry_for_ms: default_retry_for_ms(),
        }
    }
}

impl StoreConfig {
    /// The hash of routes.
    pub fn table_key(&self) -> String {
        format!("{}:table", self.key_prefix)
    }
    /// The hash of generations.
    pub fn generation_key(&self) -> String {
        format!("{}:generation", self.key_prefix)
    }
    /// The change channel.
    pub fn channel(&self) -> String {
        format!("{}:changes", self.key_prefix)
    }
    /// The audit list of a route.
    pub fn audit_key(&self, route: &str) -> String {
        format!("{}:audit:{route}", self.key_prefix)
    }
}

/// One decision about a route: who or what, the action, why, and the statistics at that
/// moment. Written with the change it explains (Redis) and to `hindsight.rollouts` (Kafka).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Unique id (equals the route's `last_change.id`).
    pub id: String,
    /// The route.
    pub route: String,
    /// The rollout it concerns, if any.
    pub rollout_id: Option<String>,
    /// `operator:<name>`, `controller`, `learner`.
    pub by: String,
    /// `start`, `advance`, `promote`, `rollback`, `kill`, `pause`, `resume`, `freeze`, `pin`,
    /// `unpin`, `supersede`, `set_stable`.
    pub action: String,
    /// Why, in words.
    pub reason: String,
    /// When, ms since the Unix epoch.
    pub at_ms: i64,
    /// The route's generation after the change.
    pub generation: u64,
    /// The canary's weight after the change (0 when none).
    pub weight: f64,
    /// The statistics the decision rests on (metrics per arm, test verdicts), when any.
    #[serde(default)]
    pub stats: Value,
}

/// Compare-and-set write of one route with its audit record; see the module docs.
const WRITE_SCRIPT: &str = r"
local cur = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if cur ~= tonumber(ARGV[2]) then return {0, cur} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], cur + 1)
redis.call('LPUSH', KEYS[4], ARGV[4])
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[5]) - 1)
redis.call('PUBLISH', KEYS[3], ARGV[1])
return {1, cur + 1}
";

/// The routing table's Redis store (for writers: the controller, operators, the learner).
pub struct RoutingStore {
    cfg: StoreConfig,
    client: redis::Client,
    conn: Mutex<Option<ConnectionManager>>,
}

/// Whether a Redis error is worth retrying.
pub fn is_transient(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::BusyLoadingError | redis::ErrorKind::TryAgain
        )
}

impl RoutingStore {
    /// A store on `cfg` (connects lazily: creating one never fails because Redis is away).
    pub fn new(cfg: StoreConfig) -> Result<Self, RoutingError> {
        if cfg.key_prefix.is_empty() {
            return Err(RoutingError::Invalid {
                field: "key_prefix".into(),
                reason: "must not be empty".into(),
            });
        }
        let client = redis::Client::open(cfg.redis_url.as_str())?;
        Ok(Self {
            cfg,
            client,
            conn: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    async fn conn(&self) -> Result<ConnectionManager, redis::RedisError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref() {
            return Ok(c.clone());
        }
        let mgr = ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_secs(5))
            .set_number_of_retries(1);
        let c = ConnectionManager::new_with_config(self.client.clone(), mgr).await?;
        *guard = Some(c.clone());
        Ok(c)
    }

    /// Runs `op` on a connection, retrying transient errors with backoff (100 ms doubling to
    /// 2 s) for up to `retry_for_ms`.
    async fn retrying<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, RoutingError>
    where
        F: FnMut(ConnectionManager, u32) -> Fut,
        Fut: std::future::Future<Output = Result<T, RoutingError>>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(self.cfg.retry_for_ms);
        let mut backoff = Duration::from_millis(100);
        let mut attempt = 0u32;
        loop {
            let result = match self.conn().await {
                Ok(c) => op(c, attempt).await,
                Err(e) => Err(RoutingError::Redis(e)),
            };
            match result {
                Err(RoutingError::Redis(e))
                    if is_transient(&e) && tokio::time::Instant::now() + backoff < deadline =>
                {
                    metrics::counter!("hindsight_routing_store_retries_total").increment(1);
                    tracing::warn!(what, attempt, error = %e, "Routing store: Redis unavailable; retrying.");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Every stored route, each parsed and validated on its own (a malformed entry does not
    /// hide the others).
    pub async fn load_all(&self) -> Result<Vec<Result<Route, RoutingError>>, RoutingError> {
        let key = self.cfg.table_key();
        self.retrying("load_all", |mut c, _| {
            let key = key.clone();
            async move {
                let raw: Vec<(String, String)> =
                    redis::cmd("HGETALL").arg(&key).query_async(&mut c).await?;
                Ok(raw.into_iter().map(|(n, j)| parse_route(&n, &j)).collect())
            }
        })
        .await
    }

    /// One route, or `None` when it was never written.
    pub async fn get(&self, route: &str) -> Result<Option<Route>, RoutingError> {
        let key = self.cfg.table_key();
        let raw: Option<String> = self
            .retrying("get", |mut c, _| {
                let key = key.clone();
                async move {
                    Ok(redis::cmd("HGET")
                        .arg(&key)
                        .arg(route)
                        .query_async(&mut c)
                        .await?)
                }
            })
            .await?;
        raw.map(|j| parse_route(route, &j)).transpose()
    }

    /// Writes `route` if the stored generation still equals `route.generation` (0 for a route
    /// never written), storing it with generation + 1, with `audit` appended to the route's
    /// audit list and the change published. Returns the route as stored.
    pub async fn write(&self, route: &Route, audit: &AuditRecord) -> Result<Route, RoutingError> {
        route.validate()?;
        let expected = route.generation;
        let mut stored = route.clone();
        stored.generation = expected + 1;
        let json = serde_json::to_string(&stored)?;
        let mut audit = audit.clone();
        audit.generation = stored.generation;
        let audit_json = serde_json::to_string(&audit)?;
        let script = redis::Script::new(WRITE_SCRIPT);
        let cfg = &self.cfg;
        let (ok, actual) = self
            .retrying("write", |mut c, _| {
                let (script, json, audit_json) = (&script, &json, &audit_json);
                async move {
                    let (ok, actual): (i64, u64) = script
                        .key(cfg.table_key())
                        .key(cfg.generation_key())
                        .key(cfg.channel())
                        .key(cfg.audit_key(&route.route))
                        .arg(&route.route)
                        .arg(expected)
                        .arg(json)
                        .arg(audit_json)
                        .arg(AUDIT_KEPT)
                        .invoke_async(&mut c)
                        .await?;
                    Ok((ok == 1, actual))
                }
            })
            .await?;
        if ok {
            return Ok(stored);
        }
        // A retried write may have landed before its connection dropped: it did if the stored
        // route carries this change's id.
        if let Some(current) = self.get(&route.route).await? {
            if current.last_change.id == route.last_change.id && current.generation == actual {
                return Ok(current);
            }
        }
        Err(RoutingError::Conflict {
            route: route.route.clone(),
            expected,
            actual,
        })
    }

    /// The route's audit records, newest first, at most `limit`.
    pub async fn audit(&self, route: &str, limit: usize) -> Result<Vec<AuditRecord>, RoutingError> {
        let key = self.cfg.audit_key(route);
        let raw: Vec<String> = self
            .retrying("audit", |mut c, _| {
                let key = key.clone();
                async move {
                    Ok(redis::cmd("LRANGE")
                        .arg(&key)
                        .arg(0)
                        .arg(limit.saturating_sub(1))
                        .query_async(&mut c)
                        .await?)
                }
            })
            .await?;
        Ok(raw
            .iter()
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect())
    }

    /// Stores the controller's current view of a route (for `hindsight rollout status`).
    pub async fn put_status(&self, route: &str, status: &Value) -> Result<(), RoutingError> {
        let key = format!("{}:status:{route}", self.cfg.key_prefix);
        let text = serde_json::to_string(status)?;
        self.retrying("put_status", |mut c, _| {
            let (key, text) = (key.clone(), text.clone());
            async move {
                let () = redis::cmd("SET")
                    .arg(&key)
                    .arg(&text)
                    .query_async(&mut c)
                    .await?;
                Ok(())
            }
        })
        .await
    }

    /// The controller's last view of a route, if any.
    pub async fn get_status(&self, route: &str) -> Result<Option<Value>, RoutingError> {
        let key = format!("{}:status:{route}", self.cfg.key_prefix);
        let raw: Option<String> = self
            .retrying("get_status", |mut c, _| {
                let key = key.clone();
                async move { Ok(redis::cmd("GET").arg(&key).query_async(&mut c).await?) }
            })
            .await?;
        Ok(raw.and_then(|t| serde_json::from_str(&t).ok()))
    }

    /// The last generation of `route` whose audit record reached Kafka (0: none).
    pub async fn get_mirrored(&self, route: &str) -> Result<u64, RoutingError> {
        let key = format!("{}:mirrored:{route}", self.cfg.key_prefix);
        let v: Option<u64> = self
            .retrying("get_mirrored", |mut c, _| {
                let key = key.clone();
                async move { Ok(redis::cmd("GET").arg(&key).query_async(&mut c).await?) }
            })
            .await?;
        Ok(v.unwrap_or(0))
    }

    /// Records that audit records up to `generation` of `route` reached Kafka.
    pub async fn put_mirrored(&self, route: &str, generation: u64) -> Result<(), RoutingError> {
        let key = format!("{}:mirrored:{route}", self.cfg.key_prefix);
        self.retrying("put_mirrored", |mut c, _| {
            let key = key.clone();
            async move {
                let () = redis::cmd("SET")
                    .arg(&key)
                    .arg(generation)
                    .query_async(&mut c)
                    .await?;
                Ok(())
            }
        })
        .await
    }

    /// Sets (or clears) the candidate waiting for `route`'s running rollout to end.
    pub async fn put_queued(&self, route: &str, version: Option<&str>) -> Result<(), RoutingError> {
        let key = format!("{}:queued:{route}", self.cfg.key_prefix);
        self.retrying("put_queued", |mut c, _| {
            let key = key.clone();
            async move {
                match version {
                    Some(v) => {
                        let () = redis::cmd("SET")
                            .arg(&key)
                            .arg(v)
                            .query_async(&mut c)
                            .await?;
                    }
                    None => {
                        let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut c).await?;
                    }
                }
                Ok(())
            }
        })
        .await
    }

    /// The candidate waiting for `route`, if any.
    pub async fn get_queued(&self, route: &str) -> Result<Option<String>, RoutingError> {
        let key = format!("{}:queued:{route}", self.cfg.key_prefix);
        self.retrying("get_queued", |mut c, _| {
            let key = key.clone();
            async move { Ok(redis::cmd("GET").arg(&key).query_async(&mut c).await?) }
        })
        .await
    }

    /// Removes every key of this store (tests). Running proxies keep the routes they hold (they
    /// never drop a route or go back a generation): restart them after clearing.
    pub async fn clear(&self) -> Result<(), RoutingError> {
        let pattern = format!("{}:*", self.cfg.key_prefix);
        self.retrying("clear", |mut c, _| {
            let pattern = pattern.clone();
            async move {
                let keys: Vec<String> =
                    redis::cmd("KEYS").arg(&pattern).query_async(&mut c).await?;
                if !keys.is_empty() {
                    let () = redis::cmd("DEL").arg(keys).query_async(&mut c).await?;
                }
                Ok(())
            }
        })
        .await
    }
}

/// Parses and validates a stored entry; the error names the route.
pub fn parse_route(name: &str, json: &str) -> Result<Route, RoutingError> {
    let malformed = |reason: String| RoutingError::Malformed {
        route: name.to_string(),
        reason,
    };
    let route: Route = serde_json::from_str(json).map_err(|e| malformed(e.to_string()))?;
    if route.route != name {
        return Err(malformed(format!(
            "stored under `{name}` but names route `{}`",
            route.route
        )));
    }
    route.validate().map_err(|e| malformed(e.to_string()))?;
    Ok(route)
}
