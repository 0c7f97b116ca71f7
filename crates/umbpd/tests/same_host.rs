//! The same-host path of the real `umbpd` binary (`mori_umbpd::shm`): a client's shared
//! buffer receives values straight from the pool, byte-exact and nowhere else; and, attacking
//! the daemon's socket from this process with the raw protocol, it refuses a peer without the
//! secret, a descriptor that is not a memfd sealed against shrinking, a hello without one, and
//! a request outside the buffer, and keeps serving others.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::path::Path;

use common::{Daemon, bytes, called_while_stopped, kept_in_time, opts, secret_file};
use mori_auth::Secret;
use mori_umbpd::shm::{
    ANSWER_AT, ANSWER_LEN_AT, ANSWERED_AT, BLOCK_MANY_MAX_KEYS, CONTROL_BYTES, DAEMON_TAKES_AT,
    DOORBELL_ACK, GET_INTO, GET_INTO_STREAMED, GET_MANY_INTO, GET_MANY_STREAMED, HELLO,
    HELLO_DOORBELL, LAST_FRAME, MANY_ABSENT, MANY_ALIGN, MANY_FOUND, MANY_TOO_LONG, MORE_FRAMES,
    PLANNED_FRAME, PROGRESS_AT, PROGRESS_RING_AT, PURPOSE, PUT_FROM, PUT_MANY_FROM, REQUEST_AT,
    REQUEST_LEN_AT, RING_AT, SHM_RING_AT, STREAM_FROM, Staged, TAKES_GET_MANY, VALUE_LEN_AT,
    send_with_fd,
};
use mori_umbpd::small_ops::{ABSENT, FAILED, FOUND};
use mori_umbpd::{Client, ClientError};

const GOOD: &str = "the-deployment-secret-of-the-same-host-test";
const BAD: &str = "a-secret-that-is-not-the-deployment-one";

fn standalone(dir: &Path) -> Daemon {
    standalone_with(dir, &["--dram-bytes", "64M"], &[])
}

/// A standalone daemon with the test's secret and `args`, `envs`.
fn standalone_with(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Daemon {
    let sf = secret_file(dir, "secret", GOOD);
    let mut all = vec!["--secret-file", sf.to_str().unwrap()];
    all.extend_from_slice(args);
    Daemon::start(dir, &all, envs)
}

/// A memfd of `len` bytes, sealed against shrinking when `seal`.
fn memfd(len: usize, seal: bool) -> OwnedFd {
    // SAFETY: a valid name; checked.
    let fd = unsafe {
        libc::memfd_create(
            c"test".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0);
    // SAFETY: just created, owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: open memfd.
    assert_eq!(
        unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) },
        0
    );
    if seal {
        // SAFETY: as above.
        assert_eq!(
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) },
            0
        );
    }
    fd
}

/// The first `len` bytes of `fd`, mapped shared, readable and writable.
fn map_shared(fd: &OwnedFd, len: usize) -> *mut u8 {
    // SAFETY: a fresh shared mapping of an open descriptor; checked.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    map.cast()
}

/// A raw connection to the daemon's same-host socket, authenticated with `secret`.
fn raw(name: &[u8], secret: &str) -> Result<UnixStream, mori_auth::Error> {
    let mut s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name).unwrap()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    mori_auth::connect(
        &mut s,
        &Secret::new(secret.as_bytes().to_vec()).unwrap(),
        PURPOSE,
    )?;
    Ok(s)
}

/// One answer in small ops' framing: (status, body).
fn raw_answer(s: &mut UnixStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(head[1..].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    (head[0], body)
}

/// A failed answer's (gRPC code, message).
fn failed(body: &[u8]) -> (i32, String) {
    (
        i32::from_le_bytes(body[..4].try_into().unwrap()),
        String::from_utf8_lossy(&body[4..]).into_owned(),
    )
}

/// A found answer's length.
fn length(body: &[u8]) -> u64 {
    u64::from_le_bytes(body.try_into().unwrap())
}

/// The daemon's answer to a hello: Ok(mapped length) or Err((gRPC code, message)).
fn hello_answer(s: &mut UnixStream) -> Result<u64, (i32, String)> {
    match raw_answer(s) {
        (FOUND, body) => Ok(length(&body)),
        (FAILED, body) => Err(failed(&body)),
        (other, _) => panic!("hello answered with status {other}"),
    }
}

/// A request for `op` on `key` (for a batch: its packed entries) and the room of `cap` bytes
/// at `offset`.
fn room_request(op: u8, key: &[u8], offset: u64, cap: u64) -> Vec<u8> {
    let mut r = vec![op];
    r.extend_from_slice(&(key.len() as u16).to_le_bytes());
    r.extend_from_slice(key);
    r.extend_from_slice(&offset.to_le_bytes());
    r.extend_from_slice(&cap.to_le_bytes());
    r
}

fn get_into_request(key: &[u8], offset: u64, cap: u64) -> Vec<u8> {
    room_request(GET_INTO, key, offset, cap)
}

/// Values of 1 B to 3 MiB land byte-exact at the offsets asked for, the bytes around them keep
/// the client's pattern, an absent key answers None and writes nothing, a value longer than the
/// room asked for fails INVALID_ARGUMENT, and two clients' buffers are their own.
/// Stores a value of each of `sizes` (bytes seeded from `seed` + its index) under
/// `{prefix}-{index}`: the keys and the values.
fn put_sized(c: &Client, prefix: &str, seed: u64, sizes: &[usize]) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let keys: Vec<Vec<u8>> = (0..sizes.len())
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect();
    let values: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(seed + i as u64, n))
        .collect();
    for (k, v) in keys.iter().zip(&values) {
        assert!(c.put(k, v).unwrap());
    }
    (keys, values)
}

#[test]
fn shared_buffers_take_values_straight_from_the_pool_and_nowhere_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let sizes = [1usize, 4096, 65536 + 3, 1 << 20, 3 << 20];
    let (_, values) = put_sized(&c, "shm", 70, &sizes);
    let len = 8 << 20;
    let buf = c.shared_buffer(len).unwrap();
    let before = c.health().unwrap();
    assert_eq!(buf.len(), len);
    // SAFETY: the buffer's mapping, len bytes, written only by this thread and the daemon
    // (during get_into, which returns after the copy).
    let mem = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) };
    mem.fill(0xAB);
    let mut offset = 17u64;
    let mut placed = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let got = buf
            .get_into(format!("shm-{i}").as_bytes(), offset, v.len() as u64 + 100)
            .unwrap();
        assert_eq!(got, Some(v.len()), "value {i}");
        placed.push((offset as usize, v.len()));
        offset += v.len() as u64 + 100;
    }
    for ((at, n), v) in placed.iter().zip(&values) {
        assert!(mem[*at..at + n] == v[..], "the value at {at} differs");
    }
    let mut inside = vec![false; len];
    for (at, n) in &placed {
        inside[*at..at + n].iter_mut().for_each(|b| *b = true);
    }
    assert!(
        mem.iter().zip(&inside).all(|(b, i)| *i || *b == 0xAB),
        "bytes outside the values changed"
    );
    // The route: every get so far was answered into shared memory, none over small ops.
    let after = c.health().unwrap();
    assert_eq!(
        after.same_host_served - before.same_host_served,
        values.len() as u64
    );
    assert_eq!(after.small_ops_served, before.small_ops_served);
    assert_eq!(buf.get_into(b"never-put", 0, 100).unwrap(), None);
    assert!(
        mem[..17].iter().all(|b| *b == 0xAB),
        "an absent key wrote something"
    );
    let short = buf.get_into(b"shm-3", 0, 1000).unwrap_err();
    assert_eq!(short.code(), tonic::Code::InvalidArgument, "{short:?}");
    let outside = buf.get_into(b"shm-0", len as u64 - 1, 2).unwrap_err();
    assert_eq!(outside.code(), tonic::Code::OutOfRange, "{outside:?}");
    // A second client's buffer: its own memory, the first one's bytes unchanged.
    let c2 = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let buf2 = c2.shared_buffer(4 << 20).unwrap();
    assert_eq!(buf2.get_into(b"shm-3", 0, 4 << 20).unwrap(), Some(1 << 20));
    // SAFETY: as above, for the second buffer.
    let mem2 = unsafe { std::slice::from_raw_parts(buf2.as_ptr(), 1 << 20) };
    assert!(mem2 == &values[3][..]);
    assert!(mem[placed[3].0..placed[3].0 + (1 << 20)] == values[3][..]);
}

