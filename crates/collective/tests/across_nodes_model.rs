//! The cross-node plans run on a model of the kernels: every rank's launches (as prepared for
//! the GPU) are executed on host memory, one launch index at a time across all ranks, with the
//! semantics `kernels/collective/ccl.cu` gives each entry point (a team's reads happen before
//! its writes). The results must be the collective's: all-reduce, reduce-scatter and all-gather
//! on 2 and 4 nodes of 1, 2 and 4 ranks, in place and out of place, in one piece and in many
//! (a small buffer), on sizes that do not divide evenly.
//!
//! This checks what the host runtime plans (pieces, slices, teams, offsets, the staging area),
//! not the kernels: the GPU suite (tests/test_gpu_ccl_nodes.py) runs those.

use std::collections::HashMap;

use mori_collective::ccl::CclArgs;
use mori_collective::communicator::{CclConfig, Communicator, DType, Launch, ReduceOp};

/// Elements are 4 bytes (f32); the model keeps each as an f64, keyed by its byte address / 4.
const ES: u64 = 4;
/// Every rank's symmetric buffer and tensors live at the same addresses in its own memory.
const BASE: u64 = 1 << 40;
/// Every rank's cross-node slots (in the shmem proxy window).
const WINDOW: u64 = 3 << 40;
const INPUT: u64 = 1 << 32;
const OUTPUT: u64 = 2 << 32;

type Memory = HashMap<u64, f64>;

fn at(addr: u64) -> u64 {
    assert_eq!(addr % ES, 0, "element-aligned address");
    addr / ES
}

fn read(m: &Memory, addr: u64) -> f64 {
    *m.get(&at(addr))
        .unwrap_or_else(|| panic!("read of unwritten element at {addr:#x}"))
}

fn team(a: &CclArgs) -> Vec<usize> {
    (0..a.team_size)
        .map(|i| (a.team_base + i * a.team_stride) as usize)
        .collect()
}

fn index_in_team(a: &CclArgs, rank: usize) -> usize {
    ((rank as u64 - a.team_base) / a.team_stride) as usize
}

