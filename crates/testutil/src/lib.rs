//! Helpers shared by mori's tests and `cargo bench` targets (a dev-dependency only).

/// A small deterministic generator (64-bit LCG, high bits): reproducible test sequences
/// without a random-number crate.
#[derive(Debug, Clone)]
pub struct Lcg(pub u64);

impl Lcg {
    /// The next 31 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    /// Uniform-ish in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Offsets for items of `sizes` laid out in order without overlap, with random gaps of
    /// 0..7 bytes (so most are unaligned), and the length of region they need.
    pub fn layout(&mut self, sizes: &[u64]) -> (Vec<u64>, u64) {
        let mut offs = Vec::with_capacity(sizes.len());
        let mut pos = 0;
        for s in sizes {
            pos += self.next() % 7;
            offs.push(pos);
            pos += s;
        }
        (offs, pos + 7)
    }
}

/// Settings of the bounded property tests that fuzz mori's decoders: `cases` cases per
/// property (kept small enough for CI), or `PROPTEST_CASES` when it is set, to fuzz longer:
/// `PROPTEST_CASES=200000 cargo test -p mori-bootstrap fuzz`. XorShift drives the generator,
/// because the default ChaCha is slow in unoptimized test builds. Failing inputs are printed
/// (shrunk), not written into the source tree.
pub fn fuzz_config(cases: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(cases);
    proptest::test_runner::Config {
        cases,
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    }
}

/// A seed for random test data (time and pid), printed so that a failing run can be replayed.
pub fn random_seed(test: &str) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let seed = nanos ^ (u64::from(std::process::id()) << 32);
    eprintln!("{test}: random seed {seed:#x}");
    seed
}

/// This test binary again, set to run only its test `test` (one thread, output not captured):
/// how a test puts an attacker or a crashing writer in another process. The caller adds the
/// child's orders (environment) and runs it.
pub fn this_test(test: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    c.args(["--exact", test, "--nocapture", "--test-threads", "1"]);
    c
}

/// Runs the `#[ignore]`d test `test` of this binary in a child process with `envs` added to its
/// environment (a setting this process must keep out of its own), and asserts that it ran and
/// passed; the child's output is in the failure message.
pub fn run_ignored_child(test: &str, envs: &[(&str, &str)]) {
    let mut c = this_test(test);
    c.arg("--include-ignored");
    for (k, v) in envs {
        c.env(k, v);
    }
    let out = c.output().expect("running the test binary again");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child test {test}:\n{stdout}\n{stderr}"
    );
}

/// This host's name as the kernel reports it.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
pub mod bench;
