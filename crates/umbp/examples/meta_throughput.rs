//! Metadata-index throughput (`mori bench umbp` runs it): batched key operations per second on
//! the in-memory store, from 1 and from 2 threads, and on a Redis store when a URL is given.
//!
//!     cargo run --release -p mori-umbp --example meta_throughput [-- redis://127.0.0.1:6379]
//!
//! Prints one JSON object: ops/s for batched inserts (insert_if_absent per key), batched lookups
//! (batch_get of 64 keys) and removes.

use std::sync::Arc;
use std::time::Instant;

use mori_umbp::{Location, MemoryStore, MetadataStore, RedisStore, Tier};

const KEYS: usize = 200_000;
const BATCH: usize = 64;

fn key(t: usize, i: usize) -> Vec<u8> {
    format!("seq{t}/blk{i:08}").into_bytes()
}

/// (insert ops/s, batch_get key-ops/s, remove ops/s) with `threads` threads on disjoint keys.
fn measure(
    store: Arc<dyn MetadataStore>,
    threads: usize,
    keys: usize,
) -> Result<(f64, f64, f64), String> {
    let run = |phase: usize| -> Result<f64, String> {
        let start = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || -> Result<(), String> {
                    let all: Vec<Vec<u8>> = (0..keys).map(|i| key(t, i)).collect();
                    let loc = Location {
                        peer: t as u64,
                        tier: Tier::Dram,
                        len: 4096,
                    };
                    for chunk in all.chunks(BATCH) {
                        match phase {
                            0 => {
                                for k in chunk {
                                    store
                                        .insert_if_absent(k, loc.clone())
                                        .map_err(|e| e.to_string())?;
                                }
                            }
                            1 => {
                                let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
                                store.batch_get(&refs).map_err(|e| e.to_string())?;
                            }
                            _ => {
                                for k in chunk {
                                    store.remove(k).map_err(|e| e.to_string())?;
                                }
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "a worker panicked".to_string())??;
        }
        Ok((threads * keys) as f64 / start.elapsed().as_secs_f64())
    };
    Ok((run(0)?, run(1)?, run(2)?))
}

fn main() {
    let redis_url = std::env::args().nth(1);
    let mut fields = Vec::new();
    for threads in [1usize, 2] {
        match measure(Arc::new(MemoryStore::new()), threads, KEYS) {
            Ok((ins, get, rem)) => fields.push(format!(
                "\"memory_{threads}t\": {{\"insert_ops\": {ins:.0}, \"batch_get_key_ops\": {get:.0}, \"remove_ops\": {rem:.0}}}"
            )),
            Err(e) => fields.push(format!("\"memory_{threads}t\": {{\"error\": {e:?}}}")),
        }
    }
    if let Some(url) = redis_url {
        let result = RedisStore::connect(&url, "bench")
            .map_err(|e| e.to_string())
            .and_then(|s| measure(Arc::new(s), 2, 20_000));
        match result {
            Ok((ins, get, rem)) => fields.push(format!(
                "\"redis_2t\": {{\"insert_ops\": {ins:.0}, \"batch_get_key_ops\": {get:.0}, \"remove_ops\": {rem:.0}}}"
            )),
            Err(e) => fields.push(format!("\"redis_2t\": {{\"error\": {e:?}}}")),
        }
    }
    println!(
        "{{{}, \"keys_per_thread\": {KEYS}, \"batch\": {BATCH}}}",
        fields.join(", ")
    );
}
