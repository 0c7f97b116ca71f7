//! Whether the SSD tier can use io_uring here (scripts/test.sh runs it to decide whether the
//! io_uring test variants must run: `MORI_REQUIRE_URING=1`).
//!
//!     cargo run -p mori-umbp --example uring_probe
//!
//! Prints `io_uring: available` and exits 0, or `io_uring: unavailable: <the kernel's reason>`
//! and exits 1.

use std::process::ExitCode;

fn main() -> ExitCode {
    match mori_umbp::ssd::probe_uring() {
        Ok(()) => {
            println!("io_uring: available");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("io_uring: unavailable: {e}");
            ExitCode::FAILURE
        }
    }
}
