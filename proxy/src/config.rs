//! Proxy configuration: a TOML file plus `HINDSIGHT_<SECTION>__<KEY>` environment overrides,
//! read into raw serde structs (unknown keys refused) and validated once into [`ProxyConfig`].
//! Every error names the key it is about.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;

/// The whole file `hindsight proxy --config FILE` reads.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The data plane: listeners, upstream, capture.
    #[serde(default)]
    pub proxy: RawProxySection,
    /// The interaction log: Kafka brokers, topics and the disk spill.
    #[serde(default)]
    pub log: hindsight_feedback::LogConfig,
    /// The feedback API mounted at `/hindsight/v1/feedback` (signing, limits, idempotency).
    #[serde(default)]
    pub feedback: hindsight_feedback::FeedbackConfig,
    /// Canary routing from the Redis routing table.
    #[serde(default)]
    pub routing: hindsight_routing::RoutingConfig,
}

/// `[proxy]` as written in the file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawProxySection {
    /// Address the data port listens on (clients send their OpenAI calls here).
    #[serde(default = "default_listen_addr")]
    pub listen_addr: String,
    /// Address of the admin listener: `/metrics`, `/healthz`, `/readyz`.
    #[serde(default = "default_admin_addr")]
    pub admin_addr: String,
    /// Base URL of the OpenAI-compatible upstream, e.g. `http://127.0.0.1:8000`. Request paths
    /// are appended unchanged.
    #[serde(default = "default_upstream_url")]
    pub upstream_url: String,
    /// Route name recorded with every interaction (one proxy fronts one route).
    #[serde(default = "default_route")]
    pub route: String,
    /// TCP connect timeout to the upstream; past it the client gets a 502.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// Time allowed for the upstream's response headers; past it the client gets a 504.
    /// Streams may then last as long as the upstream keeps sending.
    #[serde(default = "default_upstream_timeout_ms")]
    pub upstream_timeout_ms: u64,
    /// A client must send a complete request head within this (an idle keep-alive connection
    /// too); past it the connection is closed.
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// A request body that sends no data for this long is answered 408 (the clock restarts
    /// with every chunk, so a long upload that keeps moving is never cut).
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Open client connections at most; one more is answered 503 with `Retry-After` and closed,
    /// so slow or idle clients cannot exhaust file descriptors. Keep it under half the process's
    /// open-files limit (each connection may hold an upstream one); start-up warns otherwise.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Largest request body accepted on a captured path (bigger ones get 413 naming this key).
    #[serde(default = "default_max_request_body_bytes")]
    pub max_request_body_bytes: usize,
    /// Largest response body kept for the record; the client always gets the whole response,
    /// the record is marked truncated beyond this.
    #[serde(default = "default_max_capture_response_bytes")]
    pub max_capture_response_bytes: usize,
    /// Paths whose POST calls are captured into `hindsight.interactions`.
    #[serde(default = "default_capture_paths")]
    pub capture_paths: Vec<String>,
    /// How long graceful shutdown waits for in-flight requests before closing them.
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Capacity of the queue between request handling and the record encoder.
    #[serde(default = "default_capture_queue_capacity")]
    pub capture_queue_capacity: usize,
    /// Serve the feedback API on the data port under `/hindsight/v1/feedback`.
    #[serde(default = "default_true")]
    pub feedback_api: bool,
    /// Conversations remembered for inferring episodes of calls without
    /// `x-hindsight-episode` (0 turns inference off: every such call starts an episode).
    #[serde(default = "default_episode_inference_capacity")]
    pub episode_inference_capacity: usize,
    /// Share inferred episodes with the other proxies through Redis, so a conversation whose
    /// turns land on different proxies stays one episode. Needs `episode_inference_capacity`
    /// above 0. Never on the request path: the record encoder asks Redis, with
    /// `episode_redis_timeout_ms`, and falls back to this proxy's memory.
    #[serde(default = "default_true")]
    pub episode_sharing: bool,
    /// Redis holding shared episodes. Default: `routing.redis_url` when `[routing]` is
    /// enabled, else `feedback.redis_url` when the feedback API is on (with neither, sharing
    /// is off).
    #[serde(default)]
    pub episode_redis_url: Option<String>,
    /// Prefix of shared episode keys. Default: `<log.topic_prefix>:episodes:`, so the proxies
    /// writing to the same topics share episodes.
    #[serde(default)]
    pub episode_key_prefix: Option<String>,
    /// How long a conversation's latest turn stays in Redis (1 s to 7 days): a turn arriving
    /// later than this after the previous one, at a proxy that does not remember it, starts a
    /// new episode.
    #[serde(default = "default_episode_ttl_s")]
    pub episode_ttl_s: u64,
    /// Longest wait for a Redis connection or call of the episode store; past it the encoder
    /// uses this proxy's memory only and leaves Redis alone for a while (up to 5 s).
    #[serde(default = "default_episode_redis_timeout_ms")]
    pub episode_redis_timeout_ms: u64,
    /// Ask the upstream for behaviour log-probs (`x-hindsight-behaviour: 1`) on captured calls
    /// whose client did not request log-probs, record them, and strip them from the response
    /// the client gets. `hindsight serve` honours the header; other upstreams ignore it.
    #[serde(default = "default_true")]
    pub request_behaviour: bool,
}

