//! The SM90 GEMM (`kernels/gemm_sm90.cu`): the three layouts the forward and both backward
//! products need, and the launch the `linear_logp` backward reuses for its chunked products.
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use cubecl::server::TensorMapBinding;

use super::nvrtc::launch;
use super::operand::TmaOperand;
use super::params::GemmParams;
use super::sm_count;
use super::table::{Entry, constant, entry, lookup};
use crate::backends::alloc::{empty, zeros};
use crate::backends::cuda::CudaTensor;

/// `C = round(v + bias[n])`.
pub(crate) const GEMM_BIAS: u32 = constant("GEMM_BIAS") as u32;
/// `v = Cacc[m, n] + acc` (else `v = acc`).
pub(crate) const GEMM_ACC_LOAD: u32 = constant("GEMM_ACC_LOAD") as u32;
/// `Cacc[m, n] = v` (f32).
pub(crate) const GEMM_ACC_STORE: u32 = constant("GEMM_ACC_STORE") as u32;
/// `C[m, n] = round(v (+ bias))`.
pub(crate) const GEMM_STORE_C: u32 = constant("GEMM_STORE_C") as u32;

/// Rows of the small tile: products with at most this many rows take it.
const SMALL_ROWS: usize = lookup("ib_gemm_nn_small_bf16").tile[0];

/// Storage orders of the two operands (kernels/README.md, "Layouts and maps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `A [M, K] · B [K, N]`.
    Nn,
    /// `A [M, K] · B [N, K]ᵀ`.
    Nt,
    /// `A [K, M]ᵀ · B [K, N]`.
    Tn,
}

/// The entry point: big tile 128×256×64 with 2-CTA clusters; small tile 64×64×64 for M ≤ 64
/// (the same per-element arithmetic, so the choice by M keeps row invariance).
fn kernel(layout: Layout, small: bool, dtype: DType) -> Entry {
    let bf16 = match dtype {
        DType::BF16 => true,
        DType::F16 => false,
        other => unreachable!("the registry admits only bf16/f16 for Sm90, got {other:?}"),
    };
    match (layout, small, bf16) {
        (Layout::Nn, false, true) => entry!("ib_gemm_nn_bf16"),
        (Layout::Nt, false, true) => entry!("ib_gemm_nt_bf16"),
        (Layout::Tn, _, true) => entry!("ib_gemm_tn_bf16"),
        (Layout::Nn, true, true) => entry!("ib_gemm_nn_small_bf16"),
        (Layout::Nt, true, true) => entry!("ib_gemm_nt_small_bf16"),
        (Layout::Nn, false, false) => entry!("ib_gemm_nn_f16"),
        (Layout::Nt, false, false) => entry!("ib_gemm_nt_f16"),
        (Layout::Tn, _, false) => entry!("ib_gemm_tn_f16"),
        (Layout::Nn, true, false) => entry!("ib_gemm_nn_small_f16"),
        (Layout::Nt, true, false) => entry!("ib_gemm_nt_small_f16"),
    }
}

/// One operand of a launch: the buffer and the map of the rows this launch reads.
pub(crate) type MappedOperand<'a> = (&'a TmaOperand, TensorMapBinding);

/// The output side of one GEMM launch.
pub(crate) struct GemmOut<'a> {
    pub c: &'a CudaTensor,
    /// The f32 running sum of a chunked accumulation.
    pub acc: Option<&'a CudaTensor>,
    pub bias: Option<&'a CudaTensor>,
    /// `GEMM_ACC_*` / `GEMM_STORE_C`; `GEMM_BIAS` is set from `bias`.
    pub flags: u32,
    pub ldc: usize,
    pub c_offset: usize,
}

