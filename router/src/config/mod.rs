//! Router configuration: the `serve` flags, in one group per concern
//! (`groups.rs`), are the single source of truth: each subsystem is built
//! from, and reads, its own group.
//!
//! Every flag can also be set by an env var `CONNEX_<FLAG>` and by a key of the
//! TOML file given with `--config` (snake_case flag names). Precedence: command
//! line, then environment, then file, then defaults.
//!
//! A duration takes its unit (`30s`, `250ms`, `5m`, `1h`); a bare number is in
//! the unit its flag had when its name said it (`--stall-timeout-ms` is now
//! `--stall-timeout`, and both `--stall-timeout-ms 500` and
//! `--stall-timeout 500ms` still mean half a second): the old flag names, env
//! vars (`CONNEX_STALL_TIMEOUT_MS`) and file keys are kept, so nothing a user
//! wrote breaks (`units.rs`, `merge.rs`).
//!
//! A leaf: it imports nothing from the crate, so that every subsystem can be
//! built and tested from its own group.

mod groups;
mod merge;
mod units;

pub use groups::{
    AccessArgs, EngineArgs, EtcdArgs, HealthArgs, Http2Args, ListenerArgs, LogFormat,
    MembershipArgs, ObservabilityArgs, OnHoldLost, PolicyKind, RequestArgs, ResponsesArgs,
    ResumeArgs, RoutingArgs, TenantArgs,
};
pub use merge::ConfigError;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "connex-router",
    version,
    about = "P/D disaggregated LLM router with request resume"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once at start: the size of the `serve` variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI API, registration and admin routes.
    Serve(RouterConfig),
    /// Run an in-process demo cluster (router + 1 prefill + 2 decode mocks).
    Demo(DemoArgs),
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Tokens per demo request.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
}

/// `connex-router serve` flags: one group per concern, each under its heading.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct RouterConfig {
    /// TOML file with any of these settings (snake_case keys).
    #[arg(long, env = "CONNEX_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten, next_help_heading = "Listeners")]
    pub listeners: ListenerArgs,
    #[command(flatten, next_help_heading = "HTTP/2")]
    pub http2: Http2Args,
    #[command(flatten, next_help_heading = "Logs, traces and metrics")]
    pub observability: ObservabilityArgs,
    #[command(flatten, next_help_heading = "Secrets and access")]
    pub access: AccessArgs,
    #[command(flatten, next_help_heading = "Tenants and admission")]
    pub tenants: TenantArgs,
    #[command(flatten, next_help_heading = "Client requests")]
    pub requests: RequestArgs,
    #[command(flatten, next_help_heading = "Engine calls")]
    pub engines: EngineArgs,
    #[command(flatten, next_help_heading = "Routing")]
    pub routing: RoutingArgs,
    #[command(flatten, next_help_heading = "Resume")]
    pub resume: ResumeArgs,
    #[command(flatten, next_help_heading = "Membership")]
    pub membership: MembershipArgs,
    #[command(flatten, next_help_heading = "etcd")]
    pub etcd: EtcdArgs,
    #[command(flatten, next_help_heading = "Health checks")]
    pub health: HealthArgs,
    #[command(flatten, next_help_heading = "Responses")]
    pub responses: ResponsesArgs,
}

/// Parses the router's command line, merging the `--config` TOML file of
/// `serve` and the old env names of the duration flags under the command
/// line and the environment.
pub fn load(argv: Vec<OsString>) -> Result<Cli, ConfigError> {
    load_with_env(argv, |name| std::env::var_os(name))
}