/// Runs launch `i` of every rank: each team computes from a snapshot of its members' memory.
fn step(mems: &mut [Memory], launches: &[&Launch]) {
    let snapshot: Vec<Memory> = mems.to_vec();
    for (rank, l) in launches.iter().enumerate() {
        let a = &l.args;
        let members = team(a);
        let me = index_in_team(a, rank);
        assert_eq!(
            members[me], rank,
            "{}: rank {rank} outside its team",
            l.entry
        );
        for &q in &members {
            assert_eq!(
                launches[q].entry, l.entry,
                "a team's ranks run the same entry"
            );
        }
        let sum = |addr_of: &dyn Fn(usize) -> u64| -> f64 {
            members
                .iter()
                .map(|&q| read(&snapshot[q], addr_of(q)))
                .sum()
        };
        let slice_len = |t: u64| a.slice_count.min(a.total.saturating_sub(t * a.count));
        let mut writes: Vec<(u64, f64)> = Vec::new();
        let entry = l.entry.as_str();
        if entry.contains("_across_nodes") {
            assert_eq!(a.x_base, WINDOW, "{entry}: the slots are the window's");
        }
        if entry.starts_with("ccl_all_reduce_one_shot_") {
            for j in 0..a.count {
                writes.push((a.out + j * ES, sum(&|q| launches[q].args.r#in + j * ES)));
            }
        } else if entry.starts_with("ccl_all_reduce_two_shot_") {
            for t in 0..members.len() as u64 {
                for j in 0..slice_len(t) {
                    let v = sum(&|q| launches[q].args.r#in + (t * a.count + j) * ES);
                    writes.push((a.out + (t * a.out_stride + j) * ES, v));
                }
            }
        } else if entry.starts_with("ccl_reduce_scatter_") {
            let t = me as u64;
            for j in 0..slice_len(t) {
                let v = sum(&|q| launches[q].args.r#in + (t * a.count + j) * ES);
                writes.push((a.out + (t * a.out_stride + j) * ES, v));
            }
        } else if entry == "ccl_push" || entry == "ccl_gather_across_nodes" {
            // From member t: its bytes for this rank (its send_offset at this rank's place).
            for (t, &q) in members.iter().enumerate() {
                let from = &launches[q].args;
                for b in (0..a.recv_bytes[t]).step_by(ES as usize) {
                    let v = read(&snapshot[q], from.r#in + from.send_offset[me] + b);
                    writes.push((a.out + a.out_offset[t] + b, v));
                }
            }
        } else if entry.starts_with("ccl_reduce_across_nodes_") {
            for j in 0..a.count {
                let v = sum(&|q| {
                    let from = &launches[q].args;
                    from.r#in + from.send_offset[me] + j * ES
                });
                writes.push((a.out + j * ES, v));
            }
        } else {
            panic!("no model for {entry}");
        }
        for (addr, v) in writes {
            mems[rank].insert(at(addr), v);
        }
    }
}

fn communicators(world: usize, nodes: usize, buffer_bytes: u64) -> Vec<Communicator> {
    let config = CclConfig {
        buffer_bytes,
        ..CclConfig::default()
    };
    (0..world)
        .map(|rank| {
            // SAFETY: planners only (no module): nothing is launched on BASE.
            unsafe { Communicator::new(None, BASE, WINDOW, rank, world, nodes, config) }.unwrap()
        })
        .collect()
}

/// Rank `r`'s value at element `j` of its input: distinct, exact in f64 sums.
fn value(r: usize, j: u64) -> f64 {
    (r as f64) * 1e7 + j as f64
}

fn run(plans: Vec<Vec<Launch>>, mems: &mut [Memory]) {
    let n = plans[0].len();
    assert!(
        plans.iter().all(|p| p.len() == n),
        "every rank plans as many launches"
    );
    for i in 0..n {
        let launches: Vec<&Launch> = plans.iter().map(|p| &p[i]).collect();
        step(mems, &launches);
    }
}

fn fill(mem: &mut Memory, addr: u64, len: u64, f: impl Fn(u64) -> f64) {
    for j in 0..len {
        mem.insert(at(addr + j * ES), f(j));
    }
}

const LAYOUTS: [(usize, usize); 5] = [(2, 2), (4, 2), (8, 2), (4, 4), (8, 4)];

#[test]
fn all_reduce_plans_sum_every_rank_s_input() {
    for (world, nodes) in LAYOUTS {
        for buffer in [256 << 10, 8 << 20] {
            for count in [0u64, 1, 7, 1000, 20_003] {
                for in_place in [false, true] {
                    let comms = communicators(world, nodes, buffer);
                    let out = if in_place { INPUT } else { OUTPUT };
                    let mut mems: Vec<Memory> = vec![Memory::new(); world];
                    for (r, m) in mems.iter_mut().enumerate() {
                        fill(m, INPUT, count, |j| value(r, j));
                    }
                    let plans = comms
                        .iter()
                        .map(|c| {
                            c.prepare(
                                c.plan_all_reduce(
                                    INPUT,
                                    out,
                                    count,
                                    DType::F32,
                                    ReduceOp::Sum,
                                    None,
                                )
                                .unwrap(),
                            )
                        })
                        .collect();
                    run(plans, &mut mems);
                    for (r, m) in mems.iter().enumerate() {
                        for j in 0..count {
                            let want: f64 = (0..world).map(|q| value(q, j)).sum();
                            assert_eq!(
                                read(m, out + j * ES),
                                want,
                                "{world} ranks on {nodes} nodes, buffer {buffer}, count {count}, \
                                 in place {in_place}: rank {r} element {j}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_plans_give_each_rank_its_chunk_s_sum() {
    for (world, nodes) in LAYOUTS {
        for buffer in [256 << 10, 8 << 20] {
            for m_len in [0u64, 1, 7, 1000, 20_001] {
                for in_place in [false, true] {
                    let comms = communicators(world, nodes, buffer);
                    let mut mems: Vec<Memory> = vec![Memory::new(); world];
                    for (r, m) in mems.iter_mut().enumerate() {
                        fill(m, INPUT, world as u64 * m_len, |j| value(r, j));
                    }
                    let plans = comms
                        .iter()
                        .enumerate()
                        .map(|(r, c)| {
                            let out = if in_place {
                                INPUT + r as u64 * m_len * ES
                            } else {
                                OUTPUT
                            };
                            c.prepare(c.plan_reduce_scatter(
                                INPUT,
                                out,
                                m_len,
                                DType::F32,
                                ReduceOp::Sum,
                            ))
                        })
                        .collect();
                    run(plans, &mut mems);
                    for (r, m) in mems.iter().enumerate() {
                        let out = if in_place {
                            INPUT + r as u64 * m_len * ES
                        } else {
                            OUTPUT
                        };
                        for j in 0..m_len {
                            let idx = r as u64 * m_len + j;
                            let want: f64 = (0..world).map(|q| value(q, idx)).sum();
                            assert_eq!(
                                read(m, out + j * ES),
                                want,
                                "{world} ranks on {nodes} nodes, buffer {buffer}, m {m_len}, \
                                 in place {in_place}: rank {r} element {j}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn all_gather_plans_concatenate_every_rank_s_input_in_rank_order() {
    for (world, nodes) in LAYOUTS {
        for buffer in [256 << 10, 8 << 20] {
            for n in [0u64, 1, 7, 1000, 20_001] {
                for in_place in [false, true] {
                    let comms = communicators(world, nodes, buffer);
                    let mut mems: Vec<Memory> = vec![Memory::new(); world];
                    let input = |r: usize| {
                        if in_place {
                            OUTPUT + r as u64 * n * ES
                        } else {
                            INPUT
                        }
                    };
                    for (r, m) in mems.iter_mut().enumerate() {
                        fill(m, input(r), n, |j| value(r, j));
                    }
                    let plans = comms
                        .iter()
                        .enumerate()
                        .map(|(r, c)| {
                            c.prepare(c.plan_all_gather(input(r), OUTPUT, n * ES).unwrap())
                        })
                        .collect();
                    run(plans, &mut mems);
                    for (r, m) in mems.iter().enumerate() {
                        for q in 0..world {
                            for j in 0..n {
                                assert_eq!(
                                    read(m, OUTPUT + (q as u64 * n + j) * ES),
                                    value(q, j),
                                    "{world} ranks on {nodes} nodes, buffer {buffer}, n {n}, \
                                     in place {in_place}: rank {r}, block {q}, element {j}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
