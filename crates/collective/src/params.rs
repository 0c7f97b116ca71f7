//! Kernel parameters as data: the C type and offset of every field of a parameter struct, the
//! packed bytes handed to the driver, and a [`Packer`] that fills them field by field from
//! dynamically typed values (the Python bindings).
//!
//! Bytes are written field by field at the offsets rustc computes for the `#[repr(C)]` struct
//! (the C alignment rules), into a zeroed buffer: padding is zero and no `unsafe` is needed.

use crate::error::{Error, Result};

/// The most parameter bytes one launch carries (`CclArgs` is the largest: 520; CUDA takes up
/// to 4 KiB).
pub const MAX_PARAM_BYTES: usize = 1024;

/// C type of one kernel parameter, or of one member of a struct passed by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CType {
    /// Any `T*`: a device (or mapped host) address.
    Ptr,
    /// `int`
    I32,
    /// `unsigned int`
    U32,
    /// `long long`
    I64,
    /// `u64` (`unsigned long long`)
    U64,
    /// `float`
    F32,
}

impl CType {
    /// Size in bytes, which is also the alignment of every C type here.
    pub const fn size(self) -> usize {
        match self {
            CType::I32 | CType::U32 | CType::F32 => 4,
            CType::Ptr | CType::I64 | CType::U64 => 8,
        }
    }

    /// The kernels' spelling (pointers: any `T*`).
    pub const fn c_name(self) -> &'static str {
        match self {
            CType::Ptr => "T*",
            CType::I32 => "int",
            CType::U32 => "unsigned int",
            CType::I64 => "long long",
            CType::U64 => "u64",
            CType::F32 => "float",
        }
    }
}

/// One field of a parameter struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// The kernel's name for it.
    pub name: &'static str,
    pub ty: CType,
    /// Elements: 1 for a scalar, N for a `T name[N]` array member.
    pub len: usize,
    /// Byte offset in the parameter buffer.
    pub offset: usize,
}

impl Field {
    pub const fn end(&self) -> usize {
        self.offset + self.ty.size() * self.len
    }
}

/// How a kernel receives its parameter struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passing {
    /// The fields are the kernel's parameter list.
    Params,
    /// The kernel takes one parameter, `param`, of C struct type `c_type`, whose members are
    /// the fields.
    ByValue {
        c_type: &'static str,
        param: &'static str,
    },
}

/// The layout of one parameter struct and the entry points that take it.
#[derive(Debug, PartialEq, Eq)]
pub struct Layout {
    /// The Rust struct's name.
    pub name: &'static str,
    pub entries: &'static [&'static str],
    pub fields: &'static [Field],
    pub passing: Passing,
    /// Bytes handed to the driver: up to the end of the last field (no tail padding).
    pub len: usize,
}

impl Layout {
    /// Checked at compile time: fields in order, aligned, not overlapping, within
    /// [`MAX_PARAM_BYTES`].
    pub const fn new(
        name: &'static str,
        entries: &'static [&'static str],
        fields: &'static [Field],
        passing: Passing,
    ) -> Self {
        assert!(fields.len() <= 64, "a Packer tracks at most 64 fields");
        let mut end = 0;
        let mut i = 0;
        while i < fields.len() {
            let f = &fields[i];
            assert!(f.offset >= end, "fields overlap or are out of order");
            assert!(
                f.offset.is_multiple_of(f.ty.size()),
                "a field is not at its C alignment"
            );
            assert!(f.len >= 1, "an array field has no elements");
            end = f.end();
            i += 1;
        }
        assert!(end <= MAX_PARAM_BYTES, "parameters exceed MAX_PARAM_BYTES");
        Self {
            name,
            entries,
            fields,
            passing,
            len: end,
        }
    }

    /// The field called `name`, with its index.
    pub fn field(&self, name: &str) -> Option<(usize, &'static Field)> {
        self.fields.iter().enumerate().find(|(_, f)| f.name == name)
    }

    /// "name: type, ..." for messages.
    pub fn describe(&self) -> String {
        let list: Vec<String> = self
            .fields
            .iter()
            .map(|f| match f.len {
                1 => format!("{}: {}", f.name, f.ty.c_name()),
                n => format!("{}: {}[{n}]", f.name, f.ty.c_name()),
            })
            .collect();
        list.join(", ")
    }
}

/// A Rust field's name as the kernel spells it (`r#in` is `in`).
pub const fn field_name(stringified: &'static str) -> &'static str {
    match stringified.as_bytes() {
        [b'r', b'#', rest @ ..] => match core::str::from_utf8(rest) {
            Ok(name) => name,
            Err(_) => stringified,
        },
        _ => stringified,
    }
}

/// A pointer parameter: the device address the kernel receives.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DevicePtr(pub u64);

/// A type a parameter struct field may have: a C scalar (or an array of them) that writes
/// itself in native byte order.
pub trait Param: Copy {
    const TY: CType;
    const LEN: usize;
    /// Writes the value into `out` (exactly `TY.size() * LEN` bytes).
    fn write(&self, out: &mut [u8]);
}

macro_rules! scalar_param {
    ($($t:ty => $ty:ident),+) => {$(
        impl Param for $t {
            const TY: CType = CType::$ty;
            const LEN: usize = 1;
            fn write(&self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_ne_bytes());
            }
        }
    )+};
}
scalar_param!(i32 => I32, u32 => U32, i64 => I64, u64 => U64, f32 => F32);

impl Param for DevicePtr {
    const TY: CType = CType::Ptr;
    const LEN: usize = 1;
    fn write(&self, out: &mut [u8]) {
        self.0.write(out)
    }
}

