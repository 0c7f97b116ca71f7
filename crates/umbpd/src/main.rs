//! `umbpd`: the UMBP daemon. See the library docs of `mori_umbpd` and `umbpd --help`.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::unix::ffi::OsStrExt;
use std::process::ExitCode;

use clap::Parser;
use mori_umbpd::config::{self, Cli, ConfigError, ENV_LOG, Role};
use mori_umbpd::server::{self, say};
use mori_umbpd::{master_server, peer};
use tracing_subscriber::EnvFilter;

/// Exit code of configuration errors (as clap uses for usage errors).
const EXIT_CONFIG: u8 = 2;
/// Exit code of runtime failures.
const EXIT_FAILURE: u8 = 1;

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

fn init_logging() {
    let filter = EnvFilter::try_from_env(ENV_LOG).unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let cfg = match umbp_env().and_then(|env| config::resolve(&cli, &env)) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("umbpd: configuration error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    say("configuration:");
    for line in cfg.report_lines() {
        say(&format!("  {line}"));
    }
    if cli.check_config {
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .thread_name("umbpd")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbpd: error: starting the runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
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
            ExitCode::SUCCESS
        }
        Ok(None) => {
            say("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("umbpd: error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
