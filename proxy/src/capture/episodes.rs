//! Episode inference for calls without `x-hindsight-episode`: this proxy's memory
//! ([`hindsight_feedback::EpisodeInference`]) first, then the episode store in Redis that every proxy writing to
//! the same topics shares, so an agent's turns stay one episode whichever proxy each lands on.
//!
//! Only the record encoder task talks to Redis, never request handling. Every connection or
//! call is bounded by `proxy.episode_redis_timeout_ms`; a failure makes the encoder use its
//! own memory alone and leave Redis alone for a back-off (250 ms doubling to 5 s), so a slow or
//! absent Redis costs at most one timeout per back-off period and the capture queue cannot
//! back up behind it. Records never wait for Redis to come back: they are written either way.

use std::collections::HashMap;
use std::time::Duration;

use hindsight_feedback::ConversationKey;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use crate::config::EpisodeSharing;

/// Prefixes of one call looked up in Redis at most (the longest ones: a next turn matches its
/// previous turn, the longest prefix; shorter ones only matter for edited histories).
pub(crate) const MAX_SHARED_KEYS_PER_CALL: usize = 8;

const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How a header-less call's episode was found: `hindsight_episode_lookups_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// This proxy remembered the conversation.
    HitLocal,
    /// Another proxy did (found in Redis).
    HitShared,
    /// Nobody did: a new episode.
    Miss,
    /// This proxy did not, and Redis could not be asked (failed, timed out or backing off):
    /// a new episode, which may split a conversation another proxy knows.
    Error,
}

impl Lookup {
    fn as_str(self) -> &'static str {
        match self {
            Lookup::HitLocal => "hit_local",
            Lookup::HitShared => "hit_shared",
            Lookup::Miss => "miss",
            Lookup::Error => "error",
        }
    }

    pub(crate) fn count(self) {
        metrics::counter!("hindsight_episode_lookups_total", "result" => self.as_str())
            .increment(1);
    }
}

/// Why a Redis call of the episode store did not succeed.
#[derive(Debug, thiserror::Error)]
enum StoreError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// The Redis half: conversation key → episode id, `SET … EX ttl`. Owned by the encoder task.
pub(crate) struct SharedEpisodes {
    client: redis::Client,
    conn: Option<MultiplexedConnection>,
    key_prefix: String,
    ttl_s: u64,
    timeout: Duration,
    /// While set, Redis is not asked until this instant.
    resting_until: Option<Instant>,
    backoff: Duration,
}

impl SharedEpisodes {
    /// Does not connect: the first lookup does (start-up never waits for Redis).
    pub(crate) fn new(cfg: &EpisodeSharing) -> Result<SharedEpisodes, redis::RedisError> {
        Ok(SharedEpisodes {
            client: redis::Client::open(cfg.redis_url.as_str())?,
            conn: None,
            key_prefix: cfg.key_prefix.clone(),
            ttl_s: cfg.ttl.as_secs().max(1),
            timeout: cfg.timeout,
            resting_until: None,
            backoff: FIRST_BACKOFF,
        })
    }

    fn redis_key(&self, key: &ConversationKey) -> String {
        format!("{}{}", self.key_prefix, hex::encode(key))
    }

    /// The episodes stored under `keys`, or `None` when Redis could not be asked.
    pub(crate) async fn get_many(
        &mut self,
        keys: &[ConversationKey],
    ) -> Option<HashMap<ConversationKey, String>> {
        if keys.is_empty() {
            return Some(HashMap::new());
        }
        let names: Vec<String> = keys.iter().map(|k| self.redis_key(k)).collect();
        let mut cmd = redis::cmd("MGET");
        cmd.arg(&names);
        let values: Vec<Option<String>> = self.call(cmd).await?;
        Some(
            keys.iter()
                .zip(values)
                .filter_map(|(k, v)| Some((*k, v?)))
                .collect(),
        )
    }

    /// Stores each conversation's episode for `ttl`; false when Redis could not be written.
    pub(crate) async fn put_many(&mut self, entries: &[(ConversationKey, String)]) -> bool {
        if entries.is_empty() {
            return true;
        }
        let mut pipe = redis::pipe();
        for (k, episode) in entries {
            pipe.cmd("SET")
                .arg(self.redis_key(k))
                .arg(episode)
                .arg("EX")
                .arg(self.ttl_s)
                .ignore();
        }
        let ok = self.call_pipe(pipe).await.is_some();
        let result = if ok { "ok" } else { "error" };
        metrics::counter!("hindsight_episode_shared_writes_total", "result" => result)
            .increment(entries.len() as u64);
        ok
    }

