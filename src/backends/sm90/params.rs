//! `#[repr(C)]` mirrors of the by-value parameter structs of `kernels/*.cu`. The test below
//! reads the structs from the `.cu` sources and checks every field's name, offset and size
//! against these, so the two sides cannot drift apart.
use bytemuck::{Pod, Zeroable};

/// `GemmParams` of `kernels/gemm_sm90.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct GemmParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// `GEMM_*` bits.
    pub flags: u32,
    /// Row stride of C and Cacc, in elements.
    pub ldc: u64,
    /// Element offset added to C and Cacc.
    pub c_offset: u64,
}

/// `LogpFwdParams` of `kernels/linear_logp_sm90.cu` (also the `ib_logp_merge` parameters).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct LogpFwdParams {
    pub n: u32,
    pub v: u32,
    pub d: u32,
    /// `LOGP_HAS_BIAS | LOGP_HAS_IGNORE | LOGP_ENTROPY`.
    pub flags: u32,
    pub ignore_index: i64,
    /// `1 / temperature`.
    pub inv_t: f32,
    pub pad: u32,
}

/// `LogpSampleParams` of `kernels/linear_logp_sm90.cu` (the sampler's pass and merge).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct LogpSampleParams {
    pub n: u32,
    pub v: u32,
    pub d: u32,
    /// `LOGP_HAS_BIAS | LOGP_ENTROPY`.
    pub flags: u32,
    /// Unused (keys, not targets).
    pub ignore_index: i64,
    /// `1 / temperature`.
    pub inv_t: f32,
    pub pad: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    /// 1: Gumbel-max; 0: argmax.
    pub noise: u32,
    pub pad2: u32,
}

/// `LogpBwdParams` of `kernels/linear_logp_sm90.cu`: one chunk of the backward.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct LogpBwdParams {
    /// Chunk rows.
    pub tw: u32,
    /// Chunk vocabulary columns.
    pub vw: u32,
    pub d: u32,
    /// `LOGP_*` bits.
    pub flags: u32,
    pub ignore_index: i64,
    /// Chunk origin: global token row and vocabulary column.
    pub t0: u32,
    pub v0: u32,
    /// Row stride (elements) of dz and of the dbias partials.
    pub ldz: u32,
    /// `1 / temperature`.
    pub inv_t: f32,
}

/// `AttnParams` of `kernels/attention_sm90.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct AttnParams {
    /// Batch rows.
    pub b: u32,
    /// Query heads.
    pub h: u32,
    /// KV heads (`h % kh == 0`).
    pub kh: u32,
    /// Queries per row.
    pub q: u32,
    /// Keys per row of key/value.
    pub kv: u32,
    /// `ATTN_CAUSAL`.
    pub flags: u32,
    /// Score scale.
    pub scale: f32,
    pub pad: u32,
}

/// `SyncParams` of `kernels/stream_sync.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct SyncParams {
    /// Device address of the flag words.
    pub flags: u64,
    /// The exchange's sequence number (never 0).
    pub seq: u32,
    pub pad: u32,
    /// `ib_wait` gives up after this long.
    pub timeout_ns: u64,
    /// 32-bit words `ib_copy` moves.
    pub words: u64,
}

