//! Helpers of the integration tests: start the real `umbpd` binary, read its output, signal
//! it and wait for its exit.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mori_auth::Secret;
use mori_umbpd::ClientOptions;

/// A command running the daemon with `args` and `envs`, without any UMBP_* variable of the
/// test process's own environment.
pub fn command(args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_umbpd"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("UMBP_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(args).envs(envs.iter().copied());
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs the daemon to completion (for runs that exit by themselves).
pub fn run(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let out = command(args, envs).output().expect("run umbpd");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn pump(r: impl Read + Send + 'static, buf: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            let mut b = buf.lock().unwrap();
            b.push_str(&line);
            b.push('\n');
        }
    })
}

/// A running daemon.
pub struct Daemon {
    child: Child,
    /// The address it listens on (from its port file).
    pub addr: String,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    pumps: Vec<JoinHandle<()>>,
}

/// How a daemon ended.
pub struct Exited {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// The SSD directory of a test directory.
pub fn ssd_dir(dir: &Path) -> PathBuf {
    dir.join("ssd")
}

impl Daemon {
    /// Starts the daemon with `--port-file DIR/port` plus `args`, and waits until it listens.
    pub fn start(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Daemon {
        Daemon::start_with(dir, args, envs, |_| {})
    }

    /// [`Daemon::start`], with `configure` applied to the command before it is spawned.
    pub fn start_with(
        dir: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        configure: impl FnOnce(&mut Command),
    ) -> Daemon {
        let port_file = dir.join("port");
        let _ = std::fs::remove_file(&port_file);
        let pf = port_file.to_str().unwrap();
        let mut all = vec!["--port-file", pf];
        all.extend_from_slice(args);
        let mut cmd = command(&all, envs);
        configure(&mut cmd);
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn umbpd");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let pumps = vec![
            pump(child.stdout.take().unwrap(), Arc::clone(&stdout)),
            pump(child.stderr.take().unwrap(), Arc::clone(&stderr)),
        ];
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(s) = std::fs::read_to_string(&port_file) {
                break s.trim().to_string();
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "umbpd exited early ({status}):\n{}\n{}",
                    stdout.lock().unwrap(),
                    stderr.lock().unwrap()
                );
            }
            assert!(Instant::now() < deadline, "umbpd did not start in 30 s");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The port file is written just before the "listening on" line; wait for the line too,
        // so that everything printed at start (recovery counts, settings) has been read.
        while !stdout.lock().unwrap().contains("listening on") {
            assert!(
                Instant::now() < deadline,
                "umbpd wrote its port file but not its listening line in 30 s:\n{}",
                stdout.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Daemon {
            child,
            addr,
            stdout,
            stderr,
            pumps,
        }
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// What it printed to stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    /// What it printed to stderr (its log) so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// CPU time (user + system) the process's threads named `name` have used so far, from
    /// /proc (a thread's name is truncated to 15 bytes there).
    pub fn cpu_time_of_threads(&self, name: &str) -> Duration {
        let mut ticks = 0u64;
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).unwrap();
        for task in tasks {
            let Ok(stat) = std::fs::read_to_string(task.unwrap().path().join("stat")) else {
                continue; // the thread ended meanwhile
            };
            let (open, close) = (stat.find('(').unwrap(), stat.rfind(')').unwrap());
            if &stat[open + 1..close] != name {
                continue;
            }
            let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
            // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
            ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        }
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Duration::from_millis(ticks * 1000 / hz)
    }

    /// Sends `sig` without waiting.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// Stops the daemon (SIGSTOP) and waits until every thread of it is stopped (the signal
    /// takes effect some time after kill() returns).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let states: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", self.pid()))
                .unwrap()
                .map(|t| {
                    let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap();
                    let after_name = &stat[stat.rfind(')').unwrap() + 1..];
                    after_name.split_whitespace().next().unwrap().to_string()
                })
                .collect();
            if states.iter().all(|s| s == "t" || s == "T") {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the daemon did not stop: {states:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends `sig` and waits (at most `timeout`) for the process to exit.
    pub fn stop(mut self, sig: i32, timeout: Duration) -> Exited {
        self.signal(sig);
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "umbpd did not exit within {timeout:?} after signal {sig}:\n{}\n{}",
                    self.stdout.lock().unwrap(),
                    self.stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for p in self.pumps.drain(..) {
            p.join().unwrap();
        }
        Exited {
            status,
            stdout: self.stdout.lock().unwrap().clone(),
            stderr: self.stderr.lock().unwrap().clone(),
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // A test that failed half-way must not leave the daemon running.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Deterministic pseudo-random bytes (xorshift) for a seed.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A lock of the caller's own that a call keeps (`Held`: the GIL in mori's bindings), noting
/// whether the call let it go.
#[derive(Default)]
pub struct NotedHeld(std::sync::atomic::AtomicBool);

impl mori_umbpd::small_ops::Held for NotedHeld {
    fn release(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl NotedHeld {
    pub fn released(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Calls `call` with a fresh [`NotedHeld`] until 10 calls kept it or 5 s passed: (the calls
/// that kept it, the calls made). A call's own checks are `call`'s.
pub fn kept_in_time(mut call: impl FnMut(&NotedHeld)) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut kept, mut tries) = (0, 0);
    while kept < 10 && Instant::now() < deadline {
        tries += 1;
        let held = NotedHeld::default();
        call(&held);
        kept += usize::from(!held.released());
    }
    (kept, tries)
}

/// Runs `call(held)` on a thread of its own with `daemons` stopped ([`Daemon::pause`]): asserts
/// that the call let `held` go while it still waited, then resumes them and returns what the
/// call returned.
pub fn called_while_stopped<R: Send>(
    daemons: &[&Daemon],
    call: impl FnOnce(&NotedHeld) -> R + Send,
) -> R {
    for d in daemons {
        d.pause();
    }
    let held = NotedHeld::default();
    std::thread::scope(|s| {
        let running = s.spawn(|| call(&held));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !held.released() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let waiting = !running.is_finished();
        for d in daemons {
            d.signal(libc::SIGCONT);
        }
        assert!(
            held.released(),
            "a call waiting on a stopped daemon kept the caller's lock"
        );
        assert!(waiting, "the call returned while the daemon was stopped");
        running.join().unwrap()
    })
}

// ---- secrets and raw gRPC clients ------------------------------------------------------------

/// `(key, value)` slices of `keys[i]` and `values[i]`, as batch puts take them.
pub fn pairs<'a>(keys: &'a [Vec<u8>], values: &'a [Vec<u8>]) -> Vec<(&'a [u8], &'a [u8])> {
    keys.iter()
        .zip(values)
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect()
}

/// A secret file (mode 0600) holding `text`.
pub fn secret_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("{text}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

/// A master and one peer of `dram` bytes (heartbeat every 100 ms), both with a secret file
/// holding `secret` in `dirs[0]`, each daemon in its own directory of `dirs`.
pub fn master_and_peer(dirs: &[tempfile::TempDir], secret: &str, dram: &str) -> (Daemon, Daemon) {
    let sf = secret_file(dirs[0].path(), "secret", secret);
    let sf = sf.to_str().unwrap();
    let master = Daemon::start(
        dirs[0].path(),
        &["--role", "master", "--secret-file", sf],
        &[],
    );
    let peer = Daemon::start(
        dirs[1].path(),
        &[
            "--role",
            "peer",
            "--master",
            &master.addr,
            "--secret-file",
            sf,
            "--heartbeat-interval",
            "100ms",
            "--dram-bytes",
            dram,
        ],
        &[],
    );
    (master, peer)
}

/// Client options proving `secret`.
pub fn opts(secret: &str) -> ClientOptions {
    ClientOptions {
        secret: Some(Secret::new(secret.as_bytes().to_vec()).unwrap()),
        connect_timeout: Duration::from_secs(5),
        ..ClientOptions::default()
    }
}

/// A runtime for raw gRPC calls.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A raw gRPC channel to `addr` authenticating with `secret` (connected on first use).
pub fn raw_channel(addr: &str, secret: &str) -> tonic::transport::Channel {
    let o = opts(secret);
    let s = Arc::new(o.secret.clone().unwrap());
    mori_umbpd::client::lazy_channel(addr, &o, s).unwrap()
}
