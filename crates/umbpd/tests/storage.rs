//! Storage safety of the `umbpd` binary: a second daemon on a held SSD directory is refused
//! (exit status 2, the holder named), and a daemon at its `RLIMIT_NOFILE` still stores every
//! put and keeps every acknowledged value through SIGTERM and a restart.

mod common;

use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{Daemon, bytes, run, ssd_dir};
use mori_testutil::{hostname, random_seed};
use mori_umbpd::Client;

const EXIT_WAIT: Duration = Duration::from_secs(30);

fn key(i: usize) -> Vec<u8> {
    format!("key-{i:05}").into_bytes()
}

/// Random values of 1 byte to `max_len` bytes for keys `0..n` (from `seed`).
fn values(seed: u64, n: usize, max_len: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let s = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let len = 1 + (s % max_len as u64) as usize;
            bytes(s, len)
        })
        .collect()
}

/// The daemon arguments `args` plus `--ssd-dir SSD`.
fn ssd_args<'a>(ssd: &'a Path, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.extend(["--ssd-dir", ssd.to_str().unwrap()]);
    all
}

/// Every value reads back byte-exact.
fn check_values(c: &Client, values: &[Vec<u8>]) {
    for (i, v) in values.iter().enumerate() {
        let got = c.get(&key(i)).unwrap();
        assert!(got.as_ref() == Some(v), "key {i} is not intact");
    }
}

#[test]
fn a_second_daemon_on_a_held_ssd_dir_exits_2_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    let args = ssd_args(&ssd, &["--dram-bytes", "1M", "--segment-bytes", "1M"]);
    let seed = random_seed("a_second_daemon_on_a_held_ssd_dir_exits_2_naming_the_holder");
    let values = values(seed, 60, 64 << 10);
    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    for (i, v) in values.iter().enumerate() {
        assert!(c.put(&key(i), v).unwrap());
    }
    assert!(
        c.stats().unwrap().ssd_keys > 0,
        "some values must be on SSD"
    );

    // A second daemon on the same directory stops at once with the holder named.
    let t = Instant::now();
    let (code, _, err) = run(&args, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert!(err.contains("configuration error"), "{err}");
    assert!(err.contains(&ssd.display().to_string()), "{err}");
    assert!(
        err.contains(&format!("pid {} on host {}", d.pid(), hostname())),
        "{err}"
    );

    // The first daemon's values are intact, and still are after a clean restart.
    check_values(&c, &values);
    drop(c);
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
    let d = Daemon::start(dir.path(), &args, &[]);
    assert!(d.stdout().contains("clean_shutdown=true"), "{}", d.stdout());
    let c = Client::connect(&d.addr).unwrap();
    check_values(&c, &values);
    drop(c);
    assert_eq!(d.stop(libc::SIGTERM, EXIT_WAIT).status.code(), Some(0));
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The descriptor numbers `pid` has open.
fn open_fds(pid: i32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// Sets the soft `RLIMIT_NOFILE` of process `pid`.
fn set_fd_limit(pid: i32, soft: u64) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads and writes structs we own; `pid` is our child.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(rc, 0, "prlimit (read)");
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit (write)");
}

/// Opens idle connections to the daemon until process `pid`'s descriptor table is full (its
/// accept loop takes them): every number under `limit` in use but one when a thread waits in
/// a blocking `accept` (the same-host socket's, once a client used it): Linux reserves the
/// number that call will return before it waits, and /proc does not list it. Returns the
/// connections.
fn fill_fd_table(pid: i32, addr: &str, limit: u64) -> Vec<TcpStream> {
    let mut conns = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut full_since: Option<Instant> = None;
    // Full: every number, or all but one for 300 ms while connections wait to be accepted.
    while (open_fds(pid).len() as u64) < limit
        && full_since.is_none_or(|t| t.elapsed() < Duration::from_millis(300))
    {
        if full_since.is_none() && open_fds(pid).len() as u64 == limit - 1 {
            full_since = Some(Instant::now());
        }
        assert!(
            Instant::now() < deadline,
            "the fd table did not fill: {} of {limit} open",
            open_fds(pid).len()
        );
        if conns.len() < 4 * limit as usize {
            conns.push(TcpStream::connect(addr).unwrap());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    conns
}

#[test]
fn sigterm_at_the_fd_limit_keeps_every_acknowledged_value() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = ssd_dir(dir.path());
    // Small DRAM and segments: puts demote to SSD and the log needs many new segments.
    let args = ssd_args(
        &ssd,
        &[
            "--dram-bytes",
            "1M",
            "--segment-bytes",
            "64K",
            "--ssd-bytes",
            "1G",
        ],
    );
    let seed = random_seed("sigterm_at_the_fd_limit_keeps_every_acknowledged_value");
    let values = values(seed, 400, 16 << 10);
    let d = Daemon::start(dir.path(), &args, &[]);
    let c = Client::connect(&d.addr).unwrap();
    let warm = 20;
    for (i, v) in values[..warm].iter().enumerate() {
        assert!(c.put(&key(i), v).unwrap());
    }

    // The daemon may open 4 more descriptors; idle connections take every free one.
    let pid = d.pid();
    let max_fd = open_fds(pid).into_iter().max().unwrap();
    let limit = max_fd + 1 + 4;
    set_fd_limit(pid, limit);
    let conns = fill_fd_table(pid, &d.addr, limit);
    eprintln!(
        "daemon at its limit of {limit} descriptors ({} idle connections)",
        conns.len()
    );

    // Every put is acknowledged although no new segment file can be opened.
    for (i, v) in values.iter().enumerate().skip(warm) {
        match c.put(&key(i), v) {
            Ok(stored) => assert!(stored, "key {i}"),
            Err(e) => panic!("put {i} failed at the fd limit: {e}"),
        }
    }
    assert!(
        open_fds(pid).len() as u64 >= limit - 1,
        "the fd table is full (but a number a blocked accept holds)"
    );
    let s = c.stats().unwrap();
    assert!(s.demotions > 0, "{s:?}");
    drop(c);

    // SIGTERM: the pool writes DRAM to SSD and seals the log.
    let out = d.stop(libc::SIGTERM, EXIT_WAIT);
    drop(conns);
    // (mori.io's accept loop logs a warning per attempt while out of descriptors: print
    // only the end of stderr.)
    let err_tail = tail(&out.stderr, 30);
    assert_eq!(out.status.code(), Some(0), "{}\n{err_tail}", out.stdout);
    assert!(out.stdout.contains("values_lost=0"), "{}", out.stdout);
    // The log did run out of descriptors (and went on in its active segment).
    assert!(out.stderr.contains("out of file descriptors"), "{err_tail}");

    // Restarted without the limit: a clean shutdown, every acknowledged value byte-exact.
    let d = Daemon::start(dir.path(), &args, &[]);
    assert!(d.stdout().contains("clean_shutdown=true"), "{}", d.stdout());
    assert!(
        d.stdout().contains(&format!("live_keys={} ", values.len())),
        "{}",
        d.stdout()
    );
    assert!(
        d.stdout().contains("corrupt_records_dropped=0 "),
        "{}",
        d.stdout()
    );
    let c = Client::connect(&d.addr).unwrap();
    check_values(&c, &values);
    drop(c);
    assert_eq!(d.stop(libc::SIGTERM, EXIT_WAIT).status.code(), Some(0));
}
