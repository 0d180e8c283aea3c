//! `kernels/entries.txt`, the one table of the raw kernels' host constants (entry names, block
//! sizes, dynamic shared memory, clusters, tiles, the `#define`s and host chunk sizes the host
//! mirrors), parsed at compile time. Every lookup is a `const fn` used in a const context, so a
//! name missing from the table (a misspelt entry, a removed constant) fails the build. The
//! table's agreement with the CUDA sources is the unit test `table_tests`.

const TABLE: &str = include_str!("../../../kernels/entries.txt");

/// The source file an entry point lives in (the table's `file` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    /// `kernels/gemm_sm90.cu`.
    Gemm,
    /// `kernels/linear_logp_sm90.cu`.
    Logp,
    /// `kernels/stream_sync.cu`: plain CUDA for any architecture, compiled without `common.cuh`.
    StreamSync,
    /// `kernels/attention_sm90.cu`.
    Attn,
}

/// One `entry` line: an entry point of `kernels/` with its launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The `extern "C"` name; entry names are a fixed set, so no allocation per launch.
    pub name: &'static str,
    pub unit: Unit,
    /// Threads per block (the entry's `__launch_bounds__`).
    pub threads: u32,
    /// Dynamic shared memory in bytes.
    pub smem: usize,
    /// CTAs per cluster (`__cluster_dims__`; 1 without): the grid is a multiple of it.
    pub cluster: usize,
    /// Output rows and columns one CTA covers; `[0, 0]` for a kernel without a tile (`-`).
    pub tile: [usize; 2],
}

/// The table's entry point `$name` as an [`Entry`], through a const item: a name that is not in
/// the table fails to compile, in `cargo check` too (which evaluates const items, not inline
/// `const` blocks).
macro_rules! entry {
    ($name:literal) => {{
        const ENTRY: $crate::backends::sm90::table::Entry =
            $crate::backends::sm90::table::lookup($name);
        ENTRY
    }};
}
pub(crate) use entry;

/// The `entry` line named `name` (in a const item, as [`entry!`] and every use here do: a name
/// that is not in the table then fails to compile).
pub(crate) const fn lookup(name: &str) -> Entry {
    match find(b"entry", name.as_bytes()) {
        Some(line) => parse_entry(line),
        None => panic!("an entry point missing from kernels/entries.txt"),
    }
}

/// The value of the `define` or `host` line named `name` (use it in a const item: a missing name
/// then fails to compile).
pub(crate) const fn constant(name: &str) -> usize {
    let line = match find(b"define", name.as_bytes()) {
        Some(line) => line,
        None => match find(b"host", name.as_bytes()) {
            Some(line) => line,
            None => panic!("a constant missing from kernels/entries.txt"),
        },
    };
    number(field(line, 2))
}

/// The first line of the table whose first two fields are `kind` and `name`.
const fn find(kind: &[u8], name: &[u8]) -> Option<&'static [u8]> {
    let mut rest = TABLE.as_bytes();
    while !rest.is_empty() {
        let (line, next) = split_line(rest);
        rest = next;
        if same(field(line, 0), kind) && same(field(line, 1), name) {
            return Some(line);
        }
    }
    None
}

const fn parse_entry(line: &'static [u8]) -> Entry {
    let name = match core::str::from_utf8(field(line, 1)) {
        Ok(name) => name,
        Err(_) => panic!("an entry name in kernels/entries.txt is not UTF-8"),
    };
    let file = field(line, 2);
    let unit = if same(file, b"gemm_sm90.cu") {
        Unit::Gemm
    } else if same(file, b"linear_logp_sm90.cu") {
        Unit::Logp
    } else if same(file, b"stream_sync.cu") {
        Unit::StreamSync
    } else if same(file, b"attention_sm90.cu") {
        Unit::Attn
    } else {
        panic!("an entry of kernels/entries.txt names an unknown source file")
    };
    if !field(line, 8).is_empty() {
        panic!("an entry line of kernels/entries.txt has more than 7 fields");
    }
    Entry {
        name,
        unit,
        threads: number(field(line, 3)) as u32,
        smem: number(field(line, 4)),
        cluster: number(field(line, 5)),
        tile: pair(field(line, 6)),
    }
}

/// `(line, rest)` at the first newline of `text` (which the rest excludes).
const fn split_line(text: &[u8]) -> (&[u8], &[u8]) {
    let mut i = 0;
    while i < text.len() && text[i] != b'\n' {
        i += 1;
    }
    let (line, rest) = text.split_at(i);
    match rest {
        [_, rest @ ..] => (line, rest),
        [] => (line, rest),
    }
}

/// Field `index` of `line` (fields separated by blanks, `#` starts a comment); empty past the
/// last field.
pub(super) const fn field(line: &[u8], index: usize) -> &[u8] {
    let mut rest = line;
    let mut i = 0;
    loop {
        while let [b' ' | b'\t' | b'\r', tail @ ..] = rest {
            rest = tail;
        }
        let mut len = 0;
        while len < rest.len() && !matches!(rest[len], b' ' | b'\t' | b'\r') {
            len += 1;
        }
        let (token, tail) = rest.split_at(len);
        if token.is_empty() || token[0] == b'#' {
            return &[];
        }
        if i == index {
            return token;
        }
        rest = tail;
        i += 1;
    }
}

const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A decimal field (`-` reads as 0).
pub(super) const fn number(token: &[u8]) -> usize {
    if same(token, b"-") {
        return 0;
    }
    if token.is_empty() {
        panic!("a number is missing in kernels/entries.txt");
    }
    let mut value = 0;
    let mut i = 0;
    while i < token.len() {
        if !token[i].is_ascii_digit() {
            panic!("a field of kernels/entries.txt is not a decimal number");
        }
        value = value * 10 + (token[i] - b'0') as usize;
        i += 1;
    }
    value
}

/// `<rows>x<cols>` (`-` reads as `[0, 0]`).
const fn pair(token: &[u8]) -> [usize; 2] {
    if same(token, b"-") {
        return [0, 0];
    }
    let mut i = 0;
    while i < token.len() && token[i] != b'x' {
        i += 1;
    }
    if i == token.len() {
        panic!("a tile of kernels/entries.txt is not <rows>x<cols>");
    }
    let (rows, cols) = token.split_at(i);
    match cols {
        [_, cols @ ..] => [number(rows), number(cols)],
        [] => unreachable!(),
    }
}

/// Every `entry` line, in table order.
#[cfg(test)]
pub(super) fn entries() -> Vec<(Entry, &'static [u8])> {
    lines()
        .filter(|line| same(field(line, 0), b"entry"))
        .map(|line| (parse_entry(line), line))
        .collect()
}

/// Every line of the table.
#[cfg(test)]
pub(super) fn lines() -> impl Iterator<Item = &'static [u8]> {
    TABLE.as_bytes().split(|&b| b == b'\n')
}
