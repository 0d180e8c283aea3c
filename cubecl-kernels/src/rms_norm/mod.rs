//! RMS normalization over the last dimension, `y = (x·r)·gamma` with
//! `r = 1 / sqrt(mean(x²) + eps)`, and its backward: row-invariant, run-to-run deterministic,
//! bitwise the Reference (`src/ops/rms_norm/oracle.rs`) in f32.
//!
//! Kernels (see `kernels.rs`):
//! * forward: one cube of [`RMS_NORM_LANES`] units per row; unit `t` owns lane `t`
//!   (`d = t, t + 256, …`, coalesced), the lane tree in shared memory, then each unit writes its
//!   elements.
//! * backward, over host-side chunks of whole row blocks (sized so the second pass re-reads `x`
//!   and `dy` from L2): (1) statistics, one cube per row: `r` and `c = ((r·r)·r)·dot / D` into
//!   the workspace; (2) element-wise + `dGamma` partials, one cube per (row block, column tile)
//!   with one unit per column (coalesced): `dx` for every row of the block and the block's fma
//!   chain over its rows ascending; (3) one unit per column adds the block partials in ascending
//!   order and rounds once.

mod kernels;

pub use crate::consts::{RMS_NORM_LANES, RMS_NORM_ROW_BLOCK};

use crate::consts::{RMS_NORM_BWD_CHUNK_BYTES, RMS_NORM_COL_TILE};
use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::gemm::view::StridedViewLaunch;
use crate::util::{
    FloatDType, View, check_grid, check_out_view, check_runtime_dtype, check_view, chunks,
    expect_shape, launch_chunks, raw_arg, to_u32,
};
use cubecl::prelude::*;
use kernels::{
    rms_norm_dgamma_kernel, rms_norm_forward_kernel, rms_norm_grad_kernel, rms_norm_stats_kernel,
    rms_norm_zero_kernel,
};

/// The inputs of [`rms_norm_forward`] and [`rms_norm_backward`].
pub struct RmsNormRefs<'a, R: Runtime> {
    /// `[N, D]`, any strides.
    pub x: &'a TensorBinding<R>,
    /// `[D]`, any stride.
    pub gamma: &'a TensorBinding<R>,
    /// Dtype of `x`, `gamma`, the output and the gradients (f32, f16, bf16).
    pub dtype: FloatDType,
    /// Added to the mean of squares (as f32).
    pub eps: f32,
}

/// The upstream gradient, the gradient outputs and the workspace of [`rms_norm_backward`].
pub struct RmsNormGradRefs<'a, R: Runtime> {
    /// `[N, D]`, dtype of `x`, any strides.
    pub grad_out: &'a TensorBinding<R>,
    /// `[N, D]`, dtype of `x`; written.
    pub grad_x: &'a TensorBinding<R>,
    /// `[D]`, dtype of `x`; written (zeros when N = 0).
    pub grad_gamma: &'a TensorBinding<R>,
    /// f32, contiguous, at least [`rms_norm_backward_workspace_len`] elements.
    pub workspace: &'a TensorBinding<R>,
}

/// f32 elements of the workspace [`rms_norm_backward`] needs: the `dGamma` block partials
/// (`ceil(N / RMS_NORM_ROW_BLOCK) · D`), then the per-row `r` and `c` (`2 · N`).
pub fn rms_norm_backward_workspace_len(n: usize, d: usize) -> usize {
    n.div_ceil(RMS_NORM_ROW_BLOCK)
        .saturating_mul(d)
        .saturating_add(n.saturating_mul(2))
}

/// Whether [`rms_norm_forward`] and [`rms_norm_backward`] take `[N, D]` on this client: the
/// elements of `x` (and of every `[N, D]` tensor) and of the backward's workspace within 32-bit
/// indexing. Grids never fail: launches are split along the runtime's cube count. Checked before
/// anything runs by both functions; the error names the argument whose size is too large.
pub fn rms_norm_limits<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
    d: usize,
) -> Result<(), KernelError> {
    let _ = client;
    to_u32("x", "elements (N·D)", n.saturating_mul(d))?;
    to_u32(
        "workspace",
        "f32 elements of the backward's workspace (ceil(N / 256)·D + 2·N)",
        rms_norm_backward_workspace_len(n, d),
    )?;
    Ok(())
}

/// Validated inputs.
struct Checked {
    n: usize,
    d: usize,
    es: usize,
    xv: View,
    gv: View,
}

