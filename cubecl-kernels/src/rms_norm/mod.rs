//! RMS normalization over the last dimension, `y = (x·r)·gamma` with
//! `r = 1 / sqrt(mean(x²) + eps)`, and its backward: row-invariant, run-to-run deterministic,
//! bitwise the Reference (`src/ops/rms_norm/oracle.rs`) in f32.
//!
//! Kernels (see `kernels.rs`); global memory moves in vectors of up to `RMS_NORM_VECTOR_BYTES`
//! where every operand is contiguous and aligned, else element by element (same bits):
//! * forward: 256 lanes per row held by `256 / w` units (`w` rows per cube); unit `u` loads the
//!   vectors at `k·256 + w·u` (coalesced) and owns lanes `w·u ..`; the lane tree through plane
//!   shuffles where partner units share a plane (CUDA and HIP, see [`tree_plane`]), through
//!   shared memory elsewhere (the same pairs, the same bits);
//!   then each unit writes its elements (from registers when the row fits one batch of loads).
//! * backward, one pass (rows of up to [`RMS_NORM_ONE_PASS_WORDS`] words per unit): one cube
//!   per block of [`RMS_NORM_ROW_BLOCK`] rows walks them in ascending order, each row in
//!   registers (the forward's lanes), writing `dx` and folding the `dGamma` block partials in
//!   registers; `x` and `dy` are read once. A row of whole rounds of unit-stride vectors
//!   (`D = 256·rounds`) is addressed at fixed offsets from one base per row and tensor, with
//!   narrower vectors (more warps per SM). Then one unit per column adds the block partials in
//!   ascending order and rounds once.
//! * backward, two passes (longer rows; the same bits): (1) `dx` and the per-row `r` (into the
//!   workspace), the forward's shape with both sums; (2) the `dGamma` block partials, one cube
//!   per (row block, column tile), each unit owning adjacent columns (coalesced), an fma chain
//!   over the block's rows ascending; (3) the same sum of the partials.

mod kernels;

pub use crate::consts::{RMS_NORM_LANES, RMS_NORM_ROW_BLOCK};

use crate::consts::{
    RMS_NORM_BATCH, RMS_NORM_BWD_BATCH, RMS_NORM_DGAMMA_WIDTH, RMS_NORM_EXACT_WORDS,
    RMS_NORM_ONE_PASS_WORDS, RMS_NORM_ROW_BATCH, RMS_NORM_VECTOR_BYTES,
};
use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::gemm::view::StridedViewLaunch;
use crate::util::{
    FloatDType, View, check_grid, check_out_view, check_runtime_dtype, check_view, expect_shape,
    launch_chunks, raw_arg, to_u32,
};
use cubecl::features::Plane;
use cubecl::prelude::*;
use kernels::{
    ColumnLaunch, DxInputsLaunch, DxOutputsLaunch, NormInputsLaunch, NormOutputLaunch, OnePassCfg,
    OnePassOutputsLaunch, PartialSizesLaunch, PartialsLaunch, RowCfg, RowSizesLaunch, XDyLaunch,
    rms_norm_backward_kernel, rms_norm_dgamma_kernel, rms_norm_dx_kernel, rms_norm_forward_kernel,
    rms_norm_partials_kernel, rms_norm_zero_kernel,
};

thread_local! {
    static REJECTED_LAUNCH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static TWO_PASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static GENERAL_ONE_PASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ROW_KERNELS: std::cell::Cell<(usize, bool)> =
        const { std::cell::Cell::new((usize::MAX, true)) };
    static FORWARD: std::cell::Cell<(usize, usize)> =
        const { std::cell::Cell::new((usize::MAX, usize::MAX)) };
}

/// Perf hook: runs `f` with this thread's forward loading vectors of up to `width` elements (a
/// power of two; where the tensors allow it, possibly wider than the host's rule) in batches of
/// `batch` vectors per unit (`usize::MAX` leaves either to the host's rule). The same bits at
/// every setting. Other threads are unaffected; the previous setting is restored when `f`
/// returns or unwinds.
#[doc(hidden)]
pub fn with_forward_rows<T>(width: usize, batch: usize, f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_value(&FORWARD, (width, batch.max(1)), f)
}

