//! Configuration of `umbpd`: command-line flags, `UMBP_*` environment variables and a TOML
//! file, resolved into one [`Config`] that remembers where each setting came from.
//!
//! Precedence, lowest to highest: built-in defaults, the TOML file (`--config PATH` or
//! `UMBP_CONFIG`), environment variables, command-line flags. Every setting has one name
//! used in all three places:
//!
//! | TOML key         | environment variable  | flag                 | default          |
//! |------------------|-----------------------|----------------------|------------------|
//! | `role`           | `UMBP_ROLE`           | `--role`             | `standalone`     |
//! | `listen`         | `UMBP_LISTEN`         | `--listen`           | `127.0.0.1:0`    |
//! | `dram_bytes`     | `UMBP_DRAM_BYTES`     | `--dram-bytes`       | `1G`             |
//! | `page_bytes`     | `UMBP_PAGE_BYTES`     | `--page-bytes`       | `4K`             |
//! | `ssd_dir`        | `UMBP_SSD_DIR`        | `--ssd-dir`          | none (DRAM only) |
//! | `ssd_bytes`      | `UMBP_SSD_BYTES`      | `--ssd-bytes`        | `64G`            |
//! | `segment_bytes`  | `UMBP_SEGMENT_BYTES`  | `--segment-bytes`    | `256M`           |
//! | `high_watermark` | `UMBP_HIGH_WATERMARK` | `--high-watermark`   | `0.9`            |
//! | `low_watermark`  | `UMBP_LOW_WATERMARK`  | `--low-watermark`    | `0.7`            |
//! | `sync_writes`    | `UMBP_SYNC_WRITES`    | `--sync-writes`      | `false`          |
//! | `ssd_io`         | `UMBP_SSD_IO`         | `--ssd-io`           | `pread`          |
//! | `port_file`      | `UMBP_PORT_FILE`      | `--port-file`        | none             |
//! | `master`         | `UMBP_MASTER`         | `--master`           | none (peer: required) |
//! | `advertise`      | `UMBP_ADVERTISE`      | `--advertise`        | the bound address |
//! | `heartbeat_interval` | `UMBP_HEARTBEAT_INTERVAL` | `--heartbeat-interval` | `1s`   |
//! | `peer_timeout`   | `UMBP_PEER_TIMEOUT`   | `--peer-timeout`     | `5s`             |
//! | `lease_timeout`  | `UMBP_LEASE_TIMEOUT`  | `--lease-timeout`    | `5s`             |
//! | `metadata`       | `UMBP_METADATA`       | `--metadata`         | `memory`         |
//! | `metadata_namespace` | `UMBP_METADATA_NAMESPACE` | `--metadata-namespace` | `umbp` |
//! | `secret_file`    | `UMBP_SECRET_FILE`    | `--secret-file`      | none (the deployment secret) |
//! | `max_connections` | `UMBP_MAX_CONNECTIONS` | `--max-connections` | `1024`          |
//! | `handshake_timeout` | `UMBP_HANDSHAKE_TIMEOUT` | `--handshake-timeout` | `5s`     |
//! | `same_host_idle_timeout` | `UMBP_SAME_HOST_IDLE_TIMEOUT` | `--same-host-idle-timeout` | `60s` |
//!
//! The pool settings (`dram_bytes` … `ssd_io`) apply to the standalone and peer roles;
//! `master`, `advertise` and `heartbeat_interval` to peers; `peer_timeout`, `lease_timeout`,
//! `metadata` and `metadata_namespace` to masters. A setting a role does not use is
//! accepted and ignored (one file can serve every role).
//!
//! `secret_file`, `max_connections` and `handshake_timeout` apply to every role (see
//! [`crate::auth`]): every connection to the daemon, and every connection it opens (to its
//! master, to peers), proves the deployment secret before a byte of gRPC is read. The secret
//! is read from `secret_file` (mode 0600, owned by the daemon's user), else from
//! `MORI_SECRET_FILE` / `MORI_SECRET`, else from the per-user default file (see
//! `mori_auth::Secret::deployment`). `max_connections` bounds the open connections
//! (authenticated or still authenticating; at the limit the daemon stops accepting until one
//! closes); a peer that has not authenticated within `handshake_timeout` is dropped.
//! `same_host_idle_timeout` (standalone and peer roles): a client's same-host connection
//! ([`crate::shm`]) that sends no request for this long is closed (the client connects again
//! at its next request).
//!
//! Besides these, `UMBP_CONFIG` (the file) and `UMBP_LOG` (the `tracing` filter) are
//! recognised. An unknown TOML key, an unknown `UMBP_*` variable or an invalid value is a
//! [`ConfigError`] that names it.
//!
//! Sizes are integers with an optional binary suffix `K`, `M`, `G` or `T` (case-insensitive,
//! optionally followed by `iB`, e.g. `64M`, `64MiB`, `1g`) or a plain `B`; in TOML they may
//! also be integers. Durations are integers with a suffix `ms`, `s` or `m` (a bare integer is
//! milliseconds). Booleans are `true`/`false` (`1`/`0`, `yes`/`no`, `on`/`off` in the
//! environment and on the command line).

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;

/// Environment variable naming the TOML file (like `--config`).
pub const ENV_CONFIG: &str = "UMBP_CONFIG";
/// Environment variable holding the `tracing` filter (default `info`).
pub const ENV_LOG: &str = "UMBP_LOG";

/// `umbpd --version`: the version and whether this is a debug or a release build (debug
/// builds are many times slower: benchmarks refuse them unless told otherwise).
pub const VERSION: &str = if cfg!(debug_assertions) {
    concat!(env!("CARGO_PKG_VERSION"), " (debug build)")
} else {
    concat!(env!("CARGO_PKG_VERSION"), " (release build)")
};

