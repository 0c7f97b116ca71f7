//! mori.ccl across nodes: all-reduce, reduce-scatter and all-gather as a phase among each
//! node's ranks (the load/store kernels, over NVLink) and a phase among the ranks at one place
//! on every node (`ccl_*_across_nodes`, through the shmem proxy), so each byte crosses the
//! network once per destination node and the rest moves within the node.
//!
//! Plans are pure like the one-node ones: every rank derives the same launches from the same
//! call. Ranks are grouped as [`Geometry`] says: `nodes` nodes of `local_size` consecutive
//! ranks.

use crate::ccl::{CCL_MAX_RANKS, CclArgs};
use crate::communicator::{
    Algorithm, CclConfig, DType, Exchange, Geometry, Launch, OP_GATHER_ACROSS_NODES,
    OP_REDUCE_ACROSS_NODES, ReduceOp, VECTOR, plan_all_reduce, plan_exchange, reduce_scatter_range,
    signature, split_pieces,
};
use crate::error::Result;

/// A launch among the ranks at this rank's place on every node (one block: the proxy posts one
/// request per node, and waits dominate). `call` identifies the call (its kind and sizes, the
/// same at every rank of the team): sent with each signal and compared by the receiver.
fn across(geo: &Geometry, entry: String, args: CclArgs, call: &[u64]) -> Launch {
    let (_, place) = geo.node();
    let sig = signature(call);
    Launch {
        entry,
        grid: 1,
        args: CclArgs {
            team_base: place as u64,
            team_stride: geo.local_size() as u64,
            team_size: geo.nodes as u64,
            sig_send: [sig; CCL_MAX_RANKS],
            sig_expect: [sig; CCL_MAX_RANKS],
            ..args
        },
    }
}

fn reduce_entry(dtype: DType, op: ReduceOp) -> String {
    format!("ccl_reduce_across_nodes_{}_{}", dtype.suffix(), op.name())
}

/// All-reduce: per piece, an all-reduce within the node, then rank `l` of every node reduces
/// slice `l` of the piece across the nodes, then the node's ranks gather the slices.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce(
    geo: &Geometry,
    config: &CclConfig,
    input: u64,
    output: u64,
    count: u64,
    dtype: DType,
    op: ReduceOp,
    algorithm: Option<Algorithm>,
) -> Result<Vec<Launch>> {
    let (es, local) = (dtype.size(), geo.local_size() as u64);
    let quantum = VECTOR / es;
    let node = geo.within_node();
    let place = geo.node().1 as u64;
    // A slice fits a cross-node slot and, for the gather within the node, a node slot.
    let slice_max = geo.x_slot_bytes.min(geo.slot_bytes) / es / quantum * quantum;
    let mut plan = Vec::new();
    for (start, end) in split_pieces(count, slice_max * local, quantum) {
        let len = end - start;
        let piece = output + start * es;
        plan.extend(plan_all_reduce(
            &node,
            config,
            input + start * es,
            piece,
            len,
            dtype,
            op,
            algorithm,
        ));
        let per = len.div_ceil(local).div_ceil(quantum) * quantum;
        let slice = |r: u64| (len.min(r * per), len.min((r + 1) * per));
        let (lo, hi) = slice(place);
        let mut args = CclArgs {
            r#in: piece + lo * es,
            out: piece + lo * es,
            count: hi - lo,
            ..CclArgs::default()
        };
        args.send_bytes[..geo.nodes].fill((hi - lo) * es);
        let call = [OP_REDUCE_ACROSS_NODES, es, op.code(), hi - lo];
        plan.push(across(geo, reduce_entry(dtype, op), args, &call));
        if local > 1 {
            let send = vec![(lo * es, (hi - lo) * es); local as usize];
            let recv: Vec<(u64, u64)> = (0..local)
                .map(|r| {
                    let (a, b) = slice(r);
                    (a * es, (b - a) * es)
                })
                .collect();
            plan.extend(plan_exchange(
                &node,
                config,
                Exchange::AllGather,
                piece,
                piece,
                &send,
                &recv,
                0,
                false,
            )?);
        }
    }
    Ok(plan)
}

