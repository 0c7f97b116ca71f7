//! Every parameter struct against the compiler: each EP/CCL kernel source is compiled by NVRTC
//! (sm_90, the JIT's options) with static_asserts appended that the Rust layout generates —
//! per entry point: the parameter count, each parameter's C type class and size, and each
//! parameter's offset in the parameter buffer (a C struct of the kernel's own parameter types,
//! taken with `decltype` from the kernel itself); for a struct passed by value: that the kernel
//! takes exactly that struct, and each member's offset, type and size.
//!
//! Needs NVRTC 13 (the `nvidia-cuda-nvrtc` wheel, or a CUDA toolkit; `MORI_NVRTC_PATH` points
//! at it). Without it the test prints why and passes, unless `MORI_REQUIRE_NVRTC=1` (CI).

mod common;

use std::fmt::Write;

use mori_collective::params::{CType, Field, Layout, Passing};

/// Type traits the generated asserts use (NVRTC has no standard library).
const PRELUDE: &str = r#"
namespace mori_layout_check {
template <class A, class B> struct same { static constexpr bool value = false; };
template <class A> struct same<A, A> { static constexpr bool value = true; };
template <class T> struct kind { static constexpr char value = '?'; };
template <class T> struct kind<T*> { static constexpr char value = 'P'; };
template <class T, int N> struct kind<T[N]> { static constexpr char value = kind<T>::value; };
template <> struct kind<int> { static constexpr char value = 'i'; };
template <> struct kind<unsigned int> { static constexpr char value = 'I'; };
template <> struct kind<long long> { static constexpr char value = 'q'; };
template <> struct kind<unsigned long long> { static constexpr char value = 'Q'; };
template <> struct kind<float> { static constexpr char value = 'f'; };
template <int I, class... A> struct nth;
template <class H, class... T> struct nth<0, H, T...> { using type = H; };
template <int I, class H, class... T> struct nth<I, H, T...> { using type = typename nth<I - 1, T...>::type; };
template <class T> struct stand_in { using type = T; };
template <class T> struct stand_in<T*> { using type = unsigned long long; };
template <class F> struct sig;
template <class... A> struct sig<void(A...)> {
    static constexpr int arity = sizeof...(A);
    template <int I> using arg = typename nth<I, A...>::type;
};
}  // namespace mori_layout_check
"#;

fn kind(ty: CType) -> char {
    match ty {
        CType::Ptr => 'P',
        CType::I32 => 'i',
        CType::U32 => 'I',
        CType::I64 => 'q',
        CType::U64 => 'Q',
        CType::F32 => 'f',
    }
}

/// A C struct laid out like a parameter buffer: `c_type` with one member per Rust field, the
/// member's C type being `member_type(i)`.
struct Frame<'a> {
    /// What messages name (an entry point, or the by-value struct).
    what: &'a str,
    c_type: String,
    member_type: Box<dyn Fn(usize) -> String + 'a>,
}

/// static_asserts that each member of `frame` has its Rust field's kind and size, and that a
/// value stored in each member (each array element) lands at the Rust field's offset: the
/// frame is filled with markers in a constexpr function and read back as bytes with
/// `__builtin_bit_cast` (NVRTC has no `offsetof`).
fn frame_asserts(out: &mut String, frame: &Frame<'_>, layout: &Layout) {
    let (what, c_type) = (frame.what, &frame.c_type);
    let id = what.replace("::", "_");
    let mut marks = String::new();
    let mut offsets = String::new();
    let mut marker = 0u32;
    for (i, f) in layout.fields.iter().enumerate() {
        let (name, member) = (f.name, (frame.member_type)(i));
        let (k, c, size) = (kind(f.ty), f.ty.c_name(), f.ty.size() * f.len);
        writeln!(out, "static_assert(mori_layout_check::kind<{member}>::value == '{k}', \"{what}.{name}: not {c} as in Rust\");").unwrap();
        writeln!(out, "static_assert(sizeof({member}) == {size}, \"{what}.{name}: not {size} bytes as in Rust\");").unwrap();
        for j in 0..f.len {
            marker += 1;
            let lhs = if f.len == 1 {
                name.to_string()
            } else {
                format!("{name}[{j}]")
            };
            let value = match f.ty {
                CType::F32 => format!("__builtin_bit_cast(float, {marker}u)"),
                _ => format!("{marker}"),
            };
            writeln!(marks, "    f.{lhs} = {value};").unwrap();
            let at = f.offset + j * f.ty.size();
            writeln!(offsets, "static_assert(__builtin_bit_cast(mori_layout_check_{id}_bytes, mori_layout_check_{id}_marked()).b[{at}] == {marker}, \"{what}.{lhs}: not at offset {at} as in Rust\");").unwrap();
        }
    }
    assert!(marker < 256, "{what}: markers must fit in a byte");
    writeln!(out, "__device__ constexpr {c_type} mori_layout_check_{id}_marked() {{\n    {c_type} f{{}};\n{marks}    return f;\n}}").unwrap();
    writeln!(
        out,
        "struct mori_layout_check_{id}_bytes {{ unsigned char b[sizeof({c_type})]; }};"
    )
    .unwrap();
    out.push_str(&offsets);
}

