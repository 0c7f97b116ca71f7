//! Registered memory: regions another engine may read or write, by id and key.
//!
//! A region is registered once (not per block) and gets a random 64-bit key: a request must
//! name both, so a region whose descriptor was never shared cannot be reached by guessing ids.
//! Every access takes a use guard; deregistering removes the id at once (new requests fail),
//! waits for the guards in flight and, past the timeout, fences them (the caller's hook cuts
//! the connections that hold them), so no access outlives the registration.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    Host,
    /// CUDA device, by ordinal in the owning process.
    Cuda(u32),
}

impl Location {
    pub fn encode(self) -> i32 {
        match self {
            Location::Host => -1,
            Location::Cuda(d) => d as i32,
        }
    }
    pub fn decode(v: i32) -> Location {
        if v < 0 {
            Location::Host
        } else {
            Location::Cuda(v as u32)
        }
    }
}

/// A registered region: `len` bytes at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub id: u64,
    /// Random; requests must name it.
    pub key: u64,
    pub addr: u64,
    pub len: u64,
    pub location: Location,
    /// False for memory the owner may not have written (read-only buffers): writes to it, and
    /// reads into it, are refused.
    pub writable: bool,
    /// Device memory whose copies run on a stream of their own instead of after the legacy
    /// default stream's work (see [`Registry::register_independent`]).
    pub independent: bool,
}

impl Region {
    /// Checks `[offset, offset + len)` against the region.
    pub fn check(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange(format!(
                "range [{offset}, {offset}+{len}) lies outside region {} of {} bytes",
                self.id, self.len
            ))),
        }
    }
}

#[derive(Debug)]
pub struct Entry {
    pub region: Region,
    in_use: Mutex<usize>,
    idle: Condvar,
}

impl Entry {
    /// Waits up to `timeout` for the guards to drop; returns how many remain.
    fn wait_idle(&self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut n = self.in_use.lock().map_err(|_| poisoned())?;
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            n = self.idle.wait_timeout(n, left).map_err(|_| poisoned())?.0;
        }
        Ok(*n)
    }
}

/// Keeps a region registered while an access is in flight.
pub struct UseGuard(Arc<Entry>);

impl UseGuard {
    pub fn region(&self) -> &Region {
        &self.0.region
    }
}