/// Reduce-scatter (`m` elements per rank): for each node k, a reduce-scatter within this node
/// of the input chunks of node k's ranks into the staging area; then the rank at this place on
/// node k receives this node's part and reduces the nodes' parts in node order.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter(
    geo: &Geometry,
    config: &CclConfig,
    staging: u64,
    input: u64,
    output: u64,
    m: u64,
    dtype: DType,
    op: ReduceOp,
) -> Vec<Launch> {
    let (es, local) = (dtype.size(), geo.local_size() as u64);
    let quantum = VECTOR / es;
    let node = geo.within_node();
    let mut plan = Vec::new();
    for (start, end) in split_pieces(m, geo.x_slot_bytes / es / quantum * quantum, quantum) {
        let mut args = CclArgs {
            r#in: staging,
            out: output + start * es,
            count: end - start,
            ..CclArgs::default()
        };
        for k in 0..geo.nodes {
            let part = staging + k as u64 * geo.x_slot_bytes;
            let slab = input + k as u64 * local * m * es;
            plan.extend(reduce_scatter_range(
                &node, config, slab, part, m, start, end, dtype, op,
            ));
            args.send_offset[k] = k as u64 * geo.x_slot_bytes;
            args.send_bytes[k] = (end - start) * es;
        }
        let call = [OP_REDUCE_ACROSS_NODES, es, op.code(), end - start, m];
        plan.push(across(geo, reduce_entry(dtype, op), args, &call));
    }
    plan
}

