//! What every Hindsight crate shares: the one way to read config (TOML, then
//! `HINDSIGHT_<SECTION>__<KEY>` overrides, errors naming the key), the `x-hindsight-*` header
//! names, the one JSON error body, and the wall clock in milliseconds.

mod config;
mod error;
pub mod headers;

pub use config::{load_toml, ConfigError, SECTIONS};
pub use error::error_body;

/// Milliseconds since the Unix epoch (0 if the clock is before it), the unit of every event
/// time in Hindsight's records.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
