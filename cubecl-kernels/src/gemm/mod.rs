//! Deterministic, row-invariant GEMM, row-reduction GEMM and column sums.

pub(crate) mod args;
pub(crate) mod cast;
pub(crate) mod cmma;
pub(crate) mod col_sum;
pub(crate) mod fma;
pub(crate) mod view;

pub use crate::consts::CmmaTile;
pub use cmma::{cmma_supported, manual_mma_supported};
pub use fma::{FmaMode, fma_emulated_on_device, fma_mode};

use crate::consts::{CMMA_ASYNC_TILE, CMMA_FRAG, CMMA_TILE, FMA_BM, FMA_BN};
use crate::error::KernelError;
use crate::util::{FloatDType, check_out_view, check_runtime_dtype, check_view, expect_shape};
use args::{GemmOperands, Mat, Vec1};
use cmma::{CmmaChoice, async_tile, launch_cmma};
use col_sum::launch_col_sum;
use cubecl::ir::StorageType;
use cubecl::prelude::*;
use fma::{SKIP_NONE, SKIP_ZERO_RHS, launch_fma};

/// Which GEMM kernel runs for a given (dtype, K, N, device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmPath {
    /// Scalar fused multiply-add chain: `acc = fma(a[i,k], b[k,j], acc)` for k ascending, f32.
    /// Tile 64×64×16 (see [`crate::consts`]).
    Fma,
    /// Cooperative-matrix (tensor core) kernel: fragments `frag_m×frag_n×frag_k` with f32
    /// accumulators, block `block_m×block_n`, K staged `block_k` deep, ascending.
    Cmma {
        /// Fragment m.
        frag_m: u32,
        /// Fragment n.
        frag_n: u32,
        /// Fragment k.
        frag_k: u32,
        /// Rows of output per cube.
        block_m: u32,
        /// Columns of output per cube.
        block_n: u32,
        /// K depth of one shared-memory stage.
        block_k: u32,
        /// Units per plane used at launch (the device's plane width).
        plane_size: u32,
        /// Fragments through `ldmatrix` and 16×8×16 `mma.sync` with per-lane registers (CUDA)
        /// instead of WMMA; the same MMA steps per output element, so the same bits.
        manual_mma: bool,
        /// The tiling of the `cp.async` kernel that runs instead where both operands are 16-byte
        /// vectors (CUDA), `None` where it never runs; same MMA steps per output element, so the
        /// same bits.
        async_tile: Option<CmmaTile>,
    },
}

impl core::fmt::Display for GemmPath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            GemmPath::Fma => write!(
                f,
                "fma (f32 fused multiply-add chain, tile {FMA_BM}x{FMA_BN}x{}, k ascending)",
                crate::consts::FMA_BK
            ),
            GemmPath::Cmma {
                frag_m,
                frag_n,
                frag_k,
                block_m,
                block_n,
                block_k,
                plane_size,
                manual_mma,
                async_tile,
            } => {
                write!(
                    f,
                    "cmma (fragments {frag_m}x{frag_n}x{frag_k}{}, f32 accumulators, block \
                     {block_m}x{block_n}x{block_k}, plane {plane_size}, k ascending",
                    if *manual_mma {
                        " as ldmatrix + mma.sync 16x8x16"
                    } else {
                        ""
                    }
                )?;
                if let Some(t) = async_tile {
                    write!(
                        f,
                        "; where 16-byte aligned: block {}x{}x{}, planes {}x{}, cp.async ring of {}",
                        t.bm, t.bn, t.bk, t.pm, t.pn, t.stages
                    )?;
                }
                write!(f, ")")
            }
        }
    }
}

/// The GEMM kernel [`matmul`] uses for (`dtype`, `k`, `n`) on this client.
///
/// The choice depends only on the dtype and the device capabilities (and is documented to
/// possibly depend on K and N in future versions), **never on M**: f32 → [`GemmPath::Fma`];
/// f16 / bf16 → [`GemmPath::Cmma`] where [`cmma_supported`], otherwise [`GemmPath::Fma`].
pub fn matmul_path<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    k: usize,
    n: usize,
) -> Result<GemmPath, KernelError> {
    let _ = (k, n);
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    Ok(path_of(pinned_cmma(client, dt.storage())))
}