/// The asserts for one entry point taking the fields as its parameter list.
fn params_asserts(out: &mut String, entry: &str, layout: &Layout) {
    let sig = format!("mori_layout_check::sig<decltype({entry})>");
    let n = layout.fields.len();
    writeln!(
        out,
        "static_assert({sig}::arity == {n}, \"{entry}: Rust's {} has {n} fields\");",
        layout.name
    )
    .unwrap();
    // The parameter list as a C struct of the kernel's own types (pointers as same-sized
    // integers, which constexpr code may store): the driver's buffer layout.
    let c_type = format!("mori_layout_check_{entry}_frame");
    writeln!(out, "struct {c_type} {{").unwrap();
    for (i, f) in layout.fields.iter().enumerate() {
        writeln!(
            out,
            "    mori_layout_check::stand_in<{sig}::arg<{i}>>::type {};",
            f.name
        )
        .unwrap();
    }
    writeln!(out, "}};").unwrap();
    let member_type = Box::new(move |i: usize| format!("{sig}::arg<{i}>"));
    frame_asserts(
        out,
        &Frame {
            what: entry,
            c_type,
            member_type,
        },
        layout,
    );
}

/// The asserts for one struct passed by value, and one per entry point taking it.
fn by_value_asserts(out: &mut String, entries: &[&str], layout: &Layout, c_type: &str) {
    for entry in entries {
        writeln!(out, "static_assert(mori_layout_check::same<decltype({entry}), void({c_type})>::value, \"{entry}: does not take one {c_type}\");").unwrap();
    }
    let member_type = Box::new(|i: usize| format!("decltype({c_type}::{})", layout.fields[i].name));
    frame_asserts(
        out,
        &Frame {
            what: c_type,
            c_type: c_type.to_string(),
            member_type,
        },
        layout,
    );
    writeln!(
        out,
        "static_assert(sizeof({c_type}) == {}, \"{c_type}: not {} bytes as Rust's {}\");",
        layout.len, layout.len, layout.name
    )
    .unwrap();
}

/// The asserts for every entry point `source` defines.
fn checks(source: &str) -> (String, usize) {
    let defined: Vec<String> = common::entries(source)
        .into_iter()
        .map(|e| e.name)
        .collect();
    let mut out = String::from(PRELUDE);
    let mut count = 0;
    for layout in mori_collective::layouts() {
        let here: Vec<&str> = layout
            .entries
            .iter()
            .copied()
            .filter(|e| defined.iter().any(|d| d == e))
            .collect();
        if here.is_empty() {
            continue;
        }
        count += here.len();
        match layout.passing {
            Passing::Params => here
                .iter()
                .for_each(|e| params_asserts(&mut out, e, layout)),
            Passing::ByValue { c_type, .. } => by_value_asserts(&mut out, &here, layout, c_type),
        }
    }
    (out, count)
}

/// Whether NVRTC can be used; when it is absent (and may be), prints why.
fn nvrtc_available() -> bool {
    match mori_gpu::nvrtc::version() {
        Ok(_) => true,
        Err(e) if std::env::var("MORI_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("MORI_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}")
        }
        Err(e) => {
            eprintln!(
                "skipped: NVRTC is unavailable ({e}); set MORI_NVRTC_PATH to check the parameter layouts"
            );
            false
        }
    }
}

#[test]
fn every_parameter_struct_compiles_against_its_kernel() {
    if !nvrtc_available() {
        return;
    }
    let (mut checked, mut failures) = (0, Vec::new());
    for v in common::variants() {
        let (asserts, count) = checks(&v.source);
        let source = format!(
            "{}\n#line 1 \"mori-collective layout checks\"\n{asserts}",
            v.render()
        );
        let options = mori_gpu::jit::compile_options("sm_90");
        if let Err(e) = mori_gpu::nvrtc::compile_to_cubin(
            &v.name,
            "sm_90",
            &source,
            mori_gpu::kernels::HEADERS,
            &options,
        ) {
            failures.push(format!(
                "{}: the Rust parameter layouts disagree with the kernels:\n{e}",
                v.name
            ));
        }
        checked += count;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let declared: usize = mori_collective::layouts()
        .iter()
        .map(|l| l.entries.len())
        .sum();
    assert_eq!(checked, declared, "every declared entry point was checked");
}

#[test]
fn a_wrong_layout_fails_to_compile() {
    if !nvrtc_available() {
        return;
    }
    let source = "extern \"C\" __global__ void k(int* p, int n, unsigned long long m) {}";
    static FIELDS: [Field; 3] = [
        Field {
            name: "p",
            ty: CType::Ptr,
            len: 1,
            offset: 0,
        },
        Field {
            name: "n",
            ty: CType::I32,
            len: 1,
            offset: 8,
        },
        Field {
            name: "m",
            ty: CType::U64,
            len: 1,
            offset: 24,
        }, // really at 16
    ];
    static WRONG: Layout = Layout::new("Wrong", &["k"], &FIELDS, Passing::Params);
    let mut asserts = String::from(PRELUDE);
    params_asserts(&mut asserts, "k", &WRONG);
    let options = mori_gpu::jit::compile_options("sm_90");
    let err = mori_gpu::nvrtc::compile_to_cubin(
        "wrong.cu",
        "sm_90",
        &format!("{source}\n{asserts}"),
        &[],
        &options,
    )
    .expect_err("a misplaced field must not compile");
    assert!(
        err.to_string().contains("k.m: not at offset 24 as in Rust"),
        "{err}"
    );
}
