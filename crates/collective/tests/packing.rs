//! The bytes of a launch: the typed structs and the field-by-field [`Packer`] (what the Python
//! bindings fill) agree, padding is zero, and wrong fields are errors that name them.

use mori_collective::ccl::{CCL_MAX_RANKS, CclArgs};
use mori_collective::ep::{EpCombineSend, EpPrepare};
use mori_collective::{DevicePtr, Error, KernelParams, Value};
use mori_testutil::Lcg;

fn ep_prepare(rng: &mut Lcg) -> EpPrepare {
    let mut p = || DevicePtr(rng.next() << 33 | rng.next());
    let mut s = EpPrepare {
        topk_idx: p(),
        slot: p(),
        send_list: p(),
        tokens_per_rank: p(),
        tokens_per_expert: p(),
        rank_matrix_out: p(),
        counters: p(),
        rank_matrix: p(),
        expert_matrix: p(),
        host_info: p(),
        expert_counts: p(),
        in_rank: p(),
        ..EpPrepare::default()
    };
    let mut i = || rng.next() as i32;
    (s.num_tokens, s.topk, s.experts_per_rank, s.num_ranks) = (i(), i(), i(), i());
    (s.num_experts, s.notify, s.seq, s.capacity) = (i(), i(), i(), i());
    s.trap_overflow = i();
    s
}

/// `s`'s fields as dynamic values, in order.
fn ep_prepare_values(s: &EpPrepare) -> Vec<Value<'static>> {
    let p = |d: DevicePtr| Value::Ptr(d.0);
    vec![
        p(s.topk_idx),
        Value::I32(s.num_tokens),
        Value::I32(s.topk),
        Value::I32(s.experts_per_rank),
        Value::I32(s.num_ranks),
        Value::I32(s.num_experts),
        p(s.slot),
        p(s.send_list),
        p(s.tokens_per_rank),
        p(s.tokens_per_expert),
        p(s.rank_matrix_out),
        p(s.counters),
        Value::I32(s.notify),
        p(s.rank_matrix),
        p(s.expert_matrix),
        p(s.host_info),
        Value::I32(s.seq),
        Value::I32(s.capacity),
        p(s.expert_counts),
        p(s.in_rank),
        Value::I32(s.trap_overflow),
    ]
}

#[test]
fn typed_and_packer_bytes_agree_with_zero_padding() {
    let mut rng = Lcg(7);
    for _ in 0..100 {
        let s = ep_prepare(&mut rng);
        let mut packer = mori_collective::packer("ep_prepare").unwrap();
        for (i, v) in ep_prepare_values(&s).into_iter().enumerate() {
            packer.set(i, v).unwrap();
        }
        let bytes = packer.finish().unwrap();
        assert_eq!(bytes.bytes(), s.packed().bytes());
        // P i i i i i: the padding after the fifth int, before `slot`
        assert_eq!(&bytes.bytes()[28..32], &[0; 4]);
        assert_eq!(bytes.bytes().len(), 140, "no tail padding, as struct.pack");
        assert_eq!(&bytes.bytes()[..8], &s.topk_idx.0.to_ne_bytes());
    }
}

#[test]
fn arrays_are_filled_up_to_their_length_and_zero_after() {
    let mut rng = Lcg(11);
    let mut typed = CclArgs {
        base: rng.next(),
        r#in: rng.next(),
        timeout_ns: rng.next(),
        ..CclArgs::default()
    };
    let sig: Vec<u64> = (0..3).map(|_| rng.next()).collect();
    typed.sig_send[..3].copy_from_slice(&sig);
    let mut packer = mori_collective::packer("ccl_push").unwrap();
    for (i, f) in CclArgs::layout().fields.iter().enumerate() {
        let v = match f.name {
            "base" => Value::U64(typed.base),
            "in" => Value::U64(typed.r#in),
            "timeout_ns" => Value::U64(typed.timeout_ns),
            "sig_send" => Value::U64s(&sig),
            _ if f.len == CCL_MAX_RANKS => Value::U64s(&[]),
            _ => Value::U64(0),
        };
        packer.set(i, v).unwrap();
    }
    let packed = packer.finish().unwrap();
    assert_eq!(packed.bytes(), typed.packed().bytes());
    assert_eq!(packed.bytes().len(), 136 + 6 * 8 * CCL_MAX_RANKS);
}

#[test]
fn every_ccl_entry_shares_one_layout() {
    for entry in mori_collective::ccl::CCL_ENTRIES {
        assert!(std::ptr::eq(
            mori_collective::lookup(entry).unwrap().1,
            CclArgs::layout()
        ));
    }
    assert!(std::ptr::eq(
        mori_collective::lookup("ep_combine_send").unwrap().1,
        EpCombineSend::layout()
    ));
}

#[test]
fn wrong_fields_are_errors_naming_them() {
    let msg = |e: Error| e.to_string();
    assert!(msg(mori_collective::packer("ep_nope").err().unwrap()).contains("\"ep_nope\""));
    let mut p = mori_collective::packer("ep_combine_send").unwrap();
    let e = p.set(1, Value::I32(3)).unwrap_err();
    assert_eq!(
        msg(e),
        "ep_combine_send: field \"row_bytes\" is u64, got I32(3)"
    );
    p.set(1, Value::U64(3)).unwrap();
    assert!(msg(p.set(1, Value::U64(4)).unwrap_err()).contains("\"row_bytes\" given twice"));
    assert!(
        msg(p.set(12, Value::U64(4)).unwrap_err())
            .starts_with("ep_combine_send takes 12 fields (y: T*, row_bytes: u64")
    );
    let e = p.finish().err().unwrap();
    assert_eq!(
        msg(e),
        "ep_combine_send: missing fields: y, num_recv, num_ranks, rank_matrix, comb_buf, max_tokens, counters, w, comb_w, topk, send_rows"
    );
    let mut c = mori_collective::packer("ccl_push").unwrap();
    let e = c.set(17, Value::U64s(&[0; CCL_MAX_RANKS + 1])).unwrap_err();
    assert_eq!(
        msg(e),
        "ccl_push: field \"send_offset\" at most 8 elements, got 9"
    );
}
