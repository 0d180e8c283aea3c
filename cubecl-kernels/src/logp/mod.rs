//! Fused linear log-probability (`linear_logp`): forward and backward without any `[N, V]`
//! buffer.

mod backward;
mod candidates;
mod forward;
mod inputs;
mod logits;
mod noise;
mod sample;
mod tc_backward;
mod tc_forward;
mod top_k;
mod workspace;

pub use backward::linear_logp_backward;
pub use forward::linear_logp_forward;
pub use inputs::{
    LogpGradRefs, LogpInputRefs, linear_logp_backward_workspace_len, linear_logp_forward_max_rows,
    linear_logp_forward_workspace_len, linear_logp_limits, linear_logp_num_segments,
    linear_logp_tensor_cores,
};
pub use sample::{
    SAMPLE_K_MAX, SampleSpec, linear_sample_forward, linear_sample_max_rows,
    linear_sample_workspace_len,
};
pub use top_k::linear_top_k_forward;

pub(crate) use logits::{SoftmaxMath, exp_s, ln_s};

use crate::error::KernelError;
use crate::gemm::args::GemmOperands;
use crate::gemm::cmma::{CmmaChoice, launch_cmma};
use crate::gemm::fma::{SKIP_NONE, launch_fma};
use cubecl::prelude::*;
use std::cell::Cell;

/// The GEMMs of the chunked (tensor-core) path: the pinned cmma kernel, or, for tests on devices
/// without cooperative matrices, the FMA kernel in the same chunk structure.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Products {
    Cmma(CmmaChoice),
    Fma,
}

impl Products {
    /// `out (+)= lhs · rhs (+ bias)`, f32 accumulation, one rounding to the output's dtype.
    pub(crate) fn gemm<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        ops: &GemmOperands<'_, R>,
        dims: [usize; 3],
        accumulate: bool,
    ) -> Result<(), KernelError> {
        match self {
            Products::Cmma(choice) => launch_cmma(client, ops, dims, choice, accumulate),
            Products::Fma => launch_fma(client, ops, dims, accumulate, SKIP_NONE),
        }
    }
}

thread_local! {
    static CHUNKED_FMA: Cell<bool> = const { Cell::new(false) };
}

/// Test hook: runs `f` with this thread's f16 / bf16 `linear_logp` launches taking the
/// tensor-core path's chunks, scan and `dz` kernels with FMA GEMMs where the device has no
/// cooperative matrices (lavapipe), so that path's own kernels are tested there. Other threads
/// are unaffected; the previous setting is restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_chunked_fma<T>(f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_flag(&CHUNKED_FMA, f)
}

pub(crate) fn chunked_fma_forced() -> bool {
    CHUNKED_FMA.with(Cell::get)
}
