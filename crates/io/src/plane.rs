//! The data planes of an engine behind one trait. A checked batch (ranges inside both regions,
//! the peer connected, the descriptor current) is offered to each plane in turn, fastest first:
//! cuda_ipc (same host, the peer's region GPU memory exported for IPC), fabric (one-sided RMA
//! through libfabric, the peer's region registered with its NIC), then the stream plane (TCP,
//! or the same-host socket with direct copies), which reaches every connected peer. A plane
//! either launches the batch and returns its [`Transfer`] or hands it back untouched.
//!
//! Every plane keeps the same guarantees: the local registration is held until the batch is
//! done; a notified write's tag lands after its data (the stream plane sends it last on one
//! connection, the others send it over the peer's connection once every byte is back); a
//! peer's death fails the transfer within the engine's timeout.

use std::sync::Arc;
use std::time::Duration;

use mori_auth::Secret;
use mori_net::fabric::{RemoteRegion, Rma};
use mori_transport::connection::{BatchRequest, Job};
use mori_transport::cuda_ipc::{self, Importer};
use mori_transport::wire::Kind;
use mori_transport::{Batch, Error, Location, Result, Route, Transfer, UseGuard};

use crate::desc::MemoryDesc;
use crate::engine::{Op, Peer};
use crate::fabric::{self, FabricJob, FabricPlane};

/// A batch on its way to a plane.
pub(crate) struct Offer<'a> {
    pub op: Op,
    /// The local registration, held until the batch is done.
    pub local: Arc<UseGuard>,
    pub remote: &'a MemoryDesc,
    pub batch: Batch,
    pub notify: Option<&'a [u8]>,
    pub peer: Arc<Peer>,
}

/// What a plane did with an [`Offer`].
pub(crate) enum Taken<'a> {
    Launched(Transfer),
    /// Not this plane's: the offer, unchanged, for the next one.
    Declined(Offer<'a>),
}

/// One way of moving a batch between this engine's memory and a peer's.
pub(crate) trait Plane {
    /// Launches `offer` when this plane reaches the peer's region from the local one.
    fn offer<'a>(&self, offer: Offer<'a>) -> Result<Taken<'a>>;
}

/// Announces a write that moved by another route (cuda_ipc, fabric): an empty write request
/// carrying the tag, over the peer's connection; `done` completes when the peer recorded it.
fn send_tag(
    peer: &Peer,
    remote_region: u64,
    remote_key: u64,
    local: Arc<UseGuard>,
    tag: Vec<u8>,
    done: Transfer,
) {
    peer.pick().submit(Job {
        kind: Kind::Write,
        remote_region,
        remote_key,
        batch: Arc::new(Batch::default()),
        range: 0..0,
        local,
        notify: tag,
        transfer: done,
    });
}

/// Same host, the peer's region GPU memory exported for CUDA IPC: this engine's GPU copies
/// through an IPC mapping of it. Completes when the GPU is done and the peer is still
/// connected; a notified write then sends its tag.
pub(crate) struct IpcPlane<'e> {
    pub importer: &'e Importer,
    pub timeout: Duration,
}