/// [`load`], reading the old env names through `env` (tests give their own).
fn load_with_env(
    argv: Vec<OsString>,
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<Cli, ConfigError> {
    let command = Cli::command()
        .args_override_self(true)
        .mut_subcommand("serve", |serve| serve.after_help(units::help()));
    let matches = command.clone().try_get_matches_from(&argv)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let (Command::Serve(config), Some(serve)) = (&cli.command, matches.subcommand_matches("serve"))
    else {
        return Ok(cli);
    };
    let mut unset = match &config.config {
        Some(path) => merge::file_arguments(path, serve)?,
        None => Vec::new(),
    };
    // After the file's: the environment wins over the file.
    unset.extend(merge::old_env_arguments(serve, env));
    if unset.is_empty() {
        return Ok(with_host_and_port(cli));
    }
    // These settings go right after `serve`, so that any flag given on the
    // command line (later, and overriding) wins.
    let at = argv
        .iter()
        .position(|a| a == "serve")
        .map_or(argv.len(), |i| i + 1);
    let mut merged = argv;
    merged.splice(at..at, unset);
    let matches = command.try_get_matches_from(&merged)?;
    Ok(with_host_and_port(Cli::from_arg_matches(&matches)?))
}

/// Folds `--host`/`--port` into `listen`, the one address the router binds.
fn with_host_and_port(mut cli: Cli) -> Cli {
    if let Command::Serve(config) = &mut cli.command {
        let listeners = &mut config.listeners;
        if let Some(host) = listeners.host {
            listeners.listen.set_ip(host);
        }
        if let Some(port) = listeners.port {
            listeners.listen.set_port(port);
        }
    }
    cli
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A config file of `text` in a directory of its own (`name`), by path.
    fn config_file(name: &str, text: &str) -> String {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("router.toml");
        std::fs::write(&path, text).expect("write config");
        path.to_string_lossy().to_string()
    }

    /// The command line `connex-router serve` with `flags`.
    fn argv(flags: &[&str]) -> Vec<OsString> {
        ["connex-router", "serve"]
            .iter()
            .chain(flags)
            .map(OsString::from)
            .collect()
    }

    fn serve(flags: &[&str]) -> Result<RouterConfig, ConfigError> {
        match load(argv(flags))?.command {
            Command::Serve(config) => Ok(config),
            Command::Demo(_) => panic!("expected serve"),
        }
    }

    #[test]
    fn file_sets_values_and_command_line_wins() {
        let path = config_file(
            "connex-config",
            "heartbeat_ttl_s = 3\ndecode_policy = \"power_of_two\"\nadmin_token = \"file\"\n",
        );
        let config = serve(&["--config", &path, "--admin-token", "cli"]).expect("parse");
        assert_eq!(config.membership.heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(config.routing.decode_policy, PolicyKind::PowerOfTwo);
        assert_eq!(config.access.admin_token.as_deref(), Some("cli"));
    }

    #[test]
    fn host_and_port_set_the_client_listener() {
        let config = serve(&["--host", "0.0.0.0", "--port", "9100"]).expect("parse");
        assert_eq!(
            config.listeners.listen,
            "0.0.0.0:9100".parse().expect("addr")
        );
        let config = serve(&["--port", "9101"]).expect("parse");
        assert_eq!(
            config.listeners.listen,
            "127.0.0.1:9101".parse().expect("addr")
        );
        let config = serve(&["--host", "::1"]).expect("parse");
        assert_eq!(config.listeners.listen, "[::1]:8000".parse().expect("addr"));
    }

    #[test]
    fn host_or_port_with_listen_is_refused_by_name() {
        for flag in ["--host=0.0.0.0", "--port=9000"] {
            let err = serve(&["--listen", "127.0.0.1:1", flag]).expect_err("conflict");
            let ConfigError::Cli(err) = err else {
                panic!("not a command-line error: {err}");
            };
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
            let text = err.to_string();
            assert!(text.contains("--listen"), "{text}");
            assert!(
                text.contains(flag.split('=').next().unwrap_or(flag)),
                "{text}"
            );
        }
    }

    #[test]
    fn log_format_and_level_parse() {
        let config = serve(&[]).expect("parse");
        assert_eq!(config.observability.log_format, LogFormat::Text);
        assert_eq!(config.observability.log_level, None);
        let config = serve(&["--log-format", "json", "--log-level", "debug"]).expect("parse");
        assert_eq!(config.observability.log_format, LogFormat::Json);
        assert_eq!(config.observability.log_level.as_deref(), Some("debug"));
        assert!(serve(&["--log-format", "xml"]).is_err());
    }

    #[test]
    fn http2_is_off_by_default_and_its_limits_are_checked() {
        let config = serve(&[]).expect("parse");
        assert!(!config.http2.http2);
        assert_eq!(
            (
                config.http2.http2_max_streams,
                config.http2.http2_idle_timeout
            ),
            (256, Duration::from_secs(60))
        );
        let config = serve(&["--http2"]).expect("parse");
        assert!(config.http2.http2);
        for bad in [
            ["--http2-max-streams", "0"],
            ["--http2-idle-timeout-s", "0"],
            ["--http2-idle-timeout", "500ms"],
            ["--http2-idle-timeout", "25h"],
            ["--http2-idle-timeout", "100000000000000000000"],
        ] {
            assert!(serve(&bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn static_instances_come_from_flags_or_a_file_list() {
        let path = config_file("connex-config-static", "prefill = [\"http://10.0.0.1:8100,10.0.0.1:7000\"]\ndecode = [\"http://10.0.0.2:8200\", \"http://10.0.0.3:8200\"]\nstatic_model = \"m\"\n");
        let config = serve(&["--config", &path]).expect("parse");
        assert_eq!(
            config.membership.prefill,
            ["http://10.0.0.1:8100,10.0.0.1:7000"]
        );
        assert_eq!(
            config.membership.decode,
            ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
        );
        assert_eq!(config.membership.static_model.as_deref(), Some("m"));
        let config = serve(&["--decode", "http://a:1", "--decode", "http://b:2"]).expect("parse");
        assert_eq!(config.membership.decode, ["http://a:1", "http://b:2"]);
    }

    #[test]
    fn durations_take_units_and_bare_numbers_keep_the_old_flags_unit() {
        let config = serve(&[]).expect("parse");
        assert_eq!(config.engines.stall_timeout, Duration::from_secs(10));
        assert_eq!(config.membership.heartbeat_ttl, Duration::from_secs(10));
        assert_eq!(
            config.responses.response_store_ttl,
            Duration::from_secs(7 * 24 * 3600)
        );
        let config = serve(&[
            "--stall-timeout",
            "250ms",
            "--heartbeat-ttl",
            "1m30s",
            "--shutdown-grace",
            "2h",
        ])
        .expect("parse");
        assert_eq!(config.engines.stall_timeout, Duration::from_millis(250));
        assert_eq!(config.membership.heartbeat_ttl, Duration::from_secs(90));
        assert_eq!(config.listeners.shutdown_grace, Duration::from_secs(7200));
        // What a user wrote before durations took units means what it did:
        // the old names, a bare number in the unit the old name said.
        let config = serve(&[
            "--stall-timeout-ms",
            "500",
            "--heartbeat-ttl-s",
            "3",
            "--suspect-ms=40",
        ])
        .expect("parse");
        assert_eq!(config.engines.stall_timeout, Duration::from_millis(500));
        assert_eq!(config.membership.heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(config.routing.suspect_for, Duration::from_millis(40));
        for bad in [
            "10 parsecs",
            "ms",
            "5x",
            "-1s",
            "1.5s",
            "99999999999999999999h",
        ] {
            let flag = format!("--stall-timeout={bad}");
            let err = serve(&[&flag]).expect_err("not a duration");
            assert!(err.to_string().contains("is not a duration"), "{err}");
        }
    }

    #[test]
    fn a_file_may_use_the_old_duration_keys_and_units() {
        let path = config_file(
            "connex-config-units",
            "stall_timeout_ms = 750\nresume_wait = \"3s\"\nshutdown_grace_s = 5\n",
        );
        let config = serve(&["--config", &path]).expect("parse");
        assert_eq!(config.engines.stall_timeout, Duration::from_millis(750));
        assert_eq!(config.resume.resume_wait, Duration::from_secs(3));
        assert_eq!(config.listeners.shutdown_grace, Duration::from_secs(5));
        // The command line still wins over the file, under either name.
        let config = serve(&["--config", &path, "--stall-timeout", "1s"]).expect("parse");
        assert_eq!(config.engines.stall_timeout, Duration::from_secs(1));
    }

    fn serve_with_env(flags: &[&str], env: &[(&str, &str)]) -> RouterConfig {
        let lookup = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| OsString::from(value))
        };
        match load_with_env(argv(flags), lookup).expect("parse").command {
            Command::Serve(config) => config,
            Command::Demo(_) => panic!("expected serve"),
        }
    }

    #[test]
    fn old_env_names_of_duration_flags_still_work_below_the_command_line() {
        let old = [
            ("CONNEX_STALL_TIMEOUT_MS", "500"),
            ("CONNEX_HEARTBEAT_TTL_S", "3"),
            ("CONNEX_SUSPECT_MS", "1s"),
        ];
        let config = serve_with_env(&[], &old);
        assert_eq!(config.engines.stall_timeout, Duration::from_millis(500));
        assert_eq!(config.membership.heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(config.routing.suspect_for, Duration::from_secs(1));
        let config = serve_with_env(
            &["--stall-timeout=2s"],
            &[("CONNEX_STALL_TIMEOUT_MS", "500")],
        );
        assert_eq!(config.engines.stall_timeout, Duration::from_secs(2));
        // The old env name is the environment: it wins over the file.
        let path = config_file(
            "connex-config-env",
            "stall_timeout = \"7s\"\nresume_wait = \"3s\"\n",
        );
        let config = serve_with_env(&["--config", &path], &[("CONNEX_STALL_TIMEOUT_MS", "500")]);
        assert_eq!(config.engines.stall_timeout, Duration::from_millis(500));
        assert_eq!(config.resume.resume_wait, Duration::from_secs(3));
        // An empty old variable is unset (the default), not a start failure.
        let default = serve_with_env(&[], &[]);
        let config = serve_with_env(&[], &[("CONNEX_STALL_TIMEOUT_MS", "")]);
        assert_eq!(config.engines.stall_timeout, default.engines.stall_timeout);
    }

    #[test]
    fn a_bare_number_is_in_the_unit_of_the_old_name() {
        for (old, new) in units::RENAMED {
            let unit = if old.ends_with("_ms") {
                Duration::from_millis(1)
            } else {
                Duration::from_secs(1)
            };
            let flag = format!("--{}=2", new.replace('_', "-"));
            let matches = Cli::command()
                .try_get_matches_from(["connex-router", "serve", &flag])
                .expect("parse");
            let serve = matches.subcommand_matches("serve").expect("serve");
            let value = serve.get_one::<Duration>(new).copied();
            assert_eq!(value, Some(unit * 2), "{flag}");
        }
    }

    #[test]
    fn env_names_are_the_flags_and_help_says_no_old_unit() {
        let command = Cli::command();
        let serve = command.find_subcommand("serve").expect("serve");
        let mut durations = 0;
        for arg in serve.get_arguments() {
            let id = arg.get_id().as_str();
            if let Some(env) = arg.get_env() {
                assert_eq!(env.to_string_lossy(), units::env_name(id), "{id}");
            }
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            for stale in ["millisecond", "Seconds", "in seconds", ", in bytes"] {
                assert!(!help.contains(stale), "--{id}: {help}");
            }
            let names = arg.get_value_names().unwrap_or_default();
            if names.iter().any(|name| name.as_str() == "DURATION") {
                durations += 1;
                assert!(
                    units::RENAMED.iter().any(|(_, new)| *new == id),
                    "--{id} takes a DURATION but has no old name"
                );
            }
        }
        assert_eq!(durations, units::RENAMED.len());
    }

    #[test]
    fn unknown_file_key_is_an_error() {
        let path = config_file("connex-config-bad", "no_such_setting = 1\n");
        let err = serve(&["--config", &path]).expect_err("must fail");
        assert!(matches!(err, ConfigError::UnknownKey(key) if key == "no_such_setting"));
    }
}
