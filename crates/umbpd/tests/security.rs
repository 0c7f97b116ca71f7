//! Authentication and scoping of the real `umbpd` binary: every port proves the deployment
//! secret before any RPC, a rogue peer cannot join a cluster, a raw HTTP/2 client is dropped,
//! and the data plane only reaches back to the caller's own host.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Daemon, opts, raw_channel, runtime, secret_file};
use mori_auth::Secret;
use mori_io::{EngineDesc, Location, MemoryDesc};
use mori_umbpd::proto::master_client::MasterClient;
use mori_umbpd::proto::umbp_client::UmbpClient;
use mori_umbpd::proto::{
    BatchGetIntoRequest, BatchPutFromRequest, CommitEntry, CommitRequest, ExistsRequest,
    GetRequest, HeartbeatRequest, PutRequest, RegisterRequest,
};
use mori_umbpd::{Client, ClientError};

const GOOD: &str = "the-deployment-secret-of-this-test";
const BAD: &str = "not-the-deployment-secret-at-all";

fn standalone(dir: &Path) -> Daemon {
    let sf = secret_file(dir, "secret", GOOD);
    Daemon::start(
        dir,
        &["--secret-file", sf.to_str().unwrap(), "--dram-bytes", "8M"],
        &[],
    )
}

/// A client without the secret cannot connect, and over a raw channel none of its calls
/// reach the pool: puts, gets and exists fail, nothing changes, and the right client then
/// reads the original values. The daemon prints the secret's fingerprint, never the secret.
#[test]
fn a_client_with_the_wrong_secret_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let fp = Secret::new(GOOD.as_bytes().to_vec()).unwrap().fingerprint();
    let out = d.stdout();
    assert!(out.contains(&format!("fingerprint {fp}")), "{out}");
    assert!(!out.contains(GOOD), "the secret itself was printed:\n{out}");

    let good = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    assert!(good.put(b"k", b"original").unwrap());

    let err = Client::connect_with(&d.addr, &opts(BAD)).unwrap_err();
    assert!(matches!(err, ClientError::Auth(_)), "{err:?}");
    assert!(err.to_string().contains("authenticat"), "{err}");

    let rt = runtime();
    rt.block_on(async {
        let mut rogue = UmbpClient::new(raw_channel(&d.addr, BAD));
        let calls = [
            rogue
                .put(PutRequest {
                    key: b"k".to_vec(),
                    value: b"forged".to_vec(),
                })
                .await
                .map(|_| ()),
            rogue
                .put(PutRequest {
                    key: b"new".to_vec(),
                    value: b"forged".to_vec(),
                })
                .await
                .map(|_| ()),
            rogue
                .get(GetRequest { key: b"k".to_vec() })
                .await
                .map(|_| ()),
            rogue
                .exists(ExistsRequest { key: b"k".to_vec() })
                .await
                .map(|_| ()),
        ];
        for (i, c) in calls.into_iter().enumerate() {
            let s = c.expect_err("a call without the secret went through");
            assert_eq!(s.code(), tonic::Code::Unavailable, "call {i}: {s:?}");
            let full = format!("{s:?}");
            assert!(full.contains("authenticat"), "call {i}: {full}");
        }
    });
    assert_eq!(good.get(b"k").unwrap(), Some(b"original".to_vec()));
    assert!(!good.exists(b"new").unwrap());
    assert_eq!(good.stats().unwrap().keys, 1);
    let h = good.health().unwrap();
    assert!(h.connections_refused >= 5, "{h:?}");
    assert!(h.connections_open >= 1, "{h:?}");
}

/// Bytes of an HTTP/2 client that skips the handshake: the preface and an empty SETTINGS
/// frame. The daemon closes the connection without answering a byte.
#[test]
fn a_raw_http2_connection_without_the_handshake_is_dropped() {
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    dropped_unanswered_and_counted(&hello);
}

