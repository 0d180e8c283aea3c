//! The comptime configuration of one cmma GEMM launch.

use crate::consts::CmmaTile;

/// What the host decided for a launch: the kernel is compiled once per distinct value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CmmaConfig {
    /// Add `bias[j]` in f32 before the rounding.
    pub has_bias: bool,
    /// `out = old out + product` in f32 (old out read in the output dtype) instead of
    /// `out = product`: the f32 accumulators the `linear_logp` backward carries across chunks.
    pub accumulate: bool,
    /// The lhs is staged K-contiguous (else M-contiguous).
    pub a_kfast: bool,
    /// The rhs is staged N-contiguous (else K-contiguous).
    pub b_nfast: bool,
    /// Units per cube.
    pub threads: usize,
    /// The tiling.
    pub tile: CmmaTile,
    /// Fragments through `ldmatrix` + `mma.sync` (CUDA) instead of WMMA `cmma`.
    pub manual: bool,
    /// The `cp.async` ring body instead of the register-pipelined one.
    pub ring: bool,
}
