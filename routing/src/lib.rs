//! The canary routing table shared by the control plane and every proxy.
//!
//! - [`table`]: what a route is (stable version, at most one rollout, pins, generation, last
//!   change) and the rules it must satisfy.
//! - [`assign`]: sticky, weighted, monotone assignment of a request to an arm.
//! - [`store`]: the table in Redis — compare-and-set writes on the generation, each write
//!   published on a channel and appended to the route's audit list in the same transaction,
//!   transient Redis errors retried with backoff.
//! - [`watch`]: the task every proxy runs to hold the table in memory (no Redis call on the
//!   request path), applying published changes within milliseconds and keeping the last good
//!   table while Redis is away.

pub mod assign;
pub mod config;
pub mod store;
pub mod table;
pub mod watch;

pub use assign::{assign, bucket, Arm, Assignment, EpisodeMemory};
pub use config::{FallbackRoute, RoutingConfig};
pub use store::{is_transient, parse_route, AuditRecord, RoutingStore, StoreConfig};
pub use table::{validate_stages, Change, Rollout, RolloutState, Route, RoutingTable, MAX_PINS};
pub use watch::{spawn_watcher, TableHandle, Watcher};

/// What can go wrong with the routing table.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// A route breaks a rule; `field` names what to fix.
    #[error("invalid route: `{field}`: {reason}")]
    Invalid {
        /// The field (`rollout.weight`, `stages`, ...).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Someone else changed the route since it was read (compare-and-set on the generation).
    #[error("route `{route}` changed since it was read (generation {expected}, now {actual}); read it again and retry")]
    Conflict {
        /// The route.
        route: String,
        /// The generation the write was based on.
        expected: u64,
        /// The generation in Redis now.
        actual: u64,
    },
    /// No such route in the table.
    #[error("no route `{0}` in the routing table")]
    UnknownRoute(String),
    /// A stored entry is not a valid route.
    #[error("stored route `{route}` is malformed: {reason}")]
    Malformed {
        /// The route.
        route: String,
        /// The parse or validation error.
        reason: String,
    },
    /// Redis failed (after retries, for transient errors).
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Serialisation failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}