/// Command-line flags of `umbpd`. Setting values are kept as text here and parsed by
/// [`resolve`], so that every source is checked the same way.
#[derive(Parser, Debug, Default, Clone)]
#[command(
    name = "umbpd",
    version = VERSION,
    about = "The UMBP daemon: serves a tiered (DRAM + SSD) KV-block pool over gRPC",
    after_help = "Settings may also come from a TOML file (--config) and UMBP_* environment \
                  variables; flags win over the environment, which wins over the file."
)]
pub struct Cli {
    /// TOML configuration file (lowest precedence; also UMBP_CONFIG).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Print the resolved configuration and exit without serving.
    #[arg(long)]
    pub check_config: bool,
    /// Role: standalone (serves one local pool), master (the cluster index) or peer (holds
    /// bytes for a master).
    #[arg(long, value_name = "ROLE")]
    pub role: Option<String>,
    /// Address to listen on, host:port (an IP address or a host name such as localhost;
    /// port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Size of the DRAM tier (a multiple of --page-bytes), e.g. 4G.
    #[arg(long, value_name = "SIZE")]
    pub dram_bytes: Option<String>,
    /// Page size of the DRAM tier, e.g. 4K.
    #[arg(long, value_name = "SIZE")]
    pub page_bytes: Option<String>,
    /// Directory of the SSD segment log; without it the pool is DRAM only. Locked while the
    /// daemon runs: a second daemon (or pool) on it exits with status 2, naming the holder.
    #[arg(long, value_name = "DIR")]
    pub ssd_dir: Option<String>,
    /// Capacity of the SSD tier, e.g. 100G.
    #[arg(long, value_name = "SIZE")]
    pub ssd_bytes: Option<String>,
    /// Size of one SSD segment file (also the largest value the SSD tier takes).
    #[arg(long, value_name = "SIZE")]
    pub segment_bytes: Option<String>,
    /// Fraction of DRAM a put may fill before eviction runs, in (0, 1].
    #[arg(long, value_name = "FRACTION")]
    pub high_watermark: Option<String>,
    /// Fraction of DRAM eviction brings use down to, in (0, high].
    #[arg(long, value_name = "FRACTION")]
    pub low_watermark: Option<String>,
    /// fdatasync the SSD log after every write.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub sync_writes: Option<String>,
    /// SSD I/O backend: auto (io_uring where the kernel allows it, else pread/pwrite),
    /// uring (io_uring or fail) or pread.
    #[arg(long, value_name = "BACKEND")]
    pub ssd_io: Option<String>,
    /// Write the bound address (host:port) to this file once listening (a peer: once
    /// registered with its master too).
    #[arg(long, value_name = "PATH")]
    pub port_file: Option<String>,
    /// Peer: the master's address (host:port; the host may be a name, resolved when
    /// connecting).
    #[arg(long, value_name = "ADDR")]
    pub master: Option<String>,
    /// Peer: the address clients and the master use to reach it, host:port (default: the
    /// bound one).
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Peer: interval between heartbeats, e.g. 1s, 200ms.
    #[arg(long, value_name = "DURATION")]
    pub heartbeat_interval: Option<String>,
    /// Master: a peer without a heartbeat for this long is declared dead, e.g. 5s; also the
    /// deadline of each call to a peer on a get path (clients learn it from the master).
    #[arg(long, value_name = "DURATION")]
    pub peer_timeout: Option<String>,
    /// Master: how long a read lease protects a key from removal and eviction, e.g. 5s.
    #[arg(long, value_name = "DURATION")]
    pub lease_timeout: Option<String>,
    /// Master: `memory`, or a Redis URL (redis://host:port/) holding the key index.
    #[arg(long, value_name = "BACKEND")]
    pub metadata: Option<String>,
    /// Master: key prefix of the index in Redis.
    #[arg(long, value_name = "NAME")]
    pub metadata_namespace: Option<String>,
    /// File holding the deployment secret (mode 0600); default: MORI_SECRET_FILE,
    /// MORI_SECRET, else the per-user default secret.
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<String>,
    /// Most connections open at once (authenticated or authenticating).
    #[arg(long, value_name = "N")]
    pub max_connections: Option<String>,
    /// A connection that has not authenticated within this long is dropped, e.g. 5s.
    #[arg(long, value_name = "DURATION")]
    pub handshake_timeout: Option<String>,
    /// A same-host (shared-memory) connection without a request for this long is closed, e.g. 60s.
    #[arg(long, value_name = "DURATION")]
    pub same_host_idle_timeout: Option<String>,
}

/// The names of every setting, in printing order (TOML keys; see the module docs).
pub const SETTINGS: [&str; 23] = [
    "role",
    "listen",
    "dram_bytes",
    "page_bytes",
    "ssd_dir",
    "ssd_bytes",
    "segment_bytes",
    "high_watermark",
    "low_watermark",
    "sync_writes",
    "ssd_io",
    "port_file",
    "master",
    "advertise",
    "heartbeat_interval",
    "peer_timeout",
    "lease_timeout",
    "metadata",
    "metadata_namespace",
    "secret_file",
    "max_connections",
    "handshake_timeout",
    "same_host_idle_timeout",
];

/// Largest `max_connections` accepted (each connection is a file descriptor).
pub const MAX_CONNECTIONS_LIMIT: u64 = 1 << 20;

/// Upper bound of `lease_timeout` (a remove waits at most this long for leases).
const SHUTDOWN_BOUND: Duration = Duration::from_secs(60);

/// A Redis URL with any password replaced by `***`.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            match creds.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &creds[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// The environment variable of a setting (`UMBP_` + upper case name).
pub fn env_name(setting: &str) -> String {
    format!("UMBP_{}", setting.to_ascii_uppercase())
}