impl<const N: usize> Param for [u64; N] {
    const TY: CType = CType::U64;
    const LEN: usize = N;
    fn write(&self, out: &mut [u8]) {
        for (v, chunk) in self.iter().zip(out.chunks_exact_mut(8)) {
            v.write(chunk);
        }
    }
}

/// A `#[repr(C)]` parameter struct of one or more kernel entry points.
pub trait KernelParams {
    fn layout() -> &'static Layout;
    /// The bytes of the launch, in the struct's C layout.
    fn packed(&self) -> Packed;
}

/// The parameter bytes of one launch.
#[derive(Clone)]
pub struct Packed {
    layout: &'static Layout,
    buf: [u8; MAX_PARAM_BYTES],
}

impl Packed {
    pub fn zeroed(layout: &'static Layout) -> Self {
        Self {
            layout,
            buf: [0; MAX_PARAM_BYTES],
        }
    }

    pub fn layout(&self) -> &'static Layout {
        self.layout
    }

    /// What the driver receives.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.layout.len]
    }

    pub(crate) fn into_buffer(self) -> ([u8; MAX_PARAM_BYTES], usize) {
        (self.buf, self.layout.len)
    }

    /// Writes `value` at byte `offset` (used by the generated structs).
    pub fn put<P: Param>(&mut self, offset: usize, value: &P) {
        value.write(&mut self.buf[offset..offset + P::TY.size() * P::LEN]);
    }
}

/// A dynamically typed field value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Ptr(u64),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
    /// The elements of a `u64 name[N]` member: at most N, the rest are zero.
    U64s(&'a [u64]),
}

/// Fills the parameters of one entry point field by field; every field must be set once.
pub struct Packer {
    entry: &'static str,
    packed: Packed,
    set: u64,
}

impl Packer {
    pub fn new(entry: &'static str, layout: &'static Layout) -> Self {
        Self {
            entry,
            packed: Packed::zeroed(layout),
            set: 0,
        }
    }

    pub fn entry(&self) -> &'static str {
        self.entry
    }

    pub fn layout(&self) -> &'static Layout {
        self.packed.layout
    }

    fn error(&self, field: &str, problem: impl Into<String>) -> Error {
        Error::Field {
            entry: self.entry,
            field: field.to_string(),
            problem: problem.into(),
        }
    }

    /// Sets field `index` (its type must be the field's).
    pub fn set(&mut self, index: usize, value: Value<'_>) -> Result<()> {
        let field = *self
            .layout()
            .fields
            .get(index)
            .ok_or_else(|| Error::Arity {
                entry: self.entry,
                expected: self.layout().fields.len(),
                got: index + 1,
                fields: self.layout().describe(),
            })?;
        if self.set & (1 << index) != 0 {
            return Err(self.error(field.name, "given twice"));
        }
        let at = field.offset;
        match (field.ty, field.len, value) {
            (CType::Ptr, 1, Value::Ptr(v)) => self.packed.put(at, &v),
            (CType::I32, 1, Value::I32(v)) => self.packed.put(at, &v),
            (CType::U32, 1, Value::U32(v)) => self.packed.put(at, &v),
            (CType::I64, 1, Value::I64(v)) => self.packed.put(at, &v),
            (CType::U64, 1, Value::U64(v)) => self.packed.put(at, &v),
            (CType::F32, 1, Value::F32(v)) => self.packed.put(at, &v),
            (CType::U64, n, Value::U64s(vs)) if n > 1 => {
                if vs.len() > n {
                    return Err(self.error(
                        field.name,
                        format!("at most {n} elements, got {}", vs.len()),
                    ));
                }
                for (i, v) in vs.iter().enumerate() {
                    self.packed.put(at + 8 * i, v);
                }
            }
            (ty, len, v) => {
                let want = match len {
                    1 => ty.c_name().to_string(),
                    n => format!("{}[{n}]", ty.c_name()),
                };
                return Err(self.error(field.name, format!("is {want}, got {v:?}")));
            }
        }
        self.set |= 1 << index;
        Ok(())
    }

    /// The packed bytes, once every field is set.
    pub fn finish(self) -> Result<Packed> {
        let fields = self.layout().fields;
        let missing: Vec<&str> = (0..fields.len())
            .filter(|i| self.set & (1 << i) == 0)
            .map(|i| fields[i].name)
            .collect();
        if !missing.is_empty() {
            return Err(Error::Missing {
                entry: self.entry,
                fields: missing.join(", "),
            });
        }
        Ok(self.packed)
    }
}

/// Declares a `#[repr(C)]` parameter struct and its [`KernelParams`] implementation. Field
/// names and types are the kernel's parameter list (or the by-value struct's members).
macro_rules! kernel_params {
    (
        $(#[$meta:meta])*
        pub struct $name:ident for $entries:expr, $passing:expr => {
            $( $(#[$fmeta:meta])* pub $field:ident: $ty:ty, )+
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq, Default)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )+
        }

        impl $crate::params::KernelParams for $name {
            fn layout() -> &'static $crate::params::Layout {
                const FIELDS: &[$crate::params::Field] = &[$(
                    $crate::params::Field {
                        name: $crate::params::field_name(stringify!($field)),
                        ty: <$ty as $crate::params::Param>::TY,
                        len: <$ty as $crate::params::Param>::LEN,
                        offset: core::mem::offset_of!($name, $field),
                    },
                )+];
                static LAYOUT: $crate::params::Layout =
                    $crate::params::Layout::new(stringify!($name), $entries, FIELDS, $passing);
                &LAYOUT
            }

            fn packed(&self) -> $crate::params::Packed {
                let mut p = $crate::params::Packed::zeroed(Self::layout());
                $( p.put(core::mem::offset_of!($name, $field), &self.$field); )+
                p
            }
        }
    };
}
pub(crate) use kernel_params;
