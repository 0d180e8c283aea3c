//! What both directions take: the input bindings, their checks, and the workspace sizes.

use super::logits::{LinearLaunch, TargetsLaunch};
pub use super::workspace::linear_logp_num_segments;
use super::workspace::{HalfLayout, is_half, partials_len, tc_forward_scratch_len};
use crate::consts::{
    BWD_ROW_CHUNK, BWD_VOCAB_CHUNK, LOGP_PARTIAL_STRIDE, LOGP_ROWS, MAX_INDEX, TC_FWD_ROWS,
    TC_FWD_VOCAB,
};
use crate::error::KernelError;
use crate::gemm::view::{MatArgLaunch, StridedViewLaunch, VecArgLaunch};
use crate::util::{
    FloatDType, IndexDType, View, check_out_view, check_runtime_dtype, check_view, expect_shape,
    raw_arg, to_u32,
};
use cubecl::prelude::*;

/// The inputs shared by the forward and the backward.
pub struct LogpInputRefs<'a, R: Runtime> {
    /// `[N, D]`, dtype `dtype`, any strides.
    pub hidden: &'a TensorBinding<R>,
    /// `[V, D]` (LM-head layout), dtype `dtype`, any strides.
    pub weight: &'a TensorBinding<R>,
    /// `[V]`, dtype `dtype`.
    pub bias: Option<&'a TensorBinding<R>>,
    /// `[N]` integer targets (dtype `targets_dtype`: i32, or i64 where the runtime has it).
    pub targets: &'a TensorBinding<R>,
    /// Storage type of `targets`.
    pub targets_dtype: StorageType,
    /// Rows whose target equals this value are ignored (`logp = 0`, zero `g_logp` gradient).
    pub ignore_index: Option<i64>,
    /// Float dtype of `hidden`, `weight`, `bias` (f32 / f16 / bf16).
    pub dtype: StorageType,
    /// `1 / T`: the logits are `(hidden · weightᵀ + bias) · inv_temperature` (1 leaves them
    /// unchanged). Finite and positive.
    pub inv_temperature: f32,
    /// Whether the statistics carry a third column, the entropy of the row's softmax (nats).
    pub entropy: bool,
}

impl<R: Runtime> LogpInputRefs<'_, R> {
    /// Columns of the statistics and of the upstream gradient: `(logp, lse)`, then `entropy`
    /// when requested.
    pub fn stats_columns(&self) -> usize {
        2 + usize::from(self.entropy)
    }
}

/// The gradient outputs of [`crate::linear_logp_backward`].
pub struct LogpGradRefs<'a, R: Runtime> {
    /// `[N, D]`, dtype of `hidden`.
    pub d_hidden: &'a TensorBinding<R>,
    /// `[V, D]`, dtype of `weight`.
    pub d_weight: &'a TensorBinding<R>,
    /// `[V]`, dtype of `bias`; required iff the inputs have a bias.
    pub d_bias: Option<&'a TensorBinding<R>>,
}

/// f32 elements of workspace [`crate::linear_logp_forward`] needs for `dtype`: the segment
/// partials, `num_segments(V) · N · 4`, and for f16 / bf16 the tensor-core path's logits scratch,
/// `min(N, TC_FWD_ROWS) · min(V, TC_FWD_VOCAB)` (at most 64 MiB).
pub fn linear_logp_forward_workspace_len(n: usize, v: usize, dtype: StorageType) -> usize {
    let partials = partials_len(n, v);
    if is_half(dtype) {
        partials + tc_forward_scratch_len(n, v)
    } else {
        partials
    }
}

/// f32 elements of workspace [`crate::linear_logp_backward`] needs:
/// `min(N, BWD_ROW_CHUNK) · min(V, BWD_VOCAB_CHUNK)` for the `dz` scratch (≤ 1 Mi floats = 4 MiB
/// whatever N and V are), plus, when `dtype` is not f32, f32 accumulators: `dHidden` (`N·D`),
/// one vocabulary chunk of `dWeight` (`min(V, 4096)·D`), `dBias` (`V`), and the tensor-core
/// path's scratch (at most `TC_BWD_ROWS · (1.5 · TC_BWD_VOCAB + D / 2)` floats,
/// 48 MiB + 4 KiB·D).
pub fn linear_logp_backward_workspace_len(
    n: usize,
    d: usize,
    v: usize,
    dtype: StorageType,
    has_bias: bool,
) -> Result<usize, KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    let scratch = n.min(BWD_ROW_CHUNK) * v.min(BWD_VOCAB_CHUNK);
    if dt == FloatDType::F32 {
        return Ok(scratch);
    }
    Ok(HalfLayout::new(n, d, v, has_bias).len)
}

