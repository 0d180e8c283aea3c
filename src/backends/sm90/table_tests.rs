//! `kernels/entries.txt` against the CUDA sources, read as text (no GPU, no NVRTC): every entry is
//! an `extern "C" __global__` of its file (and every such kernel an entry), under the matching
//! `IB_ENTRY_` guard; `__launch_bounds__` and `__cluster_dims__` equal the table's threads and
//! cluster; an `ib::Gmma` kernel's template arguments give the table's tile, stages, threads and
//! dynamic shared memory (with `common.cuh`'s layout and the kernel's own extra bytes); a kernel
//! without one uses no dynamic shared memory; the mirrored `#define`s have the table's values.
use std::collections::BTreeSet;

use super::table::{self, Entry, Unit};

const COMMON: &str = include_str!("../../../kernels/common.cuh");

fn source(unit: Unit) -> &'static str {
    match unit {
        Unit::Gemm => include_str!("../../../kernels/gemm_sm90.cu"),
        Unit::Logp => include_str!("../../../kernels/linear_logp_sm90.cu"),
        Unit::StreamSync => include_str!("../../../kernels/stream_sync.cu"),
        Unit::Attn => include_str!("../../../kernels/attention_sm90.cu"),
    }
}

const UNITS: [(Unit, &str); 4] = [
    (Unit::Gemm, "gemm_sm90.cu"),
    (Unit::Logp, "linear_logp_sm90.cu"),
    (Unit::StreamSync, "stream_sync.cu"),
    (Unit::Attn, "attention_sm90.cu"),
];

/// An `extern "C" __global__` of a source, macros expanded.
#[derive(Debug)]
struct Kernel {
    name: String,
    threads: u64,
    cluster: [u64; 3],
    /// The `IB_ENTRY_<name>` of the `#if` around it.
    guard: Option<String>,
    /// The kernel's text (declaration and body).
    text: String,
}

/// The text inside the bracket that opens `s` (`(` or `<`) and the text after its close.
fn group(s: &str) -> (&str, &str) {
    let (open, close) = match s.as_bytes()[0] {
        b'(' => (b'(', b')'),
        b'<' => (b'<', b'>'),
        other => panic!("no bracket at `{}`", other as char),
    };
    let mut depth = 0;
    for (i, &c) in s.as_bytes().iter().enumerate() {
        depth += (c == open) as i32 - (c == close) as i32;
        if depth == 0 {
            return (&s[1..i], &s[i + 1..]);
        }
    }
    panic!("unbalanced `{s}`")
}

/// Comma-separated arguments at bracket depth 0, trimmed.
fn args(s: &str) -> Vec<String> {
    let (mut out, mut depth, mut start) = (vec![], 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '<' => depth += 1,
            ')' | '>' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim().to_string());
    out
}

/// An integer expression of literals (`u` suffixes allowed), `+`, `*` and parentheses.
fn eval(expr: &str) -> u64 {
    fn sum(t: &mut std::iter::Peekable<std::vec::IntoIter<String>>) -> u64 {
        let mut v = product(t);
        while t.next_if_eq("+").is_some() {
            v += product(t);
        }
        v
    }
    fn product(t: &mut std::iter::Peekable<std::vec::IntoIter<String>>) -> u64 {
        let mut v = atom(t);
        while t.next_if_eq("*").is_some() {
            v *= atom(t);
        }
        v
    }
    fn atom(t: &mut std::iter::Peekable<std::vec::IntoIter<String>>) -> u64 {
        match t.next().as_deref() {
            Some("(") => {
                let v = sum(t);
                assert_eq!(t.next().as_deref(), Some(")"));
                v
            }
            Some(lit) => lit
                .trim_end_matches('u')
                .parse()
                .unwrap_or_else(|_| panic!("`{lit}` is not an integer literal")),
            None => panic!("expression ends early"),
        }
    }
    let mut tokens: Vec<String> = vec![];
    for c in expr.chars().filter(|c| !c.is_whitespace()) {
        match (c, tokens.last_mut()) {
            ('0'..='9' | 'u', Some(last)) if last_is_number(last) => last.push(c),
            _ => tokens.push(c.to_string()),
        }
    }
    let mut t = tokens.into_iter().peekable();
    let v = sum(&mut t);
    assert!(t.next().is_none(), "trailing tokens in `{expr}`");
    v
}

fn last_is_number(token: &str) -> bool {
    token.as_bytes()[0].is_ascii_digit()
}

/// `text` with every whole identifier in `names` replaced by its value, then `##` pasted.
fn substitute(text: &str, names: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let value = names.iter().find(|(name, _)| name == word);
        out.push_str(value.map_or(word.as_str(), |(_, v)| v.as_str()));
        word.clear();
    };
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out.replace(" ## ", "").replace("##", "")
}

