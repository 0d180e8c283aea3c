//! The cooperative-matrix (tensor core) GEMM for f16 / bf16 inputs.
//!
//! Tiling ([`crate::consts::CmmaTile`], pinned in [`crate::consts::CMMA_TILE`]): an output block per cube, split
//! among planes that each own whole 16×16×16 fragments; K staged through shared memory in
//! fixed-depth stages of 16-deep MMA steps, walked in one ascending order. Accumulators are f32.
//!
//! Pipelining: the shared-memory stages are double-buffered and the next stage's global loads are
//! issued into registers before the current stage's MMAs, so global latency overlaps the tensor
//! cores with one cube barrier per stage ([`registers`]). On CUDA, where both operands are 16-byte
//! vectors, a `cp.async` ring runs instead ([`ring`]), with its own pinned tiling,
//! [`crate::consts::CMMA_ASYNC_TILE`], and the same fragment code and epilogue ([`fragment`]).
//! Each operand is staged in its own memory orientation
//! (the contiguous dimension stays contiguous in shared memory, rows padded by 8 elements against
//! bank conflicts) and the fragments are loaded row- or column-major to match. Global loads use
//! `VA` / `VB`-element vectors where the host found the operand contiguous and aligned, else
//! scalars; the vector width only changes how bytes travel, never the arithmetic.
//!
//! Fragments: on CUDA ([`manual_mma_supported`]) each plane loads its operands with
//! `ldmatrix` (transposed where the operand is staged the other way round) and issues
//! `mma.sync` 16×8×16 on per-lane registers; elsewhere it uses WMMA-style `cmma` 16×16×16
//! fragments. A 16×16×16 step is two 16×8×16 steps either way, so both give the same bits.
//!
//! Positions outside [M)×[K) / [K)×[N) are staged as zeros, which only ever meet other zeros or
//! in-range values of the same output element, so the padding depends on K and N, never on M. The
//! epilogue adds the bias in f32 and rounds once to the output dtype: from the lanes' registers

mod config;
mod fragment;
mod registers;
mod ring;

use config::CmmaConfig;
use registers::gemm_registers;
use ring::gemm_ring;
pub(crate) use ring::{arrive_on_copies, ring_barriers};

use crate::consts::{CMMA_FRAG, CMMA_TILE, CMMA_VECTOR, CmmaTile};
use crate::error::KernelError;
use crate::gemm::args::{GemmOperands, Mat, gemm_scalars};
use crate::gemm::view::StridedView;
use crate::util::{check_grid, raw_arg};
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;

/// `out = lhs · rhs (+ bias)` on tensor cores: the register-pipelined or the ring body.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn gemm_cmma_kernel<F: Float, O: Float, VA: Size, VB: Size>(
    lhs: &Tensor<Vector<F, VA>>,
    lo: StridedView,
    rhs: &Tensor<Vector<F, VB>>,
    ro: StridedView,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    out: &mut Tensor<O>,
    oo: StridedView,
    m: u32,
    k: u32,
    n: u32,
    #[comptime] cfg: CmmaConfig,
    #[define(F, O)] _dtypes: [StorageType; 2],
) {
    if comptime![cfg.ring] {
        gemm_ring::<F, O, VA, VB>(
            lhs,
            &lo,
            rhs,
            &ro,
            bias,
            bias_off,
            bias_stride,
            out,
            &oo,
            m,
            k,
            n,
            cfg,
        );
    } else {
        gemm_registers::<F, O, VA, VB>(
            lhs,
            &lo,
            rhs,
            &ro,
            bias,
            bias_off,
            bias_stride,
            out,
            &oo,
            m,
            k,
            n,
            cfg,
        );
    }
}

/// What the host chose for the cmma kernel on this device: the plane width, the pinned tiling of
/// the register-pipelined body, whether fragments go through `ldmatrix` + `mma.sync`, and the
/// ring's tiling where it can run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CmmaChoice {
    pub plane_size: u32,
    pub tile: CmmaTile,
    pub manual_mma: bool,
    pub async_tile: Option<CmmaTile>,
}

/// Whether the cooperative-matrix kernel can run for `dtype` on this client: the runtime must
/// advertise a 16×16×16 `dtype × dtype → f32` CMMA configuration and a fixed plane width.
pub fn cmma_supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let kind = match dtype {
        StorageType::Scalar(ElemType::Float(k @ (FloatKind::F16 | FloatKind::BF16))) => k,
        _ => return false,
    };
    let ab: StorageType = ElemType::Float(kind).into();
    let cfg = f32_accumulating(ab, CMMA_FRAG as u32);
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max;
    client.features().matmul.cmma.contains(&cfg)
        && hw.plane_size_min == hw.plane_size_max
        && (plane == 32 || plane == 64)
        && CMMA_TILE.is_valid(plane as usize)
        && (plane as usize * CMMA_TILE.planes()) <= hw.max_units_per_cube as usize
        && CMMA_TILE.shared_bytes(dtype.size()) <= hw.max_shared_memory_size
}

/// Whether the cmma kernel can drive the tensor cores by hand on this client: `ldmatrix` and
/// `mma.sync` 16×8×16 with CUDA's register layout (the CUDA runtime with that MMA advertised).
pub fn manual_mma_supported<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    let cfg = f32_accumulating(dtype, 8);
    R::name(client) == "cuda"
        && client.properties().hardware.plane_size_max == 32
        && client.features().matmul.mma.contains(&cfg)
}

