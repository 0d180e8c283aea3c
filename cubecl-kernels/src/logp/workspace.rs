//! The workspace layouts both directions and both paths share: where each buffer lies, in f32
//! elements.

use crate::consts::{
    BWD_ROW_CHUNK, BWD_VOCAB_CHUNK, LOGP_FWD_SEGMENT, LOGP_PARTIAL_STRIDE, TC_BWD_ROWS,
    TC_BWD_VOCAB, TC_FWD_ROWS, TC_FWD_VOCAB,
};
use crate::util::FloatDType;
use cubecl::prelude::*;

/// Number of vocabulary segments the forward uses: `ceil(V / LOGP_FWD_SEGMENT)`.
pub fn linear_logp_num_segments(v: usize) -> usize {
    v.div_ceil(LOGP_FWD_SEGMENT)
}

/// The forward's segment partials: `num_segments(V) · N · LOGP_PARTIAL_STRIDE`.
pub(crate) fn partials_len(n: usize, v: usize) -> usize {
    linear_logp_num_segments(v) * n * LOGP_PARTIAL_STRIDE
}

/// f16 or bf16.
pub(crate) fn is_half(dtype: StorageType) -> bool {
    matches!(
        FloatDType::from_storage("dtype", dtype),
        Ok(FloatDType::F16 | FloatDType::BF16)
    )
}

/// f32 elements of logits scratch the tensor-core forward needs after the partials.
pub(crate) fn tc_forward_scratch_len(n: usize, v: usize) -> usize {
    n.min(TC_FWD_ROWS) * v.min(TC_FWD_VOCAB)
}

/// Rows of the f16 / bf16 `dWeight` accumulator: one vocabulary chunk (both paths' chunks are at
/// most `BWD_VOCAB_CHUNK` wide).
pub(crate) fn dw_chunk_rows(v: usize) -> usize {
    v.min(BWD_VOCAB_CHUNK.max(TC_BWD_VOCAB))
}

/// f32 elements of the FMA `dz` scratch at the start of the backward's workspace.
pub(crate) fn dz_scratch_len(n: usize, v: usize) -> usize {
    n.min(BWD_ROW_CHUNK) * v.min(BWD_VOCAB_CHUNK)
}

/// The f16 / bf16 backward's workspace, in f32 elements: the FMA `dz` scratch, the tensor-core
/// scratch, then the f32 accumulators `dHidden` `[N, D]`, one chunk of `dWeight`, `dBias` `[V]`.
/// The tensor-core scratch's half-precision buffers are addressed in half elements (twice their
/// f32 offset), so they lie before the large accumulators: their offsets stay small whatever N·D
/// is, and the whole workspace only needs its length in 32 bits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HalfLayout {
    pub tc: TcScratch,
    pub d_hidden: usize,
    pub d_weight: usize,
    pub d_bias: usize,
    pub len: usize,
}

impl HalfLayout {
    pub(crate) fn new(n: usize, d: usize, v: usize, has_bias: bool) -> Self {
        let tc = TcScratch::new(dz_scratch_len(n, v), n, d, v);
        let d_hidden = tc.z + tc.len;
        let d_weight = d_hidden + n * d;
        let d_bias = d_weight + dw_chunk_rows(v) * d;
        Self {
            tc,
            d_hidden,
            d_weight,
            d_bias,
            len: d_bias + if has_bias { v } else { 0 },
        }
    }
}

/// Where the tensor-core backward's scratch lies in the f32 workspace, in f32 elements from its
/// start (the half-precision buffers at 16-byte aligned offsets).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TcScratch {
    /// `[rows_c, cols_c]` f32: the logits, then `dz`.
    pub z: usize,
    /// `[rows_c, cols_c]` of the input dtype: `dz` rounded once.
    pub dz_half: usize,
    /// `[rows_c, D]` of the input dtype: the chunk's hidden rows, zero-gradient rows zeroed.
    pub hidden_half: usize,
    /// f32 elements in all.
    pub len: usize,
}

impl TcScratch {
    /// The layout for N, D, V, starting at f32 offset `start` (`len` counts from `z`).
    pub(crate) fn new(start: usize, n: usize, d: usize, v: usize) -> Self {
        let align = |x: usize| x.div_ceil(4) * 4;
        let (rows_c, cols_c) = (n.min(TC_BWD_ROWS), v.min(TC_BWD_VOCAB));
        let z = align(start);
        let dz_half = align(z + rows_c * cols_c);
        let hidden_half = align(dz_half + (rows_c * cols_c).div_ceil(2));
        let end = align(hidden_half + (rows_c * d).div_ceil(2));
        Self {
            z,
            dz_half,
            hidden_half,
            len: end - z,
        }
    }
}