impl Drop for UseGuard {
    fn drop(&mut self) {
        if let Ok(mut n) = self.0.in_use.lock() {
            *n -= 1;
            if *n == 0 {
                self.0.idle.notify_all();
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct Registry {
    regions: RwLock<HashMap<u64, Arc<Entry>>>,
    next_id: AtomicU64,
}

impl Registry {
    pub fn new() -> Self {
        Self {
            regions: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    /// Registers `len` bytes at `addr`. The caller keeps the memory valid until it deregisters.
    /// Device memory is copied after the work queued earlier on the legacy default stream
    /// (torch's default stream), so data a kernel wrote there before a transfer is what moves.
    pub fn register(
        &self,
        addr: u64,
        len: u64,
        location: Location,
        writable: bool,
    ) -> Result<Region> {
        self.insert(addr, len, location, writable, false)
    }

    /// [`register`](Self::register) for device memory that is moved while its owner's kernels
    /// run (the shmem proxy's heap: a kernel waits on the GPU for the transfer it asked for, so
    /// a copy queued behind it would never start). Its copies use a non-blocking stream of
    /// their own; ordering with the GPU's work is the owner's (the proxy's requests are posted
    /// after the data they move was written).
    pub fn register_independent(
        &self,
        addr: u64,
        len: u64,
        location: Location,
        writable: bool,
    ) -> Result<Region> {
        self.insert(addr, len, location, writable, true)
    }

    fn insert(
        &self,
        addr: u64,
        len: u64,
        location: Location,
        writable: bool,
        independent: bool,
    ) -> Result<Region> {
        if addr == 0 && len > 0 {
            return Err(Error::InvalidArgument(
                "cannot register a null address".into(),
            ));
        }
        let mut key = [0u8; 8];
        getrandom::fill(&mut key)
            .map_err(|e| Error::InvalidArgument(format!("no random bytes from the OS: {e}")))?;
        let region = Region {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key: u64::from_le_bytes(key),
            addr,
            len,
            location,
            writable,
            independent,
        };
        let entry = Arc::new(Entry {
            region,
            in_use: Mutex::new(0),
            idle: Condvar::new(),
        });
        self.regions
            .write()
            .map_err(|_| poisoned())?
            .insert(region.id, entry);
        Ok(region)
    }

    /// Removes region `id` (new requests fail at once), then waits up to `timeout` for
    /// accesses in flight; past it calls `fence(id)` — which must make every holder of the
    /// region's guards drop them promptly (e.g. cut their connections) — and waits up to
    /// `timeout` again. Fails with `StillInUse` only if accesses remain after that: the memory
    /// must then stay allocated.
    pub fn deregister(&self, id: u64, timeout: Duration, fence: &dyn Fn(u64)) -> Result<()> {
        let entry = self
            .regions
            .write()
            .map_err(|_| poisoned())?
            .remove(&id)
            .ok_or_else(|| Error::UnknownRegion(format!("memory region {id} is not registered")))?;
        if entry.wait_idle(timeout)? == 0 {
            return Ok(());
        }
        tracing::warn!("region {id}: accesses still in flight after deregistration; fencing");
        fence(id);
        match entry.wait_idle(timeout)? {
            0 => Ok(()),
            n => Err(Error::StillInUse(format!(
                "region {id} was deregistered but {n} access(es) still use it after fencing; \
                 keep the memory allocated"
            ))),
        }
    }

    /// Deregisters every region (waiting for accesses in flight), e.g. when an engine closes.
    pub fn deregister_all(&self, timeout: Duration, fence: &dyn Fn(u64)) -> Result<()> {
        let ids: Vec<u64> = self
            .regions
            .read()
            .map_err(|_| poisoned())?
            .keys()
            .copied()
            .collect();
        ids.into_iter()
            .try_for_each(|id| match self.deregister(id, timeout, fence) {
                Err(Error::UnknownRegion(_)) => Ok(()),
                other => other,
            })
    }

    /// A use guard for region `id`, whose key must be `key`. An unknown id and a wrong key
    /// give the same answer, so the error tells a prober nothing.
    pub fn acquire(&self, id: u64, key: u64) -> Result<UseGuard> {
        let entry = self
            .regions
            .read()
            .map_err(|_| poisoned())?
            .get(&id)
            .filter(|e| e.region.key == key)
            .cloned()
            .ok_or_else(|| {
                Error::UnknownRegion(format!(
                    "memory region {id} is not registered with that key (never shared, \
                     deregistered, or a descriptor of another registration)"
                ))
            })?;
        *entry.in_use.lock().map_err(|_| poisoned())? += 1;
        Ok(UseGuard(entry))
    }

    pub fn len(&self) -> usize {
        self.regions.read().map(|r| r.len()).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned the memory registry".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_fence(_: u64) {}

    #[test]
    fn ranges_keys_and_deregistration() {
        let reg = Registry::new();
        let mut buf = vec![0u8; 100];
        let r = reg
            .register(buf.as_mut_ptr() as u64, 100, Location::Host, true)
            .unwrap();
        assert!(r.check(0, 100).is_ok() && r.check(99, 1).is_ok());
        assert!(matches!(r.check(99, 2), Err(Error::OutOfRange(_))));
        assert!(matches!(r.check(u64::MAX, 2), Err(Error::OutOfRange(_))));
        let wrong_key = reg.acquire(r.id, r.key ^ 1).err().unwrap().to_string();
        let unknown = reg.acquire(r.id + 1, r.key).err().unwrap().to_string();
        assert_eq!(
            wrong_key.replace(&r.id.to_string(), "#"),
            unknown.replace(&(r.id + 1).to_string(), "#"),
            "a wrong key and an unknown id answer alike"
        );
        let other = reg.register(0x1000, 1, Location::Host, true).unwrap();
        assert_ne!(r.key, other.key);
        let guard = reg.acquire(r.id, r.key).unwrap();
        // Deregistration waits for the guard, then succeeds.
        let reg = Arc::new(reg);
        let r2 = reg.clone();
        let t = std::thread::spawn(move || r2.deregister(r.id, Duration::from_secs(5), &no_fence));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            matches!(reg.acquire(r.id, r.key), Err(Error::UnknownRegion(_))),
            "new uses fail at once"
        );
        drop(guard);
        t.join().unwrap().unwrap();
        assert!(
            reg.deregister(r.id, Duration::from_secs(1), &no_fence)
                .is_err()
        );
    }

    #[test]
    fn a_busy_region_is_fenced_and_only_then_released() {
        let reg = Registry::new();
        let r = reg.register(0x1000, 10, Location::Host, true).unwrap();
        let held = Arc::new(Mutex::new(Some(reg.acquire(r.id, r.key).unwrap())));
        let fenced = std::sync::atomic::AtomicBool::new(false);
        let h = held.clone();
        let fence = |id: u64| {
            assert_eq!(id, r.id);
            fenced.store(true, Ordering::SeqCst);
            h.lock().unwrap().take(); // the fenced holder drops its guard
        };
        reg.deregister(r.id, Duration::from_millis(50), &fence)
            .unwrap();
        assert!(fenced.load(Ordering::SeqCst));
        // A holder that ignores the fence: deregistration says the memory is still in use.
        let r = reg.register(0x1000, 10, Location::Host, true).unwrap();
        let _stuck = reg.acquire(r.id, r.key).unwrap();
        let err = reg
            .deregister(r.id, Duration::from_millis(20), &no_fence)
            .unwrap_err();
        assert!(matches!(err, Error::StillInUse(_)), "{err}");
    }
}
