//! # burn-invariant-cubecl
//!
//! Portable [CubeCL](https://github.com/tracel-ai/cubecl) kernels for `burn-invariant`:
//! a batch-invariant deterministic GEMM, a fused linear log-probability (LM head, log-softmax
//! and target gather) that never materializes `[N, V]` logits, and RMS normalization. Every launch function is generic
//! over `cubecl::Runtime` (CUDA, HIP, wgpu/Vulkan/Metal/WebGPU) and has no Burn dependency: the
//! caller passes `TensorBinding`s (burn-cubecl's `CubeTensor::binding()`), allocates the outputs
//! and the workspaces (sizes from the `*_workspace_len` functions), and gets a `Result`.
//! Inputs are validated before any launch (rank, shapes, dtypes, runtime dtype support, buffer
//! bounds of every strided view, 32-bit index range, grid size); kernels guard every index.
//!
//! ## Arithmetic contract
//!
//! ### GEMM ([`matmul`]): `out[M,N] = lhs[M,K] · rhs[K,N] (+ bias[N])`
//! * f32 / f16 / bf16 (one dtype for all operands and the output); arbitrary 2-D strides for
//!   `lhs`, `rhs`, `out` (transposed views need no copy).
//! * **FMA path** ([`GemmPath::Fma`], always for f32, fallback for f16/bf16): per element
//!   `acc = +0.0f32; for k in 0..K ascending { acc = fma(f32(lhs[i,k]), f32(rhs[k,j]), acc) }`,
//!   then `acc = acc + f32(bias[j])`, then one rounding cast. The last partial K stage is bounded
//!   by K (no padded `fma(0, 0, acc)` terms, so the sign of a zero is preserved). This is bitwise
//!   equal to a CPU `f32::mul_add` chain: where the device `fma` rounds once (CUDA, HIP, GPUs
//!   behind Vulkan/Metal) it is used; where it rounds twice (lavapipe's WGSL `fma` is a multiply
//!   and an add) a once-rounded `fma` is emulated from error-free transformations
//!   ([`fma_mode`], probed once per device; verified bitwise on CUDA and on lavapipe).
//! * **CMMA path** ([`GemmPath::Cmma`], f16/bf16 where the runtime advertises a 16×16×16
//!   `x·x→f32` cooperative matrix, e.g. CUDA sm ≥ 70): tensor-core fragments with f32
//!   accumulators, block 128×128 of 8 planes, K staged 32 deep in ascending order through
//!   double-buffered shared memory, bias added in f32, one rounding. On CUDA the fragments go
//!   through `ldmatrix` and `mma.sync` 16×8×16 by hand ([`gemm::manual_mma_supported`]),
//!   elsewhere through WMMA-style `cmma`. Each output element is the same sequence of 16-deep MMA
//!   steps whatever the operand layouts, load widths, tiling or fragment API (tested bitwise).
//!   Bits may differ from the FMA path; deterministic and row-invariant.
//! * **Row invariance**: `out[i,:]` depends only on `lhs[i,:]`, `rhs`, `bias`. The kernel, tile
//!   and K order are functions of (dtype, device capabilities) only ([`matmul_path`]) — never of
//!   M. No split-K, no autotune, no atomics.
//! * **Row reduction** ([`matmul_row_reduction`], for `dRhs = lhsᵀ · dOut`): the FMA kernel with
//!   the transposed lhs view; reduces over M rows in ascending order in fixed 16-row stages;
//!   terms whose `dOut` element is zero are skipped, so appended zero-gradient rows leave the
//!   result bitwise unchanged. `dLhs = dOut · rhsᵀ` is plain [`matmul`] with a transposed view.
//! * [`col_sum`] (`dBias`): ascending rows, f32 accumulator from +0.0, one rounding.
//!
//! ### Fused linear log-prob ([`linear_logp_forward`], [`linear_logp_backward`])
//! * `z_ij = fma-chain_d(f32(hidden[i,d]) · f32(weight[j,d])) + f32(bias[j])` — bitwise the FMA
//!   GEMM of `hidden · weightᵀ + bias`. Outputs f32 `stats[i] = (logp_i, lse_i)`.
//! * Forward: the vocabulary is cut into `ceil(V / LOGP_FWD_SEGMENT)` fixed segments; in each, 64-wide
//!   vocab tiles are walked in ascending order with an online softmax; segment partials (an
//!   O(N) f32 workspace) are merged in ascending segment order. Backward recomputes the logits
//!   tile by tile into a scratch bounded by `BWD_ROW_CHUNK × BWD_VOCAB_CHUNK` f32 (4 MiB).
//!   No `[N, V]` buffer exists at any time.
//! * Tensor cores ([`linear_logp_tensor_cores`]: f16/bf16 where the cmma GEMM runs): the logits of
//!   fixed (row, vocabulary) chunks come from the cmma GEMM (f32 out, bias in f32) into a bounded
//!   scratch; a scan reduces each segment of a row in a fixed order into the same partials; the
//!   backward computes `dz` from the recomputed logits, rounds it once to the input dtype, and runs
//!   `dHidden`/`dWeight` as cmma GEMMs accumulating in f32 over fixed chunks in ascending order.
//! * `logp_i`, `lse_i` and `dHidden_i` depend only on row i (and the weight, bias, and row i's
//!   upstream gradient). `dWeight`/`dBias` reduce rows in ascending order and ignore rows whose
//!   upstream gradients are zero (bitwise).
//! * Targets: i32, or i64 where [`runtime_supports`] says so (CUDA and wgpu both do). Ignored rows:
//!   `logp = 0`, `lse` normal, no `g_logp` gradient. A non-ignored target outside `[0, V)` gives
//!   `logp = NaN` and never an out-of-bounds access.
//!
//! ### RMS norm ([`rms_norm_forward`], [`rms_norm_backward`])
//! * Per row, in f32: `ss` = 256 lanes (lane `t` an fma chain over `d = t, t + 256, …` ascending
//!   from +0.0) combined by the pairwise tree `lane[t] += lane[t + s]`, `s = 128, …, 1`;
//!   `r = 1 / sqrt(ss / D + eps)` (true division and square root); `y = (x·r)·gamma`, rounded once.
//! * Backward: `g = dy·gamma`, `c = ((r·r)·r)·dot / D` (`dot` the same lane tree over `g·x`),
//!   `dx = fma(−x, c, r·g)`; `dGamma` per column: fma chains of `dy·(x·r)` over blocks of
//!   [`RMS_NORM_ROW_BLOCK`] rows ascending (terms with `dy = 0` skipped), block partials added in ascending order (zero
//!   partials skipped). Bitwise the Reference in f32; f16/bf16 run the same f32 math on upcast
//!   values. `y`, `dx` are row-invariant; `dGamma` ignores appended zero-gradient rows.
//!
//! ### Attention ([`attention`]: [`attention::attention_forward`], [`attention::attention_backward`])
//! * Softmax attention with GQA, `kv_lens` and causal masking, f32 / f16 / bf16, any strides,
//!   on the FMA path for every dtype: the contract's f32 operations element for element (keys in
//!   blocks of 64 from key 0, `exp_p` / `ln_p` ([`attention::math`]), every product that feeds a
//!   sum an explicit `fma`), so f32 results equal the Reference bitwise and f16 / bf16 the same
//!   arithmetic on the upcast inputs with one rounding. Tiles never change a bit: decode =
//!   prefill = chunked prefill = a row alone or in a ragged batch. The backward skips query rows
//!   whose upstream gradient is all zero; `dKey` / `dValue` reduce heads of the group, then
//!   queries, ascending, without atomics.
//!
//! All tile sizes are in [`consts`] (attention's own in `attention`).

