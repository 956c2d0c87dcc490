//! `hindsight adapters list|show|diff`: argument parsing over `hindsight_control::report`.

use hindsight_control::registry::{Registry, RegistryConfig};
use hindsight_control::report;

/// `hindsight adapters`: read the adapter registry.
#[derive(Debug, Clone, clap::Args)]
pub struct AdaptersArgs {
    /// Redis holding the registry.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        global = true
    )]
    pub redis_url: String,
    /// Key prefix of the registry.
    #[arg(long, default_value = "hindsight:registry", global = true)]
    pub key_prefix: String,
    /// What to show.
    #[command(subcommand)]
    pub command: AdaptersCommand,
}

/// `hindsight adapters` subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum AdaptersCommand {
    /// Every version (of one adapter, or of all), oldest first.
    List {
        /// Only this adapter.
        #[arg(long)]
        name: Option<String>,
        /// JSON lines (one entry per line) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One version in full.
    Show {
        /// Adapter name.
        name: String,
        /// Version.
        version: u64,
        /// The raw JSON entry.
        #[arg(long)]
        json: bool,
    },
    /// Compare two versions: entry fields, LoRA settings, per-module weight changes.
    Diff {
        /// Adapter name.
        name: String,
        /// First version.
        a: u64,
        /// Second version.
        b: u64,
        /// The full comparison as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `hindsight adapters …`, printing to stdout.
pub async fn run(args: AdaptersArgs) -> anyhow::Result<()> {
    let reg = Registry::connect(RegistryConfig {
        redis_url: args.redis_url.clone(),
        key_prefix: args.key_prefix.clone(),
        ..RegistryConfig::default()
    })
    .await?;
    let text = match &args.command {
        AdaptersCommand::List { name, json } => report::list(&reg, name.as_deref(), *json).await?,
        AdaptersCommand::Show {
            name,
            version,
            json,
        } => report::show(&reg, name, *version, *json).await?,
        AdaptersCommand::Diff { name, a, b, json } => {
            report::compare(&reg, name, *a, *b, *json).await?
        }
    };
    print!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_cli(argv: &[&str]) -> AdaptersArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            cmd: Cmd,
        }
        #[derive(clap::Subcommand)]
        enum Cmd {
            Adapters(AdaptersArgs),
        }
        let mut full = vec!["hindsight"];
        full.extend(argv);
        match Cli::try_parse_from(full).unwrap().cmd {
            Cmd::Adapters(a) => a,
        }
    }

    #[test]
    fn cli_options_go_before_or_after_the_subcommand() {
        let a = parse_cli(&["adapters", "--key-prefix", "p", "list", "--name", "x"]);
        assert_eq!(a.key_prefix, "p");
        assert!(
            matches!(a.command, AdaptersCommand::List { name: Some(ref n), json: false } if n == "x")
        );
        let a = parse_cli(&["adapters", "diff", "x", "1", "2", "--key-prefix", "q"]);
        assert_eq!(a.key_prefix, "q");
        assert!(matches!(
            a.command,
            AdaptersCommand::Diff { a: 1, b: 2, .. }
        ));
    }
}