/// The declaration of a kernel: `__launch_bounds__`, `__cluster_dims__`, the name.
fn declaration(text: &str, guard: Option<String>) -> Kernel {
    let start = text.find("extern \"C\" __global__ void").expect("a kernel") + 26;
    let mut rest = text[start..].trim_start();
    let (mut threads, mut cluster) = (None, [1, 1, 1]);
    loop {
        if let Some(tail) = rest.strip_prefix("__launch_bounds__") {
            let (inner, tail) = group(tail);
            threads = Some(eval(&args(inner)[0]));
            rest = tail.trim_start();
        } else if let Some(tail) = rest.strip_prefix("__cluster_dims__") {
            let (inner, tail) = group(tail);
            let dims: Vec<u64> = args(inner).iter().map(|a| eval(a)).collect();
            cluster = dims.try_into().expect("three cluster dimensions");
            rest = tail.trim_start();
        } else {
            break;
        }
    }
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    Kernel {
        threads: threads.unwrap_or_else(|| panic!("{name} has no __launch_bounds__")),
        name,
        cluster,
        guard,
        text: text.to_string(),
    }
}

/// Every kernel of `src`: plain ones and those expanded from `#define`s that declare one.
fn kernels(src: &str) -> Vec<Kernel> {
    let logical = src.replace("\\\n", " ");
    let lines: Vec<&str> = logical.lines().collect();
    let mut macros = vec![];
    for line in &lines {
        if let Some(def) = line.strip_prefix("#define ")
            && def.contains("extern \"C\" __global__")
        {
            let name_end = def.find('(').expect("a macro with parameters");
            let (params, body) = group(&def[name_end..]);
            macros.push((def[..name_end].to_string(), args(params), body.to_string()));
        }
    }
    let (mut out, mut guard) = (vec![], None);
    for (i, line) in lines.iter().enumerate() {
        if let Some(cond) = line.strip_prefix("#if ") {
            guard = cond
                .split_once("defined(IB_ENTRY_")
                .map(|(_, name)| name.trim_end_matches(')').to_string());
        } else if line.starts_with("#endif") {
            guard = None;
        } else if line.starts_with("extern \"C\" __global__") {
            let end = (i..lines.len()).find(|&j| lines[j] == "}").expect("a body");
            out.push(declaration(&lines[i..=end].join("\n"), guard.clone()));
        } else if let Some((_, params, body)) = macros.iter().find(|(name, ..)| {
            line.strip_prefix(name.as_str())
                .is_some_and(|rest| rest.starts_with('('))
        }) {
            let (values, _) = group(&line[line.find('(').unwrap()..]);
            let values = args(values);
            assert_eq!(values.len(), params.len(), "arguments of `{line}`");
            let pairs: Vec<_> = params.iter().cloned().zip(values).collect();
            out.push(declaration(&substitute(body, &pairs), guard.clone()));
        }
    }
    out
}

/// The text of the `void` function `name` (its definition up to the closing `}` at column 0), in
/// `src` or `common.cuh`.
fn function<'a>(src: &'a str, name: &str) -> Option<&'a str> {
    [src, COMMON].into_iter().find_map(|text| {
        let start = text.find(&format!("void {name}("))?;
        let end = text[start..].find("\n}\n")?;
        Some(&text[start..start + end])
    })
}

/// The kernel's text and that of every `ib::` function it calls.
fn texts<'a>(kernel: &'a Kernel, src: &'a str) -> Vec<&'a str> {
    let callees = kernel.text.split("ib::").skip(1);
    let callees = callees.filter_map(|s| s.split(['<', '(']).next());
    let mut out = vec![kernel.text.as_str()];
    out.extend(callees.filter_map(|name| function(src, name)));
    out
}

/// Whether `text` has `word` as a whole identifier.
fn has_word(text: &str, word: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word)
        .any(|(i, _)| !text[..i].ends_with(ident) && !text[i + word.len()..].starts_with(ident))
}

/// The `ib::Gmma<T, BN, NC, ST, TA, TB, CL[, PP]>` numbers behind a kernel (in its text, a typedef it
/// names, or an `ib::` function it calls) and the extra bytes its `carve` asks for.
fn gmma(kernel: &Kernel, src: &str) -> Option<([u64; 7], u64)> {
    let texts = texts(kernel, src);
    let direct = |t: &str| Some(group(&t[t.find("Gmma<")? + 4..]).0.to_string());
    let typedef = || {
        src.split("typedef Gmma").skip(1).find_map(|s| {
            let (inner, rest) = group(s);
            let name = rest.split(';').next()?.trim();
            has_word(&kernel.text, name).then(|| inner.to_string())
        })
    };
    let inner = direct(&kernel.text)
        .or_else(typedef)
        .or_else(|| texts.iter().find_map(|t| direct(t)))?;
    let mut numbers: Vec<u64> = args(&inner)[1..].iter().map(|a| eval(a)).collect();
    if numbers.len() == 6 {
        numbers.push(0); // PP defaults to 0
    }
    let config: [u64; 7] = numbers
        .try_into()
        .expect("Gmma<T, BN, NC, ST, TA, TB, CL[, PP]>");
    let extra = texts
        .iter()
        .filter_map(|t| {
            let (_, rest) = t.split_once("carve(smem_raw, ")?;
            let expr = group(&format!("({rest}"))
                .0
                .replace("G::BN", &config[0].to_string());
            Some(eval(&expr))
        })
        .sum();
    Some((config, extra))
}