/// A cluster peer's same-host socket (clients of the cluster read single values through it)
/// is the same guarded door: attacked from this process, a wrong secret is refused and
/// counted, a descriptor that is not a memfd is refused, and the peer goes on serving; puts
/// through it are published to the master as any put.
#[test]
fn a_cluster_peers_same_host_socket_refuses_strangers_and_bad_descriptors() {
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let (master, peer) = common::master_and_peer(&dirs, GOOD, "16M");
    let direct = Client::connect_with(&peer.addr, &opts(GOOD)).unwrap();
    let name = direct.same_host_socket().unwrap();
    let refused = direct.health().unwrap().connections_refused;
    assert!(
        raw(&name, BAD).is_err(),
        "a wrong secret passed the peer's handshake"
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(direct.health().unwrap().connections_refused, refused + 1);
    let mut s = raw(&name, GOOD).unwrap();
    let file = std::fs::File::create(dirs[1].path().join("plain")).unwrap();
    file.set_len(1 << 20).unwrap();
    send_with_fd(&s, HELLO, file.as_raw_fd()).unwrap();
    let (code, msg) = hello_answer(&mut s).unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert!(msg.contains("not a memfd"), "{msg}");
    // Puts through it, single and batched, are stored and published to the master before
    // they are answered.
    let db = RawDoorbells::connect(&name, 1 << 16);
    db.write_at(0, &bytes(3, 100));
    let mut db = db;
    let entries = put_entries(&[(b"peer-many", 100)]);
    let (status, body) = db
        .request(
            &room_request(PUT_MANY_FROM, &entries, 0, 100),
            3 + entries.len() as u32 + 16,
        )
        .unwrap();
    assert_eq!((status, body), (FOUND, vec![MANY_FOUND]));
    let (status, _) = db
        .request(&room_request(PUT_FROM, b"peer-put", 0, 100), 3 + 8 + 16)
        .unwrap();
    assert_eq!(status, FOUND);
    // The cluster's own client still reads through it.
    let c = Client::connect_with(&master.addr, &opts(GOOD)).unwrap();
    let v = bytes(9, 3000);
    assert!(c.put(b"guarded", &v).unwrap());
    let served = direct.health().unwrap().same_host_served;
    assert_eq!(c.get(b"guarded").unwrap(), Some(v));
    assert_eq!(direct.health().unwrap().same_host_served, served + 1);
    for key in [&b"peer-many"[..], b"peer-put"] {
        assert_eq!(c.get(key).unwrap(), Some(bytes(3, 100)), "published");
    }
}

/// The raw protocol from this process: without the secret nothing is served; with it, a
/// descriptor that is not a memfd, an unsealed memfd and a hello without a descriptor are
/// refused naming why; a request outside the buffer fails OUT_OF_RANGE and closes the
/// connection; and the daemon goes on serving a well-behaved buffer.
#[test]
fn the_same_host_socket_refuses_strangers_bad_descriptors_and_requests_outside_the_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    assert!(c.put(b"k", &bytes(5, 4096)).unwrap());
    let name = c.same_host_socket().unwrap();

    // No secret: the handshake fails (the daemon proves nothing to us and reads nothing),
    // and the daemon counts the refusal.
    let refused = c.health().unwrap().connections_refused;
    assert!(
        raw(&name, BAD).is_err(),
        "a wrong secret passed the handshake"
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(c.health().unwrap().connections_refused, refused + 1);
    // A regular file.
    let mut s = raw(&name, GOOD).unwrap();
    let file = std::fs::File::create(dir.path().join("plain")).unwrap();
    file.set_len(1 << 20).unwrap();
    send_with_fd(&s, HELLO, file.as_raw_fd()).unwrap();
    let (code, msg) = hello_answer(&mut s).unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert!(msg.contains("not a memfd"), "{msg}");
    // An unsealed memfd (the client could shrink it under the daemon's mapping).
    let mut s = raw(&name, GOOD).unwrap();
    send_with_fd(&s, HELLO, memfd(1 << 20, false).as_raw_fd()).unwrap();
    let (_, msg) = hello_answer(&mut s).unwrap_err();
    assert!(msg.contains("F_SEAL_SHRINK"), "{msg}");
    // A hello without a descriptor.
    let mut s = raw(&name, GOOD).unwrap();
    s.write_all(HELLO).unwrap();
    let (_, msg) = hello_answer(&mut s).unwrap_err();
    assert!(msg.contains("no buffer"), "{msg}");
    // A sealed memfd: served; a request past its end is refused and the connection closed.
    let fd = memfd(1 << 20, true);
    let mut s = raw(&name, GOOD).unwrap();
    send_with_fd(&s, HELLO, fd.as_raw_fd()).unwrap();
    assert_eq!(hello_answer(&mut s).unwrap(), 1 << 20);
    // The seal holds against this process too.
    // SAFETY: an open memfd; shrinking must fail with EPERM.
    assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
    s.write_all(&get_into_request(b"k", 0, 4096)).unwrap();
    let (status, body) = raw_answer(&mut s);
    assert_eq!((status, length(&body)), (FOUND, 4096));
    s.write_all(&get_into_request(b"absent", 0, 10)).unwrap();
    assert_eq!(raw_answer(&mut s).0, ABSENT);
    for (offset, cap) in [((1u64 << 20) - 100, 4096u64), (u64::MAX - 10, 100)] {
        let mut s = raw(&name, GOOD).unwrap();
        send_with_fd(&s, HELLO, fd.as_raw_fd()).unwrap();
        hello_answer(&mut s).unwrap();
        s.write_all(&get_into_request(b"k", offset, cap)).unwrap();
        let (status, body) = raw_answer(&mut s);
        assert_eq!(status, FAILED);
        let (code, msg) = failed(&body);
        assert_eq!(code, tonic::Code::OutOfRange as i32, "{msg}");
        let mut rest = [0u8; 1];
        assert_eq!(
            s.read(&mut rest).unwrap_or(0),
            0,
            "the connection stayed open"
        );
    }
    // Still serving: a client's buffer reads the value.
    let buf = c.shared_buffer(8192).unwrap();
    assert_eq!(buf.get_into(b"k", 0, 8192).unwrap(), Some(4096));
    // A client with the wrong secret does not even learn the name.
    let err = Client::connect_with(&d.addr, &opts(BAD))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(err, ClientError::Auth(_) | ClientError::Connect { .. }),
        "{err:?}"
    );
}

/// A raw connection with doorbells: the memfd of `data` bytes and a control block, mapped here.
struct RawDoorbells {
    s: UnixStream,
    map: *mut u8,
    data: usize,
    ring: u32,
}

impl RawDoorbells {
    /// Hands the daemon a sealed memfd of `data` bytes and a control block with
    /// [`HELLO_DOORBELL`]; asserts the daemon agreed.
    fn connect(name: &[u8], data: usize) -> RawDoorbells {
        let total = data + CONTROL_BYTES;
        let fd = memfd(total, true);
        let mut s = raw(name, GOOD).unwrap();
        send_with_fd(&s, HELLO_DOORBELL, fd.as_raw_fd()).unwrap();
        let (status, body) = raw_answer(&mut s);
        assert_eq!(status, FOUND, "{:?}", failed(&body));
        assert_eq!(
            (length(&body[..8]), &body[8..]),
            (data as u64, &DOORBELL_ACK[..])
        );
        RawDoorbells {
            s,
            map: map_shared(&fd, total), // left mapped for the test's process
            data,
            ring: 0,
        }
    }

    fn word(&self, at: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: a control-block word (4-byte aligned, inside the live mapping).
        unsafe { &*(self.map.add(self.data + at) as *const std::sync::atomic::AtomicU32) }
    }

    /// Puts `req` in the control block with `len` as its length word, rings, and waits up to
    /// 5 s for the answer there: (status, body), or None without one.
    fn request(&mut self, req: &[u8], len: u32) -> Option<(u8, Vec<u8>)> {
        use std::sync::atomic::Ordering::SeqCst;
        // SAFETY: req fits the request area (the tests' requests are small).
        unsafe {
            std::ptr::copy_nonoverlapping(
                req.as_ptr(),
                self.map.add(self.data + REQUEST_AT),
                req.len(),
            )
        };
        self.word(REQUEST_LEN_AT).store(len, SeqCst);
        self.ring += 1;
        self.word(SHM_RING_AT).store(self.ring, SeqCst);
        self.word(RING_AT).store(self.ring, SeqCst);
        // SAFETY: a futex wake on the ring word of the shared mapping (the daemon may sleep on it).
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word(RING_AT).as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                0usize,
                0usize,
                0u32,
            )
        };
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while self.word(ANSWERED_AT).load(SeqCst) != self.ring {
            if std::time::Instant::now() > until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let n = self.word(ANSWER_LEN_AT).load(SeqCst) as usize;
        // SAFETY: the answer area of the mapping, n bytes the daemon wrote (at most 4 KiB).
        let a =
            unsafe { std::slice::from_raw_parts(self.map.add(self.data + ANSWER_AT), n) }.to_vec();
        Some((a[0], a[5..].to_vec()))
    }

    /// Writes `bytes` into the data area at `offset`.
    fn write_at(&self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.data);
        // SAFETY: inside the data area (checked).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.add(offset), bytes.len()) };
    }

    /// The data area's bytes at `offset`.
    fn data_at(&self, offset: usize, n: usize) -> Vec<u8> {
        // SAFETY: inside the data area (the tests ask within it).
        unsafe { std::slice::from_raw_parts(self.map.add(offset), n) }.to_vec()
    }

    /// Whether the daemon closed the socket (EOF within 5 s).
    fn closed(&mut self) -> bool {
        self.s
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut rest = [0u8; 1];
        self.s.read(&mut rest).unwrap_or(1) == 0
    }
}

