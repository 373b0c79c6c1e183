//! The settings that come from neither the command line nor a flag's own env
//! var: the keys of the `--config` TOML file, and the old env names of the
//! duration flags (`CONNEX_STALL_TIMEOUT_MS`). Each becomes a `--flag=value`
//! argument that `load` puts before the command line's, so that what the
//! command line says wins.

use super::units::{env_name, RENAMED};
use clap::parser::ValueSource;
use clap::ArgMatches;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Errors loading the configuration (here, where the file is read).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid TOML in {path}: {source}")]
    Toml {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("config key `{0}` is not a router setting")]
    UnknownKey(String),
    #[error(transparent)]
    Cli(#[from] clap::Error),
}

/// Whether the command line or the flag's own env var set `id`.
fn set_by_user(serve: &ArgMatches, id: &str) -> bool {
    matches!(
        serve.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    )
}

/// `--flag=value` for each duration flag set only by its old env name.
pub fn old_env_arguments(
    serve: &ArgMatches,
    env: impl Fn(&str) -> Option<OsString>,
) -> Vec<OsString> {
    let mut args = Vec::new();
    for (old, new) in RENAMED {
        // An empty variable is an unset one, as clap takes a flag's own.
        let Some(value) = env(&env_name(old)).filter(|v| !v.is_empty()) else {
            continue;
        };
        if set_by_user(serve, new) {
            continue;
        }
        let mut arg = OsString::from(format!("--{}=", new.replace('_', "-")));
        arg.push(value);
        args.push(arg);
    }
    args
}

/// The id of a file key: its flag's, or, for a duration flag's old name
/// (`stall_timeout_ms`), the flag it became (`stall_timeout`).
fn key_id(key: &str, serve: &ArgMatches) -> Option<String> {
    let id = key.replace('-', "_");
    if id != "config" && serve.try_get_raw(&id).is_ok() {
        return Some(id);
    }
    let renamed = RENAMED.iter().find(|(old, _)| *old == id)?.1;
    Some(renamed.to_string())
}

/// `--key=value` arguments for each key of the TOML file that the command line
/// and the environment left unset.
pub fn file_arguments(path: &Path, serve: &ArgMatches) -> Result<Vec<OsString>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let table: toml::Table = text.parse().map_err(|source| ConfigError::Toml {
        path: path.to_path_buf(),
        source,
    })?;
    let mut args = Vec::new();
    for (key, value) in &table {
        let Some(id) = key_id(key, serve) else {
            return Err(ConfigError::UnknownKey(key.clone()));
        };
        if set_by_user(serve, &id) {
            continue;
        }
        // A list is a repeatable flag: one argument per item.
        let values = match value {
            toml::Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        for value in values {
            let value = match value {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            args.push(format!("--{}={value}", id.replace('_', "-")).into());
        }
    }
    Ok(args)
}