/// The [`GemmPath`] a pinned choice runs (`None`: the FMA kernel).
fn path_of(choice: Option<CmmaChoice>) -> GemmPath {
    match choice {
        Some(choice) => GemmPath::Cmma {
            frag_m: CMMA_FRAG as u32,
            frag_n: CMMA_FRAG as u32,
            frag_k: CMMA_FRAG as u32,
            block_m: choice.tile.bm as u32,
            block_n: choice.tile.bn as u32,
            block_k: choice.tile.bk as u32,
            plane_size: choice.plane_size,
            manual_mma: choice.manual_mma,
            async_tile: choice.async_tile,
        },
        None => GemmPath::Fma,
    }
}

struct Checked {
    dt: FloatDType,
    m: usize,
    k: usize,
    n: usize,
}

fn check_gemm<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    bias: Option<&TensorBinding<R>>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(Checked, [crate::util::View; 3], Option<crate::util::View>), KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let es = dt.size();
    let lv = check_view("lhs", lhs, 2, es)?;
    let rv = check_view("rhs", rhs, 2, es)?;
    let ov = check_out_view("out", out, 2, es)?;
    let (m, k) = (lv.dim(0), lv.dim(1));
    if rv.dim(0) != k {
        return Err(KernelError::Shape {
            arg: "rhs",
            expected: format!("[{k}, N] (rows = lhs columns)"),
            got: rv.shape.clone(),
        });
    }
    let n = rv.dim(1);
    expect_shape("out", &ov, &[m, n])?;
    let bv = match bias {
        Some(b) => {
            let bv = check_view("bias", b, 1, es)?;
            expect_shape("bias", &bv, &[n])?;
            Some(bv)
        }
        None => None,
    };
    Ok((Checked { dt, m, k, n }, [lv, rv, ov], bv))
}

/// `out = lhs · rhs (+ bias)`, row-invariant and deterministic.
///
/// * `lhs` `[M, K]`, `rhs` `[K, N]`, `bias` `[N]`, `out` `[M, N]`: any strides (transposed views
///   included; `out` must not self-alias), all of dtype `dtype` (f32 / f16 / bf16).
/// * Accumulation in f32; bias added in f32; one final rounding to `dtype`.
/// * The kernel is chosen by [`matmul_path`] (never by M). Returns the path that ran.
pub fn matmul<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    bias: Option<&TensorBinding<R>>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<GemmPath, KernelError> {
    let (c, [lv, rv, ov], bv) = check_gemm(client, lhs, rhs, bias, out, dtype)?;
    let st = c.dt.storage();
    let choice = pinned_cmma(client, st);
    let (lm, rm, om) = (
        Mat::dense(lhs, st, &lv),
        Mat::dense(rhs, st, &rv),
        Mat::dense(out, st, &ov),
    );
    let bm = match (bias, &bv) {
        (Some(b), Some(bv)) => Some(Vec1 {
            buf: b,
            offset: 0,
            stride: bv.stride(0) as u32,
        }),
        _ => None,
    };
    let ops = GemmOperands {
        lhs: lm,
        rhs: rm,
        bias: bm,
        out: om,
    };
    let dims = [c.m, c.k, c.n];
    match &choice {
        Some(choice) => launch_cmma(client, &ops, dims, choice, false)?,
        None => launch_fma(client, &ops, dims, false, SKIP_NONE)?,
    }
    Ok(path_of(choice))
}

/// The pinned cmma choice for f16 / bf16 `dtype` where the cmma path runs on this client
/// (`None` for f32 or where it does not): what [`matmul`] and the tensor-core `linear_logp` run.
pub(crate) fn pinned_cmma<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
) -> Option<CmmaChoice> {
    let dt = FloatDType::from_storage("dtype", dtype).ok()?;
    if dt == FloatDType::F32 || !cmma_supported(client, dtype) {
        return None;
    }
    let manual_mma = manual_mma_supported(client, dtype);
    Some(CmmaChoice {
        plane_size: client.properties().hardware.plane_size_max,
        tile: CMMA_TILE,
        manual_mma,
        async_tile: async_tile(client, manual_mma, CMMA_ASYNC_TILE, dt.size()),
    })
}