/// The small-ops protocol sits behind the same handshake: its hello and a get sent without
/// the handshake are dropped unanswered and counted as refused.
#[test]
fn small_ops_without_the_handshake_are_dropped() {
    let mut request = mori_umbpd::small_ops::HELLO.to_vec();
    request.push(mori_umbpd::small_ops::GET);
    request.extend_from_slice(&10u16.to_le_bytes());
    request.extend_from_slice(b"secret-key");
    dropped_unanswered_and_counted(&request);
}

/// Sends `bytes` on a fresh connection to a daemon that holds `secret-key`, without the
/// handshake: the daemon closes the connection without answering and counts it as refused.
fn dropped_unanswered_and_counted(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let good = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    assert!(good.put(b"secret-key", b"secret-value").unwrap());
    let before = good.health().unwrap().connections_refused;
    let mut s = TcpStream::connect(&d.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        )
    };
    // The daemon may already have closed (reset) the connection while we still write.
    if let Err(e) = s.write_all(bytes) {
        assert!(closed(&e), "{e}");
    }
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => panic!("the daemon answered {n} bytes: {:?}", &buf[..n]),
        Err(e) => assert!(closed(&e), "{e}"),
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while good.health().unwrap().connections_refused == before {
        assert!(
            Instant::now() < deadline,
            "the dropped connection was not counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An authenticated small-ops connection that breaks the framing (an unknown request; a put
/// announcing a value over the limit; a key cut short by a close) is answered INVALID_ARGUMENT
/// and closed, or just closed; the daemon goes on serving, and a well-formed connection still
/// gets byte-exact answers.
#[test]
fn a_small_ops_connection_that_breaks_the_framing_is_closed() {
    use mori_umbpd::small_ops::{FAILED, FOUND, GET, HELLO, PUT};
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let good = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    assert!(good.put(b"k", b"the value").unwrap());
    let secret = Secret::new(GOOD.as_bytes().to_vec()).unwrap();
    let connect = || {
        let mut s = TcpStream::connect(&d.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        mori_auth::connect(&mut s, &secret, mori_umbpd::auth::PURPOSE).unwrap();
        s.write_all(HELLO).unwrap();
        let mut echo = [0u8; 8];
        s.read_exact(&mut echo).unwrap();
        assert_eq!(&echo, HELLO);
        s
    };
    let answer = |s: &mut TcpStream| {
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(head[1..].try_into().unwrap()) as usize];
        s.read_exact(&mut body).unwrap();
        (head[0], body)
    };
    // Answered INVALID_ARGUMENT, then closed: an unknown request; a put announcing a value of
    // 4 GiB (refused before anything is allocated).
    let mut huge_put = vec![PUT, 1, 0, b'p'];
    huge_put.extend_from_slice(&u32::MAX.to_le_bytes());
    for request in [&[77, 1, 0, b'k'][..], &huge_put] {
        let mut s = connect();
        s.write_all(request).unwrap();
        let (status, body) = answer(&mut s);
        assert_eq!(status, FAILED, "{request:?}");
        let code = i32::from_le_bytes(body[..4].try_into().unwrap());
        assert_eq!(code, tonic::Code::InvalidArgument as i32, "{body:?}");
        assert_eq!(
            s.read(&mut [0u8; 8]).unwrap(),
            0,
            "the connection stays open"
        );
    }
    assert_eq!(good.get(b"p").unwrap(), None);
    // A key announced longer than what is sent, then a close: nothing answered, no harm.
    let mut s = connect();
    s.write_all(&[GET, 0xe8, 0x03]).unwrap();
    s.write_all(&[b'x'; 10]).unwrap();
    drop(s);
    // A well-formed connection: a get answers the value.
    let mut s = connect();
    s.write_all(&[GET, 1, 0, b'k']).unwrap();
    assert_eq!(answer(&mut s), (FOUND, b"the value".to_vec()));
    assert_eq!(good.get(b"k").unwrap().as_deref(), Some(&b"the value"[..]));
}

/// A small-ops `COMMIT` request publishing `key` (5 bytes, in DRAM) for peer `peer_id`.
fn small_ops_commit(peer_id: u64, key: &[u8]) -> Vec<u8> {
    let mut entry = (key.len() as u16).to_le_bytes().to_vec();
    entry.extend_from_slice(key);
    entry.extend_from_slice(&5u64.to_le_bytes());
    entry.push(0);
    let mut request = vec![mori_umbpd::small_ops::COMMIT, 8, 0];
    request.extend_from_slice(&peer_id.to_le_bytes());
    request.extend_from_slice(&(entry.len() as u32).to_le_bytes());
    request.extend_from_slice(&entry);
    request
}

/// A master's small ops, from a client with the secret that is not a peer: a commit for an
/// unknown peer id publishes nothing (answered absent); malformed commits and put routes are
/// answered INVALID_ARGUMENT and change nothing; a peer's port takes neither.
#[test]
fn a_master_refuses_commits_of_unknown_peers_and_malformed_small_ops() {
    use mori_umbpd::small_ops::{ABSENT, FAILED, HELLO, ROUTE_PUT};
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let (master, peer) = common::master_and_peer(&dirs, GOOD, "8M");
    let c = Client::connect_with(&master.addr, &opts(GOOD)).unwrap();
    let secret = Secret::new(GOOD.as_bytes().to_vec()).unwrap();
    let exchange = |addr: &str, request: &[u8]| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        mori_auth::connect(&mut s, &secret, mori_umbpd::auth::PURPOSE).unwrap();
        s.write_all(HELLO).unwrap();
        let mut echo = [0u8; 8];
        s.read_exact(&mut echo).unwrap();
        s.write_all(request).unwrap();
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        let mut body = vec![0u8; u32::from_le_bytes(head[1..].try_into().unwrap()) as usize];
        s.read_exact(&mut body).unwrap();
        (head[0], body)
    };
    let invalid = |(status, body): (u8, Vec<u8>)| {
        status == FAILED
            && i32::from_le_bytes(body[..4].try_into().unwrap())
                == tonic::Code::InvalidArgument as i32
    };
    let known = c.cluster_info().unwrap().unwrap().peers[0].peer_id;
    assert_eq!(
        exchange(&master.addr, &small_ops_commit(known + 1000, b"forged")),
        (ABSENT, vec![])
    );
    // Malformed: an id that is not 8 bytes, an entry cut short, an SSD flag that is not 0 or 1.
    let mut short_id = small_ops_commit(known, b"forged");
    short_id.drain(3..6);
    short_id[1] = 5;
    let mut cut = small_ops_commit(known, b"forged");
    cut.pop();
    let n = cut.len() - 15;
    cut[11..15].copy_from_slice(&(n as u32).to_le_bytes());
    let mut flag = small_ops_commit(known, b"forged");
    *flag.last_mut().unwrap() = 7;
    let mut route = vec![ROUTE_PUT, 1, 0, b'r'];
    route.extend_from_slice(&5u32.to_le_bytes());
    route.extend_from_slice(&[1, 2, 3, 4, 5]);
    for (what, request) in [
        ("id", short_id),
        ("cut", cut),
        ("flag", flag),
        ("route", route),
    ] {
        assert!(invalid(exchange(&master.addr, &request)), "{what}");
    }
    assert!(
        !c.exists(b"forged").unwrap(),
        "a refused commit published a key"
    );
    // A peer's own port routes and publishes nothing.
    let (status, body) = exchange(&peer.addr, &small_ops_commit(known, b"forged"));
    assert_eq!(status, FAILED, "{body:?}");
    // Commits of real puts still work (the peer publishes them over small ops).
    let before = c.health().unwrap().small_ops_served;
    assert!(c.put(b"real", b"value").unwrap());
    assert_eq!(
        c.health().unwrap().small_ops_served - before,
        2,
        "route and commit"
    );
    assert_eq!(c.get(b"real").unwrap().as_deref(), Some(&b"value"[..]));
}

/// A peer without the secret cannot join a cluster: neither a raw client calling
/// Register / Heartbeat / Commit (impersonating the real peer's id) nor a real peer daemon
/// started with another secret changes the master's peer list or index.
#[test]
fn a_rogue_peer_cannot_register_heartbeat_or_commit() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (master, peer) = common::master_and_peer(&dirs, GOOD, "8M");
    let c = Client::connect_with(&master.addr, &opts(GOOD)).unwrap();
    let peers = |c: &Client| {
        let info = c.cluster_info().unwrap().unwrap();
        let mut v: Vec<(u64, String)> = info
            .peers
            .into_iter()
            .map(|p| (p.peer_id, p.addr))
            .collect();
        v.sort();
        v
    };
    let before = peers(&c);
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0].1, peer.addr);
    let peer_id = before[0].0;

    let rt = runtime();
    rt.block_on(async {
        let mut rogue = MasterClient::new(raw_channel(&master.addr, BAD));
        let reg = rogue
            .register(RegisterRequest {
                addr: "127.0.0.1:9".into(),
                report: None,
            })
            .await;
        let hb = rogue
            .heartbeat(HeartbeatRequest {
                peer_id,
                report: None,
                dropped: Vec::new(),
                read: Vec::new(),
            })
            .await;
        let commit = rogue
            .commit(CommitRequest {
                peer_id,
                entries: vec![CommitEntry {
                    key: b"stolen".to_vec(),
                    len: 5,
                    on_ssd: false,
                }],
            })
            .await;
        for (what, r) in [
            ("register", reg.map(|_| ())),
            ("heartbeat", hb.map(|_| ())),
            ("commit", commit.map(|_| ())),
        ] {
            let s = r.expect_err(what);
            assert_eq!(s.code(), tonic::Code::Unavailable, "{what}: {s:?}");
        }
    });

    // Nor over small ops: the handshake with another secret fails, nothing is answered.
    let commit = small_ops_commit(peer_id, b"stolen");
    let mut s = TcpStream::connect(&master.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let bad = Secret::new(BAD.as_bytes().to_vec()).unwrap();
    assert!(mori_auth::connect(&mut s, &bad, mori_umbpd::auth::PURPOSE).is_err());
    let _ = s.write_all(mori_umbpd::small_ops::HELLO);
    let _ = s.write_all(&commit);
    assert!(
        matches!(s.read(&mut [0u8; 8]), Ok(0) | Err(_)),
        "answered without the secret"
    );

    // A real peer daemon with another secret keeps failing to register.
    let bad_sf = secret_file(dirs[2].path(), "secret", BAD);
    let mut rogue_peer = common::command(
        &[
            "--role",
            "peer",
            "--master",
            &master.addr,
            "--secret-file",
            bad_sf.to_str().unwrap(),
            "--heartbeat-interval",
            "100ms",
            "--dram-bytes",
            "8M",
        ],
        &[("UMBP_LOG", "warn")],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        rogue_peer.try_wait().unwrap().is_none(),
        "the rogue peer exited"
    );
    rogue_peer.kill().unwrap();
    let out = rogue_peer.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("registering with the master failed"), "{err}");
    assert!(err.contains("authenticat"), "{err}");

    assert_eq!(peers(&c), before, "the master's peer list changed");
    assert!(!c.exists(b"stolen").unwrap());
    assert!(c.health().unwrap().connections_refused >= 4);
    // The real peer still works.
    assert!(c.put(b"real", b"value").unwrap());
    assert_eq!(c.get(b"real").unwrap(), Some(b"value".to_vec()));
}

