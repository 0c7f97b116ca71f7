//! Every parameter struct against the CUDA source, by parsing it: the set of entry points, and
//! for each one the parameter names and C types in order (for a struct passed by value: the
//! kernel takes exactly that struct, and its members are the fields).

mod common;

use std::collections::BTreeSet;

use common::{Entry, Param};
use mori_collective::params::{Field, Layout, Passing};

/// (variant, entry) for every entry point of the EP and CCL kernel sources.
fn parsed() -> Vec<(String, Entry)> {
    let mut all = Vec::new();
    for v in common::variants() {
        for e in common::entries(&v.source) {
            all.push((v.name.clone(), e));
        }
    }
    all
}

fn check_fields(what: &str, params: &[Param], fields: &[Field], extent: impl Fn(&str) -> usize) {
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    let rust: Vec<&str> = fields.iter().map(|f| f.name).collect();
    assert_eq!(
        names, rust,
        "{what}: the CUDA names (left) differ from the Rust fields (right)"
    );
    for (p, f) in params.iter().zip(fields) {
        let ctype = p.ctype();
        assert_eq!(
            ctype,
            Some(f.ty),
            "{what}.{}: CUDA type {:?}, Rust {:?}",
            p.name,
            p.c_type,
            f.ty
        );
        let len = p.extent.as_deref().map_or(1, &extent);
        assert_eq!(
            len, f.len,
            "{what}.{}: CUDA has {len} elements, Rust {}",
            p.name, f.len
        );
    }
}

fn layout_of(entry: &str) -> &'static Layout {
    mori_collective::lookup(entry)
        .unwrap_or_else(|e| panic!("{e}"))
        .1
}

#[test]
fn every_kernel_has_one_parameter_struct_and_no_struct_names_a_missing_kernel() {
    let in_source: BTreeSet<String> = parsed().into_iter().map(|(_, e)| e.name).collect();
    let declared: BTreeSet<String> = mori_collective::layouts()
        .iter()
        .flat_map(|l| l.entries.iter().map(|e| e.to_string()))
        .collect();
    assert!(in_source.len() >= 36, "the parser found only {in_source:?}");
    assert_eq!(
        in_source, declared,
        "kernels in the source (left) vs entries declared in Rust (right)"
    );
}

#[test]
fn parameter_names_and_c_types_match_the_kernels() {
    for (variant, entry) in parsed() {
        let layout = layout_of(&entry.name);
        let what = format!("{variant}: {}", entry.name);
        match layout.passing {
            Passing::Params => check_fields(&what, &entry.params, layout.fields, |e| {
                panic!("{what}: array parameter [{e}]")
            }),
            Passing::ByValue { c_type, param } => {
                let want = [Param {
                    name: param.into(),
                    c_type: c_type.into(),
                    extent: None,
                }];
                assert_eq!(entry.params, want, "{what}: takes {} {}", c_type, param);
            }
        }
    }
}

#[test]
fn by_value_structs_match_their_c_members() {
    for v in common::variants() {
        for layout in mori_collective::layouts() {
            let Passing::ByValue { c_type, .. } = layout.passing else {
                continue;
            };
            if !common::entries(&v.source)
                .iter()
                .any(|e| layout.entries.contains(&e.name.as_str()))
            {
                continue;
            }
            let short = c_type.rsplit("::").next().expect("a type name");
            let members = common::struct_members(&v.source, short);
            check_fields(c_type, &members, layout.fields, |e| {
                common::constant(&v.source, e)
            });
        }
    }
}

#[test]
fn the_parser_reads_what_the_kernels_spell() {
    let src = r#"
        // extern "C" __global__ void commented_out(int x) {}
        #define K(NAME) \
            extern "C" __global__ void __launch_bounds__(64) k_##NAME(const int* __restrict__ a, u64 b) { }
        K(one)
        extern "C" __global__ void plain(volatile unsigned int* t, float w, long long n) {}
        struct S { u64 a; u64 b[MAX]; };
    "#;
    let found = common::entries(src);
    let names: Vec<&str> = found.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["k_one", "plain"]);
    let types: Vec<&str> = found[1].params.iter().map(|p| p.c_type.as_str()).collect();
    assert_eq!(types, ["unsigned int*", "float", "long long"]);
    assert_eq!(found[0].params[0].c_type, "int*");
    let members = common::struct_members(src, "S");
    assert_eq!(members[1].extent.as_deref(), Some("MAX"));
}