pub mod attention;
pub mod consts;
pub mod error;
pub mod gemm;
pub mod logp;
pub mod rms_norm;
pub mod tp;
pub mod util;

pub use error::KernelError;
pub use gemm::{
    FmaMode, GemmPath, cmma_supported, col_sum, fma_mode, matmul, matmul_path, matmul_row_reduction,
};
#[doc(hidden)]
pub use logp::with_chunked_fma;
pub use logp::{
    LogpGradRefs, LogpInputRefs, linear_logp_backward, linear_logp_backward_workspace_len,
    linear_logp_forward, linear_logp_forward_max_rows, linear_logp_forward_workspace_len,
    linear_logp_limits, linear_logp_num_segments, linear_logp_tensor_cores,
};
pub use rms_norm::{
    RMS_NORM_LANES, RMS_NORM_ROW_BLOCK, RmsNormGradRefs, RmsNormRefs, rms_norm_backward,
    rms_norm_backward_workspace_len, rms_norm_forward, rms_norm_limits,
};
pub use util::{FloatDType, IndexDType, runtime_supports};

use cubecl::prelude::{ComputeClient, Runtime};

/// FNV-1a 64 of this crate's `src/` at build time: equal in two builds exactly when their
/// kernels are the same code.
pub const SOURCE_HASH: &str = env!("BURN_INVARIANT_CUBECL_SOURCE_HASH");

/// What this client's device makes the kernels choose for `dtype`, beside the code itself: the
/// GEMM path and tile ([`matmul_path`]; `linear_logp` takes its tensor-core path where the GEMM
/// is cmma) and the head sizes up to 256 (multiples of 16) whose attention forward runs on tensor
/// cores. Everything else gives the same bits on every device (an emulated `fma` rounds as a
/// fused one; tiles that follow the shape change no bit). For `burn_invariant::fingerprint`.
pub fn kernel_choices<R: Runtime>(client: &ComputeClient<R>, dtype: FloatDType) -> String {
    let gemm = match matmul_path(client, dtype.storage(), 0, 0) {
        Ok(path) => format!("{path:?}"),
        Err(err) => format!("unsupported ({err})"),
    };
    let attention_tc: Vec<usize> = (1..=16)
        .map(|i| 16 * i)
        .filter(|&d| attention::attention_forward_uses_tensor_cores(client, dtype, d))
        .collect();
    format!("gemm {gemm}; attention on tensor cores for head sizes {attention_tc:?}")
}