/// An attention kernel's own shared-memory layout (not `ib::Gmma`'s): the rows of its tile
/// (`ATTN_Q_TILE`, or 64 per consumer warpgroup where `ib::AttnCfg<T, D, BN, ST, NC>` names them;
/// `ATTN_BWD_TILE`), `Dh` and the stages from `ib::AttnCfg` (forward) or
/// `ib::AttnBwdCfg<T, D, ST>` (backward), and the dynamic shared memory of its
/// `SMEM_BYTES == <n>` static_assert (which NVRTC checks against the layout).
fn attn(kernel: &Kernel) -> Option<(u64, u64, u64, u64)> {
    let text = &kernel.text;
    let (rows, head_dim, stages) = match text.find("AttnCfg<") {
        Some(at) => {
            let config = args(group(&text[at + 7..]).0);
            let rows = match config.get(4) {
                Some(nc) => 64 * eval(nc),
                None => table::constant("ATTN_Q_TILE") as u64,
            };
            (rows, eval(&config[1]), eval(&config[3]))
        }
        None => {
            let at = text.find("AttnBwdCfg<")?;
            let config = args(group(&text[at + 10..]).0);
            let rows = table::constant("ATTN_BWD_TILE") as u64;
            (rows, eval(&config[1]), eval(&config[2]))
        }
    };
    let (_, rest) = text.split_once("SMEM_BYTES == ")?;
    let smem = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some((rows, head_dim, stages, smem))
}

/// The table's line of `name`.
fn table_entry(name: &str) -> (Entry, &'static [u8]) {
    let entries = table::entries();
    let found = entries.into_iter().find(|(e, _)| e.name == name);
    found.unwrap_or_else(|| panic!("{name} is not in kernels/entries.txt"))
}

/// Tile, stages, threads, cluster and shared memory of `kernel` against its table line.
fn check_shape(kernel: &Kernel, (entry, line): (Entry, &[u8]), src: &str) {
    let name = &kernel.name;
    let stages = table::number(table::field(line, 7)) as u64;
    let shared = texts(kernel, src)
        .iter()
        .any(|t| t.contains("extern __shared__"));
    let [rows, cols] = entry.tile;
    if let Some((tile_rows, head_dim, ring, smem)) = attn(kernel) {
        // tile: query rows or keys per CTA x Dh; stages: the operand ring
        assert_eq!(rows as u64, tile_rows, "{name}: tile rows");
        assert_eq!(cols as u64, head_dim, "{name}: tile columns vs Dh");
        assert_eq!(stages, ring, "{name}: stages vs the operand ring");
        assert_eq!(
            entry.smem as u64, smem,
            "{name}: dynamic shared memory vs its static_assert"
        );
        assert!(
            shared,
            "{name}: an attention kernel without extern __shared__"
        );
        return;
    }
    match gmma(kernel, src) {
        Some(([bn, nc, st, _, _, cl, pp], extra)) => {
            let bm = if pp == 1 { 64 } else { 64 * nc };
            assert_eq!(
                [rows, cols],
                [bm as usize, bn as usize],
                "{name}: tile vs Gmma"
            );
            assert_eq!(stages, st, "{name}: stages vs Gmma");
            assert_eq!(
                u64::from(entry.threads),
                128 * (nc + 1),
                "{name}: threads vs Gmma"
            );
            assert_eq!(entry.cluster as u64, cl, "{name}: cluster vs Gmma");
            let smem = 1024 + st * (bm + bn) * 64 * 2 + 16 * st + extra;
            assert_eq!(
                entry.smem as u64, smem,
                "{name}: dynamic shared memory vs Gmma"
            );
            assert!(shared, "{name}: a Gmma kernel without extern __shared__");
        }
        None => {
            assert_eq!(
                (entry.smem, stages),
                (0, 0),
                "{name}: smem/stages without Gmma"
            );
            assert!(
                !shared,
                "{name}: extern __shared__ but no smem in the table"
            );
            for block in [rows, cols].into_iter().filter(|&b| b > 1) {
                let index = format!("blockIdx.x * {block}");
                assert!(
                    kernel.text.contains(&index),
                    "{name}: no `{index}` for its tile"
                );
            }
        }
    }
}

