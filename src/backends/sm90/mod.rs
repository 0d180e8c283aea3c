//! `Sm90`: the hand-written TMA + WGMMA kernels of `kernels/`, compiled by cubecl's NVRTC path
//! for `sm_90a` at first use and launched on cubecl's own stream with cubecl's buffers, so they
//! order with every other Burn op and need no host synchronisation. The TMA maps are cubecl
//! tensor-map bindings: cubecl encodes them from the buffers at launch, on its server thread.
//!
//! The functions here take the `CubeBackend<R>` primitives the registry routed to `Sm90`
//! (which it does only on CUDA) and run them as cubecl-cuda tensors.
mod attention;
mod gemm;
mod logp;
mod nvrtc;
mod operand;
mod params;
pub(crate) mod stream_sync;
mod table;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn::tensor::{DType, backend::Backend};
use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::prelude::ComputeClient;

use crate::backend::{GradRequest, LinearLogpGrads, LinearLogpInputs, Problem};
use crate::backends::cuda::{CudaTensor, as_cuda, from_cuda};
use crate::registry::{Candidate, Implementation};
use logp::LogpArgs;

/// Largest dimension the kernels index (32-bit, with room for a tile past the end).
const DIM_LIMIT: usize = (1 << 31) - 257;

/// Compute capability of `device` (major * 10 + minor) where it is a CUDA device.
pub(crate) fn device_capability<R: CubeRuntime>(device: &R::Device) -> Option<u32> {
    (device as &dyn std::any::Any)
        .downcast_ref::<CudaDevice>()
        .and_then(compute_capability)
}

/// Compute capability of a CUDA device (major * 10 + minor), cached.
fn compute_capability(device: &CudaDevice) -> Option<u32> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Option<u32>>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    *cache.entry(device.index).or_insert_with(|| {
        use cudarc::driver::{result, sys::CUdevice_attribute::*};
        result::init().ok()?;
        let dev = result::device::get(device.index as i32).ok()?;
        // SAFETY: plain attribute queries on a valid device handle.
        let (major, minor) = unsafe {
            (
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .ok()?,
                result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                    .ok()?,
            )
        };
        Some((major * 10 + minor) as u32)
    })
}

/// The `Sm90` candidate: CUDA, compute capability exactly 9.0 (`sm_90a` code runs nowhere
/// else), bf16 or f16.
pub(crate) fn candidate<R: CubeRuntime>(device: &R::Device, dtype: DType) -> Candidate {
    let Some(device) = (device as &dyn std::any::Any).downcast_ref::<CudaDevice>() else {
        return Candidate::unavailable(
            Implementation::Sm90,
            format!(
                "needs a CUDA device, this is {}",
                R::name(&R::client(device))
            ),
        );
    };
    match (compute_capability(device), dtype) {
        (Some(90), DType::BF16 | DType::F16) => match nvrtc::toolchain() {
            Ok(()) => Candidate::available(Implementation::Sm90),
            // Hopper's kernels for these dtypes: never silently the portable ones instead.
            Err(reason) => Candidate::missing_on_host(Implementation::Sm90, reason),
        },
        (Some(90), other) => Candidate::unavailable(
            Implementation::Sm90,
            format!("the Sm90 kernels take BF16 or F16, got {other:?} (it runs on CubeCl)"),
        ),
        (Some(cc), _) => Candidate::unavailable(
            Implementation::Sm90,
            format!(
                "needs compute capability 9.0, the device has {}.{}",
                cc / 10,
                cc % 10
            ),
        ),
        (None, _) => Candidate::unavailable(
            Implementation::Sm90,
            "the CUDA driver did not report a compute capability",
        ),
    }
}

/// Shape limits of the kernels beyond dtype and device.
pub(crate) fn check_problem(problem: Problem) -> Result<(), String> {
    match problem {
        Problem::LinearLogp { d: 0, .. } => {
            Err("the Sm90 linear_logp kernels need a hidden size D >= 1".into())
        }
        Problem::Attention { head_dim, .. } if !attention::HEAD_DIMS.contains(&head_dim) => {
            Err(format!(
                "the Sm90 attention kernels take head_dim {:?}, got {head_dim} (CubeCl serves it)",
                attention::HEAD_DIMS
            ))
        }
        Problem::Attention {
            batch,
            heads,
            kv_heads,
            q_len,
            kv_len,
            ..
        } if batch
            .saturating_mul(heads)
            .saturating_mul(q_len)
            .max(batch.saturating_mul(kv_heads).saturating_mul(kv_len))
            > DIM_LIMIT =>
        {
            Err(format!(
                "the Sm90 attention kernels index up to {DIM_LIMIT} query rows (B·H·Q) and \
                 key rows (B·KH·KV)"
            ))
        }
        Problem::Matmul { m, k, n } | Problem::LinearLogp { n: m, d: k, v: n }
            if m.max(k).max(n) > DIM_LIMIT =>
        {
            Err(format!(
                "the Sm90 kernels take dimensions up to {DIM_LIMIT}"
            ))
        }
        _ => Ok(()),
    }
}

