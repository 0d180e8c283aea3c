//! Attention (docs/CONTRACT.md, *attention semantics*): forward and backward of softmax
//! attention with GQA, `kv_lens` and causal masking, on the FMA path for every dtype, except
//! f16 / bf16 on CUDA for head sizes that are multiples of 16 up to 128, whose forward and
//! backward run on the tensor cores (`tc_forward`, `tc_backward`,
//! [`attention_forward_uses_tensor_cores`]; not the Reference's bits, every invariance kept; the
//! backward's δ kernel is the FMA path's).
//!
//! On the FMA path every output element is the contract's exact sequence of f32 operations, so
//! f32 results equal the Reference bitwise (f16 / bf16: the same f32 arithmetic on the upcast
//! inputs, each output rounded once), whatever the tiling, and the tiles are free to follow the
//! shape:
//! * forward: one cube per (batch row, KV head, tile of 16, 32 or 64 query rows of the KV head's
//!   group of query heads); each block of 64 keys is staged once for the whole group. A unit
//!   computes each of its scores as one d-ascending fma chain, row owners take the block max,
//!   `α` and `l_b`, and units own `(query row, d)` accumulators of `o`;
//! * backward: a δ kernel (per query row `δ`, the activity flag and the row's visible keys, and
//!   a copy of `lse`, in the workspace), a dQ kernel (tiles as the forward, keys ascending), and a
//!   dK/dV kernel (one cube per (batch row, KV head, 32 or 64 keys), query rows of the group in
//!   steps of 32, ascending: heads of the group, then queries). No atomics.
//!
//! Launches along x only, split where the runtime's cube count is smaller; `z` stays 1 (the
//! `fma` emulation takes its runtime zero from `CUBE_POS_Z`).

mod backward;
mod forward;
mod inputs;
pub mod math;
mod tc_backward;
mod tc_forward;
mod tile;

pub use backward::attention_backward;
pub use forward::attention_forward;
#[doc(hidden)]
pub use forward::{
    SplitExecution, attention_forward_copies_async, attention_forward_uses_tensor_cores,
    attention_forward_with, with_async_staging,
};

use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::util::{FloatDType, check_grid};
use cubecl::prelude::*;

/// Keys are walked in blocks of this many from key 0 (the contract's `ATTENTION_KEY_BLOCK`).
pub const ATTENTION_KEY_BLOCK: usize = 64;
/// The forward's softmax restarts every this many keys from key 0 and the splits a query sees
/// merge in ascending order (the contract's `ATTENTION_KEY_SPLIT`).
pub const ATTENTION_KEY_SPLIT: usize = tile::KEY_SPLIT;
/// Largest head size the kernels take.
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

const _: () = assert!(ATTENTION_KEY_BLOCK == tile::KEY_BLOCK);

/// The inputs of both directions.
pub struct AttentionRefs<'a, R: Runtime> {
    /// `[B, H, Q, D]`, any strides.
    pub query: &'a TensorBinding<R>,
    /// `[B, KH, KV, D]`, any strides, `H % KH == 0`.
    pub key: &'a TensorBinding<R>,
    /// `[B, KH, KV, D]`, any strides.
    pub value: &'a TensorBinding<R>,
    /// `[B]` i32: row b's valid keys. The caller validates `[0, KV]`; the kernels clamp to
    /// `[0, KV]` anyway, so no value reads out of bounds.
    pub kv_lens: &'a TensorBinding<R>,
    /// Dtype of query, key, value, out and of the gradients.
    pub dtype: FloatDType,
    /// Query `i` sees keys `0..=pos` (else `0..kv_lens[b]`), `pos = kv_lens[b] − Q + i`.
    pub causal: bool,
    /// Score scale: `q' = f32(q)·scale`.
    pub scale: f32,
}

/// The saved state, the upstream gradient, the gradients and the workspace of the backward.
pub struct AttentionGradRefs<'a, R: Runtime> {
    /// The forward's output `[B, H, Q, D]` (dtype).
    pub out: &'a TensorBinding<R>,
    /// The forward's `lse` `[B, H, Q]` (f32).
    pub lse: &'a TensorBinding<R>,
    /// `dOut` `[B, H, Q, D]` (dtype).
    pub grad_out: &'a TensorBinding<R>,
    /// `dQuery` `[B, H, Q, D]` (dtype), written fully (zeros for rows that take no part).
    pub grad_query: &'a TensorBinding<R>,
    /// `dKey` `[B, KH, KV, D]` (dtype), written fully (zeros where nothing contributes).
    pub grad_key: &'a TensorBinding<R>,
    /// `dValue` `[B, KH, KV, D]` (dtype), written fully.
    pub grad_value: &'a TensorBinding<R>,
    /// f32, contiguous, at least [`attention_backward_workspace_len`] elements.
    pub workspace: &'a TensorBinding<R>,
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionDims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

/// f32 elements of the backward's workspace: three 32-bit words per query row (`δ`, the row's
/// visible keys or 0 when it takes no part, `lse`).
pub fn attention_backward_workspace_len(batch: usize, heads: usize, q_len: usize) -> usize {
    3 * batch * heads * q_len
}

/// Whether the kernels take `dims` on this client, checked before anything runs:
/// `head_dim ≤ ATTENTION_MAX_HEAD_DIM`, `heads % kv_heads == 0`, the 32-bit index range of every
/// tensor and of the workspace, the cube indices, and the device's cube size and shared memory.
/// Grids larger than the runtime's cube count are split into several launches, never refused.
pub fn attention_limits<R: Runtime>(
    client: &ComputeClient<R>,
    dims: AttentionDims,
) -> Result<(), KernelError> {
    inputs::limits(client, dims)
}

/// [`math`]'s functions of `x` on the device (`exp_p`, `ln_p`, `div_rn` of neighbours, `sqrt_rn`
/// of `|x|`, `recip_rn`: `5·n` values, see `math_probe_kernel`), for tests.
#[doc(hidden)]
pub fn attention_math_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    x: &[f32],
) -> Result<Vec<f32>, KernelError> {
    let n = x.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let (gx, _) = check_grid(client, "x", n.div_ceil(256), 1)?;
    let input = client.create_from_slice(f32::as_bytes(x));
    let output = client.empty(5 * n * 4);
    unsafe {
        math::math_probe_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(256),
            ArrayArg::from_raw_parts(input, n),
            ArrayArg::from_raw_parts(output.clone(), 5 * n),
            fma_mode(client) == FmaMode::Emulated,
        )
    };
    let bytes = client
        .read_one(output)
        .map_err(|e| KernelError::Unsupported {
            what: "attention_math_on_device",
            reason: format!("read back failed: {e:?}"),
        })?;
    Ok(f32::from_bytes(&bytes).to_vec())
}