/// `params` as the 64-bit words cubecl passes by value (every struct is a multiple of 8 bytes).
pub(crate) fn words<P: Pod>(params: &P) -> Vec<u64> {
    bytemuck::bytes_of(params)
        .chunks(8)
        .map(|chunk| {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            u64::from_ne_bytes(word)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use core::mem::{offset_of, size_of};

    use super::*;

    /// `(field, offset, size)` of `name` in a C source: the fields are `u32`, `float`, `u64`,
    /// `long long` or pointers, laid out at their natural alignment.
    fn c_layout(source: &str, name: &str) -> (Vec<(String, usize, usize)>, usize) {
        let start = source
            .find(&format!("struct {name} {{"))
            .expect("struct in source");
        let body = &source[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        let (mut fields, mut offset, mut align) = (Vec::new(), 0usize, 1usize);
        for line in body.lines() {
            let decl = line
                .split("//")
                .next()
                .unwrap()
                .trim()
                .trim_end_matches(';');
            if decl.is_empty() {
                continue;
            }
            let (ty, names) = if let Some(names) = decl.strip_prefix("long long") {
                ("long long", names)
            } else if let Some((_, names)) = decl.split_once('*') {
                ("ptr", names)
            } else {
                decl.split_once(' ').expect("a C declaration")
            };
            let size = match ty {
                "u32" | "float" => 4,
                "u64" | "long long" | "ptr" => 8,
                other => panic!("unexpected C type `{other}` in {name}"),
            };
            for field in names.split(',') {
                offset = offset.next_multiple_of(size);
                fields.push((field.trim().to_lowercase(), offset, size));
                offset += size;
                align = align.max(size);
            }
        }
        (fields, offset.next_multiple_of(align))
    }

    macro_rules! rust_layout {
        ($ty:ty { $($field:ident: $fty:ty),* }) => {
            (
                vec![$((stringify!($field).to_string(), offset_of!($ty, $field), size_of::<$fty>())),*],
                size_of::<$ty>(),
            )
        };
    }

    const GEMM: &str = include_str!("../../../kernels/gemm_sm90.cu");
    const LOGP: &str = include_str!("../../../kernels/linear_logp_sm90.cu");
    const SYNC: &str = include_str!("../../../kernels/stream_sync.cu");
    const ATTN: &str = include_str!("../../../kernels/attention_sm90.cu");

    #[test]
    fn structs_match_the_cuda_sources() {
        assert_eq!(
            c_layout(GEMM, "GemmParams"),
            rust_layout!(GemmParams {
                m: u32,
                n: u32,
                k: u32,
                flags: u32,
                ldc: u64,
                c_offset: u64
            })
        );
        assert_eq!(
            c_layout(LOGP, "LogpFwdParams"),
            rust_layout!(LogpFwdParams {
                n: u32,
                v: u32,
                d: u32,
                flags: u32,
                ignore_index: i64,
                inv_t: f32,
                pad: u32
            })
        );
        assert_eq!(
            c_layout(LOGP, "LogpSampleParams"),
            rust_layout!(LogpSampleParams {
                n: u32,
                v: u32,
                d: u32,
                flags: u32,
                ignore_index: i64,
                inv_t: f32,
                pad: u32,
                seed_lo: u32,
                seed_hi: u32,
                noise: u32,
                pad2: u32
            })
        );
        assert_eq!(
            c_layout(LOGP, "LogpBwdParams"),
            rust_layout!(LogpBwdParams {
                tw: u32,
                vw: u32,
                d: u32,
                flags: u32,
                ignore_index: i64,
                t0: u32,
                v0: u32,
                ldz: u32,
                inv_t: f32
            })
        );
        assert_eq!(
            c_layout(ATTN, "AttnParams"),
            rust_layout!(AttnParams {
                b: u32,
                h: u32,
                kh: u32,
                q: u32,
                kv: u32,
                flags: u32,
                scale: f32,
                pad: u32
            })
        );
        assert_eq!(
            c_layout(SYNC, "SyncParams"),
            rust_layout!(SyncParams {
                flags: u64,
                seq: u32,
                pad: u32,
                timeout_ns: u64,
                words: u64
            })
        );
    }

    #[test]
    fn words_keep_the_byte_layout() {
        let params = GemmParams {
            m: 1,
            n: 2,
            k: 3,
            flags: 4,
            ldc: 5,
            c_offset: 6,
        };
        let w = words(&params);
        assert_eq!(w.len(), 4);
        assert_eq!(w[0], 1 | (2 << 32));
        assert_eq!(w[1], 3 | (4 << 32));
        assert_eq!(&w[2..], &[5, 6]);
    }
}
