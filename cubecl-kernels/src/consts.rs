//! Tile and chunk constants shared by all kernels.
//!
//! Every constant here is fixed at compile time. None of them is ever derived from the number of
//! rows (M / N tokens), the device's core count or an autotuner: that is what makes the results
//! row-invariant and run-to-run deterministic.

use crate::gemm::CmmaTile;

/// FMA GEMM: rows of the output block owned by one cube.
pub const FMA_BM: usize = 64;
/// FMA GEMM: columns of the output block owned by one cube.
pub const FMA_BN: usize = 64;
/// FMA GEMM: K extent of one shared-memory stage (the inner dimension is walked in these
/// fixed-size blocks, in ascending order; the final partial block is bounded by K, never padded).
pub const FMA_BK: usize = 16;
/// FMA GEMM: units per cube along x (columns) and y (rows). Each unit owns a 4×4 micro-tile,
/// rows `ty + 16 r`, columns `tx + 16 c`.
pub const FMA_THREADS: usize = 16;
/// FMA GEMM: micro-tile edge per unit (`FMA_BM / FMA_THREADS`).
pub const FMA_MICRO: usize = 4;

/// CMMA GEMM, register-pipelined kernel (every runtime with cooperative matrices, and CUDA where
/// an operand is not 16-byte aligned): 128×128 output block per cube, 8 planes in a 2×4
/// arrangement (each owns 64×32 = 4×2 fragments), K staged 32 deep (two MMA steps per stage),
/// two stages (`stages` is the ring depth of the `cp.async` kernel only).
pub const CMMA_TILE: CmmaTile = CmmaTile {
    bm: 128,
    bn: 128,
    bk: 32,
    pm: 2,
    pn: 4,
    stages: 2,
    lag: 1,
};
/// CMMA GEMM, `cp.async` kernel (CUDA, both operands 16-byte vectors): 256×128 output block per
/// cube, 8 planes in a 4×2 arrangement (each owns 64×64 = 4×8 16×8 fragments), K staged 64 deep,
/// a ring of 4 stages (216 KiB of shared memory: one cube per H100 SM) refilled with lag 2 (planes
/// release slots through barriers instead of meeting at a cube barrier every stage). The fastest
/// of the tilings swept on an H100 (`benches/results/cubecl-h100.md`); all give the same bits.
/// Devices with less shared memory run the register-pipelined kernel instead.
pub const CMMA_ASYNC_TILE: CmmaTile = CmmaTile {
    bm: 256,
    bn: 128,
    bk: 64,
    pm: 4,
    pn: 2,
    stages: 4,
    lag: 2,
};
/// CMMA GEMM: the pinned fragment shape m×n×k (f16/bf16 inputs, f32 accumulator).
pub const CMMA_FRAG: usize = 16;
/// CMMA GEMM: elements of padding after each staged row (against shared-memory bank conflicts;
/// keeps rows 16-byte aligned).
pub const CMMA_PAD: usize = 8;
/// CMMA GEMM: widest global load, in elements (16 bytes of f16 / bf16).
pub const CMMA_VECTOR: usize = 8;

/// `col_sum`: columns owned by one cube (one unit per column, rows walked sequentially).
pub const COL_SUM_BLOCK: usize = 256;

/// `linear_logp`: token rows per cube (the logits tile is `LOGP_ROWS × LOGP_VOCAB_TILE`).
pub const LOGP_ROWS: usize = FMA_BM;
/// `linear_logp`: vocabulary tile walked by the online softmax, ascending.
pub const LOGP_VOCAB_TILE: usize = FMA_BN;
/// `linear_logp` forward: vocabulary segment. The vocabulary is cut into
/// `ceil(V / LOGP_SEGMENT)` segments (independent of N and of the device); each segment is reduced
/// in ascending tile order by one cube per row block, and the segment partials are merged in
/// ascending segment order by a second kernel.
pub const LOGP_SEGMENT: usize = 4096;
/// Floats per (segment, row) in the forward workspace: running max, running sum-exp, target logit.
pub const LOGP_PARTIAL_STRIDE: usize = 3;

/// `linear_logp` backward: token rows per host-side chunk (bounded `dz` scratch).
pub const BWD_ROW_CHUNK: usize = 256;
/// `linear_logp` backward: vocabulary columns per host-side chunk (bounded `dz` scratch).
/// The scratch is at most `BWD_ROW_CHUNK × BWD_VOCAB_CHUNK` f32 = 4 MiB, whatever N and V are.
pub const BWD_VOCAB_CHUNK: usize = 4096;

/// Largest element offset a kernel may compute (32-bit kernel addressing, kept in i32 range).
pub const MAX_INDEX: u128 = i32::MAX as u128;