/// Doorbells on the raw protocol from this process (the daemon another): single gets through
/// the control block land byte-exact in the data area; a buffer too small for a control block,
/// a request whose room reaches into the control block (answered OUT_OF_RANGE there, then
/// closed) and a request length past the request area (closed, unanswered) are refused; the
/// daemon serves on, and a client's shared buffer uses doorbells.
#[test]
fn doorbells_serve_gets_in_the_control_block_and_refuse_what_reaches_past_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let value = bytes(9, 4096);
    assert!(c.put(b"k", &value).unwrap());
    let name = c.same_host_socket().unwrap();

    let mut s = raw(&name, GOOD).unwrap();
    send_with_fd(&s, HELLO_DOORBELL, memfd(CONTROL_BYTES, true).as_raw_fd()).unwrap();
    let (code, msg) = hello_answer(&mut s).unwrap_err();
    assert_eq!(code, tonic::Code::InvalidArgument as i32, "{msg}");
    assert!(msg.contains("doorbells"), "{msg}");

    let mut db = RawDoorbells::connect(&name, 1 << 20);
    let (status, body) = db
        .request(&get_into_request(b"k", 4096, 8192), 3 + 1 + 16)
        .unwrap();
    assert_eq!((status, length(&body)), (FOUND, 4096));
    assert_eq!(db.data_at(4096, 4096), value);
    assert_eq!(
        db.data_at(0, 4096),
        vec![0u8; 4096],
        "bytes before the offset were written"
    );
    let (status, _) = db
        .request(&get_into_request(b"absent", 0, 10), 3 + 6 + 16)
        .unwrap();
    assert_eq!(status, ABSENT);
    // A room that reaches into the control block: refused there, the connection closed.
    let (status, body) = db
        .request(&get_into_request(b"k", (1 << 20) - 100, 4096), 3 + 1 + 16)
        .unwrap();
    assert_eq!(status, FAILED);
    assert_eq!(
        failed(&body).0,
        tonic::Code::OutOfRange as i32,
        "{}",
        failed(&body).1
    );
    assert!(db.closed(), "the connection stayed open");

    // A request length past the request area: closed without an answer.
    let mut db = RawDoorbells::connect(&name, 1 << 20);
    assert_eq!(db.request(&get_into_request(b"k", 0, 4096), u32::MAX), None);
    assert!(db.closed(), "the connection stayed open");

    // Serving on: a client's shared buffer (doorbells by default) reads the value, counted.
    let served = c.health().unwrap().same_host_served;
    let buf = c.shared_buffer(8192).unwrap();
    assert_eq!(buf.get_into(b"k", 0, 8192).unwrap(), Some(4096));
    // SAFETY: the first 4096 bytes of the buffer's data, written by the daemon.
    assert_eq!(
        unsafe { std::slice::from_raw_parts(buf.as_ptr(), 4096) },
        &value[..]
    );
    assert_eq!(c.health().unwrap().same_host_served, served + 1);
}

/// The entries of a batch of puts: each key's u16 length, the key, the value's u64 length.
fn put_entries(items: &[(&[u8], usize)]) -> Vec<u8> {
    let mut packed = Vec::new();
    for (k, len) in items {
        packed.extend_from_slice(&(k.len() as u16).to_le_bytes());
        packed.extend_from_slice(k);
        packed.extend_from_slice(&(*len as u64).to_le_bytes());
    }
    packed
}

/// Puts from shared memory on the raw protocol from this process (the daemon another, with
/// doorbells): a value written in the data area is stored byte-exact under its key and read
/// back by a client; a present key is answered ABSENT and keeps its value; a room reaching
/// into the control block is refused OUT_OF_RANGE (nothing stored, the connection closed). A
/// batch stores each value from its 64-byte-aligned place and answers a byte per key; one
/// whose last value reaches past its room (OUT_OF_RANGE) or whose entries are cut short
/// (INVALID_ARGUMENT) stores nothing, and the connection goes on. A client's own puts and
/// batch puts take this path (each counted as same-host), byte-exact.
#[test]
fn puts_from_shared_memory_store_what_the_client_wrote_and_nothing_outside_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let name = c.same_host_socket().unwrap();
    let data = 1 << 20;
    let mut db = RawDoorbells::connect(&name, data);
    let request = |db: &mut RawDoorbells, req: Vec<u8>| {
        let len = req.len() as u32;
        db.request(&req, len).expect("no answer")
    };

    let v1 = bytes(21, 100_000);
    db.write_at(4096, &v1);
    let (status, _) = request(
        &mut db,
        room_request(PUT_FROM, b"p1", 4096, v1.len() as u64),
    );
    assert_eq!(status, FOUND, "stored");
    assert_eq!(c.get(b"p1").unwrap(), Some(v1.clone()));
    db.write_at(4096, &bytes(22, 1000));
    let (status, _) = request(&mut db, room_request(PUT_FROM, b"p1", 4096, 1000));
    assert_eq!(status, ABSENT, "a present key");
    assert_eq!(
        c.get(b"p1").unwrap(),
        Some(v1.clone()),
        "a present key's value changed"
    );

    // A batch: values at 0, then at the next 64-byte boundaries; a present key answered so.
    let (a, b) = (bytes(23, 5000), bytes(24, 70_000));
    let b_at = 5000usize.next_multiple_of(MANY_ALIGN as usize);
    let p_at = (b_at + b.len()).next_multiple_of(MANY_ALIGN as usize);
    db.write_at(0, &a);
    db.write_at(b_at, &b);
    db.write_at(p_at, &[7u8; 10]);
    let entries = put_entries(&[(b"m0", a.len()), (b"m1", b.len()), (b"p1", 10)]);
    let (status, body) = request(
        &mut db,
        room_request(PUT_MANY_FROM, &entries, 0, data as u64),
    );
    assert_eq!(status, FOUND, "{:?}", failed(&body));
    assert_eq!(body, vec![MANY_FOUND, MANY_FOUND, MANY_ABSENT]);
    assert_eq!(c.get(b"m0").unwrap(), Some(a));
    assert_eq!(c.get(b"m1").unwrap(), Some(b));
    assert_eq!(c.get(b"p1").unwrap(), Some(v1));

    // The last value reaches past the room: nothing of the batch stored, the connection goes on.
    let entries = put_entries(&[(b"x0", 100), (b"x1", 1000)]);
    let (status, body) = request(&mut db, room_request(PUT_MANY_FROM, &entries, 0, 1000));
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::OutOfRange as i32)
    );
    // Entries cut short (inside the last value's length): refused, nothing stored.
    let mut entries = put_entries(&[(b"y0", 100), (b"y1", 100)]);
    entries.truncate(entries.len() - 3);
    let (status, body) = request(&mut db, room_request(PUT_MANY_FROM, &entries, 0, 4096));
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::InvalidArgument as i32)
    );
    for k in [&b"x0"[..], b"x1", b"y0", b"y1"] {
        assert!(
            !c.exists(k).unwrap(),
            "{} stored",
            String::from_utf8_lossy(k)
        );
    }

    // A room that reaches into the control block: refused there, the connection closed.
    let (status, body) = request(
        &mut db,
        room_request(PUT_FROM, b"out", data as u64 - 10, 100),
    );
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::OutOfRange as i32)
    );
    assert!(db.closed(), "the connection stayed open");
    assert!(!c.exists(b"out").unwrap());

    // The client's own puts and batch puts go this way, byte-exact and counted.
    let h0 = c.health().unwrap();
    let (keys, values) = put_sized(&c, "own", 700, &[1, 4096, 300_000]);
    let batch: Vec<(Vec<u8>, Vec<u8>)> = (0..40)
        .map(|i| {
            (
                format!("ob-{i}").into_bytes(),
                bytes(800 + i, 1000 + 997 * i as usize),
            )
        })
        .collect();
    let items: Vec<(&[u8], &[u8])> = batch.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    assert_eq!(c.batch_put(&items).unwrap(), vec![true; 40]);
    let h1 = c.health().unwrap();
    assert_eq!(h1.same_host_served - h0.same_host_served, 3 + 40);
    assert_eq!(
        h1.small_ops_served, h0.small_ops_served,
        "a put took small ops"
    );
    for (k, v) in keys
        .iter()
        .zip(&values)
        .chain(batch.iter().map(|(k, v)| (k, v)))
    {
        assert_eq!(c.get(k).unwrap().as_ref(), Some(v));
    }
}

