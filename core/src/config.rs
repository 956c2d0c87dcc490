//! One way to configure every process: a TOML file (or nothing), then
//! `HINDSIGHT_<SECTION>__<KEY>` environment overrides (`__` separates nesting levels), then
//! serde into the process's raw config type, with the dotted path of any bad or unknown key in
//! the error. Each process validates its raw config into a typed one after this.
//!
//! One file can hold every process's sections (deploy/hindsight.example.toml): a process reads
//! its own sections and leaves the other processes' alone, but a section no process knows is an
//! error (a typo must not be ignored).

use std::path::Path;

/// Every section a Hindsight process reads, so one file can configure them all.
pub const SECTIONS: &[&str] = &[
    "log",      // Kafka brokers, topics, spill: every process that touches Kafka
    "proxy",    // hindsight proxy
    "routing",  // the canary routing table (hindsight proxy, hindsight rollout)
    "rollout",  // the rollout controller (hindsight rollout run)
    "feedback", // the feedback API (hindsight proxy, hindsight feedback)
    "joiner",   // hindsight join
    "serve",    // hindsight serve
    "learner",  // hindsight learner
    "registry", // the adapter registry (hindsight learner, hindsight adapters)
    "publish",  // the eval gate and publishing (hindsight learner)
    "scenario", // the learning-curve bench's simulated scenario
];

/// Why a config could not be read; every variant names the file or the key to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("config file {path} is not valid TOML: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the TOML parser said.
        message: String,
    },
    /// A key is unknown, has the wrong type, or fails validation.
    #[error("config key `{key}`: {reason}")]
    Invalid {
        /// Dotted path of the key (`proxy.upstream_url`).
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Reads any config type the way `hindsight` reads all of them: a TOML file (or nothing) whose
/// `sections` are kept (other known sections are ignored, unknown ones refused), then
/// `HINDSIGHT_<SECTION>__<KEY>` environment overrides for those sections (other processes'
/// variables in the same environment are left alone), then serde with the path of any bad or
/// unknown key in the error.
pub fn load_toml<T: serde::de::DeserializeOwned>(
    path: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    sections: &[&str],
) -> Result<T, ConfigError> {
    let mut table: toml::Table = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                path: p.display().to_string(),
                source,
            })?;
            toml::from_str(&text).map_err(|e| ConfigError::Parse {
                path: p.display().to_string(),
                message: e.to_string(),
            })?
        }
        None => toml::Table::new(),
    };
    if let Some(unknown) = table.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
        return Err(ConfigError::Invalid {
            key: unknown.clone(),
            reason: format!("unknown section; Hindsight reads {}", SECTIONS.join(", ")),
        });
    }
    // Other processes' sections of a shared file are theirs to check.
    table.retain(|k, _| sections.contains(&k));
    apply_env_overrides(&mut table, env, sections)?;
    serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| ConfigError::Invalid {
        key: e.path().to_string(),
        reason: e.inner().to_string(),
    })
}

/// `HINDSIGHT_PROXY__UPSTREAM_URL=http://x` → `proxy.upstream_url = "http://x"`. Values are read
/// as TOML when they parse (`5000`, `true`, `["a","b"]`), as strings otherwise.
fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
    sections: &[&str],
) -> Result<(), ConfigError> {
    for (name, raw) in env {
        let Some(rest) = name.strip_prefix("HINDSIGHT_") else {
            continue;
        };
        // `__` separates nesting levels: FEEDBACK__SIGNING__SECRETS -> feedback.signing.secrets
        let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        if path.len() < 2 || !sections.contains(&path[0].as_str()) {
            continue;
        }
        let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.clone()));
        let (leaf, parents) = path.split_last().unwrap_or((&path[0], &[]));
        let mut node = &mut *table;
        for (depth, part) in parents.iter().enumerate() {
            let entry = node
                .entry(part.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            node = match entry {
                toml::Value::Table(t) => t,
                _ => {
                    let key = path[..=depth].join(".");
                    return Err(ConfigError::Invalid {
                        reason: format!(
                            "`{name}` overrides a key inside `{key}`, which is not a table"
                        ),
                        key,
                    });
                }
            };
        }
        node.insert(leaf.clone(), value);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        #[serde(default)]
        proxy: Section,
    }
    #[derive(Debug, Default, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Section {
        #[serde(default)]
        n: u32,
        #[serde(default)]
        inner: Option<Inner>,
    }
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        s: String,
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn overrides_are_typed_nested_and_scoped_to_sections() {
        let f: File = load_toml(
            None,
            env(&[
                ("HINDSIGHT_PROXY__N", "7"),
                ("HINDSIGHT_PROXY__INNER__S", "x"),
                ("HINDSIGHT_OTHER__N", "not ours"),
                ("PATH", "/bin"),
            ]),
            &["proxy"],
        )
        .unwrap();
        assert_eq!(f.proxy.n, 7);
        assert_eq!(f.proxy.inner.unwrap().s, "x");
    }

    #[test]
    fn a_bad_value_names_its_key() {
        let e = load_toml::<File>(None, env(&[("HINDSIGHT_PROXY__N", "1e-3x")]), &["proxy"])
            .unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key, .. } if key == "proxy.n"),
            "{e}"
        );
        let e =
            load_toml::<File>(None, env(&[("HINDSIGHT_PROXY__M", "1")]), &["proxy"]).unwrap_err();
        assert!(e.to_string().contains("unknown field `m`"), "{e}");
    }

    #[test]
    fn file_then_environment() {
        let dir = std::env::temp_dir().join(format!("hindsight-core-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.toml");
        std::fs::write(&p, "[proxy]\nn = 3\n").unwrap();
        let f: File = load_toml(Some(&p), env(&[]), &["proxy"]).unwrap();
        assert_eq!(f.proxy.n, 3);
        let f: File = load_toml(Some(&p), env(&[("HINDSIGHT_PROXY__N", "4")]), &["proxy"]).unwrap();
        assert_eq!(f.proxy.n, 4);
        std::fs::write(&p, "[proxy\n").unwrap();
        assert!(matches!(
            load_toml::<File>(Some(&p), env(&[]), &["proxy"]),
            Err(ConfigError::Parse { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn one_file_serves_every_process_but_an_unknown_section_is_refused() {
        let dir = std::env::temp_dir().join(format!("hindsight-core-s-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("all.toml");
        std::fs::write(
            &p,
            "[proxy]\nn = 5\n[learner]\nanything = 1\n[joiner]\nx = 2\n",
        )
        .unwrap();
        let f: File = load_toml(Some(&p), env(&[]), &["proxy"]).unwrap();
        assert_eq!(f.proxy.n, 5);
        std::fs::write(&p, "[proxy]\nn = 5\n[prxy]\nn = 1\n").unwrap();
        let e = load_toml::<File>(Some(&p), env(&[]), &["proxy"]).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Invalid { key, .. } if key == "prxy"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