/// One GEMM launch. `(m, n, k)` are the product's dimensions; the maps describe the operands
/// in the layout's storage order.
pub(crate) fn gemm_launch(
    layout: Layout,
    dtype: DType,
    (a, b): (MappedOperand<'_>, MappedOperand<'_>),
    [m, n, k]: [usize; 3],
    out: GemmOut<'_>,
) {
    let client = &out.c.client;
    let small = m <= SMALL_ROWS && layout != Layout::Tn;
    let kernel = kernel(layout, small, dtype);
    let ([bm, bn], cluster) = (kernel.tile, kernel.cluster);
    let groups = m.div_ceil(bm).div_ceil(cluster) * n.div_ceil(bn);
    let grid = cluster * groups.min(sm_count(client) / cluster).max(1);
    let params = GemmParams {
        m: m as u32,
        n: n as u32,
        k: k as u32,
        flags: out.flags | if out.bias.is_some() { GEMM_BIAS } else { 0 },
        ldc: out.ldc as u64,
        c_offset: out.c_offset as u64,
    };
    let c = out.c.handle.clone().binding();
    // The operands are buffers too: cubecl orders only buffer arguments across streams.
    let buffers = vec![
        a.0.binding(),
        b.0.binding(),
        out.bias
            .map_or_else(|| c.clone(), |t| t.handle.clone().binding()),
        c.clone(),
        out.acc.map_or(c, |t| t.handle.clone().binding()),
    ];
    launch(client, kernel, grid, vec![a.1, b.1], buffers, &params);
}

/// One whole product `C[m, n]` (reduction length `k`) in `layout`, stored in a fresh buffer.
fn product(
    layout: Layout,
    (a, b): (CudaTensor, CudaTensor),
    bias: Option<CudaTensor>,
    [m, n, k]: [usize; 3],
) -> CudaTensor {
    let dtype = a.dtype;
    let c = empty(&a, vec![m, n], dtype);
    // Rows each operand's map covers, in the layout's storage order.
    let (a_rows, b_rows) = match layout {
        Layout::Nn => (m, k),
        Layout::Nt => (m, n),
        Layout::Tn => (k, k),
    };
    let bias = bias.map(into_contiguous);
    let (a, b) = (TmaOperand::new(a), TmaOperand::new(b));
    let out = GemmOut {
        c: &c,
        acc: None,
        bias: bias.as_ref(),
        flags: GEMM_STORE_C,
        ldc: n,
        c_offset: 0,
    };
    let operands = ((&a, a.map(0, a_rows)), (&b, b.map(0, b_rows)));
    gemm_launch(layout, dtype, operands, [m, n, k], out);
    c
}

/// `lhs [M, K] · rhs [K, N] (+ bias)` (NN layout); every dimension ≥ 1 (the caller routes
/// empty products elsewhere: the kernels need K ≥ 1).
pub(crate) fn matmul(lhs: CudaTensor, rhs: CudaTensor, bias: Option<CudaTensor>) -> CudaTensor {
    let (m, k, n) = (
        lhs.meta.shape()[0],
        lhs.meta.shape()[1],
        rhs.meta.shape()[1],
    );
    product(Layout::Nn, (lhs, rhs), bias, [m, n, k])
}

/// `grad [M, N] · rhsᵀ` with `rhs [K, N]` (NT layout): `[M, K]`.
pub(crate) fn matmul_grad_lhs(grad: CudaTensor, rhs: CudaTensor) -> CudaTensor {
    let (m, n, k) = (
        grad.meta.shape()[0],
        grad.meta.shape()[1],
        rhs.meta.shape()[0],
    );
    if m == 0 || k == 0 || n == 0 {
        return zeros(&grad, vec![m, k], grad.dtype);
    }
    product(Layout::Nt, (grad, rhs), None, [m, k, n])
}

/// `lhsᵀ · grad` with `lhs [M, K]`, `grad [M, N]` (TN layout; the reduction runs over the
/// batch rows in ascending 64-row blocks): `[K, N]`.
pub(crate) fn matmul_grad_rhs(lhs: CudaTensor, grad: CudaTensor) -> CudaTensor {
    let (m, k, n) = (
        lhs.meta.shape()[0],
        lhs.meta.shape()[1],
        grad.meta.shape()[1],
    );
    if m == 0 || k == 0 || n == 0 {
        return zeros(&grad, vec![k, n], grad.dtype);
    }
    product(Layout::Tn, (lhs, grad), None, [k, n, m])
}