fn check_inputs<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &RmsNormRefs<'_, R>,
) -> Result<Checked, KernelError> {
    check_runtime_dtype(client, "dtype", inputs.dtype.storage())?;
    let es = inputs.dtype.size();
    let xv = check_view("x", inputs.x, 2, es)?;
    let (n, d) = (xv.dim(0), xv.dim(1));
    let gv = check_view("gamma", inputs.gamma, 1, es)?;
    expect_shape("gamma", &gv, &[d])?;
    rms_norm_limits(client, n, d)?;
    Ok(Checked { n, d, es, xv, gv })
}

/// The launch view of rows `row..` and columns `col..` of a checked 2-D view.
fn sub_view<R: Runtime>(
    arg: &'static str,
    v: &View,
    row: usize,
    col: usize,
) -> Result<StridedViewLaunch<R>, KernelError> {
    let offset = row * v.stride(0) + col * v.stride(1);
    Ok(StridedViewLaunch::new(
        to_u32(arg, "offset", offset)?,
        v.stride(0) as u32,
        v.stride(1) as u32,
    ))
}

/// `out = (x · r) · gamma` per row, `r = 1 / sqrt(Σ_d x² / D + eps)`, computed in f32 and rounded
/// once to `dtype` (see the crate's arithmetic contract). `out`: `[N, D]`, any non-aliasing
/// strides.
pub fn rms_norm_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &RmsNormRefs<'_, R>,
    out: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let ov = check_out_view("out", out, 2, c.es)?;
    expect_shape("out", &ov, &[c.n, c.d])?;
    if c.n == 0 || c.d == 0 {
        return Ok(());
    }
    let emulate = fma_mode(client) == FmaMode::Emulated;
    let d32 = to_u32("x", "D", c.d)?;
    let dtype = inputs.dtype.storage();
    for (row, rows) in launch_chunks(client, 0, c.n, 1) {
        let (gx, _) = check_grid(client, "x", rows, 1)?;
        unsafe {
            rms_norm_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, 1, 1),
                CubeDim::new_1d(RMS_NORM_LANES as u32),
                raw_arg(inputs.x),
                sub_view("x", &c.xv, row, 0)?,
                raw_arg(inputs.gamma),
                0,
                c.gv.stride(0) as u32,
                raw_arg(out),
                sub_view("out", &ov, row, 0)?,
                d32,
                c.d as f32,
                inputs.eps,
                emulate,
                dtype,
            );
        }
    }
    Ok(())
}

/// Rows of one backward chunk: whole row blocks, `x` and `dy` of the chunk within
/// `RMS_NORM_BWD_CHUNK_BYTES` (at least one block), the blocks within the cube count along y.
fn bwd_chunk_rows<R: Runtime>(client: &ComputeClient<R>, d: usize, es: usize) -> usize {
    let per_row = (2 * d * es).max(1);
    let max_y = client.properties().hardware.max_cube_count.1 as usize;
    let blocks = (RMS_NORM_BWD_CHUNK_BYTES / per_row / RMS_NORM_ROW_BLOCK).clamp(1, max_y.max(1));
    blocks * RMS_NORM_ROW_BLOCK
}