/// Perf hook: runs `f` with this thread's one-pass backward loading vectors of `width` elements
/// (rounded down to a power of two; narrower only where the tensors or the registers require it;
/// `usize::MAX` leaves the width to the host's rule) and, with `plane` false, every row kernel's
/// lane tree in shared memory rather than through plane shuffles (the same bits in every case),
/// so that a benchmark can compare them in one process. Other threads are unaffected; the
/// previous setting is restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_row_kernels<T>(width: usize, plane: bool, f: impl FnOnce() -> T) -> T {
    let width = match width {
        usize::MAX => usize::MAX,
        w => 1usize << w.max(1).ilog2(),
    };
    crate::util::with_thread_value(&ROW_KERNELS, (width, plane), f)
}

/// Test hook: runs `f` with this thread's [`rms_norm_backward`] taking the two-pass kernels at
/// every size, so that tests can check both paths give the same bits. Other threads are
/// unaffected; the previous setting is restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_two_pass_backward<T>(f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_flag(&TWO_PASS, f)
}

/// Test and perf hook: runs `f` with this thread's one-pass backward taking its general row
/// addressing (clamped loads, selected terms) and the width that goes with it even where a row is
/// whole rounds of unit-stride vectors, so that tests and benchmarks can compare the two (the
/// same bits). Other threads are
/// unaffected; the previous setting is restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_general_one_pass<T>(f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_flag(&GENERAL_ONE_PASS, f)
}

/// Test hook: runs `f` with this thread's [`rms_norm_forward`] launching, in place of its own
/// kernel, one that CUDA's compiler rejects (a bit-reinterpretation of a literal, the fault that
/// once broke RMSNorm there), so that a caller's handling of a failed launch can be tested; the
/// output is left unwritten. Other runtimes may compile it. Other threads are unaffected; the
/// previous setting is restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_rejected_launch<T>(f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_flag(&REJECTED_LAUNCH, f)
}

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
/// (`ceil(N / RMS_NORM_ROW_BLOCK) · D`), then the per-row `r` (`N`).
pub fn rms_norm_backward_workspace_len(n: usize, d: usize) -> usize {
    n.div_ceil(RMS_NORM_ROW_BLOCK)
        .saturating_mul(d)
        .saturating_add(n)
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
        "f32 elements of the backward's workspace (ceil(N / RMS_NORM_ROW_BLOCK)·D + N)",
        rms_norm_backward_workspace_len(n, d),
    )?;
    Ok(())
}