/// [`matmul`] with an explicit cmma tiling instead of the pinned [`crate::consts::CMMA_TILE`] /
/// [`crate::consts::CMMA_ASYNC_TILE`], for tuning benchmarks: `tile` runs on the `cp.async`
/// kernel where that kernel runs (manual MMAs on CUDA, 16-byte aligned operands), else on the
/// register-pipelined one. Every tiling gives the same bits as the pinned ones (same MMA steps in
/// the same K order); only speed differs. Errors where the cmma path does not run for `dtype` or
/// the tiling does not fit the device.
#[doc(hidden)]
pub fn matmul_cmma_tiled<R: Runtime>(
    client: &ComputeClient<R>,
    lhs: &TensorBinding<R>,
    rhs: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
    tile: CmmaTile,
    manual_mma: bool,
) -> Result<(), KernelError> {
    let (c, [lv, rv, ov], _) = check_gemm(client, lhs, rhs, None, out, dtype)?;
    let GemmPath::Cmma { plane_size, .. } = matmul_path(client, dtype, c.k, c.n)? else {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: "the cmma path does not run for this dtype on this device".into(),
        });
    };
    let hw = &client.properties().hardware;
    if manual_mma && !manual_mma_supported(client, dtype) {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: "no ldmatrix + mma.sync 16x8x16 here".into(),
        });
    }
    if !tile.is_valid(plane_size as usize)
        || plane_size as usize * tile.planes() > hw.max_units_per_cube as usize
        || tile.shared_bytes(c.dt.size()) > hw.max_shared_memory_size
    {
        return Err(KernelError::Unsupported {
            what: "matmul_cmma_tiled",
            reason: format!("tiling {tile:?} does not fit this device"),
        });
    }
    let st = c.dt.storage();
    let mat = |buf, v: &crate::util::View| Mat::dense(buf, st, v);
    let ops = GemmOperands {
        lhs: mat(lhs, &lv),
        rhs: mat(rhs, &rv),
        bias: None,
        out: mat(out, &ov),
    };
    let choice = CmmaChoice {
        plane_size,
        tile,
        manual_mma,
        async_tile: async_tile(client, manual_mma, tile, c.dt.size()),
    };
    launch_cmma(client, &ops, [c.m, c.k, c.n], &choice, false)
}

/// The row-reduction product `out = lhs_t · dout`, for `dRhs = lhsᵀ · dOut`.
///
/// * `lhs_t` `[K, M]` is the transposed view of the forward lhs (pass strides `(1, K)` for a
///   row-major `[M, K]` lhs — no copy), `dout` `[M, N]`, `out` `[K, N]`; one dtype.
/// * Always the FMA kernel: `acc = fma(lhs[m,k], dout[m,n], acc)` for `m` ascending, walked in
///   fixed 16-row stages (a constant, independent of M), f32, one final rounding. No split-K, no
///   atomics, run-to-run deterministic.
/// * Terms whose `dout` element is exactly zero are **skipped**, so appending rows whose `dOut`
///   is zero leaves `out` bitwise unchanged — even when those rows of `lhs` hold NaN/Inf, and
///   including the sign of zero. (This is the only difference from [`matmul`]'s arithmetic.)
pub fn matmul_row_reduction<R: Runtime>(
    client: &ComputeClient<R>,
    lhs_t: &TensorBinding<R>,
    dout: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(), KernelError> {
    let (c, [lv, rv, ov], _) = check_gemm(client, lhs_t, dout, None, out, dtype)?;
    let st = c.dt.storage();
    let mat = |buf, v: &crate::util::View| Mat::dense(buf, st, v);
    let ops = GemmOperands {
        lhs: mat(lhs_t, &lv),
        rhs: mat(dout, &rv),
        bias: None,
        out: mat(out, &ov),
    };
    launch_fma(client, &ops, [c.m, c.k, c.n], false, SKIP_ZERO_RHS)
}

/// `out[j] = Σ_i x[i, j]` (bias gradient): rows in ascending order, f32 accumulator starting at
/// +0.0, one final rounding to `dtype`. `x` `[M, N]` any strides, `out` `[N]`.
///
/// Because the accumulator starts at +0.0 and IEEE addition never produces −0.0 from it, adding
/// a zero is an exact no-op: appending rows of zeros leaves the result bitwise unchanged.
pub fn col_sum<R: Runtime>(
    client: &ComputeClient<R>,
    x: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
) -> Result<(), KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let xv = check_view("x", x, 2, dt.size())?;
    let ov = check_out_view("out", out, 1, dt.size())?;
    let (m, n) = (xv.dim(0), xv.dim(1));
    expect_shape("out", &ov, &[n])?;
    launch_col_sum(
        client,
        &Mat {
            buf: x,
            dtype: dt.storage(),
            offset: 0,
            s0: xv.stride(0) as u32,
            s1: xv.stride(1) as u32,
        },
        &Vec1 {
            buf: out,
            offset: 0,
            stride: ov.stride(0) as u32,
        },
        dt.storage(),
        m,
        n,
        false,
    )
}
