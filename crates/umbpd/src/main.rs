//! `umbpd`: the UMBP daemon. See the library docs of `mori_umbpd` and `umbpd --help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(mori_umbpd::run_cli(std::env::args_os().skip(1).collect()))
}