/// Streamed gets on the raw protocol (the daemon another process): a value of at least
/// `STREAM_FROM` bytes lands byte-exact and its progress words name this request's ring, the
/// value's length and all of it landed, the answer its length twice (all of it holds); a
/// shorter value publishes nothing (the words keep the earlier ring); an absent key answers
/// ABSENT; a client's single gets of large values read back byte-exact through this path.
#[test]
fn streamed_gets_publish_their_progress_for_large_values() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let (keys, values) = put_sized(&c, "st", 40, &[STREAM_FROM, 3 << 20, 4096]);
    let name = c.same_host_socket().unwrap();
    let mut db = RawDoorbells::connect(&name, 4 << 20);
    let load = |db: &RawDoorbells, at| db.word(at).load(std::sync::atomic::Ordering::SeqCst);
    for (k, v) in keys.iter().zip(&values).take(2) {
        let req = room_request(GET_INTO_STREAMED, k, 0, 4 << 20);
        let (status, body) = db.request(&req, req.len() as u32).unwrap();
        assert_eq!(status, FOUND, "{:?}", failed(&body));
        let len = v.len() as u64;
        assert_eq!((length(&body[..8]), length(&body[8..])), (len, len));
        assert_eq!(db.data_at(0, v.len()), *v);
        assert_eq!(load(&db, PROGRESS_RING_AT), db.ring);
        assert_eq!(load(&db, VALUE_LEN_AT) as u64, len);
        assert_eq!(load(&db, PROGRESS_AT) as u64, len);
    }
    let published = load(&db, PROGRESS_RING_AT);
    let req = room_request(GET_INTO_STREAMED, &keys[2], 0, 4 << 20);
    let (status, body) = db.request(&req, req.len() as u32).unwrap();
    assert_eq!((status, length(&body[..8])), (FOUND, 4096));
    assert_eq!(db.data_at(0, 4096), values[2]);
    assert_eq!(
        load(&db, PROGRESS_RING_AT),
        published,
        "a short value published progress"
    );
    let req = room_request(GET_INTO_STREAMED, b"absent", 0, 4 << 20);
    assert_eq!(db.request(&req, req.len() as u32).unwrap().0, ABSENT);
    for (k, v) in keys.iter().zip(&values) {
        assert_eq!(c.get(k).unwrap().as_ref(), Some(v));
    }
    // A caller's buffer too small for a streamed value: the caller's argument, as before.
    let err = c.get_with(&keys[1], &mut SmallSink(1 << 20)).unwrap_err();
    assert_eq!(err.code(), Some(tonic::Code::InvalidArgument), "{err}");
    assert_eq!(c.get(&keys[1]).unwrap().as_ref(), Some(&values[1]));
}

/// A sink that refuses every value as too long for its buffer of `.0` bytes (as a caller's
/// buffer refuses a longer value).
struct SmallSink(usize);

impl mori_umbpd::small_ops::Sink for SmallSink {
    fn buffer(&mut self, len: usize) -> std::io::Result<&mut [u8]> {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{len} bytes for a buffer of {}", self.0),
        ))
    }
}

/// A thread of the test's process rewriting the first `len` bytes of a raw doorbell buffer's
/// data (a new byte each pass) until stopped: the client's own writes racing the daemon.
struct Scribbler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Scribbler {
    fn start(db: &RawDoorbells, len: usize) -> Scribbler {
        assert!(len <= db.data);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let at = db.map as usize;
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut b = 0u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // SAFETY: the first len bytes of the data area (asserted above), mapped
                    // for the rest of the test's process.
                    unsafe { std::ptr::write_bytes(at as *mut u8, b, len) };
                    b = b.wrapping_add(1);
                }
            })
        };
        Scribbler { stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}

/// A client that keeps rewriting its buffer while the daemon stores from it cannot make the
/// pool hold a value that fails its checksum: each racing put reads back whole (whatever bytes
/// the daemon copied), never as a corrupt value; and a value stored while nothing raced reads
/// back exact.
#[test]
fn a_put_racing_the_clients_own_writes_is_stored_with_a_matching_checksum() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let name = c.same_host_socket().unwrap();
    let (data, len) = (4 << 20, 1 << 20);
    let mut db = RawDoorbells::connect(&name, data);
    let scribbler = Scribbler::start(&db, len);
    let keys: Vec<Vec<u8>> = (0..24).map(|i| format!("race-{i}").into_bytes()).collect();
    for k in &keys {
        let req = room_request(PUT_FROM, k, 0, len as u64);
        let (status, body) = db.request(&req, req.len() as u32).expect("no answer");
        assert_eq!(status, FOUND, "{:?}", failed(&body));
    }
    scribbler.stop();
    for k in &keys {
        let got = c.get(k);
        assert!(
            matches!(&got, Ok(Some(v)) if v.len() == len),
            "{}: {:?}",
            String::from_utf8_lossy(k),
            got.map(|v| v.map(|v| v.len()))
        );
    }
    let calm = bytes(31, len);
    db.write_at(0, &calm);
    let req = room_request(PUT_FROM, b"calm", 0, len as u64);
    assert_eq!(db.request(&req, req.len() as u32).unwrap().0, FOUND);
    assert_eq!(c.get(b"calm").unwrap(), Some(calm));
}

/// A client that keeps rewriting its buffer while the daemon copies values into it cannot make
/// the daemon take a stored value for corrupt and drop it: the daemon checksums the arena's
/// side of each copy, not the buffer's (with its copies cut into runs on several threads and
/// on one). Afterwards every value reads back exact and no checksum failed.
#[test]
fn a_get_racing_the_clients_own_writes_leaves_the_stored_value_intact() {
    for threads in ["3", "1"] {
        let dir = tempfile::tempdir().unwrap();
        let d = standalone_with(
            dir.path(),
            &["--dram-bytes", "64M"],
            &[("MORI_CHECKSUM_THREADS", threads)],
        );
        let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
        let len = 1 << 20;
        let (keys, values) = put_sized(&c, "raced", 5, &[len; 6]);
        let name = c.same_host_socket().unwrap();
        let mut db = RawDoorbells::connect(&name, 4 << 20);
        let scribbler = Scribbler::start(&db, len);
        for _ in 0..24 {
            for k in &keys {
                let req = get_into_request(k, 0, len as u64);
                let (status, body) = db.request(&req, req.len() as u32).expect("no answer");
                assert_eq!(status, FOUND, "{threads} threads: {:?}", failed(&body));
            }
        }
        scribbler.stop();
        for (k, v) in keys.iter().zip(&values) {
            assert_eq!(c.get(k).unwrap().as_ref(), Some(v), "{threads} threads");
        }
        let stats = c.stats().unwrap();
        assert_eq!(
            (stats.dram_checksum_errors, stats.corrupt_dropped),
            (0, 0),
            "{threads} threads"
        );
    }
}

/// A batch request of `packed` keys (each a u16 length and its bytes) into `cap` bytes at
/// `offset`.
fn get_many_request(packed: &[u8], offset: u64, cap: u64) -> Vec<u8> {
    room_request(GET_MANY_INTO, packed, offset, cap)
}

fn packed(keys: &[&[u8]]) -> Vec<u8> {
    keys.iter()
        .flat_map(|k| {
            (k.len() as u16)
                .to_le_bytes()
                .into_iter()
                .chain(k.iter().copied())
        })
        .collect()
}

