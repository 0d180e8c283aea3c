//! Tile and chunk constants shared by all kernels.
//!
//! Every constant here is fixed at compile time. None of them is ever derived from the number of
//! rows (M / N tokens), the device's core count or an autotuner: that is what makes the results
//! row-invariant and run-to-run deterministic.

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
/// `ceil(V / LOGP_FWD_SEGMENT)` segments (independent of N and of the device); each segment is reduced
/// in ascending tile order by one cube per row block, and the segment partials are merged in
/// ascending segment order by a second kernel.
pub const LOGP_FWD_SEGMENT: usize = 4096;
/// Floats per (segment, row) in the forward workspace: running max, running sum-exp, target logit,
/// and (with entropy) the running `Σ exp(z − max)·(z − max)`.
pub const LOGP_PARTIAL_STRIDE: usize = 4;

/// `linear_logp` on tensor cores (f16 / bf16 where the cmma GEMM runs): token rows per forward
/// chunk. Logits of a `TC_FWD_ROWS × TC_FWD_VOCAB` chunk go through an f32 scratch (64 MiB; 1024-row
/// chunks measured 10–14% slower on an H100: more launches, no L2 reuse seen by the scan).
pub const TC_FWD_ROWS: usize = 2048;
/// `linear_logp` on tensor cores: vocabulary columns per forward chunk (whole segments).
pub const TC_FWD_VOCAB: usize = 2 * LOGP_FWD_SEGMENT;
/// `linear_logp` on tensor cores: token rows per backward chunk (the K of the `dWeight` GEMMs).
pub const TC_BWD_ROWS: usize = 2048;
/// `linear_logp` on tensor cores: vocabulary columns per backward chunk (the K of the `dHidden`
/// GEMMs). Scratch: `TC_BWD_ROWS × TC_BWD_VOCAB` f32 logits / `dz` (32 MiB), the same `dz` in the
/// input dtype (16 MiB), and the chunk's hidden rows with zero-gradient rows zeroed.
pub const TC_BWD_VOCAB: usize = LOGP_FWD_SEGMENT;
/// `linear_logp` on tensor cores: units along a row in the segment scan (fixed: the order of the
/// scan's tree is a constant, not the device's plane width).
pub const SCAN_LANES: usize = 32;
/// `linear_logp` on tensor cores: rows per cube in the segment scan.
pub const SCAN_ROWS: usize = 8;
/// `linear_logp` on tensor cores: logits each unit takes per step of the scan (one max, one
/// rescale per step).
pub const SCAN_BATCH: usize = 8;

/// `linear_logp` backward on tensor cores: units per cube of the element-wise kernels, and
/// columns each unit takes.
pub const EW_UNITS: usize = 256;
/// See [`EW_UNITS`].
pub const EW_PER_UNIT: usize = 4;
/// Columns one cube of the element-wise kernels covers (their grid over D or a chunk's width).
pub const EW_COLUMNS_PER_CUBE: usize = EW_UNITS * EW_PER_UNIT;

/// `linear_logp` backward: token rows per host-side chunk (bounded `dz` scratch).
pub const BWD_ROW_CHUNK: usize = 256;
/// `linear_logp` backward: vocabulary columns per host-side chunk (bounded `dz` scratch).
/// The scratch is at most `BWD_ROW_CHUNK × BWD_VOCAB_CHUNK` f32 = 4 MiB, whatever N and V are.
pub const BWD_VOCAB_CHUNK: usize = 4096;

/// Largest element offset a kernel may compute (32-bit kernel addressing, kept in i32 range).
pub const MAX_INDEX: u128 = i32::MAX as u128;

/// The cube's tiling: output block `bm × bn`, K stage depth `bk`, planes `pm × pn` (plane-major
/// along N). Every tiling computes each output element with the same sequence of 16-deep MMA
/// steps in ascending K, so all tilings give the same bits; one is pinned for [`crate::matmul`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmmaTile {
    /// Output rows per cube.
    pub bm: usize,
    /// Output columns per cube.
    pub bn: usize,
    /// K depth of one shared-memory stage.
    pub bk: usize,
    /// Planes along M.
    pub pm: usize,
    /// Planes along N.
    pub pn: usize,
    /// Shared-memory stages in the ring of the `cp.async` pipeline (CUDA, 16-byte aligned
    /// operands); elsewhere the kernel double-buffers through registers.
    pub stages: usize,
    /// `cp.async` ring: the slot refilled while stage `j` runs is the one stage `j - lag` used.
    /// 1: after a cube barrier; 2 (needs `stages ≥ 3`): after that slot's release barrier, so
    /// planes drift apart by up to a stage instead of meeting at a cube barrier every stage.
    pub lag: usize,
}

impl CmmaTile {
    /// Planes per cube.
    pub fn planes(&self) -> usize {
        self.pm * self.pn
    }

