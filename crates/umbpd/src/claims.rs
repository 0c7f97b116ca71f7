//! One put of a key at a time on a cluster peer, from storing it to settling its publication.
//!
//! A peer stores a put's values, publishes the keys to the master, and drops the copies of those
//! the master places at another peer (another writer won). Two puts of one key on one peer must
//! not interleave those steps: a losing put drops whatever the key holds in the pool, so its drop
//! could take the value a later put stored meanwhile, and that put, finding nothing to publish,
//! would answer stored while the master places the key elsewhere (two writers told they won).
//! A heartbeat reporting the keys the pool dropped by itself must not cross a put of such a key
//! either: the master would forget the value that put just published. Both hold a [`KeyClaim`]
//! on their keys from before they look at the pool until the master has answered.

use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// The keys claimed on one peer.
#[derive(Debug, Default)]
pub struct PutClaims {
    held: Mutex<HashSet<Vec<u8>>>,
    freed: Condvar,
}

/// Keys held by one put (or heartbeat) until dropped.
#[derive(Debug)]
pub struct KeyClaim {
    claims: Arc<PutClaims>,
    keys: Vec<Vec<u8>>,
}

impl PutClaims {
    /// Claims `keys` (duplicates allowed), blocking while any of them is claimed: all of them
    /// are taken at once, so two claims never wait on each other.
    pub fn claim<'k>(self: &Arc<Self>, keys: impl IntoIterator<Item = &'k [u8]>) -> KeyClaim {
        let mut keys: Vec<Vec<u8>> = keys.into_iter().map(<[u8]>::to_vec).collect();
        keys.sort_unstable();
        keys.dedup();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        while keys.iter().any(|k| held.contains(k)) {
            held = self
                .freed
                .wait(held)
                .unwrap_or_else(PoisonError::into_inner);
        }
        held.extend(keys.iter().cloned());
        KeyClaim {
            claims: Arc::clone(self),
            keys,
        }
    }

    /// Claims those of `keys` no one holds, without waiting: their claim, and the keys held by
    /// others (a put of each is under way). A heartbeat takes its keys this way, so puts of
    /// dropped keys can never hold its report back (the master would declare the peer dead).
    pub fn claim_free(self: &Arc<Self>, mut keys: Vec<Vec<u8>>) -> (KeyClaim, Vec<Vec<u8>>) {
        keys.sort_unstable();
        keys.dedup();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let (free, busy): (Vec<_>, Vec<_>) = keys.into_iter().partition(|k| !held.contains(k));
        held.extend(free.iter().cloned());
        let claim = KeyClaim {
            claims: Arc::clone(self),
            keys: free,
        };
        (claim, busy)
    }
}

impl KeyClaim {
    /// The keys claimed (sorted, once each, for [`PutClaims::claim`]).
    pub fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }
}

impl Drop for KeyClaim {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut held = self
            .claims
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for k in &self.keys {
            held.remove(k);
        }
        drop(held);
        self.claims.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A claim on a key waits for the claim holding it; claims of other keys do not wait, and a
    /// batch claiming a held key among free ones takes none of them until it can take all.
    #[test]
    fn a_claimed_key_waits_for_its_holder_and_other_keys_do_not() {
        let claims = Arc::new(PutClaims::default());
        let first = claims.claim([&b"k"[..], b"k", b"a"]);
        let other = claims.claim([&b"b"[..]]);
        let done = AtomicUsize::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                let _batch = claims.claim([&b"c"[..], b"k"]);
                done.fetch_add(1, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(done.load(Ordering::SeqCst), 0, "waits while k is claimed");
            // "c" was not taken by the waiting batch: it is free to claim.
            drop(claims.claim([&b"c"[..]]));
            drop(other);
            assert_eq!(
                done.load(Ordering::SeqCst),
                0,
                "b's release does not free k"
            );
            drop(first);
        });
        assert_eq!(done.load(Ordering::SeqCst), 1);
        // Without waiting: the free keys are claimed (once each), the held one is named.
        let put = claims.claim([&b"p"[..]]);
        let keys = |ks: &[&[u8]]| ks.iter().map(|k| k.to_vec()).collect::<Vec<_>>();
        let (report, busy) = claims.claim_free(keys(&[b"d", b"p", b"d", b"e"]));
        assert_eq!(report.keys(), keys(&[b"d", b"e"]).as_slice());
        assert_eq!(busy, keys(&[b"p"]));
        drop(claims.claim_free(keys(&[b"x"])));
        assert!(
            claims.claim_free(keys(&[b"d"])).1 == keys(&[b"d"]),
            "d held by the report"
        );
        drop((report, put));
        assert!(
            claims.held.lock().unwrap().is_empty(),
            "every claim released"
        );
    }
}