fn default_true() -> bool {
    true
}
fn default_episode_inference_capacity() -> usize {
    100_000
}
fn default_episode_ttl_s() -> u64 {
    3_600
}
fn default_episode_redis_timeout_ms() -> u64 {
    100
}
/// Longest `proxy.episode_ttl_s`: shared episodes are state of live conversations, not an archive.
const MAX_EPISODE_TTL_S: u64 = 7 * 24 * 3_600;
/// Longest `proxy.episode_redis_timeout_ms`: the encoder waits this long for each batch.
const MAX_EPISODE_REDIS_TIMEOUT_MS: u64 = 10_000;

fn default_listen_addr() -> String {
    "127.0.0.1:8080".into()
}
fn default_admin_addr() -> String {
    "127.0.0.1:9464".into()
}
fn default_upstream_url() -> String {
    "http://127.0.0.1:8000".into()
}
fn default_route() -> String {
    "default".into()
}
fn default_connect_timeout_ms() -> u64 {
    2_000
}
fn default_upstream_timeout_ms() -> u64 {
    300_000
}
fn default_header_read_timeout_ms() -> u64 {
    30_000
}
fn default_body_read_timeout_ms() -> u64 {
    30_000
}
fn default_max_connections() -> usize {
    8_192
}
fn default_max_request_body_bytes() -> usize {
    32 * 1024 * 1024
}
fn default_max_capture_response_bytes() -> usize {
    16 * 1024 * 1024
}
fn default_capture_paths() -> Vec<String> {
    vec!["/v1/chat/completions".into(), "/v1/completions".into()]
}
fn default_shutdown_grace_ms() -> u64 {
    10_000
}
fn default_capture_queue_capacity() -> usize {
    16_384
}

impl Default for RawProxySection {
    fn default() -> Self {
        Self {
            listen_addr: default_listen_addr(),
            admin_addr: default_admin_addr(),
            upstream_url: default_upstream_url(),
            route: default_route(),
            connect_timeout_ms: default_connect_timeout_ms(),
            upstream_timeout_ms: default_upstream_timeout_ms(),
            header_read_timeout_ms: default_header_read_timeout_ms(),
            body_read_timeout_ms: default_body_read_timeout_ms(),
            max_connections: default_max_connections(),
            max_request_body_bytes: default_max_request_body_bytes(),
            max_capture_response_bytes: default_max_capture_response_bytes(),
            capture_paths: default_capture_paths(),
            shutdown_grace_ms: default_shutdown_grace_ms(),
            capture_queue_capacity: default_capture_queue_capacity(),
            feedback_api: true,
            episode_inference_capacity: default_episode_inference_capacity(),
            episode_sharing: true,
            episode_redis_url: None,
            episode_key_prefix: None,
            episode_ttl_s: default_episode_ttl_s(),
            episode_redis_timeout_ms: default_episode_redis_timeout_ms(),
            request_behaviour: true,
        }
    }
}

/// The validated proxy section.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub listen_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Scheme + authority + optional base path, without a trailing slash.
    pub upstream: Upstream,
    pub route: String,
    pub connect_timeout: Duration,
    pub upstream_timeout: Duration,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
    pub max_request_body_bytes: usize,
    pub max_capture_response_bytes: usize,
    pub capture_paths: Vec<String>,
    pub shutdown_grace: Duration,
    pub capture_queue_capacity: usize,
    pub episode_inference_capacity: usize,
    /// `None`: episodes are inferred from this proxy's memory only.
    pub episode_sharing: Option<EpisodeSharing>,
    pub request_behaviour: bool,
}

/// Where and how inferred episodes are shared between proxies.
#[derive(Debug, Clone)]
pub struct EpisodeSharing {
    pub redis_url: RedisUrl,
    pub key_prefix: String,
    pub ttl: Duration,
    pub timeout: Duration,
}