/// The widest vector (elements, a power of two up to `max_bytes`) that every operand allows:
/// `D` a multiple of it, the last dimension contiguous, row strides multiples of it, and the
/// buffers aligned to it. 1 (scalar) otherwise. Only how bytes travel depends on it.
fn vector_width<R: Runtime>(
    client: &ComputeClient<R>,
    es: usize,
    max_bytes: usize,
    d: usize,
    mats: &[(&TensorBinding<R>, &View)],
    gamma: (&TensorBinding<R>, &View),
) -> usize {
    let aligned = |t: &TensorBinding<R>, w: usize| {
        t.handle
            .offset_start
            .unwrap_or(0)
            .is_multiple_of((w * es) as u64)
    };
    client
        .io_optimized_vector_sizes(es)
        .filter(|&w| w * es <= max_bytes && d.is_multiple_of(w))
        .find(|&w| {
            w == 1
                || (mats.iter().all(|(t, v)| {
                    v.stride(1) == 1
                        && (v.dim(0) <= 1 || v.stride(0).is_multiple_of(w))
                        && aligned(t, w)
                }) && gamma.1.stride(0) == 1
                    && aligned(gamma.0, w))
        })
        .unwrap_or(1)
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
    if REJECTED_LAUNCH.with(std::cell::Cell::get) {
        let scratch = client.empty(4);
        unsafe {
            kernels::rejected_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                ArrayArg::from_raw_parts(scratch, 1),
            )
        };
        return Ok(());
    }
    let emulate = fma_mode(client) == FmaMode::Emulated;
    let d32 = to_u32("x", "D", c.d)?;
    let dtype = inputs.dtype.storage();
    let (width, batch) = FORWARD.with(std::cell::Cell::get);
    let max_bytes = match width {
        usize::MAX => RMS_NORM_VECTOR_BYTES,
        w => w * c.es,
    };
    let w = vector_width(
        client,
        c.es,
        max_bytes,
        c.d,
        &[(inputs.x, &c.xv), (out, &ov)],
        (inputs.gamma, &c.gv),
    );
    let batch = if batch == usize::MAX {
        RMS_NORM_BATCH
    } else {
        batch
    };
    for (row, rows) in launch_chunks(client, 0, c.n, w) {
        let (gx, _) = check_grid(client, "x", rows.div_ceil(w), 1)?;
        unsafe {
            rms_norm_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, 1, 1),
                CubeDim::new_2d((RMS_NORM_LANES / w) as u32, w as u32),
                w,
                NormInputsLaunch::new(
                    raw_arg(inputs.x),
                    sub_view("x", &c.xv, row, 0)?,
                    raw_arg(inputs.gamma),
                    0,
                    c.gv.stride(0) as u32,
                ),
                NormOutputLaunch::new(raw_arg(out), sub_view("out", &ov, row, 0)?),
                RowSizesLaunch::new(to_u32("x", "N", rows)?, d32, c.d as f32, inputs.eps),
                RowCfg {
                    w,
                    batch,
                    emulate_fma: emulate,
                    plane: tree_plane(client),
                },
                dtype,
            );
        }
    }
    Ok(())
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
    check_backward_workspace(grads.workspace, rms_norm_backward_workspace_len(n, d))?;
    if d == 0 {
        return Ok(());
    }
    let w = vector_width(
        client,
        es,
        RMS_NORM_VECTOR_BYTES,
        d,
        &[
            (inputs.x, &c.xv),
            (grads.grad_out, &dyv),
            (grads.grad_x, &dxv),
        ],
        (inputs.gamma, &c.gv),
    );
    let bwd = Backward {
        client,
        inputs,
        grads,
        c,
        dyv,
        dxv,
        dgs: dgv.stride(0),
        w,
    };
    if n == 0 {
        return bwd.zero_grad_gamma();
    }
    let widest = ROW_KERNELS.with(std::cell::Cell::get).0;
    let cfg = one_pass_cfg(d, es, w.min(widest), bwd.emulate(), tree_plane(client));
    // A width set through `with_row_kernels` is kept where the registers allow it.
    let cfg = cfg.map(|c| match widest {
        usize::MAX => c.narrowed(es),
        _ => c,
    });
    match cfg {
        Some(cfg) if !TWO_PASS.with(std::cell::Cell::get) => bwd.launch_one_pass(cfg)?,
        _ => {
            bwd.launch_dx()?;
            bwd.launch_partials()?;
        }
    }
    bwd.launch_sum_partials()
}

/// The one-pass kernel's configuration for rows of `d` elements of `es` bytes, where a row fits
/// its units' registers: the widest vector `w' ≤ w` whose words per unit (the partials in f32
/// plus the row's `x` and `dy`) stay within [`RMS_NORM_ONE_PASS_WORDS`]. Wide vectors keep the
/// instructions per element low (scalar loads, 256 units per cube, ran 1.6× slower on an H200)
/// where the addressing is general; a row of whole rounds of unit-stride vectors takes fixed
/// offsets (`exact`; see [`OnePassCfg::narrowed`] for its width). `plane`: see [`tree_plane`].
/// Only which kernels run depends on it, never the bits.
fn one_pass_cfg(
    d: usize,
    es: usize,
    w: usize,
    emulate_fma: bool,
    plane: usize,
) -> Option<OnePassCfg> {
    let rounds = d.div_ceil(RMS_NORM_LANES).next_power_of_two();
    let mut w = w;
    while w > 1 && one_pass_words(rounds, w, es) > RMS_NORM_ONE_PASS_WORDS {
        w /= 2;
    }
    // Vectors wider than one element imply unit strides (`vector_width`).
    let exact =
        w > 1 && d == rounds * RMS_NORM_LANES && !GENERAL_ONE_PASS.with(std::cell::Cell::get);
    (one_pass_words(rounds, w, es) <= RMS_NORM_ONE_PASS_WORDS).then_some(OnePassCfg {
        w,
        rounds,
        emulate_fma,
        plane,
        exact,
    })
}