/// A 16×`n`×16 `dtype × dtype → f32` matrix-multiply configuration.
fn f32_accumulating(dtype: StorageType, n: u32) -> MmaConfig {
    MmaConfig {
        a_type: dtype,
        b_type: dtype,
        cd_type: ElemType::Float(FloatKind::F32).into(),
        m: CMMA_FRAG as u32,
        n,
        k: CMMA_FRAG as u32,
    }
}

/// The widest global load (in elements) the cmma kernel may use for `mat`, staged with its
/// contiguous (`inner`) dimension of extent `inner_ext`: [`CMMA_VECTOR`] where that dimension has
/// stride 1 and every vector start is 16-byte aligned and in-bounds, else 1. Only how bytes travel
/// depends on it, never the arithmetic.
fn cmma_vector<R: Runtime>(
    mat: &Mat<'_, R>,
    inner_stride: u32,
    outer_stride: u32,
    inner_ext: usize,
    elem_size: usize,
) -> usize {
    let w = CMMA_VECTOR;
    let base_aligned = mat
        .buf
        .handle
        .offset_start
        .unwrap_or(0)
        .is_multiple_of((w * elem_size) as u64);
    if inner_stride == 1
        && (outer_stride as usize).is_multiple_of(w)
        && inner_ext.is_multiple_of(w)
        && (mat.offset as usize).is_multiple_of(w)
        && base_aligned
    {
        w
    } else {
        1
    }
}

/// Launch the cmma kernel on explicit layouts (shapes already validated by the caller; f16/bf16
/// operands, output of the operands' dtype or f32). With `accumulate`, `out += lhs · rhs` in f32.
/// Output blocks of whole fragments, as many as the runtime's cube count needs (every tiling
/// runs the same MMA steps per output element, so the split never changes a bit).
pub(crate) fn launch_cmma<R: Runtime>(
    client: &ComputeClient<R>,
    ops: &GemmOperands<'_, R>,
    [m, k, n]: [usize; 3],
    choice: &CmmaChoice,
    accumulate: bool,
) -> Result<(), KernelError> {
    ops.for_blocks(
        client,
        [m, n],
        [CMMA_FRAG, CMMA_FRAG],
        |block, rows, cols| launch_cmma_grid(client, block, [rows, k, cols], choice, accumulate),
    )
}

/// One launch of the cmma kernel.
fn launch_cmma_grid<R: Runtime>(
    client: &ComputeClient<R>,
    ops: &GemmOperands<'_, R>,
    [m, k, n]: [usize; 3],
    choice: &CmmaChoice,
    accumulate: bool,
) -> Result<(), KernelError> {
    let CmmaChoice {
        plane_size,
        tile,
        manual_mma,
        async_tile,
    } = *choice;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let GemmOperands {
        lhs,
        rhs,
        bias,
        out,
    } = ops;
    let ([m32, k32, n32], (bias_buf, bias_off, bias_stride)) =
        gemm_scalars(m, k, n, rhs, bias.as_ref())?;
    let elem = lhs.dtype.size();
    // Each operand is staged with its smaller stride as the contiguous dimension.
    let a_kfast = lhs.s1 <= lhs.s0;
    let b_nfast = rhs.s1 <= rhs.s0;
    let va = if a_kfast {
        cmma_vector(lhs, lhs.s1, lhs.s0, k, elem)
    } else {
        cmma_vector(lhs, lhs.s0, lhs.s1, m, elem)
    };
    let vb = if b_nfast {
        cmma_vector(rhs, rhs.s1, rhs.s0, n, elem)
    } else {
        cmma_vector(rhs, rhs.s0, rhs.s1, k, elem)
    };
    // The ring kernel where both operands travel as 16-byte vectors; same bits either way.
    let ring = async_tile.filter(|_| va == CMMA_VECTOR && vb == CMMA_VECTOR);
    let tile = ring.unwrap_or(tile);
    let (gx, gy) = check_grid(client, "out", m.div_ceil(tile.bm), n.div_ceil(tile.bn))?;
    let cfg = CmmaConfig {
        has_bias: bias.is_some(),
        accumulate,
        a_kfast,
        b_nfast,
        threads: plane_size as usize * tile.planes(),
        tile,
        manual: manual_mma,
        ring: ring.is_some(),
    };
    unsafe {
        gemm_cmma_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_2d(plane_size, tile.planes() as u32),
            va,
            vb,
            raw_arg(lhs.buf),
            lhs.launch(),
            raw_arg(rhs.buf),
            rhs.launch(),
            raw_arg(bias_buf),
            bias_off,
            bias_stride,
            raw_arg(out.buf),
            out.launch(),
            m32,
            k32,
            n32,
            cfg,
            [lhs.dtype, out.dtype],
        );
    }
    Ok(())
}

/// `tile` where the `cp.async` kernel can run with it here: manual MMAs, the runtime has
/// `cp.async`, and the tiling is well formed and fits the cube and shared-memory limits. Where it
/// cannot, the register-pipelined kernel runs (same bits).
pub(crate) fn async_tile<R: Runtime>(
    client: &ComputeClient<R>,
    manual_mma: bool,
    tile: CmmaTile,
    elem: usize,
) -> Option<CmmaTile> {
    let hw = &client.properties().hardware;
    let plane = hw.plane_size_max as usize;
    (manual_mma
        && tile.ring_is_valid()
        && client.properties().features.copy_async
        && tile.is_valid(plane)
        && plane * tile.planes() <= hw.max_units_per_cube as usize
        && tile.async_shared_bytes(elem) <= hw.max_shared_memory_size)
        .then_some(tile)
}