/// A Redis URL, which may carry a password: `Debug` shows it without the credentials.
#[derive(Clone)]
pub struct RedisUrl(String);

impl RedisUrl {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0.split_once("://"), self.0.rfind('@')) {
            (Some((scheme, _)), Some(at)) => write!(f, "{scheme}://***@{}", &self.0[at + 1..]),
            _ => f.write_str(&self.0),
        }
    }
}

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// Prefix prepended to every forwarded path ("" for none).
    pub base_path: String,
}

/// Everything `hindsight proxy` needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub proxy: ProxyConfig,
    pub log: hindsight_feedback::ValidatedLogConfig,
    /// `None` when `proxy.feedback_api = false`.
    pub feedback: Option<hindsight_feedback::ValidatedFeedbackConfig>,
    /// `None` when `routing.enabled = false`.
    pub routing: Option<hindsight_routing::RoutingConfig>,
}

impl RawConfig {
    /// Reads a TOML file (or the defaults when `path` is `None`) and applies environment
    /// overrides from `env` (`HINDSIGHT_PROXY__UPSTREAM_URL=...` sets `proxy.upstream_url`).
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        hindsight_core::load_toml(path, env, &["proxy", "log", "feedback", "routing"])
    }

    /// Validates into the typed config.
    pub fn validate(self) -> Result<Config, ConfigError> {
        let p = self.proxy;
        let addr = |key: &'static str, v: &str| {
            v.parse::<SocketAddr>().map_err(|e| ConfigError::Invalid {
                key: key.into(),
                reason: format!("`{v}` is not an IP:port address ({e})"),
            })
        };
        let positive = |key: &'static str, v: u64| {
            if v == 0 {
                Err(ConfigError::Invalid {
                    key: key.into(),
                    reason: "must be greater than 0".into(),
                })
            } else {
                Ok(Duration::from_millis(v))
            }
        };
        if p.route.is_empty() {
            return Err(ConfigError::Invalid {
                key: "proxy.route".into(),
                reason: "must not be empty".into(),
            });
        }
        for (i, path) in p.capture_paths.iter().enumerate() {
            if !path.starts_with('/') {
                return Err(ConfigError::Invalid {
                    key: format!("proxy.capture_paths[{i}]"),
                    reason: format!("`{path}` must start with `/`"),
                });
            }
        }
        if p.max_connections == 0 {
            return Err(ConfigError::Invalid {
                key: "proxy.max_connections".into(),
                reason: "must be greater than 0".into(),
            });
        }
        if p.capture_queue_capacity == 0 {
            return Err(ConfigError::Invalid {
                key: "proxy.capture_queue_capacity".into(),
                reason: "must be greater than 0".into(),
            });
        }
        let mut proxy = ProxyConfig {
            listen_addr: addr("proxy.listen_addr", &p.listen_addr)?,
            admin_addr: addr("proxy.admin_addr", &p.admin_addr)?,
            upstream: parse_upstream(&p.upstream_url)?,
            route: p.route,
            connect_timeout: positive("proxy.connect_timeout_ms", p.connect_timeout_ms)?,
            upstream_timeout: positive("proxy.upstream_timeout_ms", p.upstream_timeout_ms)?,
            header_read_timeout: positive(
                "proxy.header_read_timeout_ms",
                p.header_read_timeout_ms,
            )?,
            body_read_timeout: positive("proxy.body_read_timeout_ms", p.body_read_timeout_ms)?,
            max_connections: p.max_connections,
            max_request_body_bytes: p.max_request_body_bytes,
            max_capture_response_bytes: p.max_capture_response_bytes,
            capture_paths: p.capture_paths,
            shutdown_grace: Duration::from_millis(p.shutdown_grace_ms),
            capture_queue_capacity: p.capture_queue_capacity,
            episode_inference_capacity: p.episode_inference_capacity,
            episode_sharing: None,
            request_behaviour: p.request_behaviour,
        };
        if p.episode_sharing && p.episode_inference_capacity > 0 {
            let url = p.episode_redis_url.or_else(|| {
                if self.routing.enabled {
                    Some(self.routing.redis_url.clone())
                } else if p.feedback_api {
                    Some(self.feedback.redis_url.clone())
                } else {
                    None
                }
            });
            if let Some(url) = url {
                proxy.episode_sharing = Some(episode_sharing(
                    url,
                    p.episode_key_prefix,
                    &self.log.topic_prefix,
                    p.episode_ttl_s,
                    p.episode_redis_timeout_ms,
                )?);
            }
        }
        let feedback = if p.feedback_api {
            Some(self.feedback.validate().map_err(|e| match e {
                hindsight_feedback::FeedbackError::Config { key, reason } => ConfigError::Invalid {
                    key: format!("feedback.{key}"),
                    reason,
                },
                other => ConfigError::Invalid {
                    key: "feedback".into(),
                    reason: other.to_string(),
                },
            })?)
        } else {
            None
        };
        let log = self.log.validate().map_err(|e| match e {
            hindsight_feedback::LogError::Config { key, reason } => ConfigError::Invalid {
                key: format!("log.{key}"),
                reason,
            },
            other => ConfigError::Invalid {
                key: "log".into(),
                reason: other.to_string(),
            },
        })?;
        let routing = if self.routing.enabled {
            self.routing.validate().map_err(|e| match e {
                hindsight_routing::RoutingError::Invalid { field, reason } => {
                    ConfigError::Invalid { key: field, reason }
                }
                other => ConfigError::Invalid {
                    key: "routing".into(),
                    reason: other.to_string(),
                },
            })?;
            Some(self.routing)
        } else {
            None
        };
        Ok(Config {
            proxy,
            log,
            feedback,
            routing,
        })
    }
}

