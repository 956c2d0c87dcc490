//! `hindsight proxy` flags. Precedence: flag > environment (`HINDSIGHT_PROXY__*`,
//! `HINDSIGHT_LOG__*`) > config file > built-in default.

use std::path::PathBuf;

use crate::config::{Config, RawConfig};
use crate::error::ConfigError;

/// Run the transparent capturing proxy in front of one OpenAI-compatible upstream.
#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// TOML config file (sections `[proxy]` and `[log]`; see deploy/hindsight.example.toml).
    #[arg(long, short = 'c', env = "HINDSIGHT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Data-port address clients call, e.g. 127.0.0.1:8080 (`proxy.listen_addr`).
    #[arg(long)]
    pub listen: Option<String>,
    /// Admin address serving /metrics, /healthz, /readyz (`proxy.admin_addr`).
    #[arg(long)]
    pub admin: Option<String>,
    /// Upstream base URL, e.g. http://127.0.0.1:8000 (`proxy.upstream_url`).
    #[arg(long)]
    pub upstream: Option<String>,
    /// Route name recorded with each interaction (`proxy.route`).
    #[arg(long)]
    pub route: Option<String>,
    /// Kafka bootstrap servers, comma-separated (`log.brokers`).
    #[arg(long)]
    pub kafka_brokers: Option<String>,
    /// Directory of the on-disk spill used while Kafka is unreachable (`log.spill_dir`).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
    /// Upper bound of the spill in bytes; beyond it records are dropped and counted
    /// (`log.spill_max_bytes`).
    #[arg(long)]
    pub spill_max_bytes: Option<u64>,
}

impl ProxyArgs {
    /// File, then environment, then flags; validated.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut raw = RawConfig::load(self.config.as_deref(), std::env::vars())?;
        let p = &mut raw.proxy;
        if let Some(v) = &self.listen {
            p.listen_addr = v.clone();
        }
        if let Some(v) = &self.admin {
            p.admin_addr = v.clone();
        }
        if let Some(v) = &self.upstream {
            p.upstream_url = v.clone();
        }
        if let Some(v) = &self.route {
            p.route = v.clone();
        }
        if let Some(v) = &self.kafka_brokers {
            raw.log.brokers = v.clone();
        }
        if let Some(v) = &self.spill_dir {
            raw.log.spill_dir = v.clone();
        }
        if let Some(v) = self.spill_max_bytes {
            raw.log.spill_max_bytes = v;
        }
        raw.validate()
    }
}