/// `BatchGetInto` / `BatchPutFrom` naming an engine that is not on the caller's host are
/// refused before the daemon connects anywhere; the caller's own engine works.
#[test]
fn the_data_plane_refuses_engines_on_other_hosts() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    assert!(c.put(b"k", &[5u8; 3000]).unwrap());
    // An engine address that is neither the caller's IP nor loopback (the unspecified
    // address: were the check ever broken, a connection to it stays on this machine).
    let engine = EngineDesc {
        name: "foreign".into(),
        addr: "0.0.0.0:7000".parse().unwrap(),
        instance: 1,
        host: "elsewhere".into(),
        local: String::new(),
    }
    .to_bytes();
    let memory = MemoryDesc {
        engine: "foreign".into(),
        instance: 1,
        id: 1,
        key: 1,
        len: 1 << 20,
        location: Location::Host,
        writable: true,
        ipc: None,
        fabric: Vec::new(),
    }
    .to_bytes();
    let rt = runtime();
    rt.block_on(async {
        let mut raw = UmbpClient::new(raw_channel(&d.addr, GOOD));
        let get = raw
            .batch_get_into(BatchGetIntoRequest {
                engine: engine.clone(),
                memory: memory.clone(),
                keys: vec![b"k".to_vec()],
                offsets: vec![0],
                capacities: vec![4096],
            })
            .await;
        let put = raw
            .batch_put_from(BatchPutFromRequest {
                engine: engine.clone(),
                memory: memory.clone(),
                keys: vec![b"p".to_vec()],
                offsets: vec![0],
                lens: vec![100],
            })
            .await;
        for (what, r) in [("get", get.map(|_| ())), ("put", put.map(|_| ()))] {
            let s = r.expect_err(what);
            assert_eq!(s.code(), tonic::Code::PermissionDenied, "{what}: {s:?}");
            assert!(s.message().contains("caller's own host"), "{what}: {s:?}");
        }
    });
    assert!(!c.exists(b"p").unwrap());
    // The caller's own (loopback) engine is served.
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the registration (deregistered below) and is not used meanwhile.
    let mem = unsafe { c.register(buf.as_mut_ptr() as u64, buf.len() as u64) }.unwrap();
    let got = c.batch_get_into(&[b"k"], &mem, &[0], &[4096]).unwrap();
    c.deregister(&mem).unwrap();
    assert_eq!(got, vec![Some(3000)]);
    assert_eq!(&buf[..3000], &[5u8; 3000][..]);
}