fn episode_sharing(
    url: String,
    key_prefix: Option<String>,
    topic_prefix: &str,
    ttl_s: u64,
    timeout_ms: u64,
) -> Result<EpisodeSharing, ConfigError> {
    let bad = |key: &str, reason: String| ConfigError::Invalid {
        key: format!("proxy.{key}"),
        reason,
    };
    // The URL may hold a password: the message names the key, not the value.
    redis::Client::open(url.as_str())
        .map_err(|e| bad("episode_redis_url", format!("not a usable Redis URL ({e})")))?;
    let key_prefix = key_prefix.unwrap_or_else(|| format!("{topic_prefix}:episodes:"));
    if key_prefix.is_empty() {
        return Err(bad("episode_key_prefix", "must not be empty".into()));
    }
    if !(1..=MAX_EPISODE_TTL_S).contains(&ttl_s) {
        return Err(bad(
            "episode_ttl_s",
            format!("must be between 1 and {MAX_EPISODE_TTL_S} (7 days)"),
        ));
    }
    if !(1..=MAX_EPISODE_REDIS_TIMEOUT_MS).contains(&timeout_ms) {
        return Err(bad(
            "episode_redis_timeout_ms",
            format!("must be between 1 and {MAX_EPISODE_REDIS_TIMEOUT_MS}"),
        ));
    }
    Ok(EpisodeSharing {
        redis_url: RedisUrl(url),
        key_prefix,
        ttl: Duration::from_secs(ttl_s),
        timeout: Duration::from_millis(timeout_ms),
    })
}

