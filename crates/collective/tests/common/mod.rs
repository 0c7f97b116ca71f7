//! A small parser of the kernel sources mori-collective declares parameters for: every
//! `extern "C" __global__` entry point with its parameter list (function-like macros that
//! define kernels are expanded), and the members of a struct.

#![allow(dead_code)] // each test binary uses its own part

use mori_collective::params::CType;
use mori_gpu::jit::KernelSpec;

/// The kernel variants whose entry points mori-collective launches.
pub fn variants() -> Vec<KernelSpec> {
    mori_gpu::kernels::variants()
        .into_iter()
        .filter(|v| v.name.starts_with("ep/") || v.name.starts_with("collective/"))
        .collect()
}

/// One parameter (or struct member) as the source spells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub name: String,
    /// The C type with `const`, `volatile` and `__restrict__` dropped (`int*`, `u64`,
    /// `mori::ccl::CclArgs`).
    pub c_type: String,
    /// Array extent as written (`MAX_RANKS`), for struct members.
    pub extent: Option<String>,
}

impl Param {
    /// The scalar C type, or None for a struct type.
    pub fn ctype(&self) -> Option<CType> {
        if self.c_type.ends_with('*') {
            return Some(CType::Ptr);
        }
        Some(match self.c_type.as_str() {
            "int" => CType::I32,
            "unsigned int" => CType::U32,
            "long long" => CType::I64,
            "u64" | "unsigned long long" => CType::U64,
            "float" => CType::F32,
            _ => return None,
        })
    }
}

/// An `extern "C" __global__` entry point.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub params: Vec<Param>,
}

/// Drops `//` comments and joins backslash-continued lines.
fn clean(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        match code.trim_end().strip_suffix('\\') {
            Some(joined) => {
                out.push_str(joined);
                out.push(' ');
            }
            None => {
                out.push_str(code);
                out.push('\n');
            }
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Replaces whole-word `from` (and `##from` / `from##` token pastes) with `to`.
fn substitute(text: &str, from: &str, to: &str) -> String {
    let text = text
        .replace(&format!("##{from}"), to)
        .replace(&format!("{from}##"), to);
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find(from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(is_ident) || after.is_some_and(is_ident) {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

/// The text between the parenthesis at `open` and its match, and the index after the match.
fn parenthesized(text: &str, open: usize) -> (&str, usize) {
    let mut depth = 0;
    for (i, c) in text[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return (&text[open + 1..open + i], open + i + 1);
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses after {:?}", &text[open..]);
}

/// Expands every function-like macro whose body defines an `extern "C"` kernel.
fn expand_kernel_macros(text: &str) -> String {
    let mut out = String::new();
    let mut macros: Vec<(String, Vec<String>, String)> = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(def) = trimmed.strip_prefix("#define ")
            && def.contains("extern \"C\"")
        {
            let name_end = def.find('(').expect("a function-like macro");
            let (params, body_at) = parenthesized(def, name_end);
            let params = params.split(',').map(|p| p.trim().to_string()).collect();
            macros.push((
                def[..name_end].to_string(),
                params,
                def[body_at..].to_string(),
            ));
            continue;
        }
        let invoked = macros.iter().find(|(name, _, _)| {
            trimmed
                .strip_prefix(name.as_str())
                .is_some_and(|r| r.starts_with('('))
        });
        match invoked {
            Some((name, params, body)) => {
                let (args, _) = parenthesized(trimmed, name.len());
                let mut expanded = body.clone();
                for (p, a) in params.iter().zip(args.split(',')) {
                    expanded = substitute(&expanded, p, a.trim());
                }
                out.push_str(&expanded);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn parse_param(text: &str) -> Param {
    let spaced = text.replace('*', " * ");
    let words: Vec<&str> = spaced
        .split_whitespace()
        .filter(|w| !matches!(*w, "const" | "volatile" | "__restrict__"))
        .collect();
    let (name, ty) = words.split_last().expect("a parameter has a name");
    let (name, extent) = match name.split_once('[') {
        Some((n, e)) => (n, Some(e.trim_end_matches(']').to_string())),
        None => (*name, None),
    };
    Param {
        name: name.to_string(),
        c_type: ty.join(" ").replace(" *", "*"),
        extent,
    }
}

/// Every `extern "C" __global__` entry point of `source`, in order.
pub fn entries(source: &str) -> Vec<Entry> {
    let text = expand_kernel_macros(&clean(source));
    let marker = "extern \"C\" __global__ void";
    let mut found = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find(marker) {
        let mut decl = rest[at + marker.len()..].trim_start();
        if let Some(bounds) = decl.strip_prefix("__launch_bounds__") {
            let (_, after) = parenthesized(bounds, bounds.find('(').expect("bounds"));
            decl = bounds[after..].trim_start();
        }
        let open = decl.find('(').expect("a parameter list");
        let (params, after) = parenthesized(decl, open);
        found.push(Entry {
            name: decl[..open].trim().to_string(),
            params: params.split(',').map(parse_param).collect(),
        });
        rest = &decl[after..];
    }
    found
}

/// The members of `struct name { ... };` in `source`.
pub fn struct_members(source: &str, name: &str) -> Vec<Param> {
    let text = clean(source);
    let head = format!("struct {name} {{");
    let start = text.find(&head).unwrap_or_else(|| panic!("no {head}")) + head.len();
    let body = &text[start..start + text[start..].find("};").expect("end of struct")];
    body.split(';')
        .filter(|m| !m.trim().is_empty())
        .map(parse_param)
        .collect()
}

/// The value of `constexpr int name = N;` in `source`.
pub fn constant(source: &str, name: &str) -> usize {
    let head = format!("constexpr int {name} = ");
    let at = source.find(&head).unwrap_or_else(|| panic!("no {head}")) + head.len();
    source[at..at + source[at..].find(';').expect(";")]
        .trim()
        .parse()
        .expect("an integer")
}