fn sm_count(client: &ComputeClient<CudaRuntime>) -> usize {
    client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(132)
        .max(2) as usize
}

/// `t` as a CUDA tensor: the registry selects `Sm90` only on the CUDA runtime.
fn cuda<R: CubeRuntime>(t: CubeTensor<R>) -> CudaTensor {
    as_cuda(t).unwrap_or_else(|| unreachable!("Sm90 selected on a non-CUDA runtime"))
}

fn back<R: CubeRuntime>(t: CudaTensor) -> CubeTensor<R> {
    from_cuda(t).unwrap_or_else(|| unreachable!("Sm90 selected on a non-CUDA runtime"))
}

/// `lhs [M, K] · rhs [K, N] (+ bias)`, every dimension ≥ 1.
pub(crate) fn matmul<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    back(gemm::matmul(cuda(lhs), cuda(rhs), bias.map(cuda)))
}

/// `grad · rhsᵀ`.
pub(crate) fn matmul_grad_lhs<R: CubeRuntime>(
    grad: CubeTensor<R>,
    rhs: CubeTensor<R>,
) -> CubeTensor<R> {
    back(gemm::matmul_grad_lhs(cuda(grad), cuda(rhs)))
}

/// `lhsᵀ · grad`.
pub(crate) fn matmul_grad_rhs<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    back(gemm::matmul_grad_rhs(cuda(lhs), cuda(grad)))
}

/// A backend whose primitives are `CubeTensor<R>`s.
pub(crate) trait CubePrimitives<R: CubeRuntime>:
    Backend<FloatTensorPrimitive = CubeTensor<R>, IntTensorPrimitive = CubeTensor<R>>
{
}

impl<R: CubeRuntime, B> CubePrimitives<R> for B where
    B: Backend<FloatTensorPrimitive = CubeTensor<R>, IntTensorPrimitive = CubeTensor<R>>
{
}

fn logp_args<R: CubeRuntime, B: CubePrimitives<R>>(inputs: LinearLogpInputs<B>) -> LogpArgs {
    LogpArgs {
        hidden: cuda(inputs.hidden),
        weight: cuda(inputs.weight),
        bias: inputs.bias.map(cuda),
        targets: cuda(inputs.targets),
        ignore_index: inputs.ignore_index,
        head: inputs.head,
    }
}

/// Forward: `[N, C]` f32 `(logp, lse[, entropy])`.
pub(crate) fn linear_logp<R: CubeRuntime, B: CubePrimitives<R>>(
    inputs: LinearLogpInputs<B>,
) -> CubeTensor<R> {
    back(logp::linear_logp(logp_args(inputs)))
}

/// The sampler in one pass (Gumbel-max with `noise`, argmax without): `[N, C + 1]` f32
/// `(logp, lse[, entropy], token)` for the row keys in `inputs.targets`.
pub(crate) fn linear_sample<R: CubeRuntime, B: CubePrimitives<R>>(
    inputs: LinearLogpInputs<B>,
    seed: u64,
    noise: bool,
) -> CubeTensor<R> {
    back(logp::linear_sample(logp_args(inputs), seed, noise))
}

/// Backward from the forward's `stats` and the upstream `grad`.
pub(crate) fn linear_logp_backward<R: CubeRuntime, B: CubePrimitives<R>>(
    inputs: LinearLogpInputs<B>,
    stats: CubeTensor<R>,
    grad: CubeTensor<R>,
    request: GradRequest,
) -> LinearLogpGrads<B> {
    let (d_hidden, d_weight, d_bias) =
        logp::linear_logp_backward(logp_args(inputs), cuda(stats), cuda(grad));
    LinearLogpGrads {
        hidden: request.hidden.then(|| back(d_hidden)),
        weight: request.weight.then(|| back(d_weight)),
        bias: d_bias.filter(|_| request.bias).map(back),
    }
}

/// Attention forward: `(out, lse)`.
pub(crate) fn attention<R: CubeRuntime>(
    [query, key, value]: [CubeTensor<R>; 3],
    kv_lens: CubeTensor<R>,
    causal: bool,
    scale: f32,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (out, lse) = attention::attention(
        cuda(query),
        cuda(key),
        cuda(value),
        cuda(kv_lens),
        causal,
        scale,
    );
    (back(out), back(lse))
}

/// Attention backward from the forward's `out`, `lse` and the upstream `grad`: `[dq, dk, dv]`.
pub(crate) fn attention_backward<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 3],
    kv_lens: CubeTensor<R>,
    saved: [CubeTensor<R>; 3],
    causal: bool,
    scale: f32,
) -> [CubeTensor<R>; 3] {
    attention::attention_backward(
        inputs.map(cuda),
        cuda(kv_lens),
        saved.map(cuda),
        causal,
        scale,
    )
    .map(back)
}

#[cfg(test)]
mod table_tests;
