//! Registered memory: regions another engine may read or write, by id.
//!
//! A region is registered once (not per block). Every access takes a use guard; deregistering
//! removes the id at once (new requests fail) and then waits for the guards in flight, so no
//! access outlives the registration.

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
    pub addr: u64,
    pub len: u64,
    pub location: Location,
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
    pub fn register(&self, addr: u64, len: u64, location: Location) -> Result<Region> {
        if addr == 0 && len > 0 {
            return Err(Error::InvalidArgument(
                "cannot register a null address".into(),
            ));
        }
        let region = Region {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr,
            len,
            location,
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

    /// Removes region `id`, then waits (up to `timeout`) for accesses in flight.
    pub fn deregister(&self, id: u64, timeout: Duration) -> Result<()> {
        let entry = self
            .regions
            .write()
            .map_err(|_| poisoned())?
            .remove(&id)
            .ok_or_else(|| Error::UnknownRegion(format!("memory region {id} is not registered")))?;
        let deadline = Instant::now() + timeout;
        let mut n = entry.in_use.lock().map_err(|_| poisoned())?;
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::InvalidArgument(format!(
                    "region {id} was deregistered but {} transfer(s) still use it after {:.1}s",
                    *n,
                    timeout.as_secs_f64()
                )));
            }
            n = entry.idle.wait_timeout(n, left).map_err(|_| poisoned())?.0;
        }
        Ok(())
    }

    /// Deregisters every region (waiting for accesses in flight), e.g. when an engine closes.
    pub fn deregister_all(&self, timeout: Duration) -> Result<()> {
        let ids: Vec<u64> = self
            .regions
            .read()
            .map_err(|_| poisoned())?
            .keys()
            .copied()
            .collect();
        ids.into_iter()
            .try_for_each(|id| match self.deregister(id, timeout) {
                Err(Error::UnknownRegion(_)) => Ok(()),
                other => other,
            })
    }

    /// A use guard for region `id`.
    pub fn acquire(&self, id: u64) -> Result<UseGuard> {
        let entry = self
            .regions
            .read()
            .map_err(|_| poisoned())?
            .get(&id)
            .cloned()
            .ok_or_else(|| {
                Error::UnknownRegion(format!(
                    "memory region {id} is not registered (or was deregistered)"
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

    #[test]
    fn ranges_ids_and_deregistration() {
        let reg = Registry::new();
        let mut buf = vec![0u8; 100];
        let r = reg
            .register(buf.as_mut_ptr() as u64, 100, Location::Host)
            .unwrap();
        assert!(r.check(0, 100).is_ok() && r.check(99, 1).is_ok());
        assert!(matches!(r.check(99, 2), Err(Error::OutOfRange(_))));
        assert!(matches!(r.check(u64::MAX, 2), Err(Error::OutOfRange(_))));
        let guard = reg.acquire(r.id).unwrap();
        // Deregistration waits for the guard, then succeeds.
        let reg = Arc::new(reg);
        let r2 = reg.clone();
        let t = std::thread::spawn(move || r2.deregister(r.id, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            matches!(reg.acquire(r.id), Err(Error::UnknownRegion(_))),
            "new uses fail at once"
        );
        drop(guard);
        t.join().unwrap().unwrap();
        assert!(reg.deregister(r.id, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn busy_region_times_out() {
        let reg = Registry::new();
        let r = reg.register(0x1000, 10, Location::Host).unwrap();
        let _g = reg.acquire(r.id).unwrap();
        assert!(reg.deregister(r.id, Duration::from_millis(50)).is_err());
    }
}