    /// Whether the tiling is well formed: every plane owns whole 16×16 fragments, the stage is
    /// whole MMA steps, and each unit moves a whole number of vectors.
    pub fn is_valid(&self, plane_size: usize) -> bool {
        let threads = plane_size * self.planes();
        let f = CMMA_FRAG;
        self.pm > 0
            && self.pn > 0
            && self.bm.is_multiple_of(self.pm * f)
            && self.bn.is_multiple_of(self.pn * f)
            && self.bk.is_multiple_of(f)
            && (self.bm * self.bk).is_multiple_of(threads * CMMA_VECTOR)
            && (self.bn * self.bk).is_multiple_of(threads * CMMA_VECTOR)
            && (f * f).is_multiple_of(plane_size)
    }

    /// Elements of one shared stage of the lhs tile, staged K-contiguous or M-contiguous.
    pub const fn a_stage_len(&self, a_kfast: bool) -> usize {
        if a_kfast {
            stage_len(self.bm, self.bk)
        } else {
            stage_len(self.bk, self.bm)
        }
    }

    /// Elements of one shared stage of the rhs tile, staged N-contiguous or K-contiguous.
    pub const fn b_stage_len(&self, b_nfast: bool) -> usize {
        if b_nfast {
            stage_len(self.bk, self.bn)
        } else {
            stage_len(self.bn, self.bk)
        }
    }

    /// Elements of one stage of both operands, each in its larger orientation.
    fn stage_elems(&self) -> usize {
        self.a_stage_len(true).max(self.a_stage_len(false))
            + self.b_stage_len(true).max(self.b_stage_len(false))
    }

    /// Shared memory the register-pipelined kernel uses, in bytes, for `elem_size`-byte operands
    /// (two stages, plus the `cmma` epilogue scratch).
    pub fn shared_bytes(&self, elem_size: usize) -> usize {
        2 * self.stage_elems() * elem_size + self.planes() * CMMA_FRAG * CMMA_FRAG * 4
    }

    /// Shared memory the `cp.async` kernel uses, in bytes (the ring of stages; the barriers
    /// take 8 bytes each, counted generously).
    pub fn async_shared_bytes(&self, elem_size: usize) -> usize {
        self.stages * self.stage_elems() * elem_size + 16 * self.stages
    }

    /// Whether the `cp.async` ring is well formed: at least two stages and a lag that leaves a
    /// stage in flight.
    pub fn ring_is_valid(&self) -> bool {
        self.stages >= 2 && self.lag >= 1 && self.lag < self.stages && self.lag <= 2
    }
}

/// Elements of one shared stage of an operand tile `outer × inner` (inner contiguous, padded).
pub(crate) const fn stage_len(outer: usize, inner: usize) -> usize {
    outer * (inner + CMMA_PAD)
}

/// `rms_norm`: lanes of the per-row sums (`Σ x²`, `Σ g·x`). Lane `t` is an fma chain over
/// `d = t, t + 256, …` ascending from +0.0; the lanes are combined by the fixed pairwise tree
/// `lane[t] += lane[t + s]` for `s = 128, 64, …, 1`.
pub const RMS_NORM_LANES: usize = 256;
/// `rms_norm` backward: rows of one `dGamma` block (an fma chain over the block's rows per
/// column; the block partials are then added in ascending block order).
pub const RMS_NORM_ROW_BLOCK: usize = 32;
/// `rms_norm` forward: vectors each unit loads at once before their fma steps; a row of at most
/// `256 · RMS_NORM_BATCH` elements stays in registers for the output pass (longer rows are
/// re-read the same way). Changes no bit.
pub const RMS_NORM_BATCH: usize = 16;
/// `rms_norm` backward, `dx` rows: vectors of `x`, `dy` and `gamma` each unit loads at once
/// before their fma steps (kept for the `dx` pass when the row fits one batch, else re-read).
/// Changes no bit.
pub const RMS_NORM_BWD_BATCH: usize = 8;
/// `rms_norm` backward, one pass: 32-bit words of a row each unit may hold in registers (its
/// `dGamma` partials in f32 plus the row's `x` and `dy`); longer rows take the two-pass kernels.
/// Changes no bit.
pub const RMS_NORM_ONE_PASS_WORDS: usize = 128;
/// `rms_norm` backward, one pass over whole rounds at fixed offsets: the vector narrows (not
/// below 2 elements) until a unit holds at most this many words, since fewer registers keep more
/// warps on an SM and fixed offsets add no addressing per element (`[16384, 4096]` bf16 takes
/// vectors of 2; `benches/results/attention-h100.md`). Changes no bit.
pub const RMS_NORM_EXACT_WORDS: usize = 64;
/// `rms_norm` backward, `dGamma` partials: rows each unit loads before their fma steps. Changes
/// no bit.
pub const RMS_NORM_ROW_BATCH: usize = 32;
/// `rms_norm`: widest global load in bytes (the width in elements is the widest power of two the
/// runtime and every operand's layout allow). Changes no bit.
pub const RMS_NORM_VECTOR_BYTES: usize = 8;
/// `rms_norm` backward, `dGamma` partials: widest vector (elements) of `x` and `dy` per unit,
/// i.e. adjacent columns per unit. Changes no bit.
pub const RMS_NORM_DGAMMA_WIDTH: usize = 2;