/// 32-bit words a unit of the one pass holds: its `dGamma` partials in f32 plus the row's `x` and
/// `dy` in `es`-byte elements.
fn one_pass_words(rounds: usize, w: usize, es: usize) -> usize {
    rounds * w + 2 * rounds * (w * es).div_ceil(4)
}

impl OnePassCfg {
    /// With fixed offsets, the vector narrows (not below 2 elements) until a unit holds at most
    /// [`RMS_NORM_EXACT_WORDS`]: each round's address is a constant offset from the row's base
    /// there, so narrower vectors add no addressing per element and leave registers for more
    /// warps per SM.
    fn narrowed(mut self, es: usize) -> Self {
        while self.exact
            && self.w > 2
            && one_pass_words(self.rounds, self.w, es) > RMS_NORM_EXACT_WORDS
        {
            self.w /= 2;
        }
        self
    }
}

/// The plane size of the row kernels' lane-tree shuffles: the device's, where the runtime is
/// CUDA or HIP (which number a cube's units into planes consecutively, as the tree's partner
/// arithmetic needs; Vulkan and WebGPU do not promise it) with plane operations and one fixed
/// plane size (a power of two), else 0 (the tree in shared memory). Only the speed depends on it.
#[doc(hidden)]
pub fn tree_plane<R: Runtime>(client: &ComputeClient<R>) -> usize {
    let props = client.properties();
    let hw = &props.hardware;
    let consecutive = matches!(R::name(client), "cuda" | "hip");
    let fixed = hw.plane_size_min == hw.plane_size_max && hw.plane_size_max.is_power_of_two();
    let allowed = ROW_KERNELS.with(std::cell::Cell::get).1;
    if allowed && consecutive && props.features.plane.contains(Plane::Ops) && fixed {
        hw.plane_size_max as usize
    } else {
        0
    }
}

/// Units per cube of the `dGamma` sum.
const SUM_UNITS: usize = 32;

/// The workspace holds at least `needed` f32 and is contiguous.
fn check_backward_workspace<R: Runtime>(
    workspace: &TensorBinding<R>,
    needed: usize,
) -> Result<(), KernelError> {
    let wv = check_out_view("workspace", workspace, 1, 4)?;
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

/// One validated backward call: its three phases share the views.
struct Backward<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    inputs: &'a RmsNormRefs<'a, R>,
    grads: &'a RmsNormGradRefs<'a, R>,
    c: Checked,
    dyv: View,
    dxv: View,
    dgs: usize,
    /// Vector width of the row kernels.
    w: usize,
}