/// Rows one [`crate::linear_logp_forward`] call takes at most on this client for `v`: its grids
/// within the runtime's cube count along x and its workspace within 32-bit indexing, whatever N
/// is. Larger N runs as calls of at most this many rows: rows are independent, so the split never
/// changes a bit. A multiple of the row tile, at least one tile.
pub fn linear_logp_forward_max_rows<R: Runtime>(
    client: &ComputeClient<R>,
    v: usize,
    dtype: StorageType,
) -> usize {
    let max_x = client.properties().hardware.max_cube_count.0 as usize;
    // The partials kernel takes LOGP_ROWS rows per cube, the merge more.
    let grid = max_x.max(1).saturating_mul(LOGP_ROWS);
    let scratch = if is_half(dtype) {
        TC_FWD_ROWS * TC_FWD_VOCAB
    } else {
        0
    };
    let per_row = linear_logp_num_segments(v).max(1) * LOGP_PARTIAL_STRIDE;
    let space = (MAX_INDEX as usize - scratch) / per_row;
    (grid.min(space) / LOGP_ROWS * LOGP_ROWS).max(LOGP_ROWS)
}

/// Whether [`crate::linear_logp_forward`] (in calls of [`linear_logp_forward_max_rows`] rows)
/// and [`crate::linear_logp_backward`] run N, D, V for `dtype` on this client: the forward's
/// vocabulary segments within the runtime's cube count along y, the backward's f32 workspace
/// within 32-bit indexing and its tensor-core element-wise grids within the cube count along x.
/// The error names the argument whose size the limit is about.
pub fn linear_logp_limits<R: Runtime>(
    client: &ComputeClient<R>,
    [n, d, v]: [usize; 3],
    dtype: StorageType,
    has_bias: bool,
) -> Result<(), KernelError> {
    let (_, max_y, _) = client.properties().hardware.max_cube_count;
    let segments = linear_logp_num_segments(v);
    if segments as u64 > max_y as u64 {
        return Err(KernelError::GridTooLarge {
            arg: "weight",
            what: "vocabulary segments (V / 4096), one cube each along y",
            value: segments as u64,
            limit: max_y as u64,
        });
    }
    let len = linear_logp_backward_workspace_len(n, d, v, dtype, has_bias)?;
    to_u32(
        "hidden",
        "f32 elements of the backward's workspace (N·D + one chunk of dWeight + …)",
        len,
    )?;
    if linear_logp_tensor_cores(client, dtype) || (is_half(dtype) && super::chunked_fma_forced()) {
        // The tensor-core scratch's buffers are addressed in half elements.
        let tc = HalfLayout::new(n, d, v, has_bias).tc;
        to_u32(
            "hidden",
            "half elements up to the end of the tensor-core scratch",
            2 * (tc.z + tc.len),
        )?;
        let cubes = d.div_ceil(crate::consts::EW_COLUMNS_PER_CUBE);
        let max_x = client.properties().hardware.max_cube_count.0 as u64;
        if cubes as u64 > max_x {
            return Err(KernelError::GridTooLarge {
                arg: "hidden",
                what: "cubes over D in the backward's element-wise kernels",
                value: cubes as u64,
                limit: max_x,
            });
        }
    }
    Ok(())
}

pub(crate) struct Checked {
    pub dt: FloatDType,
    pub it: IndexDType,
    pub n: usize,
    pub d: usize,
    pub v: usize,
    pub hv: View,
    pub wv: View,
    pub bv: Option<View>,
    pub tv: View,
    /// `Some(value)` when an ignore index is set and representable in the target dtype.
    pub ignore: Option<i64>,
    /// `1 / T`.
    pub inv_t: f32,
    /// Whether the entropy column is computed (forward) or differentiated (backward).
    pub entropy: bool,
    /// Columns of the statistics and of the upstream gradient (2 or 3).
    pub cols: usize,
}

