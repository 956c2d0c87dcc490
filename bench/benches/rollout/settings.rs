//! The bench's knobs, read from the environment and checked before anything runs.

use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail};
use hindsight_control::rollout::stats::Alpha;

/// `name` from the environment, `default` when unset; anything unparseable is an error naming
/// the variable (a silently ignored typo would publish a figure for the wrong setting).
pub(crate) fn setting<T: FromStr>(name: &str, default: T) -> anyhow::Result<T>
where
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => bail!("{name}: {e}"),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| anyhow!("{name}={v:?} is not valid: {e}")),
    }
}

pub(crate) fn check(
    ok: bool,
    name: &str,
    value: impl std::fmt::Display,
    rule: &str,
) -> anyhow::Result<()> {
    if ok {
        Ok(())
    } else {
        bail!("{name}={value}: {rule}")
    }
}

pub(crate) struct Settings {
    pub(crate) parts: Vec<String>,
    pub(crate) changes: usize,
    pub(crate) poll: Duration,
    pub(crate) requests: usize,
    pub(crate) concurrency: usize,
    pub(crate) blocks: usize,
    pub(crate) server_threads: usize,
    pub(crate) seeds: usize,
    pub(crate) p_stable: f64,
    pub(crate) p_canary: Vec<f64>,
    pub(crate) canary_share: f64,
    pub(crate) alpha: Alpha,
    pub(crate) margin: f64,
    pub(crate) power: f64,
    pub(crate) max_canary_exposures: u64,
    pub(crate) false_alarm_horizon: u64,
    pub(crate) brokers: String,
    /// How long the mock upstream takes to answer (0: at once, which shows routing's cost
    /// plainly; 10 ms: the proxy overhead bench's upstream, a fast model's floor).
    pub(crate) upstream_latency: Duration,
}

impl Settings {
    pub(crate) fn from_env() -> anyhow::Result<Self> {
        let parts: Vec<String> = setting("PARTS", "propagation,overhead,stats".to_string())?
            .split(',')
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
            .collect();
        for p in &parts {
            check(
                ["propagation", "overhead", "stats"].contains(&p.as_str()),
                "PARTS",
                p,
                "each part is propagation, overhead or stats",
            )?;
        }
        let p_canary = setting("P_CANARY", "0.15 0.20 0.30".to_string())?
            .split_whitespace()
            .map(|v| {
                v.parse::<f64>()
                    .map_err(|e| anyhow!("P_CANARY: {v:?} is not a number: {e}"))
            })
            .collect::<anyhow::Result<Vec<f64>>>()?;
        let s = Self {
            parts,
            changes: setting("CHANGES", 200)?,
            poll: Duration::from_micros(setting("POLL_US", 1000)?),
            requests: setting("REQUESTS", 2000)?,
            concurrency: setting("CONCURRENCY", 8)?,
            blocks: setting("BLOCKS", 20)?,
            server_threads: setting("SERVER_THREADS", 2)?,
            seeds: setting("SEEDS", 1000)?,
            p_stable: setting("P_STABLE", 0.10)?,
            p_canary,
            canary_share: setting("CANARY_SHARE", 0.05)?,
            alpha: Alpha::new(setting("ALPHA", 0.05)?).map_err(|e| anyhow!("ALPHA: {e}"))?,
            margin: setting("MARGIN", 0.0)?,
            power: setting("POWER", 0.8)?,
            max_canary_exposures: setting("MAX_CANARY_EXPOSURES", 20_000)?,
            false_alarm_horizon: setting("FALSE_ALARM_HORIZON", 2_000)?,
            brokers: setting("KAFKA_BROKERS", "127.0.0.1:9092".to_string())?,
            upstream_latency: Duration::from_micros(setting("UPSTREAM_LATENCY_US", 0u64)?),
        };
        let unit = |p: f64| p > 0.0 && p < 1.0;
        check(s.changes >= 1, "CHANGES", s.changes, "at least 1")?;
        check(
            s.poll >= Duration::from_micros(10),
            "POLL_US",
            s.poll.as_micros(),
            "at least 10",
        )?;
        check(
            s.concurrency >= 1,
            "CONCURRENCY",
            s.concurrency,
            "at least 1",
        )?;
        check(
            s.blocks >= 2 && s.blocks.is_multiple_of(2),
            "BLOCKS",
            s.blocks,
            "an even number >= 2 (blocks alternate A B B A)",
        )?;
        check(
            s.requests >= s.blocks * s.concurrency,
            "REQUESTS",
            s.requests,
            "at least BLOCKS x CONCURRENCY",
        )?;
        check(
            s.server_threads >= 1,
            "SERVER_THREADS",
            s.server_threads,
            "at least 1",
        )?;
        check(s.seeds >= 10, "SEEDS", s.seeds, "at least 10")?;
        check(unit(s.p_stable), "P_STABLE", s.p_stable, "in (0, 1)")?;
        check(
            !s.p_canary.is_empty() && s.p_canary.iter().all(|&p| unit(p) && p != s.p_stable),
            "P_CANARY",
            format!("{:?}", s.p_canary),
            "values in (0, 1), none equal to P_STABLE",
        )?;
        check(
            unit(s.canary_share),
            "CANARY_SHARE",
            s.canary_share,
            "in (0, 1)",
        )?;
        check(
            s.margin.is_finite() && s.margin >= 0.0,
            "MARGIN",
            s.margin,
            "finite and >= 0",
        )?;
        check(unit(s.power), "POWER", s.power, "in (0, 1)")?;
        check(
            s.max_canary_exposures >= 10,
            "MAX_CANARY_EXPOSURES",
            s.max_canary_exposures,
            "at least 10",
        )?;
        check(
            s.false_alarm_horizon >= 10,
            "FALSE_ALARM_HORIZON",
            s.false_alarm_horizon,
            "at least 10",
        )?;
        Ok(s)
    }

    pub(crate) fn runs(&self, part: &str) -> bool {
        self.parts.iter().any(|p| p == part)
    }
}