/// The command-line flag of a setting (`--` + name with dashes).
pub fn flag_name(setting: &str) -> String {
    format!("--{}", setting.replace('_', "-"))
}

/// What the daemon does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Serves one local pool (index and tiers in this process).
    Standalone,
    /// Keeps the key index of a cluster of peers and routes clients to them.
    Master,
    /// Holds the bytes for a master.
    Peer,
}

impl Role {
    /// The name used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Standalone => "standalone",
            Role::Master => "master",
            Role::Peer => "peer",
        }
    }
}

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// A TOML file.
    File(PathBuf),
    /// An environment variable (its name).
    Env(String),
    /// A command-line flag (its name).
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(n) => write!(f, "env {n}"),
            Source::Flag(n) => write!(f, "flag {n}"),
        }
    }
}

/// A resolved value and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// Its source.
    pub source: Source,
}

impl<T> Setting<T> {
    fn default(value: T) -> Setting<T> {
        Setting {
            value,
            source: Source::Default,
        }
    }
}

/// A configuration error; the daemon prints it and exits with code 2.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// The resolved configuration of the daemon.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `role`.
    pub role: Setting<Role>,
    /// `listen`.
    pub listen: Setting<SocketAddr>,
    /// `dram_bytes`.
    pub dram_bytes: Setting<u64>,
    /// `page_bytes`.
    pub page_bytes: Setting<u64>,
    /// `ssd_dir` (`None`: no SSD tier).
    pub ssd_dir: Setting<Option<PathBuf>>,
    /// `ssd_bytes`.
    pub ssd_bytes: Setting<u64>,
    /// `segment_bytes`.
    pub segment_bytes: Setting<u64>,
    /// `high_watermark`.
    pub high_watermark: Setting<f64>,
    /// `low_watermark`.
    pub low_watermark: Setting<f64>,
    /// `sync_writes`.
    pub sync_writes: Setting<bool>,
    /// `ssd_io`: the SSD tier's I/O backend (the one chosen is printed when the pool opens).
    pub ssd_io: Setting<mori_umbp::SsdIoMode>,
    /// `port_file`.
    pub port_file: Setting<Option<PathBuf>>,
    /// `master` (peer role).
    pub master: Setting<Option<String>>,
    /// `advertise` (peer role; `None`: the bound address).
    pub advertise: Setting<Option<SocketAddr>>,
    /// `heartbeat_interval` (peer role).
    pub heartbeat_interval: Setting<Duration>,
    /// `peer_timeout` (master role).
    pub peer_timeout: Setting<Duration>,
    /// `lease_timeout` (master role).
    pub lease_timeout: Setting<Duration>,
    /// `metadata` (master role): `memory` or a Redis URL.
    pub metadata: Setting<String>,
    /// `metadata_namespace` (master role).
    pub metadata_namespace: Setting<String>,
    /// `secret_file` (`None`: the deployment secret, `mori_auth::Secret::deployment`).
    pub secret_file: Setting<Option<PathBuf>>,
    /// `max_connections`.
    pub max_connections: Setting<u64>,
    /// `handshake_timeout`.
    pub handshake_timeout: Setting<Duration>,
    /// `same_host_idle_timeout` (standalone and peer roles).
    pub same_host_idle_timeout: Setting<Duration>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            role: Setting::default(Role::Standalone),
            listen: Setting::default(SocketAddr::from(([127, 0, 0, 1], 0))),
            dram_bytes: Setting::default(1 << 30),
            page_bytes: Setting::default(4 << 10),
            ssd_dir: Setting::default(None),
            ssd_bytes: Setting::default(64 << 30),
            segment_bytes: Setting::default(256 << 20),
            high_watermark: Setting::default(0.9),
            low_watermark: Setting::default(0.7),
            sync_writes: Setting::default(false),
            ssd_io: Setting::default(mori_umbp::SsdIoMode::Pread),
            port_file: Setting::default(None),
            master: Setting::default(None),
            advertise: Setting::default(None),
            heartbeat_interval: Setting::default(Duration::from_secs(1)),
            peer_timeout: Setting::default(Duration::from_secs(5)),
            lease_timeout: Setting::default(Duration::from_secs(5)),
            metadata: Setting::default("memory".to_string()),
            metadata_namespace: Setting::default("umbp".to_string()),
            secret_file: Setting::default(None),
            max_connections: Setting::default(1024),
            handshake_timeout: Setting::default(Duration::from_secs(5)),
            same_host_idle_timeout: Setting::default(Duration::from_secs(60)),
        }
    }
}