impl Plane for IpcPlane<'_> {
    fn offer<'a>(&self, o: Offer<'a>) -> Result<Taken<'a>> {
        let Some(blob) = o.remote.ipc.as_ref().filter(|_| o.peer.same_host) else {
            return Ok(Taken::Declined(o));
        };
        let Some(prepared) = self.importer.prepare(
            &o.remote.engine,
            o.peer.conns.first().and_then(|c| c.peer_pid()),
            o.local.region(),
            blob,
            o.remote.len,
        )?
        else {
            return Ok(Taken::Declined(o));
        };
        let transfer = Transfer::on_route(1, Route::CudaIpc);
        let done = transfer.clone();
        let tag = o.notify.map(<[u8]>::to_vec);
        let (remote_id, remote_key) = (o.remote.id, o.remote.key);
        let (name, local, peer) = (o.remote.engine.clone(), o.local.clone(), o.peer.clone());
        let finish: cuda_ipc::Finish = Box::new(move |outcome| match outcome {
            Err(e) => done.part_done(Err(&e)),
            Ok(()) if !peer.alive() => done.part_done(Err(&Error::ConnectionLost {
                peer: name,
                detail: "the peer's connections closed during a cuda_ipc transfer".into(),
            })),
            Ok(()) => match tag {
                Some(tag) => send_tag(&peer, remote_id, remote_key, local, tag, done),
                None => done.part_done(Ok(())),
            },
        });
        let region = *o.local.region();
        // SAFETY: this is the submitting call, during which a borrowed batch's arrays are not
        // written (Batch::borrowed's contract); the importer copies what it keeps.
        let (local_offsets, remote_offsets, sizes) = unsafe { o.batch.slices() };
        self.importer.launch(
            prepared,
            o.op == Op::Write,
            &region,
            local_offsets,
            remote_offsets,
            sizes,
            &o.remote.engine,
            self.timeout,
            Box::new(o.local),
            finish,
        )?;
        Ok(Taken::Launched(transfer))
    }
}

/// A peer reached over this engine's fabric endpoints, its region registered with its NICs:
/// one-sided RMA posted by the fabric threads. With several endpoints (one per NIC) a batch is
/// striped: its items are dealt to the endpoints by bytes (each to the least loaded), endpoint i
/// talking to the peer's endpoint i. This side's GPU memory that no NIC registers goes through
/// the first endpoint's staging slots. A notified write sends its tag over the peer's
/// connection once every part is back.
pub(crate) struct FabricRoute<'e> {
    pub planes: &'e [FabricPlane],
    /// Unmasks the remote keys the peer's descriptor carries.
    pub secret: &'e Secret,
}

/// What the parts of one striped batch share: the parts still running and the first failure.
struct Parts {
    left: std::sync::atomic::AtomicUsize,
    failure: std::sync::Mutex<Option<Error>>,
}

/// Deals the items of a batch to `k` stripes, each item to the stripe with the fewest bytes so
/// far: the stripes' batches and the items each holds.
fn stripe(batch: &Batch, k: usize) -> Result<Vec<Batch>> {
    // SAFETY: this is the submitting call, during which a borrowed batch's arrays are not
    // written (Batch::borrowed's contract); the stripes copy what they keep.
    let (local, remote, sizes) = unsafe { batch.slices() };
    let mut bytes = vec![0u64; k];
    let mut items: Vec<Vec<usize>> = vec![Vec::new(); k];
    for (i, &size) in sizes.iter().enumerate() {
        let p = (0..k)
            .min_by_key(|&p| bytes[p])
            .expect("at least one stripe");
        bytes[p] += size;
        items[p].push(i);
    }
    items
        .into_iter()
        .map(|idx| {
            let pick = |a: &[u64]| idx.iter().map(|&i| a[i]).collect::<Vec<u64>>();
            Batch::owned(pick(local), pick(remote), pick(sizes))
        })
        .collect()
}