/// All-gather (`nbytes` per rank): the rank at this place on every node gathers its peers'
/// inputs across the nodes (pieces of a cross-node slot), then for each node k the node's ranks
/// exchange what they received from node k.
pub fn all_gather(
    geo: &Geometry,
    config: &CclConfig,
    input: u64,
    output: u64,
    nbytes: u64,
) -> Result<Vec<Launch>> {
    let local = geo.local_size() as u64;
    let place = geo.node().1 as u64;
    let home = |k: usize, r: u64| (k as u64 * local + r) * nbytes;
    let mut plan = Vec::new();
    for (start, end) in split_pieces(nbytes, geo.x_slot_bytes, VECTOR) {
        let mut args = CclArgs {
            r#in: input + start,
            out: output,
            ..CclArgs::default()
        };
        for k in 0..geo.nodes {
            args.send_bytes[k] = end - start;
            args.out_offset[k] = home(k, place) + start;
            args.recv_bytes[k] = end - start;
        }
        let call = [OP_GATHER_ACROSS_NODES, end - start, nbytes];
        plan.push(across(geo, "ccl_gather_across_nodes".into(), args, &call));
    }
    if local > 1 {
        let node = geo.within_node();
        for k in 0..geo.nodes {
            let send = vec![(home(k, place), nbytes); local as usize];
            let recv: Vec<(u64, u64)> = (0..local).map(|r| (home(k, r), nbytes)).collect();
            plan.extend(plan_exchange(
                &node,
                config,
                Exchange::AllGather,
                output,
                output,
                &send,
                &recv,
                0,
                true,
            )?);
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::communicator::{Communicator, node_count};

    const MIB: u64 = 1 << 20;

    /// Rank `rank` of 2 nodes x 2 ranks, on a planner-only communicator at buffer address 0.
    fn planner(rank: usize, world: usize, nodes: usize, buffer_bytes: u64) -> Communicator {
        let config = CclConfig {
            buffer_bytes,
            ..CclConfig::default()
        };
        // SAFETY: a planner only (no module): nothing is launched on the buffer.
        unsafe { Communicator::new(None, 0, 0, rank, world, nodes, config) }.unwrap()
    }

    fn entries(plan: &[Launch]) -> Vec<&str> {
        plan.iter().map(|l| l.entry.as_str()).collect()
    }

    #[test]
    fn node_layouts_must_be_regular() {
        assert_eq!(node_count(&[vec![0, 1], vec![2, 3]]).unwrap(), 2);
        assert_eq!(node_count(&[vec![0, 1, 2, 3]]).unwrap(), 1);
        for bad in [
            vec![vec![0, 1, 2], vec![3]],
            vec![vec![0, 2], vec![1, 3]],
            vec![],
        ] {
            let e = node_count(&bad).unwrap_err().to_string();
            assert!(e.contains("consecutive ranks on every node"), "{e}");
        }
    }

    #[test]
    fn an_all_reduce_is_node_phase_cross_phase_node_gather_and_covers_every_element_once() {
        let count = 3 * MIB + 100; // f32: several pieces, an uneven last one
        let per_place: Vec<Vec<(u64, u64)>> = (0..4)
            .map(|rank| {
                let c = planner(rank, 4, 2, 4 * MIB);
                let plan = c
                    .plan_all_reduce(0, 1 << 40, count, DType::F32, ReduceOp::Sum, None)
                    .unwrap();
                let plan = c.prepare(plan);
                let mut covered = Vec::new();
                let crossings = plan
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.entry.contains("across"));
                for (i, x) in crossings {
                    // Before it, the node's all-reduce of the piece; after it, the node's gather.
                    let (ar, gather) = (&plan[i - 1], &plan[i + 1]);
                    assert!(ar.entry.starts_with("ccl_all_reduce_"), "{}", ar.entry);
                    assert_eq!(x.entry, "ccl_reduce_across_nodes_f32_sum");
                    assert_eq!(gather.entry, "ccl_push");
                    // Within the node: the node's two PEs; across: this place on both nodes.
                    let (node, place) = (rank as u64 / 2, rank as u64 % 2);
                    assert_eq!(
                        (ar.args.team_base, ar.args.team_stride, ar.args.team_size),
                        (node * 2, 1, 2)
                    );
                    assert_eq!(
                        (x.args.team_base, x.args.team_stride, x.args.team_size),
                        (place, 2, 2)
                    );
                    assert_eq!(x.grid, 1);
                    assert!(x.args.count * 4 <= x.args.x_slot_bytes);
                    assert_eq!(x.args.send_bytes[..2], [x.args.count * 4; 2]);
                    assert_eq!(x.args.r#in, x.args.out);
                    covered.push(((x.args.out - (1 << 40)) / 4, x.args.count));
                }
                covered
            })
            .collect();
        // Ranks at one place cross with the same slices; the places together cover each
        // element once.
        assert_eq!(per_place[0], per_place[2]);
        assert_eq!(per_place[1], per_place[3]);
        let mut all: Vec<(u64, u64)> = per_place[0].iter().chain(&per_place[1]).copied().collect();
        all.sort();
        let mut next = 0;
        for (start, len) in all {
            assert_eq!(start, next);
            next += len;
        }
        assert_eq!(next, count);
    }

    #[test]
    fn one_rank_per_node_needs_no_gather_within_the_node() {
        let c = planner(1, 2, 2, 4 * MIB);
        let plan = c
            .plan_all_reduce(0, 0, 1000, DType::Bf16, ReduceOp::Max, None)
            .unwrap();
        assert_eq!(
            entries(&plan),
            [
                "ccl_all_reduce_one_shot_bf16_max",
                "ccl_reduce_across_nodes_bf16_max"
            ]
        );
        let x = &c.prepare(plan)[1];
        assert_eq!(
            (x.args.team_base, x.args.team_stride, x.args.team_size),
            (0, 1, 2)
        );
    }

    #[test]
    fn a_reduce_scatter_stages_each_node_s_part_then_sends_it_to_that_node() {
        let m = 5000; // f16 elements per rank
        let c = planner(3, 4, 2, 4 * MIB);
        let geo = *c.geometry();
        let staging = geo.staging_offset();
        let plan = c.prepare(c.plan_reduce_scatter(1 << 30, 1 << 40, m, DType::F16, ReduceOp::Sum));
        assert_eq!(
            entries(&plan),
            [
                "ccl_reduce_scatter_f16_sum",
                "ccl_reduce_scatter_f16_sum",
                "ccl_reduce_across_nodes_f16_sum"
            ]
        );
        // Node k's slab (its ranks' chunks, 2 x m elements into the input) lands in staging slot k.
        for (k, rs) in plan[..2].iter().enumerate() {
            assert_eq!(rs.args.r#in, (1 << 30) + k as u64 * 2 * m * 2);
            assert_eq!(rs.args.out, staging + k as u64 * geo.x_slot_bytes);
            assert_eq!((rs.args.count, rs.args.slice_count), (m, m));
            assert_eq!((rs.args.team_base, rs.args.team_size), (2, 2));
        }
        let x = &plan[2];
        assert_eq!(
            (x.args.r#in, x.args.out, x.args.count),
            (staging, 1 << 40, m)
        );
        assert_eq!(x.args.send_offset[..2], [0, geo.x_slot_bytes]);
        assert_eq!(x.args.send_bytes[..2], [m * 2; 2]);
        assert_eq!(
            (x.args.team_base, x.args.team_stride, x.args.team_size),
            (1, 2, 2)
        );
        assert!(geo.staging_offset() + 2 * geo.x_slot_bytes <= geo.buffer_bytes());
    }

    #[test]
    fn an_all_gather_crosses_once_then_exchanges_each_node_s_blocks() {
        let nb = 3 * MIB; // above one cross-node slot (2 MiB on 2 nodes): two pieces
        let c = planner(2, 4, 2, 4 * MIB);
        let plan = c.prepare(c.plan_all_gather(1 << 30, 1 << 40, nb).unwrap());
        assert_eq!(
            entries(&plan)[..2],
            ["ccl_gather_across_nodes", "ccl_gather_across_nodes"]
        );
        assert!(entries(&plan)[2..].iter().all(|e| *e == "ccl_push"));
        // Rank 2 is place 0 on node 1: its blocks go to ranks 0 (node 0) and 2 (node 1).
        let (a, b) = (&plan[0].args, &plan[1].args);
        assert_eq!(a.out_offset[..2], [0, 2 * nb]);
        assert_eq!(
            b.out_offset[..2],
            [a.recv_bytes[0], 2 * nb + a.recv_bytes[0]]
        );
        assert_eq!(a.recv_bytes[0] + b.recv_bytes[0], nb);
        assert_eq!(b.r#in, (1 << 30) + a.recv_bytes[0]);
    }

    #[test]
    fn a_cross_node_call_s_signature_is_the_team_s_and_names_the_call() {
        let sig_of = |rank: usize, count: u64, op: ReduceOp| {
            let c = planner(rank, 4, 2, 4 * MIB);
            let plan = c
                .plan_all_reduce(0, 0, count, DType::F32, op, None)
                .unwrap();
            let x = plan.iter().find(|l| l.entry.contains("across")).unwrap();
            assert_eq!(x.args.sig_send, x.args.sig_expect);
            x.args.sig_send[0]
        };
        // Ranks 0 and 2 (place 0 of each node) send and expect the same; so do ranks 1 and 3.
        assert_eq!(
            sig_of(0, 1000, ReduceOp::Sum),
            sig_of(2, 1000, ReduceOp::Sum)
        );
        assert_eq!(
            sig_of(1, 1000, ReduceOp::Sum),
            sig_of(3, 1000, ReduceOp::Sum)
        );
        // Another size or op is another call.
        assert_ne!(
            sig_of(0, 1000, ReduceOp::Sum),
            sig_of(2, 2000, ReduceOp::Sum)
        );
        assert_ne!(
            sig_of(0, 1000, ReduceOp::Sum),
            sig_of(2, 1000, ReduceOp::Max)
        );
        let gather = |nbytes: u64| {
            let c = planner(0, 2, 2, 4 * MIB);
            c.plan_all_gather(0, 0, nbytes).unwrap()[0].args.sig_send[0]
        };
        assert_ne!(gather(64), gather(128));
    }

    #[test]
    fn exchanges_other_than_all_gather_need_one_node() {
        let c = planner(0, 2, 2, 4 * MIB);
        let e = c
            .plan_exchange(
                Exchange::Broadcast,
                0,
                0,
                &[(0, 8); 2],
                &[(0, 8); 2],
                0,
                true,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs every rank on one node"), "{e}");
    }

    #[test]
    fn one_node_keeps_its_buffer_and_its_launches() {
        let config = CclConfig::default();
        let one = Geometry::new(1, 4, &config).unwrap();
        assert_eq!(one, Geometry::with_nodes(1, 4, 1, &config).unwrap());
        assert_eq!(one.buffer_bytes(), one.staging_offset());
        assert_eq!(one.window_bytes(), 0);
        let two = Geometry::with_nodes(1, 4, 2, &config).unwrap();
        assert_eq!(two.slot_bytes, 2 * one.slot_bytes);
        assert_eq!(
            two.buffer_bytes(),
            two.staging_offset() + 2 * two.x_slot_bytes
        );
        // The cross-node slots live in the proxy window, at most 4 MiB each (a 64 MiB buffer
        // across 2 nodes would otherwise pin 32 MiB slots).
        assert_eq!(two.x_slot_bytes, 4 * MIB);
        assert_eq!(two.window_bytes(), 4 * 2 * 4 * MIB + 2 * 8 * 8);
        assert!(Geometry::with_nodes(0, 4, 3, &config).is_err());
    }
}
