//! The data plane: a transparent reverse proxy in front of an OpenAI-compatible endpoint that
//! captures chat/completion calls (streams reassembled) into the Kafka interaction log without
//! ever making user traffic wait on it.

mod capture;
mod cli;
mod config;
mod error;
mod forward;
mod headers;
mod limits;
mod routing;
mod server;
mod telemetry;

pub use capture::sse::{SseParser, StreamKind, StreamReassembler};
pub use cli::ProxyArgs;
pub use config::{Config, EpisodeSharing, ProxyConfig, RawConfig, RawProxySection, RedisUrl};
pub use error::{ConfigError, ProxyError};
pub use server::{run, Extensions, ShutdownReport};
pub use telemetry::prometheus;