pub(crate) fn check_inputs<R: Runtime>(
    client: &ComputeClient<R>,
    inp: &LogpInputRefs<'_, R>,
) -> Result<Checked, KernelError> {
    let dt = FloatDType::from_storage("dtype", inp.dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let it = IndexDType::from_storage("targets", inp.targets_dtype)?;
    check_runtime_dtype(client, "targets", it.storage())?;
    if !(inp.inv_temperature.is_finite() && inp.inv_temperature > 0.0) {
        return Err(KernelError::Unsupported {
            what: "inv_temperature",
            reason: format!("must be finite and > 0, got {}", inp.inv_temperature),
        });
    }
    let es = dt.size();
    let hv = check_view("hidden", inp.hidden, 2, es)?;
    let wv = check_view("weight", inp.weight, 2, es)?;
    let (n, d) = (hv.dim(0), hv.dim(1));
    let v = wv.dim(0);
    if wv.dim(1) != d {
        return Err(KernelError::Shape {
            arg: "weight",
            expected: format!("[V, {d}] (columns = hidden columns)"),
            got: wv.shape.clone(),
        });
    }
    let bv = match inp.bias {
        Some(b) => {
            let bv = check_view("bias", b, 1, es)?;
            expect_shape("bias", &bv, &[v])?;
            Some(bv)
        }
        None => None,
    };
    let tv = check_view("targets", inp.targets, 1, it.size())?;
    expect_shape("targets", &tv, &[n])?;
    to_u32("weight", "V", v)?;
    to_u32("hidden", "N", n)?;
    let ignore = match (inp.ignore_index, it) {
        (Some(x), IndexDType::I32) => i32::try_from(x).ok().map(i64::from),
        (Some(x), IndexDType::I64) => Some(x),
        (None, _) => None,
    };
    Ok(Checked {
        dt,
        it,
        n,
        d,
        v,
        hv,
        wv,
        bv,
        tv,
        ignore,
        inv_t: inp.inv_temperature,
        entropy: inp.entropy,
        cols: inp.stats_columns(),
    })
}

pub(crate) fn check_workspace<R: Runtime>(
    ws: &TensorBinding<R>,
    needed: usize,
) -> Result<(), KernelError> {
    let wv = check_out_view("workspace", ws, 1, 4)?;
    if wv.dim(0) < needed {
        return Err(KernelError::BufferTooSmall {
            arg: "workspace",
            needed,
            got: wv.dim(0),
        });
    }
    if needed > 0 && wv.stride(0) != 1 {
        return Err(KernelError::Layout {
            arg: "workspace",
            reason: format!("must be contiguous (stride 1), got stride {}", wv.stride(0)),
        });
    }
    Ok(())
}

pub(crate) fn ignore_scalar(c: &Checked) -> InputScalar {
    InputScalar::new(c.ignore.unwrap_or(0), c.it.storage())
}

/// The linear layer as a kernel argument: `hidden`, `weight` viewed as the rhs `[D, V]` (row
/// stride along d, column stride along v), `bias` (or the stand-in `bias_buf` with stride 0).
pub(crate) fn linear<F: Float, R: Runtime>(
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    bias_buf: &TensorBinding<R>,
    bias_stride: usize,
) -> LinearLaunch<F, R> {
    LinearLaunch::new(
        MatArgLaunch::new(
            raw_arg(inputs.hidden),
            view(c.hv.stride(0), c.hv.stride(1), 0),
        ),
        MatArgLaunch::new(
            raw_arg(inputs.weight),
            view(c.wv.stride(1), c.wv.stride(0), 0),
        ),
        VecArgLaunch::new(raw_arg(bias_buf), 0, bias_stride as u32),
    )
}

/// The targets as a kernel argument (from row 0).
pub(crate) fn targets<I: Int, R: Runtime>(
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
) -> TargetsLaunch<I, R> {
    TargetsLaunch::new(raw_arg(inputs.targets), 0, c.tv.stride(0) as u32)
}

/// A strided view for a kernel argument.
pub(crate) fn view<R: Runtime>(s0: usize, s1: usize, offset: usize) -> StridedViewLaunch<R> {
    StridedViewLaunch::new(offset as u32, s0 as u32, s1 as u32)
}

/// Whether `linear_logp` runs on tensor cores for `dtype` on this client: f16 / bf16 where the
/// cmma GEMM runs ([`crate::matmul_path`] is `Cmma`). Elsewhere, and for f32, the FMA kernels
/// run (f32: bitwise the reference).
pub fn linear_logp_tensor_cores<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    crate::gemm::pinned_cmma(client, dtype).is_some()
}

/// The GEMMs the tensor-core path runs with for these checked inputs, `None` where the FMA
/// kernels run (f32, no cmma, or an empty dimension: nothing to multiply).
pub(crate) fn tensor_core_choice<R: Runtime>(
    client: &ComputeClient<R>,
    c: &Checked,
) -> Option<super::Products> {
    if c.n == 0 || c.d == 0 || c.v == 0 || !is_half(c.dt.storage()) {
        return None;
    }
    if super::chunked_fma_forced() {
        return Some(super::Products::Fma);
    }
    crate::gemm::pinned_cmma(client, c.dt.storage()).map(super::Products::Cmma)
}