fn parse_upstream(url: &str) -> Result<Upstream, ConfigError> {
    let bad = |reason: String| ConfigError::Invalid {
        key: "proxy.upstream_url".into(),
        reason,
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e| bad(format!("`{url}` is not a URL ({e})")))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| bad(format!("`{url}` has no scheme (http:// or https://)")))?;
    if scheme != http::uri::Scheme::HTTP {
        return Err(bad(format!(
            "scheme `{scheme}` is not supported; use http:// (terminate TLS in front of the upstream)"
        )));
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| bad(format!("`{url}` has no host")))?;
    if uri.query().is_some() {
        return Err(bad("must not contain a query string".into()));
    }
    let base_path = uri.path().trim_end_matches('/').to_string();
    Ok(Upstream {
        scheme,
        authority,
        base_path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(toml_text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, toml_text).unwrap();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        RawConfig::load(Some(&path), env)?.validate()
    }

    #[test]
    fn example_config_file_is_valid() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/hindsight.example.toml"
        );
        let c = RawConfig::load(Some(Path::new(path)), Vec::new())
            .unwrap()
            .validate()
            .unwrap();
        assert_eq!(c.proxy.listen_addr.port(), 8080);
    }

    #[test]
    fn defaults_validate() {
        let c = load("", &[]).unwrap();
        assert_eq!(c.proxy.listen_addr.port(), 8080);
        assert_eq!(c.proxy.upstream.authority.as_str(), "127.0.0.1:8000");
    }

    #[test]
    fn unknown_key_is_named() {
        let err = load("[proxy]\nupstream_ur = \"http://x\"\n", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("upstream_ur"), "{msg}");
    }

    #[test]
    fn bad_value_is_named() {
        let err = load("[proxy]\nlisten_addr = \"nope\"\n", &[]).unwrap_err();
        assert!(err.to_string().contains("proxy.listen_addr"), "{err}");
        let err = load("[proxy]\nconnect_timeout_ms = \"soon\"\n", &[]).unwrap_err();
        assert!(
            err.to_string().contains("proxy.connect_timeout_ms"),
            "{err}"
        );
        let err = load("[proxy]\nupstream_url = \"ftp://x\"\n", &[]).unwrap_err();
        assert!(err.to_string().contains("proxy.upstream_url"), "{err}");
    }

    #[test]
    fn env_overrides_file_and_is_typed() {
        let c = load(
            "[proxy]\nupstream_url = \"http://127.0.0.1:1\"\n",
            &[
                ("HINDSIGHT_PROXY__UPSTREAM_URL", "http://127.0.0.1:9/base/"),
                ("HINDSIGHT_PROXY__CONNECT_TIMEOUT_MS", "77"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.proxy.upstream.authority.as_str(), "127.0.0.1:9");
        assert_eq!(c.proxy.upstream.base_path, "/base");
        assert_eq!(c.proxy.connect_timeout, Duration::from_millis(77));
        let c = load(
            "",
            &[("HINDSIGHT_FEEDBACK__SIGNING__SECRETS", "[\"a\", \"b\"]")],
        )
        .unwrap();
        assert!(c.feedback.is_some());
        let err = load("", &[("HINDSIGHT_PROXY__NOPE", "1")]).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn episode_sharing_defaults_follow_routing_and_topics() {
        let c = load(
            "[routing]\nredis_url = \"redis://:hunter2@10.0.0.9:6379/2\"\n[log]\ntopic_prefix = \"prod\"\n",
            &[],
        )
        .unwrap();
        let s = c.proxy.episode_sharing.clone().unwrap();
        assert_eq!(s.redis_url.as_str(), "redis://:hunter2@10.0.0.9:6379/2");
        assert_eq!(s.key_prefix, "prod:episodes:");
        assert_eq!(s.ttl, Duration::from_secs(3_600));
        // The password never reaches a log line through `Debug`.
        let shown = format!("{:?}", c.proxy);
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("redis://***@10.0.0.9:6379/2"), "{shown}");
        // Without routing, the feedback API's Redis; with neither, no sharing.
        let c = load(
            "[routing]\nenabled = false\n[feedback]\nredis_url = \"redis://f:6379\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.proxy.episode_sharing.unwrap().redis_url.as_str(),
            "redis://f:6379"
        );
        let c = load(
            "[proxy]\nfeedback_api = false\n[routing]\nenabled = false\n",
            &[],
        )
        .unwrap();
        assert!(c.proxy.episode_sharing.is_none());
        let c = load("[proxy]\nepisode_sharing = false\n", &[]).unwrap();
        assert!(c.proxy.episode_sharing.is_none());
        let c = load("[proxy]\nepisode_inference_capacity = 0\n", &[]).unwrap();
        assert!(c.proxy.episode_sharing.is_none());
    }

    #[test]
    fn episode_sharing_values_are_checked() {
        let c = load(
            "",
            &[
                ("HINDSIGHT_PROXY__EPISODE_REDIS_URL", "redis://r:1/"),
                ("HINDSIGHT_PROXY__EPISODE_KEY_PREFIX", "eps:"),
                ("HINDSIGHT_PROXY__EPISODE_TTL_S", "60"),
                ("HINDSIGHT_PROXY__EPISODE_REDIS_TIMEOUT_MS", "20"),
            ],
        )
        .unwrap();
        let s = c.proxy.episode_sharing.unwrap();
        assert_eq!(
            (
                s.redis_url.as_str(),
                s.key_prefix.as_str(),
                s.ttl,
                s.timeout
            ),
            (
                "redis://r:1/",
                "eps:",
                Duration::from_secs(60),
                Duration::from_millis(20)
            )
        );
        for (toml_text, key) in [
            ("episode_ttl_s = 0", "proxy.episode_ttl_s"),
            ("episode_ttl_s = 604801", "proxy.episode_ttl_s"),
            (
                "episode_redis_timeout_ms = 0",
                "proxy.episode_redis_timeout_ms",
            ),
            ("episode_key_prefix = \"\"", "proxy.episode_key_prefix"),
            (
                "episode_redis_url = \"http://x\"",
                "proxy.episode_redis_url",
            ),
        ] {
            let err = load(&format!("[proxy]\n{toml_text}\n"), &[]).unwrap_err();
            assert!(err.to_string().contains(key), "{toml_text}: {err}");
        }
    }
}