/// Batches of gets in the control block. On the raw protocol from this process (the daemon
/// another): the daemon says it takes them before its doorbell hello answer; a batch of more
/// keys than the answer area holds is answered for the first [`BLOCK_MANY_MAX_KEYS`], each
/// value byte-exact at its place, and asked again for the rest (an absent key absent); one
/// whose room reaches into the control block is refused and the connection closed. A
/// client's batch that begins with small values (taken in the control block, past what one
/// request answers) and goes on to a value longer than its room (it and the rest then
/// streamed), and one that begins with values whose size ends the control-block requests,
/// hand every value to the key it belongs to.
#[test]
fn batches_of_gets_travel_in_the_control_block_answered_up_to_what_it_holds() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    // Small values past what one answer holds, one longer than a control-block request's room,
    // small ones again, then values of 32 KiB.
    let mut sizes: Vec<usize> = (0..BLOCK_MANY_MAX_KEYS + 60)
        .map(|i| 100 + i % 37)
        .collect();
    sizes.push(300 << 10);
    sizes.extend((0..40).map(|i| 1000 + i));
    sizes.extend([32 << 10; 20]);
    let (keys, values) = put_sized(&c, "blk", 7, &sizes);
    let name = c.same_host_socket().unwrap();

    let mut db = RawDoorbells::connect(&name, 1 << 20);
    assert_eq!(db.word(DAEMON_TAKES_AT).load(SeqCst), TAKES_GET_MANY);
    let first: Vec<&[u8]> = keys[..BLOCK_MANY_MAX_KEYS + 60]
        .iter()
        .map(Vec::as_slice)
        .collect();
    let req = get_many_request(&packed(&first), 0, 1 << 20);
    let (status, body) = db.request(&req, req.len() as u32).unwrap();
    assert_eq!(status, FOUND, "{:?}", failed(&body));
    assert_eq!(
        body.len(),
        BLOCK_MANY_MAX_KEYS * 9,
        "more keys answered than the block holds"
    );
    let mut at = 0;
    for (i, entry) in body.chunks(9).enumerate() {
        assert_eq!(
            (entry[0], length(&entry[1..])),
            (MANY_FOUND, sizes[i] as u64),
            "key {i}"
        );
        assert_eq!(db.data_at(at, sizes[i]), values[i], "key {i}");
        at = (at + sizes[i]).next_multiple_of(MANY_ALIGN as usize);
    }
    let mut rest: Vec<&[u8]> = first[BLOCK_MANY_MAX_KEYS..].to_vec();
    rest.push(b"blk/absent");
    let req = get_many_request(&packed(&rest), 0, 1 << 20);
    let (status, body) = db.request(&req, req.len() as u32).unwrap();
    assert_eq!(status, FOUND, "{:?}", failed(&body));
    assert_eq!(body.len(), rest.len() * 9);
    assert_eq!(body[body.len() - 9], MANY_ABSENT);
    let first_rest = &body[..9];
    assert_eq!(length(&first_rest[1..]), sizes[BLOCK_MANY_MAX_KEYS] as u64);
    assert_eq!(
        db.data_at(0, sizes[BLOCK_MANY_MAX_KEYS]),
        values[BLOCK_MANY_MAX_KEYS]
    );
    // A batch whose room reaches into the control block: refused there, the connection closed.
    let req = get_many_request(&packed(&first[..2]), (1 << 20) - 100, 4096);
    let (status, body) = db.request(&req, req.len() as u32).unwrap();
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::OutOfRange as i32)
    );
    assert!(db.closed(), "the connection stayed open");

    let buf = c.shared_buffer(1 << 20).unwrap();
    let mut refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    refs.insert(3, b"blk/absent");
    let mut got: Vec<Option<Vec<u8>>> = vec![None; refs.len()];
    let lens = buf
        .get_many_with(&refs, |i, v| {
            got[i] = Some(v.to_vec());
            Ok(())
        })
        .unwrap();
    let mut want: Vec<Option<Vec<u8>>> = values.iter().cloned().map(Some).collect();
    want.insert(3, None);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g == w,
            "key {i} ({:?}) got other bytes",
            String::from_utf8_lossy(refs[i])
        );
    }
    let want_lens: Vec<Option<Option<usize>>> = want
        .iter()
        .map(|w| Some(w.as_ref().map(Vec::len)))
        .collect();
    assert_eq!(lens, want_lens);

    // Values of 32 KiB first: their average ends the control-block requests after the first,
    // the rest (small ones among them) streamed.
    let order: Vec<usize> = (sizes.len() - 20..sizes.len()).chain(0..5).collect();
    let refs: Vec<&[u8]> = order.iter().map(|&i| keys[i].as_slice()).collect();
    let mut got: Vec<Option<Vec<u8>>> = vec![None; refs.len()];
    buf.get_many_with(&refs, |i, v| {
        got[i] = Some(v.to_vec());
        Ok(())
    })
    .unwrap();
    for (j, &i) in order.iter().enumerate() {
        assert!(
            got[j].as_ref() == Some(&values[i]),
            "key {i} got other bytes"
        );
    }
}

/// A batch fills the buffer with as many values as fit, each at the next 64-byte boundary and
/// byte-exact, the bytes between them untouched; the rest are asked for again; a value longer
/// than the buffer is reported as such (and nothing written), an absent key takes no room.
/// Raw requests with keys that end inside a length or a key, or without keys, fail
/// INVALID_ARGUMENT and the connection goes on; one outside the buffer fails OUT_OF_RANGE and
/// the connection is closed.
#[test]
fn batches_fill_the_shared_buffer_with_what_fits_and_ask_again_for_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let sizes = [300_000usize, 1, 400_000, 2 << 20, 500_000];
    let (keys, values) = put_sized(&c, "many", 900, &sizes);
    let len = 1 << 20;
    let buf = c.shared_buffer(len).unwrap();
    // SAFETY: the buffer's mapping, written only by this thread and the daemon (during
    // get_many_into, which returns after the copies).
    let mem = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) };
    mem.fill(0xAB);
    let ask: Vec<&[u8]> = vec![&keys[0], b"many-absent", &keys[1], &keys[2], &keys[4]];
    let first = buf.get_many_into(&ask).unwrap();
    // 300000 B at 0, the absent key, 1 B at the next 64-byte boundary, 400000 B after it;
    // 500000 B do not fit the rest of 1 MiB.
    let second_at = 300_000usize.next_multiple_of(64);
    let third_at = (second_at + 1).next_multiple_of(64);
    assert_eq!(
        first,
        vec![
            Staged::Found {
                offset: 0,
                len: 300_000
            },
            Staged::Absent,
            Staged::Found {
                offset: second_at,
                len: 1
            },
            Staged::Found {
                offset: third_at,
                len: 400_000
            },
        ]
    );
    assert_eq!(&mem[..300_000], values[0].as_slice());
    assert!(mem[300_000..second_at].iter().all(|&b| b == 0xAB));
    assert_eq!(&mem[second_at..second_at + 1], values[1].as_slice());
    assert!(mem[second_at + 1..third_at].iter().all(|&b| b == 0xAB));
    assert_eq!(&mem[third_at..third_at + 400_000], values[2].as_slice());
    assert!(mem[third_at + 400_000..].iter().all(|&b| b == 0xAB));
    // Asked again, the rest fits; a 2 MiB value is longer than the whole buffer.
    mem.fill(0xCD);
    let again = buf.get_many_into(&[&keys[4], &keys[3]]).unwrap();
    assert_eq!(
        again,
        vec![Staged::Found {
            offset: 0,
            len: 500_000
        }]
    );
    assert_eq!(&mem[..500_000], values[4].as_slice());
    assert_eq!(
        buf.get_many_into(&[&keys[3], &keys[1]]).unwrap()[0],
        Staged::TooLong
    );

    // The raw protocol.
    let name = c.same_host_socket().unwrap();
    let fd = memfd(1 << 20, true);
    let mut s = raw(&name, GOOD).unwrap();
    send_with_fd(&s, HELLO, fd.as_raw_fd()).unwrap();
    assert_eq!(hello_answer(&mut s).unwrap(), 1 << 20);
    let mut cut_key = packed(&[&keys[1]]);
    cut_key.pop();
    for bad in [vec![5u8], cut_key, Vec::new()] {
        s.write_all(&get_many_request(&bad, 0, 4096)).unwrap();
        let (status, body) = raw_answer(&mut s);
        assert_eq!(status, FAILED);
        assert_eq!(
            failed(&body).0,
            tonic::Code::InvalidArgument as i32,
            "{bad:?}"
        );
    }
    s.write_all(&get_many_request(
        &packed(&[&keys[1], b"many-absent"]),
        64,
        4096,
    ))
    .unwrap();
    let (status, body) = raw_answer(&mut s);
    assert_eq!(
        status, FOUND,
        "the connection goes on after a malformed batch"
    );
    assert_eq!(body.len(), 18);
    assert_eq!((body[0], body[9]), (1, 0), "found, then absent");
    s.write_all(&get_many_request(
        &packed(&[&keys[1]]),
        (1 << 20) - 10,
        4096,
    ))
    .unwrap();
    let (status, body) = raw_answer(&mut s);
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::OutOfRange as i32)
    );
    let mut rest = [0u8; 1];
    assert_eq!(
        s.read(&mut rest).unwrap_or(0),
        0,
        "the connection stayed open"
    );
}

/// A streamed batch's frames up to its last, on the raw protocol: its plan (`Some(keys)` when
/// its first frame has one), then each frame's flag and entries (status, length), asserted to
/// answer the planned keys, or all `sent` keys without a plan; `check(entries)` runs as each
/// frame arrives, before the next is read.
#[allow(clippy::type_complexity)]
fn streamed_frames(
    s: &mut UnixStream,
    sent: usize,
    mut check: impl FnMut(&[(u8, u64)]),
) -> (Option<usize>, Vec<(u8, Vec<(u8, u64)>)>) {
    let mut first = Some(raw_answer(s));
    let mut planned = None;
    if let Some((FOUND, plan)) = &first
        && plan[0] == PLANNED_FRAME
    {
        assert_eq!(plan.len(), 9);
        planned = Some(u64::from_le_bytes(plan[1..].try_into().unwrap()) as usize);
        first = None;
    }
    let mut frames = Vec::new();
    loop {
        let (status, body) = first.take().unwrap_or_else(|| raw_answer(s));
        assert_eq!(status, FOUND, "{:?}", failed(&body));
        let entries: Vec<(u8, u64)> = body[1..]
            .chunks_exact(9)
            .map(|e| (e[0], u64::from_le_bytes(e[1..].try_into().unwrap())))
            .collect();
        assert_eq!((body.len() - 1) % 9, 0);
        check(&entries);
        frames.push((body[0], entries));
        if body[0] == LAST_FRAME {
            let answered: usize = frames.iter().map(|(_, e)| e.len()).sum();
            assert_eq!(
                answered,
                planned.unwrap_or(sent),
                "the planned keys answered"
            );
            return (planned, frames);
        }
        assert_eq!(body[0], MORE_FRAMES);
    }
}