#[test]
fn entries_are_the_kernels_of_their_sources() {
    let entries = table::entries();
    let names: BTreeSet<&str> = entries.iter().map(|(e, _)| e.name).collect();
    assert_eq!(
        names.len(),
        entries.len(),
        "an entry name twice in kernels/entries.txt"
    );
    for (unit, file) in UNITS {
        let src = source(unit);
        let found = kernels(src);
        let in_source: BTreeSet<&str> = found.iter().map(|k| k.name.as_str()).collect();
        let in_table = entries.iter().filter(|(e, _)| e.unit == unit);
        let in_table: BTreeSet<&str> = in_table.map(|(e, _)| e.name).collect();
        assert_eq!(
            in_source, in_table,
            "{file}: kernels vs kernels/entries.txt"
        );
        assert_eq!(
            in_source.len(),
            found.len(),
            "{file}: a kernel defined twice"
        );
        for kernel in &found {
            let (entry, line) = table_entry(&kernel.name);
            let name = &kernel.name;
            assert_eq!(
                kernel.threads,
                u64::from(entry.threads),
                "{name}: __launch_bounds__"
            );
            let cluster = [entry.cluster as u64, 1, 1];
            assert_eq!(kernel.cluster, cluster, "{name}: __cluster_dims__");
            // Compiled alone (no entry selection) or selected by its own guard.
            let guard = (unit != Unit::StreamSync).then_some(name.as_str());
            assert_eq!(
                kernel.guard.as_deref(),
                guard,
                "{name}: #if IB_ENTRY_ guard"
            );
            check_shape(kernel, (entry, line), src);
        }
    }
}

#[test]
fn gmma_layout_is_the_one_the_table_assumes() {
    for text in [
        "template <class T, int BN_, int NC_, int ST_, int TA_, int TB_, int CL_ = 1, int PP_ = 0>\nstruct Gmma {",
        "static constexpr int BM = PP ? 64 : 64 * NC, BK = 64;",
        "A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;",
        "static constexpr int NTHREADS = 128 * (NC + 1);",
        "static constexpr int PIPE_BYTES = ST * STAGE_BYTES;",
        "static constexpr int SMEM_BYTES = 1024 + PIPE_BYTES + 16 * ST;",
        "s.full = (u64*)(s.a + PIPE_BYTES + extra_bytes);",
        "s.empty = s.full + ST;",
    ] {
        assert!(COMMON.contains(text), "common.cuh no longer has `{text}`");
    }
}

#[test]
fn defines_match_the_sources() {
    let defines = table::lines().filter(|l| table::field(l, 0) == b"define");
    let mut count = 0;
    for line in defines {
        let text = |i| std::str::from_utf8(table::field(line, i)).unwrap();
        let (name, value, file) = (text(1), table::number(table::field(line, 2)), text(3));
        let (unit, _) = UNITS
            .iter()
            .find(|(_, f)| *f == file)
            .expect("a kernel file");
        let prefix = format!("#define {name} ");
        let defined = source(*unit)
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()));
        let defined = defined.unwrap_or_else(|| panic!("{file} does not #define {name}"));
        let literal = defined
            .split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches('u');
        assert_eq!(
            literal.parse::<usize>().ok(),
            Some(value),
            "{name} in {file}"
        );
        count += 1;
    }
    assert!(
        count >= 11,
        "the defines of kernels/entries.txt were not read"
    );
}

#[test]
fn constants_fit_the_kernels() {
    let (fwd, dz) = (
        table::lookup("ib_logp_fwd_bf16"),
        table::lookup("ib_logp_bwd_dz_bf16"),
    );
    let seg = table::constant("LOGP_SEG");
    assert_eq!(
        seg % fwd.tile[1],
        0,
        "LOGP_SEG is a multiple of the vocab tile"
    );
    let vocab_chunk = table::constant("VOCAB_CHUNK");
    assert_eq!(
        vocab_chunk % 8,
        0,
        "VOCAB_CHUNK (the dz row stride) is a multiple of 8"
    );
    let merge = table::lookup("ib_logp_merge");
    assert_eq!(
        merge.tile[0] * 32,
        merge.threads as usize,
        "ib_logp_merge: a warp per row"
    );
    // The dbias kernels sum one partial per dz row block (the host sizes dbias_part by it).
    let sum = format!("cdiv((int)p.tw, {})", dz.tile[0]);
    for kernel in kernels(source(Unit::Logp)) {
        if kernel.name.starts_with("ib_logp_bwd_dbias_") {
            assert!(kernel.text.contains(&sum), "{}: no `{sum}`", kernel.name);
        }
    }
}