/// `grad_x` and `grad_gamma` of [`rms_norm_forward`] for the upstream gradient `grad_out`:
/// `g = dy·gamma`, `c = ((r·r)·r)·Σ_d g·x / D`, `dx = fma(−x, c, r·g)` per row; `dGamma` per
/// column as fma chains of `dy·(x·r)` over blocks of [`RMS_NORM_ROW_BLOCK`] rows ascending (terms
/// with `dy == 0` skipped), the block partials added in ascending order (zero partials skipped);
/// all in f32, each output rounded once. `dGamma` does not change when rows with a zero upstream
/// gradient are appended. Uses the f32 workspace of [`rms_norm_backward_workspace_len`].
pub fn rms_norm_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &RmsNormRefs<'_, R>,
    grads: &RmsNormGradRefs<'_, R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let (n, d, es) = (c.n, c.d, c.es);
    let dyv = check_view("grad_out", grads.grad_out, 2, es)?;
    expect_shape("grad_out", &dyv, &[n, d])?;
    let dxv = check_out_view("grad_x", grads.grad_x, 2, es)?;
    expect_shape("grad_x", &dxv, &[n, d])?;
    let dgv = check_out_view("grad_gamma", grads.grad_gamma, 1, es)?;
    expect_shape("grad_gamma", &dgv, &[d])?;
    let needed = rms_norm_backward_workspace_len(n, d);
    let wv = check_out_view("workspace", grads.workspace, 1, 4)?;
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
    if d == 0 {
        return Ok(());
    }
    let dtype = inputs.dtype.storage();
    let gs = c.gv.stride(0);
    let (dgs, lanes) = (dgv.stride(0), RMS_NORM_LANES);
    if n == 0 {
        for (col, cols) in launch_chunks(client, 0, d, lanes) {
            let (gx, _) = check_grid(client, "grad_gamma", cols.div_ceil(lanes), 1)?;
            unsafe {
                rms_norm_zero_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_1d(lanes as u32),
                    raw_arg(grads.grad_gamma),
                    to_u32("grad_gamma", "offset", col * dgs)?,
                    dgs as u32,
                    to_u32("grad_gamma", "D", cols)?,
                    dtype,
                );
            }
        }
        return Ok(());
    }
    let emulate = fma_mode(client) == FmaMode::Emulated;
    let d32 = to_u32("x", "D", d)?;
    let blocks = n.div_ceil(RMS_NORM_ROW_BLOCK);
    let r_base = blocks * d;
    let c_base = r_base + n;
    for (row, rows) in chunks(n, bwd_chunk_rows(client, d, es)) {
        // (1) r and c of every row of the chunk.
        for (sub, sub_rows) in launch_chunks(client, 0, rows, 1) {
            let first = row + sub;
            let (gx, _) = check_grid(client, "x", sub_rows, 1)?;
            unsafe {
                rms_norm_stats_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_1d(lanes as u32),
                    raw_arg(inputs.x),
                    sub_view("x", &c.xv, first, 0)?,
                    raw_arg(grads.grad_out),
                    sub_view("grad_out", &dyv, first, 0)?,
                    raw_arg(inputs.gamma),
                    0,
                    gs as u32,
                    raw_arg(grads.workspace),
                    to_u32("workspace", "offset", r_base + first)?,
                    to_u32("workspace", "offset", c_base + first)?,
                    d32,
                    d as f32,
                    inputs.eps,
                    emulate,
                    dtype,
                );
            }
        }
        // (2) dx and the dGamma partials of the chunk's row blocks.
        let chunk_blocks = rows.div_ceil(RMS_NORM_ROW_BLOCK);
        for (col, cols) in launch_chunks(client, 0, d, RMS_NORM_COL_TILE) {
            let (gx, gy) = check_grid(client, "x", cols.div_ceil(RMS_NORM_COL_TILE), chunk_blocks)?;
            unsafe {
                rms_norm_grad_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, gy, 1),
                    CubeDim::new_1d(RMS_NORM_COL_TILE as u32),
                    raw_arg(inputs.x),
                    sub_view("x", &c.xv, row, col)?,
                    raw_arg(grads.grad_out),
                    sub_view("grad_out", &dyv, row, col)?,
                    raw_arg(inputs.gamma),
                    to_u32("gamma", "offset", col * gs)?,
                    gs as u32,
                    raw_arg(grads.grad_x),
                    sub_view("grad_x", &dxv, row, col)?,
                    raw_arg(grads.workspace),
                    to_u32("workspace", "offset", r_base + row)?,
                    to_u32("workspace", "offset", c_base + row)?,
                    to_u32("workspace", "offset", row / RMS_NORM_ROW_BLOCK * d + col)?,
                    d32,
                    to_u32("x", "N", rows)?,
                    to_u32("x", "D", cols)?,
                    emulate,
                    dtype,
                );
            }
        }
    }
    // (3) dGamma: the block partials in ascending order.
    let blocks32 = to_u32("x", "row blocks", blocks)?;
    for (col, cols) in launch_chunks(client, 0, d, lanes) {
        let (gx, _) = check_grid(client, "grad_gamma", cols.div_ceil(lanes), 1)?;
        unsafe {
            rms_norm_dgamma_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, 1, 1),
                CubeDim::new_1d(lanes as u32),
                raw_arg(grads.workspace),
                to_u32("workspace", "offset", col)?,
                d32,
                blocks32,
                raw_arg(grads.grad_gamma),
                to_u32("grad_gamma", "offset", col * dgs)?,
                dgs as u32,
                to_u32("grad_gamma", "D", cols)?,
                dtype,
            );
        }
    }
    Ok(())
}