/// A streamed batch answers a frame once 256 KiB were placed since the last (each value
/// already in place, byte-exact, when its frame arrives; the bytes between values untouched),
/// and its last frame where a value no longer fits or every key was answered; together the
/// entries are a plain batch's. A first value longer than the room is reported so; raw
/// requests without keys fail INVALID_ARGUMENT and the connection goes on; one outside the
/// buffer fails OUT_OF_RANGE and the connection is closed.
#[test]
fn streamed_batches_answer_a_frame_as_their_values_land() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let sizes = [300_000usize, 1, 400_000, 100_000, 2 << 20, 50_000];
    let (keys, values) = put_sized(&c, "streamed", 1300, &sizes);
    let name = c.same_host_socket().unwrap();
    let len = 1usize << 20;
    let fd = memfd(len, true);
    let map = map_shared(&fd, len);
    // SAFETY: the mapping of `len` bytes above; the daemon writes it only while a request is
    // being answered, and this test reads the bytes a frame names only after that frame.
    let mem = |at: usize, n: usize| unsafe { std::slice::from_raw_parts(map.add(at), n) }.to_vec();
    // SAFETY: as above; nothing else writes the mapping meanwhile.
    unsafe { std::ptr::write_bytes(map, 0xAB, len) };
    let mut s = raw(&name, GOOD).unwrap();
    send_with_fd(&s, HELLO, fd.as_raw_fd()).unwrap();
    assert_eq!(hello_answer(&mut s).unwrap(), len as u64);

    // From offset 64: 300000 B (a frame), the absent key and 1 B and 400000 B (a frame), then
    // 100000 B; 2 MiB does not fit the rest (the last frame).
    let ask = packed(&[
        &keys[0],
        b"streamed-absent",
        &keys[1],
        &keys[2],
        &keys[3],
        &keys[4],
    ]);
    s.write_all(&room_request(
        GET_MANY_STREAMED,
        &ask,
        64,
        (len - 64) as u64,
    ))
    .unwrap();
    let mut at = 64usize;
    let mut next_value = [0usize, 1, 2, 3].into_iter();
    let (planned, frames) = streamed_frames(&mut s, 6, |entries| {
        for &(status, n) in entries {
            if status == MANY_ABSENT {
                continue;
            }
            assert_eq!(status, MANY_FOUND);
            let v = &values[next_value.next().unwrap()];
            assert_eq!(n as usize, v.len());
            assert_eq!(mem(at, v.len()), *v, "in place when its frame arrives");
            let end = at + v.len();
            at = end.next_multiple_of(MANY_ALIGN as usize);
            assert!(mem(end, at - end).iter().all(|&b| b == 0xAB));
        }
    });
    let (f, a) = (MANY_FOUND, MANY_ABSENT);
    assert_eq!(planned, Some(5), "the 2 MiB value left out of the plan");
    assert_eq!(
        frames,
        [
            (MORE_FRAMES, vec![(f, 300_000)]),
            (MORE_FRAMES, vec![(a, 0), (f, 1), (f, 400_000)]),
            (LAST_FRAME, vec![(f, 100_000)]),
        ]
    );
    assert!(
        mem(at, len - at).iter().all(|&b| b == 0xAB),
        "nothing past the last value"
    );
    // Every key answered: one last frame; a first value longer than the room: TOO_LONG.
    s.write_all(&room_request(
        GET_MANY_STREAMED,
        &packed(&[&keys[5]]),
        0,
        len as u64,
    ))
    .unwrap();
    assert_eq!(
        streamed_frames(&mut s, 1, |_| {}),
        (None, vec![(LAST_FRAME, vec![(f, 50_000)])]),
        "no plan when every key fits"
    );
    assert_eq!(mem(0, 50_000), values[5]);
    s.write_all(&room_request(
        GET_MANY_STREAMED,
        &packed(&[&keys[4], &keys[5]]),
        0,
        len as u64,
    ))
    .unwrap();
    assert_eq!(
        streamed_frames(&mut s, 2, |_| {}),
        (
            None,
            vec![(LAST_FRAME, vec![(MANY_TOO_LONG, 0), (f, 50_000)])]
        ),
        "the next key takes the whole room"
    );
    s.write_all(&room_request(GET_MANY_STREAMED, &[], 0, 4096))
        .unwrap();
    let (status, body) = raw_answer(&mut s);
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::InvalidArgument as i32)
    );
    s.write_all(&room_request(
        GET_MANY_STREAMED,
        &packed(&[&keys[1]]),
        len as u64 - 10,
        4096,
    ))
    .unwrap();
    let (status, body) = raw_answer(&mut s);
    assert_eq!(
        (status, failed(&body).0),
        (FAILED, tonic::Code::OutOfRange as i32),
        "the connection went on after the malformed batch"
    );
    let mut rest = [0u8; 1];
    assert_eq!(
        s.read(&mut rest).unwrap_or(0),
        0,
        "the connection stayed open"
    );
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(map.cast(), len) };
}

/// A client's single gets from a daemon on its host go through its staging buffer (the daemon
/// counts them as same-host), byte-exact for values up to the staging size; a longer value
/// and every get with `MORI_UMBP_SHM=0` take small ops.
#[test]
fn single_gets_take_shared_memory_on_the_same_host_and_small_ops_beyond_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone_with(dir.path(), &["--dram-bytes", "128M"], &[]);
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let big = mori_umbpd::client::SHM_STAGING_BYTES + 4096;
    let (_, values) = put_sized(&c, "g", 300, &[4096, 1 << 20, big]);
    let h0 = c.health().unwrap();
    assert_eq!(c.get(b"g-0").unwrap().as_deref(), Some(&values[0][..]));
    assert_eq!(c.get(b"g-1").unwrap().as_deref(), Some(&values[1][..]));
    assert_eq!(c.get(b"nope").unwrap(), None);
    let h1 = c.health().unwrap();
    assert_eq!(h1.same_host_served - h0.same_host_served, 3);
    // No small op: the staging buffer was made at the first put.
    assert_eq!(h1.small_ops_served, h0.small_ops_served);
    // Longer than the staging buffer: tried there (refused), then over small ops.
    assert_eq!(c.get(b"g-2").unwrap().as_deref(), Some(&values[2][..]));
    let h2 = c.health().unwrap();
    assert_eq!(h2.small_ops_served - h1.small_ops_served, 1);
    drop(c);
    // The switch: a client started with MORI_UMBP_SHM=0 (in a child, to keep this process's
    // environment) reads over small ops only.
    mori_testutil::run_ignored_child(
        "same_host_child_reads_over_small_ops",
        &[("MORI_UMBP_SHM", "0"), ("UMBP_TEST_ADDR", &d.addr)],
    );
}

/// Single gets and puts through the staging buffer keep the caller's lock when the real daemon
/// answers in time (some of a run do, even on a loaded machine; a call that let it go at the
/// start would keep it in none), and let it go while the daemon is stopped (SIGSTOP) before the
/// answer comes; what they read or stored once the daemon goes on is exact.
#[test]
fn single_gets_and_puts_keep_the_callers_lock_only_while_the_daemon_answers_in_time() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let (keys, values) = put_sized(&c, "held", 500, &[4096]);
    let mut v = Vec::new();
    assert_eq!(c.get_with(&keys[0], &mut v).unwrap(), Some(4096)); // connected
    let value = bytes(501, 4096);
    let (kept, tries) = kept_in_time(|held| {
        v.clear();
        assert_eq!(c.get_with_held(&keys[0], &mut v, held).unwrap(), Some(4096));
        assert_eq!(v, values[0]);
    });
    assert_eq!(kept, 10, "{tries} gets kept the caller's lock in {kept}");
    let mut n = 0;
    let (kept, tries) = kept_in_time(|held| {
        n += 1;
        assert!(
            c.put_held(format!("put-{n}").as_bytes(), &value, held)
                .unwrap()
        );
    });
    assert_eq!(kept, 10, "{tries} puts kept the caller's lock in {kept}");
    assert_eq!(
        c.get(format!("put-{n}").as_bytes()).unwrap(),
        Some(value.clone())
    );

    let (got, v) = called_while_stopped(&[&d], |held| {
        let mut v = Vec::new();
        (c.get_with_held(&keys[0], &mut v, held), v)
    });
    assert_eq!(got.unwrap(), Some(4096));
    assert_eq!(v, values[0]);
    let stored = called_while_stopped(&[&d], |held| c.put_held(b"put-stalled", &value, held));
    assert!(stored.unwrap());
    assert_eq!(c.get(b"put-stalled").unwrap(), Some(value));
}

