//! The `umbpd` command: flags, `UMBP_*` environment, logging, the runtime and the role, ending
//! in an exit code. The `umbpd` binary and the Python entry point (`mori._core.umbpd_main`)
//! both run [`run_cli`].

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::unix::ffi::OsStrExt;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::config::{self, Cli, ConfigError, ENV_LOG, Role};
use crate::server::{self, say};
use crate::{master_server, peer};

/// Exit code of configuration errors (as clap uses for usage errors).
pub const EXIT_CONFIG: u8 = 2;
/// Exit code of runtime failures.
pub const EXIT_FAILURE: u8 = 1;

/// The `UMBP_*` variables of the process environment, as text.
fn umbp_env() -> Result<Vec<(String, String)>, ConfigError> {
    let mut out = Vec::new();
    for (name, value) in std::env::vars_os() {
        if !name.as_bytes().starts_with(b"UMBP_") {
            continue;
        }
        let text = |s: OsString| {
            s.into_string()
                .map_err(|s| ConfigError(format!("environment variable {s:?} is not UTF-8")))
        };
        let name = text(name)?;
        let value = value
            .into_string()
            .map_err(|_| ConfigError(format!("the value of {name} is not UTF-8")))?;
        out.push((name, value));
    }
    Ok(out)
}

/// The daemon's log filter: `UMBP_LOG`, default `info`.
pub fn log_filter() -> EnvFilter {
    EnvFilter::try_from_env(ENV_LOG).unwrap_or_else(|_| EnvFilter::new("info"))
}

/// Logs to stderr through [`log_filter`], unless the process already has a subscriber (a host
/// such as `mori._core` installs its own and applies [`log_filter`] to it).
fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Runs `umbpd` with `args` (the arguments after the program name) until the daemon stops
/// (SIGTERM/SIGINT) and returns the process exit code: 0 after a clean shutdown (and for
/// `--help`, `--version`, `--check-config`), [`EXIT_CONFIG`] for bad flags or settings (and
/// for an SSD directory that another daemon or pool holds), [`EXIT_FAILURE`] when the daemon
/// fails. Errors are printed to stderr.
pub fn run_cli(args: Vec<OsString>) -> u8 {
    let cli = match Cli::try_parse_from(std::iter::once(OsString::from("umbpd")).chain(args)) {
        Ok(cli) => cli,
        Err(e) => {
            // Usage and errors as clap's own `exit` prints them (help and version to stdout).
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(EXIT_CONFIG);
        }
    };
    init_logging();
    let cfg = match umbp_env().and_then(|env| config::resolve(&cli, &env)) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("umbpd: configuration error: {e}");
            return EXIT_CONFIG;
        }
    };
    say(&format!("umbpd {}", config::VERSION));
    say("configuration:");
    for line in cfg.report_lines() {
        say(&format!("  {line}"));
    }
    if cli.check_config {
        return 0;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .thread_name("umbpd")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbpd: error: starting the runtime: {e}");
            return EXIT_FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cfg.role.value {
            Role::Standalone => server::run_standalone(&cfg).await.map(Some),
            Role::Peer => peer::run_peer(&cfg).await.map(Some),
            Role::Master => master_server::run_master(&cfg).await.map(|()| None),
        }
    });
    match result {
        Ok(Some(report)) => {
            say(&server::close_line(&report));
            0
        }
        Ok(None) => {
            say("stopped");
            0
        }
        Err(server::DaemonError::Pool(e @ mori_umbp::Error::Locked { .. })) => {
            // A setting that cannot be used (the directory belongs to another daemon or pool).
            eprintln!("umbpd: configuration error: ssd_dir: {e}");
            EXIT_CONFIG
        }
        Err(e) => {
            eprintln!("umbpd: error: {e}");
            EXIT_FAILURE
        }
    }
}
