//! The harness of mori's `cargo bench` targets (`harness = false`): each case is warmed up,
//! then timed in samples of `iters` calls sized so that a sample lasts about
//! [`SAMPLE_TIME`]; the per-call median, p10 and p90 over the samples are printed and written,
//! with the date, host and configuration, as one JSON record per suite:
//! `benches/results/cargo-<suite>-<host>-<UTC time>.json` of the workspace, or under
//! `MORI_BENCH_OUT` (a folder) when set. `MORI_BENCH_QUICK=1` (CI) takes few, short samples:
//! it proves the benches run, its figures are not for quoting.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Target length of one timed sample.
pub const SAMPLE_TIME: Duration = Duration::from_millis(40);
const SAMPLES: usize = 25;
const QUICK_SAMPLE_TIME: Duration = Duration::from_millis(4);
const QUICK_SAMPLES: usize = 5;

/// One suite's cases and record.
pub struct Bench {
    suite: String,
    quick: bool,
    config: Vec<(String, String)>,
    cases: Vec<String>,
}

impl Bench {
    /// A suite; `cargo bench -- FILTER` runs only the cases whose name contains FILTER.
    pub fn new(suite: &str) -> Bench {
        let quick = std::env::var("MORI_BENCH_QUICK").is_ok_and(|v| v == "1");
        println!(
            "{suite}{}",
            if quick {
                " (quick: figures not for quoting)"
            } else {
                ""
            }
        );
        Bench {
            suite: suite.to_string(),
            quick,
            config: Vec::new(),
            cases: Vec::new(),
        }
    }

    /// Records a configuration entry (shown in the record's `config`).
    pub fn config(&mut self, key: &str, value: impl ToString) {
        self.config.push((key.to_string(), value.to_string()));
    }

    /// Whether `case` passes the command line's filter (the first argument that is not an
    /// option; cargo passes `--bench`).
    pub fn wanted(&self, case: &str) -> bool {
        std::env::args()
            .skip(1)
            .find(|a| !a.starts_with('-'))
            .is_none_or(|f| case.contains(&f))
    }

    /// Times `f`, one call per iteration. `bytes` moved per call (0: none) gives GB/s.
    pub fn run(&mut self, case: &str, bytes: u64, mut f: impl FnMut()) {
        self.run_batched(case, bytes, |iters| {
            let t0 = Instant::now();
            for _ in 0..iters {
                f();
            }
            t0.elapsed()
        });
    }

    /// Times a case whose closure runs `iters` calls and returns how long they took (for
    /// work outside the timed part, or calls every rank of a collective must make alike).
    pub fn run_batched(&mut self, case: &str, bytes: u64, mut f: impl FnMut(u64) -> Duration) {
        if !self.wanted(case) {
            return;
        }
        let (sample_time, samples) = if self.quick {
            (QUICK_SAMPLE_TIME, QUICK_SAMPLES)
        } else {
            (SAMPLE_TIME, SAMPLES)
        };
        // Warm-up, then size a sample from the calls' rate.
        let mut iters = 1u64;
        loop {
            let t = f(iters);
            if t >= sample_time / 4 || iters >= 1 << 30 {
                let per = t.as_secs_f64() / iters as f64;
                iters = ((sample_time.as_secs_f64() / per.max(1e-9)) as u64).max(1);
                break;
            }
            iters *= 4;
        }
        let mut per_call: Vec<f64> = (0..samples)
            .map(|_| f(iters).as_secs_f64() / iters as f64)
            .collect();
        per_call.sort_by(f64::total_cmp);
        let pick = |q: f64| per_call[((samples - 1) as f64 * q).round() as usize];
        let (median, p10, p90) = (pick(0.5), pick(0.1), pick(0.9));
        let gbps = (bytes > 0).then(|| bytes as f64 / median / 1e9);
        println!(
            "  {case:<44} {:>11} (p10 {}, p90 {}){}",
            human(median),
            human(p10),
            human(p90),
            gbps.map_or(String::new(), |g| format!("  {g:.2} GB/s"))
        );
        let mut row = format!(
            "{{\"case\": {}, \"iters_per_sample\": {iters}, \"samples\": {samples}, \
             \"median_ns\": {:.1}, \"p10_ns\": {:.1}, \"p90_ns\": {:.1}",
            json_str(case),
            median * 1e9,
            p10 * 1e9,
            p90 * 1e9
        );
        if let Some(g) = gbps {
            let _ = write!(row, ", \"bytes_per_call\": {bytes}, \"gbps\": {g:.3}");
        }
        row.push('}');
        self.cases.push(row);
    }

    /// Writes the record; returns its path.
    pub fn finish(self) -> std::io::Result<PathBuf> {
        let stamp = utc_stamp();
        let host = crate::hostname();
        let dir = match std::env::var_os("MORI_BENCH_OUT") {
            Some(d) => PathBuf::from(d),
            None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/results"),
        };
        std::fs::create_dir_all(&dir)?;
        let dir = std::fs::canonicalize(&dir)?;
        let path = dir.join(format!("cargo-{}-{host}-{stamp}.json", self.suite));
        let config: Vec<String> = self
            .config
            .iter()
            .map(|(k, v)| format!("{}: {}", json_str(k), json_str(v)))
            .collect();
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        let record = format!(
            "{{\n \"benchmark\": {},\n \"harness\": \"cargo bench (mori-testutil)\",\n \
             \"env\": {{\"date\": {}, \"host\": {}, \"mori_version\": {}, \"cpus\": {cpus}}},\n \
             \"quick\": {},\n \
             \"method\": \"per call: median, p10 and p90 over samples of iters calls each \
             (a sample lasts about {} ms)\",\n \"config\": {{{}}},\n \"cases\": [\n  {}\n ]\n}}\n",
            json_str(&self.suite),
            json_str(&stamp),
            json_str(&host),
            json_str(env!("CARGO_PKG_VERSION")),
            self.quick,
            if self.quick {
                QUICK_SAMPLE_TIME
            } else {
                SAMPLE_TIME
            }
            .as_millis(),
            config.join(", "),
            self.cases.join(",\n  ")
        );
        std::fs::write(&path, record)?;
        println!("wrote {}", path.display());
        Ok(path)
    }
}

fn human(secs: f64) -> String {
    match secs {
        s if s < 1e-6 => format!("{:.1} ns", s * 1e9),
        s if s < 1e-3 => format!("{:.2} µs", s * 1e6),
        s => format!("{:.3} ms", s * 1e3),
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Now in UTC as `2026-12-01T173005Z`.
fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}{:02}{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_strings() {
        let s = utc_stamp();
        assert_eq!(s.len(), 18, "{s}");
        assert!(s.starts_with("20") && s.ends_with('Z'), "{s}");
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        assert_eq!(human(2.5e-7), "250.0 ns");
        assert_eq!(human(0.0025), "2.500 ms");
    }
}
