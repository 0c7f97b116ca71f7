//! Choosing the address the root listens on (and that the unique id advertises).

use std::env;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;
use tracing::{debug, warn};

use crate::error::{Error, Result};

/// Env var: IP address, or `IP:port`, for the root to listen on. Wins over everything else.
pub const ENV_BOOTSTRAP_ADDR: &str = "MORI_BOOTSTRAP_ADDR";
/// Env var: network interface whose first IPv4 address the root listens on.
pub const ENV_SOCKET_IFNAME: &str = "MORI_SOCKET_IFNAME";

/// Interfaces never picked automatically: loopback is unreachable from other hosts, and
/// container bridges usually are too.
fn auto_candidate(name: &str, flags: InterfaceFlags) -> bool {
    flags.contains(InterfaceFlags::IFF_UP)
        && !flags.contains(InterfaceFlags::IFF_LOOPBACK)
        && !name.starts_with("docker")
}

/// Looks up an environment variable (a parameter so tests need not touch the process env).
type Lookup<'a> = &'a dyn Fn(&str) -> std::result::Result<String, env::VarError>;

/// Reads an env var; unset or empty means `None`.
fn env_var(lookup: Lookup<'_>, name: &str) -> Result<Option<String>> {
    match lookup(name) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_string())),
        Err(env::VarError::NotPresent) => Ok(None),
        Err(env::VarError::NotUnicode(_)) => {
            Err(Error::InvalidArgument(format!("{name} is not valid UTF-8")))
        }
    }
}

/// Rejects addresses a remote rank cannot be told to connect to.
pub(crate) fn check_listen_ip(ip: IpAddr, origin: &str) -> Result<()> {
    if ip.is_unspecified() || ip.is_multicast() {
        return Err(Error::InvalidArgument(format!(
            "{origin}: {ip} cannot be advertised to other ranks; give one of this host's addresses"
        )));
    }
    Ok(())
}

/// The listen address, from (in order) `MORI_BOOTSTRAP_ADDR`, `MORI_SOCKET_IFNAME`, the first
/// up non-loopback IPv4 interface, or 127.0.0.1. Port 0 lets the OS choose.
pub(crate) fn listen_addr_from_env() -> Result<SocketAddr> {
    listen_addr(&|name| env::var(name))
}

fn listen_addr(lookup: Lookup<'_>) -> Result<SocketAddr> {
    if let Some(v) = env_var(lookup, ENV_BOOTSTRAP_ADDR)? {
        let addr = v
            .parse::<SocketAddr>()
            .or_else(|_| v.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 0)))
            .map_err(|_| {
                Error::InvalidArgument(format!(
                    "{ENV_BOOTSTRAP_ADDR}={v:?} is neither an IP address nor IP:port"
                ))
            })?;
        check_listen_ip(addr.ip(), ENV_BOOTSTRAP_ADDR)?;
        return Ok(addr);
    }
    if let Some(name) = env_var(lookup, ENV_SOCKET_IFNAME)? {
        return interface_ipv4(&name).map(|ip| SocketAddr::new(IpAddr::V4(ip), 0));
    }
    match first_auto_ipv4() {
        Ok(Some(ip)) => return Ok(SocketAddr::new(IpAddr::V4(ip), 0)),
        Ok(None) => debug!("no usable IPv4 interface; bootstrap root uses 127.0.0.1"),
        Err(e) => warn!("listing network interfaces failed ({e}); bootstrap root uses 127.0.0.1"),
    }
    Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
}

fn ipv4_of(addr: &nix::ifaddrs::InterfaceAddress) -> Option<Ipv4Addr> {
    addr.address.as_ref()?.as_sockaddr_in().map(|sin| sin.ip())
}

fn first_auto_ipv4() -> nix::Result<Option<Ipv4Addr>> {
    Ok(getifaddrs()?
        .filter(|a| auto_candidate(&a.interface_name, a.flags))
        .find_map(|a| ipv4_of(&a)))
}

/// First IPv4 address of interface `name`; the error lists the interfaces that have one.
fn interface_ipv4(name: &str) -> Result<Ipv4Addr> {
    let addrs: Vec<_> = getifaddrs()
        .map_err(|e| Error::io("listing network interfaces", e.into()))?
        .collect();
    if let Some(ip) = addrs
        .iter()
        .filter(|a| a.interface_name == name)
        .find_map(ipv4_of)
    {
        return Ok(ip);
    }
    let mut available: Vec<String> = addrs
        .iter()
        .filter_map(|a| ipv4_of(a).map(|ip| format!("{} ({ip})", a.interface_name)))
        .collect();
    available.dedup();
    Err(Error::InvalidArgument(format!(
        "{ENV_SOCKET_IFNAME}={name:?} names no interface with an IPv4 address; \
         interfaces with one: {}",
        available.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<SocketAddr> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        listen_addr(&move |name| {
            vars.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .ok_or(env::VarError::NotPresent)
        })
    }

    #[test]
    fn explicit_address_wins() {
        let a = with(&[
            (ENV_BOOTSTRAP_ADDR, "127.0.0.1"),
            (ENV_SOCKET_IFNAME, "nope0"),
        ]);
        assert_eq!(a.unwrap(), "127.0.0.1:0".parse().unwrap());
        assert_eq!(
            with(&[(ENV_BOOTSTRAP_ADDR, "127.0.0.1:5555")])
                .unwrap()
                .port(),
            5555
        );
        assert_eq!(
            with(&[(ENV_BOOTSTRAP_ADDR, "[::1]:7")]).unwrap(),
            "[::1]:7".parse().unwrap()
        );
    }

    #[test]
    fn bad_values_are_rejected() {
        for v in ["not-an-ip", "0.0.0.0", "::", "224.0.0.1"] {
            let r = with(&[(ENV_BOOTSTRAP_ADDR, v)]);
            assert!(matches!(r, Err(Error::InvalidArgument(_))), "{v}: {r:?}");
        }
        let r = with(&[(ENV_SOCKET_IFNAME, "no-such-if0")]);
        match r {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("no-such-if0"), "{msg}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn interface_and_default() {
        assert_eq!(
            with(&[(ENV_SOCKET_IFNAME, "lo")]).unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        let a = with(&[]).unwrap();
        assert!(a.is_ipv4() && a.port() == 0, "{a}");
        // Empty values count as unset.
        assert_eq!(with(&[(ENV_BOOTSTRAP_ADDR, " ")]).unwrap(), a);
    }
}