impl Plane for FabricRoute<'_> {
    fn offer<'a>(&self, o: Offer<'a>) -> Result<Taken<'a>> {
        let stripes = o
            .peer
            .fabric
            .len()
            .min(o.remote.fabric.len())
            .min(self.planes.len());
        if stripes == 0 {
            return Ok(Taken::Declined(o));
        }
        let staged = self.planes[0].is_staged(o.local.region().id);
        if staged && o.local.region().independent {
            // Staging copies are ordered with the legacy default stream; an independent
            // region's must not be: the stream plane copies it on a stream of its own.
            return Ok(Taken::Declined(o));
        }
        // Staged memory goes through one endpoint's slots; so does a batch of one item.
        let stripes = if staged || o.batch.len() < 2 {
            1
        } else {
            stripes
        };
        let route = if staged {
            Route::FabricStaged
        } else {
            Route::Fabric
        };
        let transfer = Transfer::on_route(1, route);
        let done = transfer.clone();
        let tag = o.notify.map(<[u8]>::to_vec);
        let remote = o.remote;
        let (remote_id, remote_key) = (remote.id, remote.key);
        let (local, peer) = (o.local.clone(), o.peer.clone());
        // Runs once, when the last part is back.
        let complete = move |outcome: Result<()>| match (outcome, tag) {
            (Err(e), _) => done.part_done(Err(&e)),
            (Ok(()), Some(tag)) => send_tag(&peer, remote_id, remote_key, local, tag, done),
            (Ok(()), None) => done.part_done(Ok(())),
        };
        let op = match o.op {
            Op::Read => Rma::Read,
            Op::Write => Rma::Write,
        };
        let mask = fabric::mask(self.secret, remote.instance, remote.id, remote.key);
        let job = |i: usize, batch: Batch, finish: fabric::Finish| FabricJob {
            op,
            local: o.local.clone(),
            peer: o.peer.fabric[i],
            peer_name: remote.engine.clone(),
            remote: RemoteRegion {
                base: remote.fabric[i].base,
                len: remote.len,
                key: remote.fabric[i].masked_key ^ mask,
            },
            batch: Arc::new(batch),
            finish,
        };
        if stripes == 1 {
            self.planes[0].run(job(0, o.batch, Box::new(complete)));
            return Ok(Taken::Launched(transfer));
        }
        let parts = stripe(&o.batch, stripes)?;
        let shared = Arc::new(Parts {
            left: std::sync::atomic::AtomicUsize::new(parts.len()),
            failure: std::sync::Mutex::new(None),
        });
        let complete = Arc::new(std::sync::Mutex::new(Some(complete)));
        for (i, part) in parts.into_iter().enumerate() {
            let (shared, complete) = (shared.clone(), complete.clone());
            let finish: fabric::Finish = Box::new(move |outcome: Result<()>| {
                if let Err(e) = outcome
                    && let Ok(mut f) = shared.failure.lock()
                {
                    f.get_or_insert(e);
                }
                if shared
                    .left
                    .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
                    == 1
                {
                    let failure = shared.failure.lock().ok().and_then(|mut f| f.take());
                    if let Some(run) = complete.lock().ok().and_then(|mut c| c.take()) {
                        run(failure.map_or(Ok(()), Err));
                    }
                }
            });
            self.planes[i].run(job(i, part, finish));
        }
        Ok(Taken::Launched(transfer))
    }
}

/// The engine's connections to the peer: TCP, or the same-host socket, where host memory on
/// both sides moves by a direct copy between the processes. Takes every offer.
pub(crate) struct StreamPlane {
    /// About this many bytes per request.
    pub chunk_bytes: u64,
}

impl Plane for StreamPlane {
    fn offer<'a>(&self, o: Offer<'a>) -> Result<Taken<'a>> {
        let peer = &o.peer;
        let direct = peer.local
            && o.local.region().location == Location::Host
            && o.remote.location == Location::Host
            && peer.conns.iter().all(|c| c.direct_ok());
        let kind = match (o.op, direct) {
            (Op::Read, false) => Kind::Read,
            (Op::Write, false) => Kind::Write,
            (Op::Read, true) => Kind::DirectRead,
            (Op::Write, true) => Kind::DirectWrite,
        };
        // One hand-over to one connection: its sender cuts the batch into requests of about
        // chunk_bytes and deals them round-robin over the live connections (one hand-over to
        // each, off this thread); a notified write stays on its connection, in order, so its
        // last request lands last.
        let share = (o.notify.is_none() && peer.conns.len() > 1).then(|| peer.conns.clone());
        Ok(Taken::Launched(peer.pick().submit_batch(
            BatchRequest {
                kind,
                remote_region: o.remote.id,
                remote_key: o.remote.key,
                batch: o.batch,
                local: o.local,
                notify: o.notify.map(<[u8]>::to_vec).unwrap_or_default(),
                chunk_bytes: self.chunk_bytes,
                route: match (direct, peer.local) {
                    (true, _) => Route::Direct,
                    (false, true) => Route::Local,
                    (false, false) => Route::Tcp,
                },
            },
            share,
        )))
    }
}