/// A raw value before parsing: text (environment, flags) or a TOML value.
enum Raw<'a> {
    Text(&'a str),
    Toml(&'a toml::Value),
}

impl Raw<'_> {
    fn text(&self) -> Result<&str, String> {
        match self {
            Raw::Text(s) => Ok(s),
            Raw::Toml(toml::Value::String(s)) => Ok(s),
            Raw::Toml(v) => Err(format!("expected a string, found {}", v.type_str())),
        }
    }

    fn size(&self) -> Result<u64, String> {
        match self {
            Raw::Toml(toml::Value::Integer(i)) => {
                u64::try_from(*i).map_err(|_| format!("size {i} is negative"))
            }
            Raw::Toml(toml::Value::String(_)) | Raw::Text(_) => parse_size(self.text()?),
            Raw::Toml(v) => Err(format!(
                "expected a size (integer or string), found {}",
                v.type_str()
            )),
        }
    }

    fn fraction(&self) -> Result<f64, String> {
        let f = match self {
            Raw::Toml(toml::Value::Float(f)) => *f,
            Raw::Toml(toml::Value::Integer(i)) => *i as f64,
            Raw::Toml(toml::Value::String(_)) | Raw::Text(_) => {
                let s = self.text()?;
                s.trim()
                    .parse::<f64>()
                    .map_err(|_| format!("`{s}` is not a number"))?
            }
            Raw::Toml(v) => return Err(format!("expected a number, found {}", v.type_str())),
        };
        if f.is_finite() && f > 0.0 && f <= 1.0 {
            Ok(f)
        } else {
            Err(format!("{f} is not in (0, 1]"))
        }
    }

    fn duration(&self) -> Result<Duration, String> {
        let d = match self {
            Raw::Toml(toml::Value::Integer(i)) => Duration::from_millis(
                u64::try_from(*i).map_err(|_| format!("duration {i} is negative"))?,
            ),
            Raw::Toml(toml::Value::String(_)) | Raw::Text(_) => parse_duration(self.text()?)?,
            Raw::Toml(v) => {
                return Err(format!(
                    "expected a duration (e.g. \"500ms\", \"2s\"), found {}",
                    v.type_str()
                ));
            }
        };
        if d.is_zero() {
            return Err("a duration must be positive".to_string());
        }
        Ok(d)
    }

    fn boolean(&self) -> Result<bool, String> {
        match self {
            Raw::Toml(toml::Value::Boolean(b)) => Ok(*b),
            Raw::Text(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(true),
                "false" | "0" | "no" | "off" => Ok(false),
                _ => Err(format!("`{s}` is not a boolean (true/false)")),
            },
            Raw::Toml(v) => Err(format!("expected a boolean, found {}", v.type_str())),
        }
    }

    /// A plain non-negative integer.
    fn count(&self) -> Result<u64, String> {
        match self {
            Raw::Toml(toml::Value::Integer(i)) => {
                u64::try_from(*i).map_err(|_| format!("{i} is negative"))
            }
            Raw::Toml(toml::Value::String(_)) | Raw::Text(_) => {
                let s = self.text()?;
                s.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("`{s}` is not a non-negative integer"))
            }
            Raw::Toml(v) => Err(format!("expected an integer, found {}", v.type_str())),
        }
    }

    /// A path; empty text means "none".
    fn opt_path(&self) -> Result<Option<PathBuf>, String> {
        let s = self.text()?;
        Ok((!s.is_empty()).then(|| PathBuf::from(s)))
    }
}