    async fn call<T: redis::FromRedisValue>(&mut self, cmd: redis::Cmd) -> Option<T> {
        let mut conn = self.connection().await?;
        let timeout = self.timeout;
        let outcome = match tokio::time::timeout(timeout, cmd.query_async::<T>(&mut conn)).await {
            Ok(r) => r.map_err(StoreError::from),
            Err(_) => Err(StoreError::Timeout(timeout)),
        };
        self.settle(outcome)
    }

    async fn call_pipe(&mut self, pipe: redis::Pipeline) -> Option<()> {
        let mut conn = self.connection().await?;
        let timeout = self.timeout;
        let outcome = match tokio::time::timeout(timeout, pipe.query_async::<()>(&mut conn)).await {
            Ok(r) => r.map_err(StoreError::from),
            Err(_) => Err(StoreError::Timeout(timeout)),
        };
        self.settle(outcome)
    }

    /// A connection, connecting first if needed; `None` while resting after a failure.
    async fn connection(&mut self) -> Option<MultiplexedConnection> {
        if let Some(until) = self.resting_until {
            if Instant::now() < until {
                return None;
            }
        }
        if let Some(c) = &self.conn {
            return Some(c.clone());
        }
        let connect = self.client.get_multiplexed_async_connection();
        let outcome = match tokio::time::timeout(self.timeout, connect).await {
            Ok(r) => r.map_err(StoreError::from),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        let conn = self.settle(outcome)?;
        self.conn = Some(conn.clone());
        Some(conn)
    }

    /// Success resets the back-off; failure drops the connection and rests.
    fn settle<T>(&mut self, outcome: Result<T, StoreError>) -> Option<T> {
        match outcome {
            Ok(v) => {
                if self.resting_until.take().is_some() {
                    tracing::info!("Shared episode store reachable again.");
                }
                self.backoff = FIRST_BACKOFF;
                Some(v)
            }
            Err(e) => {
                if self.resting_until.is_none() {
                    // Once per outage; the lookup counter shows its extent.
                    tracing::warn!(error = %e, "Shared episode store unavailable; inferring episodes from this proxy's memory only.");
                }
                self.conn = None;
                self.resting_until = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RawConfig;

    fn sharing(url: &str, timeout_ms: u64) -> EpisodeSharing {
        let mut raw = RawConfig::default();
        raw.proxy.episode_redis_url = Some(url.into());
        raw.proxy.episode_key_prefix = Some(format!("test:{}:", uuid::Uuid::now_v7()));
        raw.proxy.episode_redis_timeout_ms = timeout_ms;
        raw.validate().unwrap().proxy.episode_sharing.unwrap()
    }

    fn redis_url() -> String {
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
    }

    #[tokio::test]
    async fn stores_and_finds_episodes() {
        let cfg = sharing(&redis_url(), 1_000);
        let mut a = SharedEpisodes::new(&cfg).unwrap();
        let mut b = SharedEpisodes::new(&cfg).unwrap();
        assert!(a.put_many(&[([1; 16], "ep-1".into())]).await);
        let found = b.get_many(&[[2; 16], [1; 16]]).await.unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[&[1; 16]], "ep-1");
    }

    #[tokio::test(start_paused = true)]
    async fn an_unreachable_store_is_left_alone_for_a_while() {
        // Port 1: connection refused at once.
        let cfg = sharing("redis://127.0.0.1:1/", 50);
        let mut s = SharedEpisodes::new(&cfg).unwrap();
        assert!(s.get_many(&[[1; 16]]).await.is_none());
        let resting = s.resting_until.unwrap();
        // While resting nothing is attempted (no connection error, no wait).
        assert!(s.get_many(&[[1; 16]]).await.is_none());
        assert_eq!(s.resting_until, Some(resting));
        tokio::time::advance(FIRST_BACKOFF).await;
        assert!(!s.put_many(&[([1; 16], "e".into())]).await);
        assert_eq!(s.backoff, FIRST_BACKOFF * 4);
    }

    #[tokio::test]
    async fn a_silent_store_costs_one_timeout_per_rest() {
        // Accepts connections and never answers: a black-holed or wedged Redis.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        let cfg = sharing(&format!("redis://{addr}/"), 100);
        let mut s = SharedEpisodes::new(&cfg).unwrap();
        let t = std::time::Instant::now();
        assert!(s.get_many(&[[1; 16]]).await.is_none());
        let first = t.elapsed();
        assert!(first < Duration::from_secs(1), "{first:?}");
        let t = std::time::Instant::now();
        for _ in 0..100 {
            assert!(s.get_many(&[[1; 16]]).await.is_none());
            assert!(!s.put_many(&[([1; 16], "e".into())]).await);
        }
        // Resting: nothing waited on Redis.
        assert!(t.elapsed() < Duration::from_millis(50), "{:?}", t.elapsed());
    }
}