/// The real daemon closing same-host connections idle for 1 s (`--same-host-idle-timeout`):
/// after each idle pause (the daemon logs the close) a batch and a single get still read
/// through shared memory over a new connection, byte-exact, every key counted in the daemon's
/// `same_host_served` (a batch that failed over to gRPC would count none).
#[test]
fn gets_and_batches_after_the_daemon_closed_an_idle_same_host_connection_read_through_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone_with(
        dir.path(),
        &["--dram-bytes", "64M", "--same-host-idle-timeout", "1s"],
        &[("UMBP_LOG", "mori_umbpd=debug")],
    );
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let (keys, values) = put_sized(&c, "idle", 500, &[4096, 100_000, 1 << 20]);
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let want: Vec<Option<Vec<u8>>> = values.iter().cloned().map(Some).collect();
    let closed = || {
        d.stderr()
            .matches("closed a same-host connection idle")
            .count()
    };
    for round in 0..3 {
        let h0 = c.health().unwrap();
        assert_eq!(
            c.batch_get(&refs).unwrap(),
            want,
            "round {round}: the batch"
        );
        assert_eq!(
            c.get(&keys[1]).unwrap().as_ref(),
            Some(&values[1]),
            "round {round}: the get"
        );
        let h1 = c.health().unwrap();
        assert_eq!(
            h1.same_host_served - h0.same_host_served,
            refs.len() as u64 + 1,
            "round {round}: every key through shared memory"
        );
        let before = closed();
        let t = std::time::Instant::now();
        while closed() == before {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(10),
                "round {round}: the idle connection was not closed:\n{}\n{}",
                d.stdout(),
                d.stderr()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Run by the test above in a child process with `MORI_UMBP_SHM=0`.
#[test]
#[ignore = "run by single_gets_take_shared_memory_on_the_same_host_and_small_ops_beyond_it"]
fn same_host_child_reads_over_small_ops() {
    let addr = std::env::var("UMBP_TEST_ADDR").unwrap();
    let c = Client::connect_with(&addr, &opts(GOOD)).unwrap();
    let h0 = c.health().unwrap();
    assert_eq!(c.get(b"g-0").unwrap().map(|v| v.len()), Some(4096));
    let h1 = c.health().unwrap();
    assert_eq!(h1.same_host_served, h0.same_host_served);
    assert_eq!(h1.small_ops_served - h0.small_ops_served, 1);
}

/// Writes one answer in small ops' framing.
fn raw_reply(s: &mut UnixStream, status: u8, body: &[u8]) {
    let mut a = vec![status];
    a.extend_from_slice(&(body.len() as u32).to_le_bytes());
    a.extend_from_slice(body);
    s.write_all(&a).unwrap();
}

/// One connection of a fake daemon on the raw protocol, past the handshake: the stream and the
/// client's buffer mapped here.
struct FakeConnection {
    s: UnixStream,
    map: *mut u8,
    len: usize,
}

/// The connections of a fake daemon older than doorbells: a hello that asks for them is
/// closed at once (as such a daemon closes a hello it does not know), and not counted.
fn older_connections<'a>(
    listener: &'a std::os::unix::net::UnixListener,
    secret: &'a Secret,
) -> impl Iterator<Item = FakeConnection> + 'a {
    listener
        .incoming()
        .filter_map(move |s| FakeConnection::accept(s.unwrap(), secret))
}

impl FakeConnection {
    /// Serves the handshake as a daemon older than doorbells does: the secret proven, the
    /// hello with the client's memfd, mapped, and its length answered; None (the connection
    /// closed) for a hello that asks for doorbells.
    fn accept(mut s: UnixStream, secret: &Secret) -> Option<FakeConnection> {
        mori_auth::accept(&mut s, secret, PURPOSE).unwrap();
        let mut hello = [0u8; 8];
        let fd = mori_umbpd::shm::recv_with_fd(&s, &mut hello)
            .unwrap()
            .unwrap();
        if &hello == HELLO_DOORBELL {
            return None;
        }
        assert_eq!(&hello, HELLO);
        // SAFETY: fstat into a zeroed struct; the memfd the client sent.
        let len = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::fstat(fd.as_raw_fd(), &mut st), 0);
            st.st_size as usize
        };
        let map = map_shared(&fd, len); // unmapped on drop
        raw_reply(&mut s, FOUND, &(len as u64).to_le_bytes());
        Some(FakeConnection { s, map, len })
    }

    /// The next request: its op, its key bytes (a batch's packed keys) and its 16 closing
    /// bytes (offset and bytes); None once the client closed.
    fn request(&mut self) -> Option<(u8, Vec<u8>, [u8; 16])> {
        let mut head = [0u8; 3];
        self.s.read_exact(&mut head).ok()?;
        let mut key = vec![0u8; u16::from_le_bytes([head[1], head[2]]) as usize];
        self.s.read_exact(&mut key).unwrap();
        let mut at = [0u8; 16];
        self.s.read_exact(&mut at).unwrap();
        Some((head[0], key, at))
    }

    /// Writes `bytes` at `offset` of the client's buffer.
    fn write(&mut self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.add(offset), bytes.len()) };
    }
}

