//! The symmetric heap's memory: one reserved VA range per PE (ours and each reachable peer's),
//! backed chunk by chunk as allocations grow. Each chunk is created on our GPU, exported as a
//! file descriptor and passed to every reachable peer over a Unix socket; each peer maps it at
//! the same offset of the range it reserved for us.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mori_gpu::fdpass::{self, Peer};
use mori_gpu::{Device, Mapping, PhysicalMemory, VaRange};

use crate::error::{Error, Result};

/// Smallest chunk mapped at once, so many small allocations cost few exchanges.
const MIN_CHUNK: u64 = 32 << 20;

struct Chunk {
    // Drop order: unmap before releasing the memory.
    _mapping: Mapping,
    _memory: PhysicalMemory,
}

/// One PE's heap as mapped in this process.
struct MappedHeap {
    // Drop order: chunks (unmapped) before the range is freed.
    chunks: Vec<Chunk>,
    range: VaRange,
}

pub struct SymmetricHeap {
    device: Device,
    my_pe: usize,
    granularity: u64,
    size: u64,
    local: MappedHeap,
    /// Indexed by PE; None for ourselves and for peers we cannot reach by load/store.
    peers: Vec<Option<MappedHeap>>,
    /// Bytes from offset 0 backed by memory on every PE.
    backed: u64,
    /// Growth steps so far (names the sockets of each exchange).
    steps: u64,
    /// Indexed by PE: the process a chunk is sent to / received from.
    processes: Vec<Peer>,
    socket_dir: PathBuf,
    timeout: Duration,
}

impl SymmetricHeap {
    /// Reserves VA for our heap and for each PE in `reachable` (ours excluded).
    pub fn reserve(
        device: Device,
        my_pe: usize,
        size: u64,
        reachable: &[bool],
        processes: Vec<Peer>,
        socket_dir: PathBuf,
        timeout: Duration,
    ) -> Result<Self> {
        let granularity = mori_gpu::vmm_granularity(device)? as u64;
        let size = size.div_ceil(granularity) * granularity;
        let reserve = || -> Result<MappedHeap> {
            Ok(MappedHeap {
                chunks: Vec::new(),
                range: VaRange::reserve(size as usize, granularity as usize)?,
            })
        };
        let local = reserve()?;
        let peers = reachable
            .iter()
            .enumerate()
            .map(|(pe, &r)| {
                if r && pe != my_pe {
                    reserve().map(Some)
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            device,
            my_pe,
            granularity,
            size,
            local,
            peers,
            backed: 0,
            steps: 0,
            processes,
            socket_dir,
            timeout,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn local_base(&self) -> u64 {
        self.local.range.base()
    }
    /// Where `pe`'s heap is mapped here (ours included), or None if it is not reachable.
    pub fn base_of(&self, pe: usize) -> Option<u64> {
        if pe == self.my_pe {
            return Some(self.local_base());
        }
        self.peers.get(pe)?.as_ref().map(|h| h.range.base())
    }

    /// The process of `pe` (any process of this user when its pid is not comparable).
    fn process(&self, pe: usize) -> Peer {
        self.processes.get(pe).copied().unwrap_or_default()
    }

    fn socket(&self, from: usize, to: usize) -> PathBuf {
        self.socket_dir
            .join(format!("g{}-{from}-{to}.sock", self.steps))
    }

    /// Backs offsets `[0, end)` with memory on every PE. Collective: every PE calls it with the
    /// same `end` (the allocator is deterministic), and each pair of reachable PEs swaps chunks.
    pub fn ensure_backed(&mut self, end: u64) -> Result<()> {
        if end <= self.backed {
            return Ok(());
        }
        if end > self.size {
            return Err(Error::InvalidArgument(format!(
                "offset {end} lies beyond the {}-byte heap",
                self.size
            )));
        }
        let want = (end - self.backed)
            .max(MIN_CHUNK)
            .min(self.size - self.backed);
        let chunk_size = want.div_ceil(self.granularity) * self.granularity;
        let offset = self.backed;
        let memory = PhysicalMemory::create(self.device, chunk_size as usize)?;
        // SAFETY: [offset, offset + chunk) lies inside our reserved range and is not mapped yet
        // (`backed` only grows); the range outlives the chunk (MappedHeap's field order).
        let mapping =
            unsafe { Mapping::new(self.local.range.base() + offset, &memory, &[self.device])? };
        let fd = memory.export_fd()?;
        let peers: Vec<usize> = (0..self.peers.len())
            .filter(|&pe| self.peers[pe].is_some())
            .collect();
        let payload = chunk_size.to_le_bytes();
        let received = std::thread::scope(|scope| -> Result<Vec<(usize, PhysicalMemory)>> {
            let senders: Vec<_> = peers
                .iter()
                .map(|&pe| {
                    let path = self.socket(self.my_pe, pe);
                    let raw = fd.as_raw_fd();
                    let (timeout, to) = (self.timeout, self.process(pe));
                    scope.spawn(move || fdpass::serve_fd_to(&path, raw, &payload, to, timeout))
                })
                .collect();
            let mut imported = Vec::with_capacity(peers.len());
            let mut first_error = None;
            for &pe in &peers {
                match self.receive_chunk(pe, chunk_size) {
                    Ok(m) => imported.push((pe, m)),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            for s in senders {
                let sent = s
                    .join()
                    .map_err(|_| Error::InvalidArgument("an fd sender thread panicked".into()))?;
                if let Err(e) = sent {
                    first_error.get_or_insert(e.into());
                }
            }
            match first_error {
                Some(e) => Err(e),
                None => Ok(imported),
            }
        })?;
        self.local.chunks.push(Chunk {
            _mapping: mapping,
            _memory: memory,
        });
        for (pe, memory) in received {
            let heap = self.peers[pe]
                .as_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("PE {pe} has no mapped heap")))?;
            // SAFETY: as above, for the range reserved for `pe`.
            let mapping =
                unsafe { Mapping::new(heap.range.base() + offset, &memory, &[self.device])? };
            heap.chunks.push(Chunk {
                _mapping: mapping,
                _memory: memory,
            });
        }
        self.backed = offset + chunk_size;
        self.steps += 1;
        tracing::debug!(
            "symmetric heap backed to {} bytes ({} peers mapped)",
            self.backed,
            peers.len()
        );
        // A request bigger than MIN_CHUNK may still not be covered if it was clamped.
        if self.backed < end {
            self.ensure_backed(end)
        } else {
            Ok(())
        }
    }

    fn receive_chunk(&self, pe: usize, chunk_size: u64) -> Result<PhysicalMemory> {
        let (fd, payload) =
            fdpass::receive_fd_from(&self.socket(pe, self.my_pe), self.process(pe), self.timeout)?;
        let size = u64::from_le_bytes(payload.as_slice().try_into().unwrap_or([0; 8]));
        if size != chunk_size {
            return Err(Error::Mismatch(format!(
                "PE {pe} backed a {size}-byte heap chunk where PE {} backed {chunk_size}: the PEs' allocation sequences differ",
                self.my_pe
            )));
        }
        Ok(PhysicalMemory::import(fd, size as usize, usize::MAX)?)
    }

    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }
}