impl<R: Runtime> Backward<'_, R> {
    fn dtype(&self) -> StorageType {
        self.inputs.dtype.storage()
    }

    fn emulate(&self) -> bool {
        fma_mode(self.client) == FmaMode::Emulated
    }

    /// Rows of the `r` copies in the workspace start after the dGamma partials.
    fn r_base(&self) -> usize {
        self.c.n.div_ceil(RMS_NORM_ROW_BLOCK) * self.c.d
    }

    /// `N = 0`: `dGamma` is zeros.
    fn zero_grad_gamma(&self) -> Result<(), KernelError> {
        let (client, lanes, dgs) = (self.client, RMS_NORM_LANES, self.dgs);
        for (col, cols) in launch_chunks(client, 0, self.c.d, lanes) {
            let (gx, _) = check_grid(client, "grad_gamma", cols.div_ceil(lanes), 1)?;
            unsafe {
                rms_norm_zero_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_1d(lanes as u32),
                    raw_arg(self.grads.grad_gamma),
                    to_u32("grad_gamma", "offset", col * dgs)?,
                    dgs as u32,
                    to_u32("grad_gamma", "D", cols)?,
                    self.dtype(),
                );
            }
        }
        Ok(())
    }

    /// `x`, `dy` and `gamma` of the row kernels, from row `row` on.
    fn dx_inputs<F: Float, N: Size>(
        &self,
        row: usize,
    ) -> Result<DxInputsLaunch<F, N, R>, KernelError> {
        let (inputs, grads, c) = (self.inputs, self.grads, &self.c);
        Ok(DxInputsLaunch::new(
            raw_arg(inputs.x),
            sub_view("x", &c.xv, row, 0)?,
            raw_arg(grads.grad_out),
            sub_view("grad_out", &self.dyv, row, 0)?,
            raw_arg(inputs.gamma),
            0,
            c.gv.stride(0) as u32,
        ))
    }

    /// The one-pass backward: `dx` and the `dGamma` block partials, one cube per row block.
    fn launch_one_pass(&self, cfg: OnePassCfg) -> Result<(), KernelError> {
        let (client, inputs, grads, c) = (self.client, self.inputs, self.grads, &self.c);
        let (n, d, block) = (c.n, c.d, RMS_NORM_ROW_BLOCK);
        let d32 = to_u32("x", "D", d)?;
        for (row, rows) in launch_chunks(client, 0, n, block) {
            let (gx, _) = check_grid(client, "x", rows.div_ceil(block), 1)?;
            unsafe {
                rms_norm_backward_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_1d((RMS_NORM_LANES / cfg.w) as u32),
                    cfg.w,
                    self.dx_inputs(row)?,
                    OnePassOutputsLaunch::new(
                        raw_arg(grads.grad_x),
                        sub_view("grad_x", &self.dxv, row, 0)?,
                        raw_arg(grads.workspace),
                        to_u32("x", "row blocks", row / block)?,
                    ),
                    RowSizesLaunch::new(to_u32("x", "N", rows)?, d32, d as f32, inputs.eps),
                    cfg,
                    self.dtype(),
                );
            }
        }
        Ok(())
    }

    /// Phase 1: `dx` and `r` of each row, `w` rows per cube.
    fn launch_dx(&self) -> Result<(), KernelError> {
        let (client, inputs, grads, c) = (self.client, self.inputs, self.grads, &self.c);
        let (n, d, lanes) = (c.n, c.d, RMS_NORM_LANES);
        let w = self.w;
        let d32 = to_u32("x", "D", d)?;
        for (row, rows) in launch_chunks(client, 0, n, w) {
            let (gx, _) = check_grid(client, "x", rows.div_ceil(w), 1)?;
            unsafe {
                rms_norm_dx_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_2d((lanes / w) as u32, w as u32),
                    w,
                    self.dx_inputs(row)?,
                    DxOutputsLaunch::new(
                        raw_arg(grads.grad_x),
                        sub_view("grad_x", &self.dxv, row, 0)?,
                        raw_arg(grads.workspace),
                        to_u32("workspace", "offset", self.r_base() + row)?,
                    ),
                    RowSizesLaunch::new(to_u32("x", "N", rows)?, d32, d as f32, inputs.eps),
                    RowCfg {
                        w,
                        batch: RMS_NORM_BWD_BATCH,
                        emulate_fma: self.emulate(),
                        plane: tree_plane(client),
                    },
                    self.dtype(),
                );
            }
        }
        Ok(())
    }

    /// Phase 2: the dGamma partials, one cube per (row block, tile of `256·wg` columns).
    fn launch_partials(&self) -> Result<(), KernelError> {
        let (client, inputs, grads, c) = (self.client, self.inputs, self.grads, &self.c);
        let (n, d, lanes) = (c.n, c.d, RMS_NORM_LANES);
        let w = self.w;
        let wg = w.min(RMS_NORM_DGAMMA_WIDTH.max(1));
        let tiles = d.div_ceil(lanes * wg);
        let cubes = n.div_ceil(RMS_NORM_ROW_BLOCK) * tiles;
        let (max_x, _, _) = client.properties().hardware.max_cube_count;
        let gx = cubes.min((max_x as usize).max(1));
        let (gx, gy) = check_grid(client, "x", gx, cubes.div_ceil(gx))?;
        unsafe {
            rms_norm_partials_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, gy, 1),
                CubeDim::new_1d(lanes as u32),
                wg,
                XDyLaunch::new(
                    raw_arg(inputs.x),
                    sub_view("x", &c.xv, 0, 0)?,
                    raw_arg(grads.grad_out),
                    sub_view("grad_out", &self.dyv, 0, 0)?,
                ),
                raw_arg(grads.workspace),
                PartialSizesLaunch::new(
                    to_u32("workspace", "offset", self.r_base())?,
                    to_u32("x", "N", n)?,
                    to_u32("x", "cubes", cubes)?,
                    to_u32("x", "column tiles", tiles)?,
                    to_u32("x", "D", d)?,
                ),
                RowCfg {
                    w: wg,
                    batch: RMS_NORM_ROW_BATCH,
                    emulate_fma: self.emulate(),
                    // No lane tree.
                    plane: 0,
                },
                self.dtype(),
            );
        }
        Ok(())
    }

    /// Phase 3: `dGamma`, the block partials in ascending order.
    fn launch_sum_partials(&self) -> Result<(), KernelError> {
        // One warp-sized cube per 32 columns: each unit's sum is a chain of loads, so many
        // small cubes keep more of them in flight.
        let (client, units, dgs, d) = (self.client, SUM_UNITS, self.dgs, self.c.d);
        let blocks32 = to_u32("x", "row blocks", self.c.n.div_ceil(RMS_NORM_ROW_BLOCK))?;
        let d32 = to_u32("x", "D", d)?;
        for (col, cols) in launch_chunks(client, 0, d, units) {
            let (gx, _) = check_grid(client, "grad_gamma", cols.div_ceil(units), 1)?;
            unsafe {
                rms_norm_dgamma_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, 1, 1),
                    CubeDim::new_1d(units as u32),
                    PartialsLaunch::new(
                        raw_arg(self.grads.workspace),
                        to_u32("workspace", "offset", col)?,
                        d32,
                        blocks32,
                    ),
                    ColumnLaunch::new(
                        raw_arg(self.grads.grad_gamma),
                        to_u32("grad_gamma", "offset", col * dgs)?,
                        dgs as u32,
                    ),
                    to_u32("grad_gamma", "D", cols)?,
                    self.dtype(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::one_pass_cfg;

    /// Model widths (bf16, 8-byte vectors) take the one pass up to D = 8192, narrowing the
    /// vectors past 4096; wider rows and f32 rows past 8192 take the two passes.
    #[test]
    fn one_pass_covers_model_widths() {
        let cfg = |d, es, w| one_pass_cfg(d, es, w, false, 32).map(|c| (c.w, c.rounds));
        assert_eq!(cfg(4096, 2, 4), Some((4, 16)));
        assert_eq!(cfg(5120, 2, 4), Some((2, 32)));
        assert_eq!(cfg(8192, 2, 4), Some((2, 32)));
        assert_eq!(cfg(8192, 4, 2), Some((1, 32)));
        assert_eq!(cfg(37, 4, 1), Some((1, 1)));
        assert_eq!(cfg(16384, 2, 4), None);
        assert_eq!(cfg(8448, 4, 2), None);
        // Whole rounds of vectors take fixed offsets, and narrower vectors there.
        let narrowed = |d, es, w| one_pass_cfg(d, es, w, false, 32).map(|c| c.narrowed(es).w);
        assert_eq!(narrowed(4096, 2, 4), Some(2));
        assert_eq!(narrowed(2048, 2, 4), Some(4));
        assert_eq!(narrowed(5120, 2, 4), Some(2));
        assert_eq!(narrowed(4096, 4, 2), Some(2));
        let exact = |d, es, w| one_pass_cfg(d, es, w, false, 32).map(|c| c.exact);
        assert_eq!(exact(4096, 2, 4), Some(true));
        assert_eq!(exact(8192, 2, 4), Some(true));
        assert_eq!(exact(5120, 2, 4), Some(false));
        assert_eq!(exact(4100, 2, 4), Some(false));
        assert_eq!(exact(256, 2, 1), Some(false));
    }
}