/// Out of file descriptors, the gRPC accept loop pauses instead of spinning (and says so at
/// most about once per second); once connections close, clients are served again. Only the
/// daemon's own threads (named `umbpd`: the runtime) are measured: mori.io's accept thread
/// (`mori-io-accept-*`) is another crate's.
#[test]
fn running_out_of_file_descriptors_does_not_spin_the_accept_loop() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let sf = secret_file(dir.path(), "secret", GOOD);
    let limit: libc::rlim_t = 96;
    let d = Daemon::start_with(
        dir.path(),
        &[
            "--secret-file",
            sf.to_str().unwrap(),
            "--dram-bytes",
            "8M",
            "--handshake-timeout",
            "6s",
        ],
        &[("UMBP_LOG", "info,mori_transport=off")],
        |cmd| {
            // SAFETY: setrlimit is async-signal-safe and touches only the child.
            unsafe {
                cmd.pre_exec(move || {
                    let l = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        },
    );
    // Silent connections (no handshake) use up the daemon's descriptors; the rest wait in
    // the backlog while accept fails with EMFILE.
    let silent: Vec<TcpStream> = (0..limit as usize + 20)
        .map(|_| TcpStream::connect(&d.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let cpu0 = d.cpu_time_of_threads("umbpd");
    std::thread::sleep(Duration::from_millis(2000));
    let used = d.cpu_time_of_threads("umbpd") - cpu0;
    let log = d.stderr();
    assert!(
        used < Duration::from_millis(500),
        "the accept loop spun: {used:?} of CPU in 2 s:\n{log}"
    );
    let pauses = log.matches("accepting connections failed").count();
    assert!((1..=4).contains(&pauses), "{pauses} pause messages:\n{log}");
    drop(silent);
    // Served again once the silent connections are gone.
    let deadline = Instant::now() + Duration::from_secs(15);
    let c = loop {
        match Client::connect_with(&d.addr, &opts(GOOD)) {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "not served after the descriptors came back: {e}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert!(c.put(b"k", b"v").unwrap());
}