/// Parses a size: digits with an optional binary suffix (K, M, G, T, optionally followed by
/// `iB`; or `B`), case-insensitive, e.g. `4096`, `4K`, `64MiB`, `1g`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "`{s}` is not a size (expected e.g. 4096, 64M, 1GiB)"
        ));
    }
    let n: u64 = digits.parse().map_err(|_| format!("`{s}` is too large"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        "t" | "tib" => 40,
        _ => {
            return Err(format!(
                "`{s}` has an unknown size suffix `{suffix}` (use K, M, G or T, optionally \
                 followed by iB)"
            ));
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Splits `host:port` (`[v6]:port` too) and checks that the host is present and the port a
/// number.
fn split_host_port(s: &str) -> Result<(&str, u16), String> {
    let expected = "expected host:port, e.g. 127.0.0.1:7000 or localhost:7000";
    let (host, port) = s
        .trim()
        .rsplit_once(':')
        .ok_or_else(|| format!("`{s}` has no port ({expected})"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("`{s}` has no host ({expected})"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("`{s}`: `{port}` is not a port number (0..65535)"))?;
    Ok((host, port))
}

/// Checks a daemon address as the client takes it: `host:port` (the host an IP address or a
/// name, resolved when connecting), optionally as an `http://` or `https://` URI.
pub fn check_host_port(s: &str) -> Result<(), String> {
    let t = s.trim();
    let t = t
        .strip_prefix("http://")
        .or_else(|| t.strip_prefix("https://"))
        .unwrap_or(t);
    split_host_port(t.strip_suffix('/').unwrap_or(t)).map(|_| ())
}

/// Resolves `host:port` to one socket address: an IP address as given (`127.0.0.1:7000`,
/// `[::1]:7000`), or a host name (`localhost:7000`) to the first IPv4 address it resolves to,
/// else its first address.
pub fn resolve_addr(s: &str) -> Result<SocketAddr, String> {
    let t = s.trim();
    if let Ok(addr) = t.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let (host, port) = split_host_port(t)?;
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve the host `{host}` of `{s}`: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("the host `{host}` of `{s}` resolves to no address"))
}

/// Parses a duration: digits with a suffix `ms`, `s` or `m` (a bare integer is
/// milliseconds), e.g. `500ms`, `2s`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (expected e.g. 500ms, 2s, 1m)"))?;
    let ms = match suffix.to_ascii_lowercase().as_str() {
        "" | "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        _ => {
            return Err(format!(
                "`{s}` has an unknown duration unit `{suffix}` (use ms, s or m)"
            ));
        }
    };
    ms.map(Duration::from_millis)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Renders a duration as milliseconds.
pub fn format_duration(d: Duration) -> String {
    format!("{}ms", d.as_millis())
}

/// Renders a size in bytes with a binary unit when it is a whole number of one.
pub fn format_size(n: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n.is_multiple_of(1 << shift) {
            return format!("{n} ({} {unit})", n >> shift);
        }
    }
    n.to_string()
}

impl Config {
    /// Parses `raw` as the value of setting `name` and stores it with `source`. Returns
    /// `Ok(false)` for an unknown name; `Err` holds the reason a value is invalid.
    fn apply(&mut self, name: &str, raw: Raw<'_>, source: Source) -> Result<bool, String> {
        fn set<T>(slot: &mut Setting<T>, value: T, source: Source) {
            *slot = Setting { value, source };
        }
        match name {
            "role" => {
                let role = match raw.text()?.trim() {
                    "standalone" => Role::Standalone,
                    "master" => Role::Master,
                    "peer" => Role::Peer,
                    other => {
                        return Err(format!(
                            "unknown role `{other}` (expected standalone, master or peer)"
                        ));
                    }
                };
                set(&mut self.role, role, source);
            }
            "listen" => set(&mut self.listen, resolve_addr(raw.text()?)?, source),
            "dram_bytes" => set(&mut self.dram_bytes, raw.size()?, source),
            "page_bytes" => set(&mut self.page_bytes, raw.size()?, source),
            "ssd_dir" => set(&mut self.ssd_dir, raw.opt_path()?, source),
            "ssd_bytes" => set(&mut self.ssd_bytes, raw.size()?, source),
            "segment_bytes" => set(&mut self.segment_bytes, raw.size()?, source),
            "high_watermark" => set(&mut self.high_watermark, raw.fraction()?, source),
            "low_watermark" => set(&mut self.low_watermark, raw.fraction()?, source),
            "sync_writes" => set(&mut self.sync_writes, raw.boolean()?, source),
            "ssd_io" => {
                let s = raw.text()?;
                let mode = match s.trim() {
                    "auto" => mori_umbp::SsdIoMode::Auto,
                    "uring" => mori_umbp::SsdIoMode::Uring,
                    "pread" => mori_umbp::SsdIoMode::Pread,
                    _ => {
                        return Err(format!(
                            "unknown SSD I/O backend `{s}` (expected auto, uring or pread)"
                        ));
                    }
                };
                set(&mut self.ssd_io, mode, source);
            }
            "port_file" => set(&mut self.port_file, raw.opt_path()?, source),
            "master" => {
                let s = raw.text()?.trim().to_string();
                if !s.is_empty() {
                    check_host_port(&s)?;
                }
                set(&mut self.master, (!s.is_empty()).then_some(s), source);
            }
            "advertise" => {
                let s = raw.text()?;
                let addr = if s.trim().is_empty() {
                    None
                } else {
                    Some(resolve_addr(s)?)
                };
                set(&mut self.advertise, addr, source);
            }
            "heartbeat_interval" => set(&mut self.heartbeat_interval, raw.duration()?, source),
            "peer_timeout" => set(&mut self.peer_timeout, raw.duration()?, source),
            "lease_timeout" => set(&mut self.lease_timeout, raw.duration()?, source),
            "metadata" => {
                let s = raw.text()?.trim().to_string();
                if s != "memory" && !s.starts_with("redis://") && !s.starts_with("rediss://") {
                    return Err(format!(
                        "`{s}` is not a metadata backend (expected memory or redis://host:port/)"
                    ));
                }
                set(&mut self.metadata, s, source);
            }
            "metadata_namespace" => {
                let s = raw.text()?.trim().to_string();
                if s.is_empty() {
                    return Err("the namespace must not be empty".to_string());
                }
                set(&mut self.metadata_namespace, s, source);
            }
            "secret_file" => set(&mut self.secret_file, raw.opt_path()?, source),
            "max_connections" => {
                let n = raw.count()?;
                if n == 0 || n > MAX_CONNECTIONS_LIMIT {
                    return Err(format!("{n} is not in 1..={MAX_CONNECTIONS_LIMIT}"));
                }
                set(&mut self.max_connections, n, source);
            }
            "handshake_timeout" => set(&mut self.handshake_timeout, raw.duration()?, source),
            "same_host_idle_timeout" => {
                set(&mut self.same_host_idle_timeout, raw.duration()?, source);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the relations between settings.
    fn validate(&self) -> Result<(), ConfigError> {
        let err = |msg: String| Err(ConfigError(msg));
        let (dram, page) = (&self.dram_bytes, &self.page_bytes);
        if page.value == 0 {
            return err(format!("page_bytes ({}) must be positive", page.source));
        }
        if dram.value == 0 || !dram.value.is_multiple_of(page.value) {
            return err(format!(
                "dram_bytes {} ({}) must be a positive multiple of page_bytes {} ({})",
                dram.value, dram.source, page.value, page.source
            ));
        }
        if usize::try_from(dram.value).is_err() {
            return err(format!("dram_bytes {} does not fit in memory", dram.value));
        }
        let (hi, lo) = (&self.high_watermark, &self.low_watermark);
        if lo.value > hi.value {
            return err(format!(
                "low_watermark {} ({}) must not exceed high_watermark {} ({})",
                lo.value, lo.source, hi.value, hi.source
            ));
        }
        if self.role.value == Role::Peer {
            if self.master.value.is_none() {
                return err(format!(
                    "the peer role needs the master's address: set master (UMBP_MASTER, --master) \
                     (role from {})",
                    self.role.source
                ));
            }
            let adv = self.advertise.value.unwrap_or(self.listen.value);
            if adv.ip().is_unspecified() && self.advertise.value.is_some() {
                return err(format!(
                    "advertise {} ({}) must be an address others can reach, not a wildcard",
                    adv, self.advertise.source
                ));
            }
            if adv.ip().is_unspecified() {
                return err(format!(
                    "listen {} ({}) is a wildcard: a peer needs advertise (UMBP_ADVERTISE, \
                     --advertise) naming the address others reach it at",
                    self.listen.value, self.listen.source
                ));
            }
        }
        if self.role.value == Role::Master && self.lease_timeout.value >= SHUTDOWN_BOUND {
            return err(format!(
                "lease_timeout {} ({}) must be below {}s",
                format_duration(self.lease_timeout.value),
                self.lease_timeout.source,
                SHUTDOWN_BOUND.as_secs()
            ));
        }
        if self.ssd_dir.value.is_some() {
            let (seg, cap) = (&self.segment_bytes, &self.ssd_bytes);
            if seg.value < 4096 {
                return err(format!(
                    "segment_bytes {} ({}) must be at least 4K",
                    seg.value, seg.source
                ));
            }
            if seg.value > cap.value {
                return err(format!(
                    "segment_bytes {} ({}) must not exceed ssd_bytes {} ({})",
                    seg.value, seg.source, cap.value, cap.source
                ));
            }
        }
        Ok(())
    }

    /// The value of a setting as printed, and its source.
    pub fn describe(&self, name: &str) -> Option<(String, &Source)> {
        fn path(p: &Option<PathBuf>) -> String {
            p.as_ref()
                .map_or_else(|| "none".to_string(), |p| p.display().to_string())
        }
        Some(match name {
            "role" => (self.role.value.as_str().to_string(), &self.role.source),
            "listen" => (self.listen.value.to_string(), &self.listen.source),
            "dram_bytes" => (format_size(self.dram_bytes.value), &self.dram_bytes.source),
            "page_bytes" => (format_size(self.page_bytes.value), &self.page_bytes.source),
            "ssd_dir" => (path(&self.ssd_dir.value), &self.ssd_dir.source),
            "ssd_bytes" => (format_size(self.ssd_bytes.value), &self.ssd_bytes.source),
            "segment_bytes" => (
                format_size(self.segment_bytes.value),
                &self.segment_bytes.source,
            ),
            "high_watermark" => (
                self.high_watermark.value.to_string(),
                &self.high_watermark.source,
            ),
            "low_watermark" => (
                self.low_watermark.value.to_string(),
                &self.low_watermark.source,
            ),
            "sync_writes" => (self.sync_writes.value.to_string(), &self.sync_writes.source),
            "ssd_io" => (self.ssd_io.value.to_string(), &self.ssd_io.source),
            "port_file" => (path(&self.port_file.value), &self.port_file.source),
            "master" => (
                self.master.value.clone().unwrap_or_else(|| "none".into()),
                &self.master.source,
            ),
            "advertise" => (
                self.advertise
                    .value
                    .map_or_else(|| "the bound address".into(), |a| a.to_string()),
                &self.advertise.source,
            ),
            "heartbeat_interval" => (
                format_duration(self.heartbeat_interval.value),
                &self.heartbeat_interval.source,
            ),
            "peer_timeout" => (
                format_duration(self.peer_timeout.value),
                &self.peer_timeout.source,
            ),
            "lease_timeout" => (
                format_duration(self.lease_timeout.value),
                &self.lease_timeout.source,
            ),
            "metadata" => (redact(&self.metadata.value), &self.metadata.source),
            "metadata_namespace" => (
                self.metadata_namespace.value.clone(),
                &self.metadata_namespace.source,
            ),
            "secret_file" => (
                self.secret_file.value.as_ref().map_or_else(
                    || "none (the deployment secret)".to_string(),
                    |p| p.display().to_string(),
                ),
                &self.secret_file.source,
            ),
            "max_connections" => (
                self.max_connections.value.to_string(),
                &self.max_connections.source,
            ),
            "handshake_timeout" => (
                format_duration(self.handshake_timeout.value),
                &self.handshake_timeout.source,
            ),
            "same_host_idle_timeout" => (
                format_duration(self.same_host_idle_timeout.value),
                &self.same_host_idle_timeout.source,
            ),
            _ => return None,
        })
    }

    /// One line per setting: `name = value (source)`.
    pub fn report_lines(&self) -> Vec<String> {
        let width = SETTINGS.iter().map(|name| name.len()).max().unwrap_or(0);
        SETTINGS
            .iter()
            .filter_map(|name| {
                self.describe(name)
                    .map(|(v, src)| format!("{name:<width$} = {v} ({src})"))
            })
            .collect()
    }

    /// The pool configuration these settings describe.
    pub fn pool_config(&self) -> mori_umbp::PoolConfig {
        let ssd = self.ssd_dir.value.as_ref().map(|dir| mori_umbp::SsdConfig {
            dir: dir.clone(),
            segment_bytes: self.segment_bytes.value,
            capacity_bytes: self.ssd_bytes.value,
            sync_writes: self.sync_writes.value,
            io: self.ssd_io.value,
        });
        mori_umbp::PoolConfig {
            // validate() checked that it fits.
            dram_bytes: usize::try_from(self.dram_bytes.value).unwrap_or(usize::MAX),
            page_bytes: usize::try_from(self.page_bytes.value).unwrap_or(usize::MAX),
            ssd,
            // The GPU tier is embedded-only (docs/umbp.md).
            gpu: None,
            high_watermark: self.high_watermark.value,
            low_watermark: self.low_watermark.value,
        }
    }
}

/// Resolves the configuration from the flags, the `UMBP_*` environment variables in `env`
/// (name, value pairs; other names are ignored) and the TOML file they name.
pub fn resolve(cli: &Cli, env: &[(String, String)]) -> Result<Config, ConfigError> {
    let mut cfg = Config::default();

    // Check every UMBP_* name first, so a misspelt variable is reported even when the
    // file fails.
    let mut env_settings = Vec::new();
    let mut env_file = None;
    for (name, value) in env {
        if !name.starts_with("UMBP_") {
            continue;
        }
        if name == ENV_LOG {
            continue;
        }
        if name == ENV_CONFIG {
            env_file = Some(PathBuf::from(value));
            continue;
        }
        match SETTINGS.iter().find(|s| env_name(s) == *name) {
            Some(setting) => env_settings.push((*setting, name, value)),
            None => {
                let known: Vec<String> = SETTINGS.iter().map(|s| env_name(s)).collect();
                return Err(ConfigError(format!(
                    "unknown environment variable {name} (known: {}, {ENV_CONFIG}, {ENV_LOG})",
                    known.join(", ")
                )));
            }
        }
    }

    if let Some(path) = cli.config.clone().or(env_file) {
        apply_file(&mut cfg, &path)?;
    }
    for (setting, name, value) in env_settings {
        cfg.apply(setting, Raw::Text(value), Source::Env(name.clone()))
            .map_err(|why| ConfigError(format!("invalid value for {name}: {why}")))?;
    }
    let flags: [(&str, &Option<String>); 23] = [
        ("role", &cli.role),
        ("listen", &cli.listen),
        ("dram_bytes", &cli.dram_bytes),
        ("page_bytes", &cli.page_bytes),
        ("ssd_dir", &cli.ssd_dir),
        ("ssd_bytes", &cli.ssd_bytes),
        ("segment_bytes", &cli.segment_bytes),
        ("high_watermark", &cli.high_watermark),
        ("low_watermark", &cli.low_watermark),
        ("sync_writes", &cli.sync_writes),
        ("ssd_io", &cli.ssd_io),
        ("port_file", &cli.port_file),
        ("master", &cli.master),
        ("advertise", &cli.advertise),
        ("heartbeat_interval", &cli.heartbeat_interval),
        ("peer_timeout", &cli.peer_timeout),
        ("lease_timeout", &cli.lease_timeout),
        ("metadata", &cli.metadata),
        ("metadata_namespace", &cli.metadata_namespace),
        ("secret_file", &cli.secret_file),
        ("max_connections", &cli.max_connections),
        ("handshake_timeout", &cli.handshake_timeout),
        ("same_host_idle_timeout", &cli.same_host_idle_timeout),
    ];
    for (setting, value) in flags {
        if let Some(v) = value {
            let flag = flag_name(setting);
            cfg.apply(setting, Raw::Text(v), Source::Flag(flag.clone()))
                .map_err(|why| ConfigError(format!("invalid value for {flag}: {why}")))?;
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

fn apply_file(cfg: &mut Config, path: &Path) -> Result<(), ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("cannot read config file {}: {e}", path.display())))?;
    let table: toml::Table = text.parse().map_err(|e| {
        ConfigError(format!(
            "config file {} is not valid TOML: {e}",
            path.display()
        ))
    })?;
    for (key, value) in &table {
        let known = cfg
            .apply(key, Raw::Toml(value), Source::File(path.to_path_buf()))
            .map_err(|why| {
                ConfigError(format!(
                    "invalid value for key `{key}` in config file {}: {why}",
                    path.display()
                ))
            })?;
        if !known {
            return Err(ConfigError(format!(
                "unknown key `{key}` in config file {} (known keys: {})",
                path.display(),
                SETTINGS.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4kib"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size(" 1G "), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("12B"), Ok(12));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("4KB").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(format_size(64 << 20), "67108864 (64 MiB)");
        assert_eq!(format_size(1000), "1000");
    }

    #[test]
    fn host_names_and_addresses() {
        let localhost = |a: SocketAddr| a.ip().is_loopback();
        assert_eq!(
            resolve_addr("127.0.0.1:7070"),
            Ok(SocketAddr::from(([127, 0, 0, 1], 7070)))
        );
        assert_eq!(resolve_addr("[::1]:7"), Ok("[::1]:7".parse().unwrap()));
        let a = resolve_addr(" localhost:7070 ").unwrap();
        assert!(localhost(a) && a.port() == 7070, "{a}");
        for bad in [
            "localhost",
            ":7070",
            "localhost:http",
            "localhost:70000",
            "[]:1",
        ] {
            let e = resolve_addr(bad).unwrap_err();
            assert!(e.contains(bad.trim()), "{bad}: {e}");
        }
        let e = resolve_addr("no-such-host.invalid:7070").unwrap_err();
        assert!(
            e.contains("cannot resolve") && e.contains("no-such-host.invalid"),
            "{e}"
        );

        // Flags and the environment: --listen takes a name; --master takes a name (resolved
        // when connecting) or a URI; --advertise takes a name.
        let cli = Cli {
            listen: Some("localhost:0".into()),
            role: Some("peer".into()),
            master: Some("localhost:7070".into()),
            advertise: Some("localhost:7071".into()),
            ..Cli::default()
        };
        let cfg = resolve(&cli, &[]).unwrap();
        assert!(localhost(cfg.listen.value) && cfg.listen.value.port() == 0);
        assert_eq!(cfg.master.value.as_deref(), Some("localhost:7070"));
        assert!(
            cfg.advertise
                .value
                .is_some_and(|a| localhost(a) && a.port() == 7071)
        );
        let cfg = resolve(
            &Cli::default(),
            &env(&[
                ("UMBP_LISTEN", "localhost:7070"),
                ("UMBP_MASTER", "http://h:1/"),
            ]),
        )
        .unwrap();
        assert!(localhost(cfg.listen.value) && cfg.listen.value.port() == 7070);
        assert_eq!(cfg.master.value.as_deref(), Some("http://h:1/"));
        let cli = Cli {
            master: Some("localhost".into()),
            ..Cli::default()
        };
        let e = resolve(&cli, &[]).unwrap_err().0;
        assert!(e.contains("--master") && e.contains("no port"), "{e}");
    }

    #[test]
    fn defaults_and_precedence() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("u.toml");
        std::fs::write(
            &file,
            "dram_bytes = \"8M\"\npage_bytes = 8192\nhigh_watermark = 0.8\nsync_writes = true\n",
        )
        .unwrap();
        let cli = Cli {
            config: Some(file.clone()),
            dram_bytes: Some("2M".into()),
            ..Cli::default()
        };
        let cfg = resolve(
            &cli,
            &env(&[
                ("UMBP_DRAM_BYTES", "4M"),
                ("UMBP_PAGE_BYTES", "16K"),
                ("UMBP_LOG", "debug"),
                ("PATH", "/bin"),
            ]),
        )
        .unwrap();
        assert_eq!(cfg.dram_bytes.value, 2 << 20);
        assert_eq!(cfg.dram_bytes.source, Source::Flag("--dram-bytes".into()));
        assert_eq!(cfg.page_bytes.value, 16 << 10);
        assert_eq!(cfg.page_bytes.source, Source::Env("UMBP_PAGE_BYTES".into()));
        assert_eq!(cfg.high_watermark.value, 0.8);
        assert_eq!(cfg.high_watermark.source, Source::File(file));
        assert!(cfg.sync_writes.value);
        assert_eq!(cfg.low_watermark, Setting::default(0.7));
        assert_eq!(cfg.role.value, Role::Standalone);
        assert_eq!(cfg.report_lines().len(), SETTINGS.len());
        assert!(cfg.pool_config().ssd.is_none());
    }

    #[test]
    fn ssd_io_setting() {
        use mori_umbp::SsdIoMode;
        let dir = tempfile::tempdir().unwrap();
        let ssd = dir.path().to_str().unwrap();
        let cfg = resolve(&Cli::default(), &env(&[("UMBP_SSD_DIR", ssd)])).unwrap();
        assert_eq!(cfg.ssd_io, Setting::default(SsdIoMode::Pread));
        assert_eq!(cfg.pool_config().ssd.unwrap().io, SsdIoMode::Pread);
        let cfg = resolve(
            &Cli::default(),
            &env(&[("UMBP_SSD_DIR", ssd), ("UMBP_SSD_IO", "auto")]),
        )
        .unwrap();
        assert_eq!(cfg.ssd_io.value, SsdIoMode::Auto);
        assert_eq!(cfg.ssd_io.source, Source::Env("UMBP_SSD_IO".into()));
        assert_eq!(cfg.pool_config().ssd.unwrap().io, SsdIoMode::Auto);
        assert!(
            cfg.report_lines()
                .iter()
                .any(|l| l.starts_with("ssd_io") && l.contains("= auto (env UMBP_SSD_IO)")),
            "{:?}",
            cfg.report_lines()
        );
        let cli = Cli {
            ssd_io: Some("uring".into()),
            ..Cli::default()
        };
        let cfg = resolve(&cli, &env(&[("UMBP_SSD_IO", "pread")])).unwrap();
        assert_eq!(cfg.ssd_io.value, SsdIoMode::Uring);
        assert_eq!(cfg.ssd_io.source, Source::Flag("--ssd-io".into()));
        let file = dir.path().join("u.toml");
        std::fs::write(&file, "ssd_io = \"auto\"\n").unwrap();
        let cli = Cli {
            config: Some(file.clone()),
            ..Cli::default()
        };
        assert_eq!(resolve(&cli, &[]).unwrap().ssd_io.value, SsdIoMode::Auto);
        // Unknown values name the setting and list the accepted ones.
        let e = resolve(&Cli::default(), &env(&[("UMBP_SSD_IO", "aio")]))
            .unwrap_err()
            .0;
        assert!(e.contains("UMBP_SSD_IO") && e.contains("aio"), "{e}");
        assert!(e.contains("auto, uring or pread"), "{e}");
        let cli = Cli {
            ssd_io: Some("libaio".into()),
            ..Cli::default()
        };
        let e = resolve(&cli, &[]).unwrap_err().0;
        assert!(e.contains("--ssd-io") && e.contains("libaio"), "{e}");
        std::fs::write(&file, "ssd_io = \"spdk\"\n").unwrap();
        let cli = Cli {
            config: Some(file),
            ..Cli::default()
        };
        let e = resolve(&cli, &[]).unwrap_err().0;
        assert!(e.contains("`ssd_io`") && e.contains("spdk"), "{e}");
    }

    #[test]
    fn errors_name_the_culprit() {
        let bad = |cli: Cli, e: &[(&str, &str)]| resolve(&cli, &env(e)).unwrap_err().0;
        assert!(bad(Cli::default(), &[("UMBP_DRAM_BYTE", "1G")]).contains("UMBP_DRAM_BYTE"));
        assert!(bad(Cli::default(), &[("UMBP_DRAM_BYTES", "1Q")]).contains("UMBP_DRAM_BYTES"));
        let cli = Cli {
            high_watermark: Some("1.5".into()),
            ..Cli::default()
        };
        assert!(bad(cli, &[]).contains("--high-watermark"));
        let cli = Cli {
            low_watermark: Some("0.95".into()),
            ..Cli::default()
        };
        assert!(bad(cli, &[]).contains("low_watermark"));
        let cli = Cli {
            dram_bytes: Some("10000".into()),
            ..Cli::default()
        };
        assert!(bad(cli, &[]).contains("multiple of page_bytes"));
        let cli = Cli {
            role: Some("boss".into()),
            ..Cli::default()
        };
        assert!(bad(cli, &[]).contains("boss"));

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("u.toml");
        std::fs::write(&file, "dram_bites = 5\n").unwrap();
        let cli = Cli {
            config: Some(file.clone()),
            ..Cli::default()
        };
        assert!(bad(cli.clone(), &[]).contains("`dram_bites`"));
        std::fs::write(&file, "sync_writes = \"yes\"\n").unwrap();
        assert!(bad(cli.clone(), &[]).contains("`sync_writes`"));
        std::fs::write(&file, "listen = [1]\n").unwrap();
        assert!(bad(cli, &[]).contains("`listen`"));
        let missing = Cli {
            config: Some(dir.path().join("nope.toml")),
            ..Cli::default()
        };
        assert!(bad(missing, &[]).contains("nope.toml"));
    }
}