impl Drop for FakeConnection {
    fn drop(&mut self) {
        // SAFETY: the mapping made in accept.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

/// The fake daemons' value of `key`: the key repeated to 100 bytes.
fn fake_value(key: &[u8]) -> Vec<u8> {
    key.iter().copied().cycle().take(100).collect()
}

/// A daemon older than batches into shared memory, on the raw protocol: it serves `GET_INTO`
/// (values: [`fake_value`]), closes its first connection after one get (as an idle connection
/// is closed), and answers `GET_MANY_INTO` `UNIMPLEMENTED` and closes, as a daemon that does not
/// know the op does. Logs "<connection> <op>".
fn older_daemon(listener: std::os::unix::net::UnixListener, secret: Secret, log: FakeLog) {
    for (conn, mut c) in older_connections(&listener, &secret).enumerate() {
        while let Some((op, key, at)) = c.request() {
            log.lock().unwrap().push(format!("{conn} {op}"));
            if op != GET_INTO {
                let mut body = 12i32.to_le_bytes().to_vec(); // UNIMPLEMENTED
                body.extend_from_slice(b"unknown same-host op");
                raw_reply(&mut c.s, FAILED, &body);
                break;
            }
            c.write(
                u64::from_le_bytes(at[..8].try_into().unwrap()) as usize,
                &fake_value(&key),
            );
            raw_reply(&mut c.s, FOUND, &100u64.to_le_bytes());
            if conn == 0 {
                break; // closed after one get, as when idle
            }
        }
    }
}

/// What a fake daemon logs, shared with the test.
type FakeLog = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// Runs `serve` on a new abstract socket (named after `tag`) on a thread, and returns a shared
/// buffer of 1 MiB connected to it (the first connection) and the fake's log.
fn fake_daemon(
    tag: &str,
    serve: fn(std::os::unix::net::UnixListener, Secret, FakeLog),
) -> (mori_umbpd::shm::SharedBuffer, FakeLog) {
    let secret = Secret::new(GOOD.as_bytes().to_vec()).unwrap();
    let name = format!("mori-umbpd-test-{tag}-{}", std::process::id()).into_bytes();
    let listener = std::os::unix::net::UnixListener::bind_addr(
        &SocketAddr::from_abstract_name(&name).unwrap(),
    )
    .unwrap();
    let log = FakeLog::default();
    let (s2, l2) = (secret.clone(), std::sync::Arc::clone(&log));
    std::thread::spawn(move || serve(listener, s2, l2));
    let buf = mori_umbpd::shm::SharedBuffer::connect(&name, &secret, 1 << 20).unwrap();
    (buf, log)
}

/// A shared buffer keeps working when the daemon closes its connection (it connects again and
/// hands the same memory over, the get asked once more), and against a daemon older than
/// batches: the batch fails `UNIMPLEMENTED` (the client then reads it another way), is not asked
/// again, and single gets go on over a new connection.
#[test]
fn shared_buffers_connect_again_and_stop_asking_an_older_daemon_for_batches() {
    let (buf, log) = fake_daemon("older", older_daemon);
    let read = |offset: usize| {
        // SAFETY: the mapping holds 1 MiB; nothing writes it while it is read here.
        unsafe { std::slice::from_raw_parts(buf.as_ptr().add(offset), 100) }.to_vec()
    };
    let want = fake_value;
    assert_eq!(buf.get_into(b"first", 0, 1000).unwrap(), Some(100));
    assert_eq!(read(0), want(b"first"));
    // The daemon closed that connection: this get connects again.
    assert_eq!(buf.get_into(b"second", 4096, 1000).unwrap(), Some(100));
    assert_eq!(read(4096), want(b"second"));
    let refused = buf.get_many_into(&[b"a", b"b"]).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused:?}");
    let again = buf.get_many_into(&[b"a"]).unwrap_err();
    assert_eq!(again.code(), tonic::Code::Unimplemented, "{again:?}");
    assert_eq!(buf.get_into(b"third", 8192, 1000).unwrap(), Some(100));
    assert_eq!(read(8192), want(b"third"));
    let (g, m) = (GET_INTO, GET_MANY_INTO);
    assert_eq!(
        *log.lock().unwrap(),
        [
            format!("0 {g}"),
            format!("1 {g}"),
            format!("1 {m}"),
            format!("2 {g}")
        ],
        "one batch request only, and a new connection after each close"
    );
}

/// A daemon that serves batches into shared memory on the raw protocol (every key found, its
/// value [`fake_value`] at the next 64-byte boundary of the request's room; a streamed batch
/// answered in one last frame) and closes each connection after one batch, as the daemon
/// closes one left idle between a client's batches. Logs "<connection> <op> <keys>".
fn batch_then_close_daemon(
    listener: std::os::unix::net::UnixListener,
    secret: Secret,
    log: FakeLog,
) {
    for (conn, mut c) in older_connections(&listener, &secret).enumerate() {
        let Some((op, packed, at)) = c.request() else {
            continue;
        };
        let (keys, frames) = fake_batch(&mut c, op, packed, at);
        log.lock().unwrap().push(format!("{conn} {op} {keys}"));
        for frame in frames {
            raw_reply(&mut c.s, FOUND, &frame);
        }
    } // each connection closed when its FakeConnection drops
}

/// Serves a fake batch (`op` [`GET_MANY_INTO`] or [`GET_MANY_STREAMED`], one answer or one
/// last frame) of the `packed` keys into the room at `at`: every key found, its value
/// [`fake_value`] at the next 64-byte boundary. Returns how many keys it answered and the
/// answer's frames (sent by the caller once it logged the request: a streamed batch's plan,
/// then its one last frame).
fn fake_batch(
    c: &mut FakeConnection,
    op: u8,
    mut packed: Vec<u8>,
    at: [u8; 16],
) -> (usize, Vec<Vec<u8>>) {
    let (mut offset, mut body, mut keys) = (
        u64::from_le_bytes(at[..8].try_into().unwrap()) as usize,
        Vec::new(),
        0,
    );
    if op == GET_MANY_STREAMED {
        body.push(LAST_FRAME);
    }
    while !packed.is_empty() {
        let len = u16::from_le_bytes([packed[0], packed[1]]) as usize;
        let key: Vec<u8> = packed.drain(..2 + len).skip(2).collect();
        c.write(offset, &fake_value(&key));
        body.push(MANY_FOUND);
        body.extend_from_slice(&100u64.to_le_bytes());
        offset = (offset + 100).next_multiple_of(MANY_ALIGN as usize);
        keys += 1;
    }
    if op != GET_MANY_STREAMED {
        return (keys, vec![body]);
    }
    // Every key fits: no plan is needed, but one is allowed.
    let mut plan = vec![PLANNED_FRAME];
    plan.extend_from_slice(&(keys as u64).to_le_bytes());
    (keys, vec![plan, body])
}

/// A daemon older than streamed batches, on the raw protocol: it answers [`GET_MANY_STREAMED`]
/// `UNIMPLEMENTED` and closes, as a daemon that does not know the op does, and serves
/// [`GET_MANY_INTO`] ([`fake_batch`]). Logs "<connection> <op> <keys>".
fn unstreamed_daemon(listener: std::os::unix::net::UnixListener, secret: Secret, log: FakeLog) {
    for (conn, mut c) in older_connections(&listener, &secret).enumerate() {
        while let Some((op, packed, at)) = c.request() {
            if op != GET_MANY_INTO {
                log.lock().unwrap().push(format!("{conn} {op}"));
                let mut body = 12i32.to_le_bytes().to_vec(); // UNIMPLEMENTED
                body.extend_from_slice(b"unknown same-host op");
                raw_reply(&mut c.s, FAILED, &body);
                break;
            }
            let (keys, frames) = fake_batch(&mut c, op, packed, at);
            log.lock().unwrap().push(format!("{conn} {op} {keys}"));
            for frame in frames {
                raw_reply(&mut c.s, FOUND, &frame);
            }
        }
    }
}

/// Reads `keys` through `buf` from a fake daemon: every value [`fake_value`], handed out in
/// key order with its own index.
fn read_fake_batch(buf: &mori_umbpd::shm::SharedBuffer, keys: &[&[u8]]) {
    let mut seen = Vec::new();
    let got = buf
        .get_many_with(keys, |i, v| {
            seen.push((i, v.to_vec()));
            Ok(())
        })
        .unwrap();
    assert_eq!(got, vec![Some(Some(100)); keys.len()]);
    let want: Vec<(usize, Vec<u8>)> = keys.iter().map(|k| fake_value(k)).enumerate().collect();
    assert_eq!(seen, want);
}

/// Against a daemon older than streamed batches, a batch is asked the older way on a new
/// connection (nothing was handed out), byte-exact, and later batches do not ask for streams
/// again.
#[test]
fn batches_ask_an_older_daemon_once_for_streams_then_the_older_way() {
    let (buf, log) = fake_daemon("unstreamed", unstreamed_daemon);
    let batches: [&[&[u8]]; 2] = [&[b"one", b"two", b"three"], &[b"four"]];
    for keys in batches {
        read_fake_batch(&buf, keys);
    }
    let (s, m) = (GET_MANY_STREAMED, GET_MANY_INTO);
    assert_eq!(
        *log.lock().unwrap(),
        [format!("0 {s}"), format!("1 {m} 3"), format!("1 {m} 1")],
        "streams asked once; both batches the older way over the new connection"
    );
}

/// A connection the daemon closed between two batches (as it closes idle ones) is made anew and
/// the batch asked again over it: every batch reads byte-exact through the shared buffer instead
/// of failing `UNAVAILABLE` (which sent the caller to gRPC for that batch).
#[test]
fn a_batch_after_the_daemon_closed_the_connection_connects_again() {
    let (buf, log) = fake_daemon("closing", batch_then_close_daemon);
    let batches: [&[&[u8]]; 3] = [&[b"one", b"two", b"three"], &[b"four", b"five"], &[b"six"]];
    for keys in batches {
        read_fake_batch(&buf, keys);
    }
    let m = GET_MANY_STREAMED;
    assert_eq!(
        *log.lock().unwrap(),
        [format!("0 {m} 3"), format!("1 {m} 2"), format!("2 {m} 1")],
        "each batch once, each over a new connection"
    );
}

/// A batch read half the buffer at a time, one request ahead: every value of many rounds
/// reaches the callback byte-exact, in key order, with its own index; absent keys are
/// `Some(None)`; a value longer than half the buffer is read with the whole buffer; one
/// longer than the whole buffer is `None` (left to another path); and a failing callback ends
/// the batch with its status, the buffer working on after it.
#[test]
fn batches_read_half_the_buffer_at_a_time_while_the_other_half_fills() {
    let dir = tempfile::tempdir().unwrap();
    let d = standalone(dir.path());
    let c = Client::connect_with(&d.addr, &opts(GOOD)).unwrap();
    let len = 1 << 20; // halves of 512 KiB
    // 30 values of 100–300 KB (many rounds), one of 700 KB (longer than a half), one of
    // 1.5 MB (longer than the buffer).
    let mut sizes: Vec<usize> = (0..30).map(|i| 100_000 + (i * 7_919) % 200_000).collect();
    sizes.insert(11, 700_000);
    sizes.insert(20, 1_500_000);
    let (keys, values) = put_sized(&c, "halves", 1200, &sizes);
    let buf = c.shared_buffer(len).unwrap();
    let mut ask: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    ask.insert(5, b"halves-absent");
    let mut expect: Vec<Option<&[u8]>> = values.iter().map(|v| Some(v.as_slice())).collect();
    expect.insert(5, None);
    let mut seen = Vec::new();
    let got = buf
        .get_many_with(&ask, |i, v| {
            seen.push(i);
            assert!(expect[i] == Some(v), "value of key {i}: {} bytes", v.len());
            Ok(())
        })
        .unwrap();
    let longer_than_half = 11 + 1; // index in `ask`, after the absent key
    let longer_than_buffer = 20 + 1;
    let want_seen: Vec<usize> = (0..ask.len())
        .filter(|&i| i != 5 && i != longer_than_half && i != longer_than_buffer)
        .chain([longer_than_half])
        .collect();
    assert_eq!(
        seen, want_seen,
        "values in key order, the one longer than a half last"
    );
    for (i, g) in got.iter().enumerate() {
        let want = match expect[i] {
            _ if i == longer_than_buffer => None,
            v => Some(v.map(<[u8]>::len)),
        };
        assert_eq!(*g, want, "answer for key {i}");
    }
    // A callback that fails ends the batch with its status; the buffer reads on afterwards.
    let failed = buf
        .get_many_with(&ask, |_, _| {
            Err(tonic::Status::resource_exhausted("no room"))
        })
        .unwrap_err();
    assert_eq!(failed.code(), tonic::Code::ResourceExhausted);
    let again = buf.get_many_with(&ask[..3], |_, _| Ok(())).unwrap();
    assert_eq!(
        again,
        [
            Some(Some(sizes[0])),
            Some(Some(sizes[1])),
            Some(Some(sizes[2]))
        ]
    );
}
