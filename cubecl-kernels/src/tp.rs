//! Per-row kernels of the vocabulary-sharded (tensor-parallel) `linear_logp` in `burn-invariant`:
//! the leaf target remap, the `lse` merge of the fixed tree, the owner pick and the final
//! `(logp, lse)`. Each replaces a chain of small element-wise ops with one launch; all are pure
//! per-row functions, so their bits do not depend on N or on the world size.
//!
//! Buffers are contiguous (the caller makes them so); every launch checks shapes and sizes.

use crate::error::KernelError;
use crate::logp::{SoftmaxMath, exp_s, ln_s};
use crate::util::{IndexDType, check_grid, check_out_view, check_view, expect_shape, raw_arg};
use cubecl::prelude::*;

const BLOCK: usize = 256;

/// A leaf's vocabulary columns `start .. start + len` and the ignore index, in the targets' dtype.
#[derive(CubeType, CubeLaunch)]
struct LeafRange {
    start: InputScalar,
    len: InputScalar,
    ignore: InputScalar,
}

/// The pick kernel's inputs: the running `acc [2, N]`, the leaf's `stats [N, 2]` and its leaf
/// targets.
#[derive(CubeType, CubeLaunch)]
struct PickInputs<I: Int> {
    acc: Tensor<f32>,
    stats: Tensor<f32>,
    leaf_targets: Tensor<I>,
}

/// The finish kernel's inputs: the picks `[2, N]`, the merged `lse [N]`, the targets.
#[derive(CubeType, CubeLaunch)]
struct FinishInputs<I: Int> {
    picks: Tensor<f32>,
    lse: Tensor<f32>,
    targets: Tensor<I>,
}

/// The finish kernel's scalars: rows, the vocabulary size (`vocab_unbounded == 1` where it does
/// not fit the targets' dtype), the ignore index, NaN.
#[derive(CubeType, CubeLaunch)]
struct FinishScalars {
    n: u32,
    vocab: InputScalar,
    vocab_unbounded: u32,
    ignore: InputScalar,
    nan: f32,
}

/// Leaf target of row `i`: `t − start` when `0 ≤ t − start < len` and `t` is not ignored,
/// `-1` (the leaf's ignore index) when ignored, `-2` (matches no column) otherwise.
#[cube(launch_unchecked)]
fn leaf_targets_kernel<I: Int>(
    targets: &Tensor<I>,
    out: &mut Tensor<I>,
    n: u32,
    leaf: LeafRange,
    #[comptime] has_ignore: bool,
    #[define(I)] _dtype: StorageType,
) {
    let row = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if row < n as usize {
        let t = targets[row];
        let mut ignored = false;
        if comptime![has_ignore] {
            ignored = t == leaf.ignore.get::<I>();
        }
        let start = leaf.start.get::<I>();
        let mut out_t = I::from_int(-2);
        if ignored {
            out_t = I::from_int(-1);
        } else if t >= start {
            let local = t - start;
            if local < leaf.len.get::<I>() {
                out_t = local;
            }
        }
        out[row] = out_t;
    }
}

/// `a ⊕ b = max(a, b) + ln(1 + exp(−|a − b|))`, with `−|a − b|` taken as 0 when `a == b` (so two
/// equal infinities give that infinity); NaN propagates.
#[cube(launch_unchecked)]
fn merge_lse_kernel(
    a: &Tensor<f32>,
    b: &Tensor<f32>,
    out: &mut Tensor<f32>,
    n: u32,
    #[comptime] math: SoftmaxMath,
) {
    let row = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if row < n as usize {
        let x = a[row];
        let y = b[row];
        let max = select(x > y, x, y);
        let gap = select(x == y, 0.0f32, -f32::abs(x - y));
        out[row] = max + log1p_exp(gap, math);
    }
}

/// `out [2, N]` from `(lse, entropy)` pairs `a`, `b` `[2, N]`: row 0 `a ⊕ b` as in
/// `merge_lse_kernel`; row 1 `Σ_side w·(H + lse − lse_side)`, `w = exp(lse_side − lse)`, a side
/// whose lse is −∞ adding exactly nothing.
/// (`neg_inf` is a launch scalar: WGSL has no infinite literal.)
#[cube(launch_unchecked)]
fn merge_entropy_kernel(
    a: &Tensor<f32>,
    b: &Tensor<f32>,
    out: &mut Tensor<f32>,
    n_rows: u32,
    neg_inf: f32,
    #[comptime] math: SoftmaxMath,
) {
    let row = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    let n = n_rows as usize;
    if row < n {
        let x = a[row];
        let y = b[row];
        let max = select(x > y, x, y);
        let gap = select(x == y, 0.0f32, -f32::abs(x - y));
        let lse = max + log1p_exp(gap, math);
        let h = entropy_side(x, a[n + row], lse, neg_inf, math)
            + entropy_side(y, b[n + row], lse, neg_inf, math);
        out[row] = lse;
        out[n + row] = h;
    }
}

/// One side's share of a merged entropy: `w·(H + lse − lse_side)`, `w = exp(lse_side − lse)`.
#[cube]
fn entropy_side(
    lse_side: f32,
    h: f32,
    lse: f32,
    neg_inf: f32,
    #[comptime] math: SoftmaxMath,
) -> f32 {
    let gap = lse_side - lse;
    select(lse_side == neg_inf, 0.0f32, exp_s(gap, math) * (h - gap))
}

/// `ln(1 + eˣ)` for `x ≤ 0`: the runtime's `log1p` and `exp`, or the portable `ln(1 + exp_p(x))`
/// (see `SoftmaxMath`).
#[cube]
fn log1p_exp(x: f32, #[comptime] math: SoftmaxMath) -> f32 {
    if comptime![math.portable] {
        ln_s(1.0f32 + exp_s(x, math), math)
    } else {
        f32::log1p(f32::exp(x))
    }
}

/// `out [2, N]`: row 0 the leaf's `logp`, row 1 its `lse` where the leaf owns the row
/// (`leaf_targets ≥ 0`), `acc` (or 0) elsewhere.
#[cube(launch_unchecked)]
fn pick_kernel<I: Int>(
    ins: &PickInputs<I>,
    out: &mut Tensor<f32>,
    n: u32,
    #[comptime] has_acc: bool,
    #[define(I)] _dtype: StorageType,
) {
    let row = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    let n = n as usize;
    if row < n {
        let mut logp = 0.0f32;
        let mut lse = 0.0f32;
        if comptime![has_acc] {
            logp = ins.acc[row];
            lse = ins.acc[n + row];
        }
        if ins.leaf_targets[row] >= I::from_int(0) {
            logp = ins.stats[2 * row];
            lse = ins.stats[2 * row + 1];
        }
        out[row] = logp;
        out[n + row] = lse;
    }
}

/// `out [N, 2] = (logp, lse)`: `logp = 0` for ignored rows, `pick_logp + (pick_lse − lse)` for
/// targets in `[0, V)`, NaN for any other target.
#[cube(launch_unchecked)]
fn finish_kernel<I: Int>(
    ins: &FinishInputs<I>,
    out: &mut Tensor<f32>,
    sc: FinishScalars,
    #[comptime] has_ignore: bool,
    #[define(I)] _dtype: StorageType,
) {
    let row = (CUBE_POS_Y as usize * CUBE_COUNT_X as usize + CUBE_POS_X as usize)
        * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    let n = sc.n as usize;
    if row < n {
        let t = ins.targets[row];
        let l = ins.lse[row];
        let mut ignored = false;
        if comptime![has_ignore] {
            ignored = t == sc.ignore.get::<I>();
        }
        let mut logp = sc.nan;
        if ignored {
            logp = 0.0f32;
        } else if t >= I::from_int(0) && (sc.vocab_unbounded == 1u32 || t < sc.vocab.get::<I>()) {
            logp = ins.picks[row] + (ins.picks[n + row] - l);
        }
        out[2 * row] = logp;
        out[2 * row + 1] = l;
    }
}

fn contiguous<R: Runtime>(
    arg: &'static str,
    t: &TensorBinding<R>,
    shape: &[usize],
    elem_size: usize,
    output: bool,
) -> Result<(), KernelError> {
    let view = if output {
        check_out_view(arg, t, shape.len(), elem_size)?
    } else {
        check_view(arg, t, shape.len(), elem_size)?
    };
    expect_shape(arg, &view, shape)?;
    let mut expected = 1;
    for d in (0..shape.len()).rev() {
        if shape[d] > 1 && view.stride(d) != expected {
            return Err(KernelError::Layout {
                arg,
                reason: format!("expected a contiguous view, got strides {:?}", view.strides),
            });
        }
        expected *= shape[d];
    }
    Ok(())
}

/// The grid over N rows: cubes along x up to the runtime's limit, then rows of them along y
/// (the kernels number cubes row-major and skip rows past N).
fn rows<R: Runtime>(client: &ComputeClient<R>, n: usize) -> Result<(CubeCount, u32), KernelError> {
    let n32 = crate::util::to_u32("targets", "N", n)?;
    let cubes = n.div_ceil(BLOCK).max(1);
    let max_x = client.properties().hardware.max_cube_count.0.max(1) as usize;
    let (gx, gy) = check_grid(client, "targets", cubes.min(max_x), cubes.div_ceil(max_x))?;
    Ok((CubeCount::Static(gx, gy, 1), n32))
}

/// An integer scalar of `targets`' dtype, saturated to its range.
fn int_scalar(value: i64, dtype: IndexDType) -> InputScalar {
    let value = match dtype {
        IndexDType::I32 => value.clamp(i32::MIN as i64, i32::MAX as i64),
        IndexDType::I64 => value,
    };
    InputScalar::new(value, dtype.storage())
}

/// `ignore_index` in `targets`' dtype, or `None` when no target of that dtype can equal it.
fn ignore_scalar(ignore_index: Option<i64>, dtype: IndexDType) -> Option<i64> {
    match (ignore_index, dtype) {
        (Some(x), IndexDType::I32) => i32::try_from(x).ok().map(i64::from),
        (x, _) => x,
    }
}

/// The leaf `[start, end)` of a tensor-parallel rank: `out[i] = targets[i] − start` where the
/// target lies in the leaf and is not `ignore_index`, `-1` where it is ignored, `-2` elsewhere.
/// `targets` and `out`: contiguous `[N]`, dtype `dtype`.
pub fn leaf_targets<R: Runtime>(
    client: &ComputeClient<R>,
    targets: &TensorBinding<R>,
    out: &TensorBinding<R>,
    dtype: StorageType,
    start: usize,
    end: usize,
    ignore_index: Option<i64>,
) -> Result<(), KernelError> {
    let it = IndexDType::from_storage("targets", dtype)?;
    let n = targets.shape.first().copied().unwrap_or(0);
    contiguous("targets", targets, &[n], it.size(), false)?;
    contiguous("out", out, &[n], it.size(), true)?;
    if n == 0 {
        return Ok(());
    }
    // A leaf beyond the dtype's range holds no target of that dtype: an empty range.
    let max = match it {
        IndexDType::I32 => i32::MAX as usize,
        IndexDType::I64 => i64::MAX as usize,
    };
    let (start, len) = if start > max {
        (max, 0)
    } else {
        (start, end.saturating_sub(start).min(max))
    };
    let ignore = ignore_scalar(ignore_index, it);
    let (count, n32) = rows(client, n)?;
    unsafe {
        leaf_targets_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(BLOCK as u32),
            raw_arg(targets),
            raw_arg(out),
            n32,
            LeafRangeLaunch::new(
                int_scalar(start as i64, it),
                int_scalar(len as i64, it),
                int_scalar(ignore.unwrap_or(0), it),
            ),
            ignore.is_some(),
            it.storage(),
        );
    }
    Ok(())
}

/// The checks of a merge over contiguous f32 operands `[lead.., N]`, and its launch grid (`None`
/// for N = 0: nothing to launch).
fn merge_grid<R: Runtime>(
    client: &ComputeClient<R>,
    [a, b, out]: [&TensorBinding<R>; 3],
    lead: &[usize],
) -> Result<Option<(CubeCount, u32)>, KernelError> {
    let n = a.shape.get(lead.len()).copied().unwrap_or(0);
    let shape = [lead, &[n]].concat();
    contiguous("a", a, &shape, 4, false)?;
    contiguous("b", b, &shape, 4, false)?;
    contiguous("out", out, &shape, 4, true)?;
    if n == 0 {
        return Ok(None);
    }
    rows(client, n).map(Some)
}

/// `out = a ⊕ b` element-wise over contiguous f32 `[N]` (see the module docs).
pub fn merge_lse<R: Runtime>(
    client: &ComputeClient<R>,
    a: &TensorBinding<R>,
    b: &TensorBinding<R>,
    out: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let Some((count, n32)) = merge_grid(client, [a, b, out], &[])? else {
        return Ok(());
    };
    unsafe {
        merge_lse_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(BLOCK as u32),
            raw_arg(a),
            raw_arg(b),
            raw_arg(out),
            n32,
            SoftmaxMath::of(client),
        );
    }
    Ok(())
}

/// `out = a ⊕ b` over contiguous f32 `[2, N]` `(lse, entropy)` pairs (see
/// `merge_entropy_kernel`).
pub fn merge_entropy<R: Runtime>(
    client: &ComputeClient<R>,
    a: &TensorBinding<R>,
    b: &TensorBinding<R>,
    out: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let Some((count, n32)) = merge_grid(client, [a, b, out], &[2])? else {
        return Ok(());
    };
    unsafe {
        merge_entropy_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(BLOCK as u32),
            raw_arg(a),
            raw_arg(b),
            raw_arg(out),
            n32,
            f32::NEG_INFINITY,
            SoftmaxMath::of(client),
        );
    }
    Ok(())
}

/// `out [2, N]` f32: the leaf's `(logp, lse)` from `stats [N, 2]` where `leaf_targets [N] ≥ 0`,
/// `acc [2, N]` (or 0) elsewhere. All contiguous.
pub fn pick<R: Runtime>(
    client: &ComputeClient<R>,
    acc: Option<&TensorBinding<R>>,
    stats: &TensorBinding<R>,
    leaf_targets: &TensorBinding<R>,
    targets_dtype: StorageType,
    out: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let it = IndexDType::from_storage("leaf_targets", targets_dtype)?;
    let n = leaf_targets.shape.first().copied().unwrap_or(0);
    contiguous("leaf_targets", leaf_targets, &[n], it.size(), false)?;
    contiguous("stats", stats, &[n, 2], 4, false)?;
    if let Some(acc) = acc {
        contiguous("acc", acc, &[2, n], 4, false)?;
    }
    contiguous("out", out, &[2, n], 4, true)?;
    if n == 0 {
        return Ok(());
    }
    let (count, n32) = rows(client, n)?;
    unsafe {
        pick_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(BLOCK as u32),
            PickInputsLaunch::new(
                raw_arg(acc.unwrap_or(stats)),
                raw_arg(stats),
                raw_arg(leaf_targets),
            ),
            raw_arg(out),
            n32,
            acc.is_some(),
            it.storage(),
        );
    }
    Ok(())
}

/// The global targets of [`finish`]: `[N]` integers over the vocabulary `[0, vocab)`, and the
/// ignore index.
pub struct GlobalTargets<'a, R: Runtime> {
    /// Contiguous `[N]`, dtype `dtype`.
    pub targets: &'a TensorBinding<R>,
    /// i32 or i64.
    pub dtype: StorageType,
    /// The global vocabulary size.
    pub vocab: usize,
    /// Rows whose target equals this give `logp = 0`.
    pub ignore_index: Option<i64>,
}

/// `out [N, 2] = (logp, lse)` from the owners' `picks [2, N]` (logp row, lse row), the global
/// `lse [N]` and the global targets. All contiguous.
pub fn finish<R: Runtime>(
    client: &ComputeClient<R>,
    picks: &TensorBinding<R>,
    lse: &TensorBinding<R>,
    global: &GlobalTargets<'_, R>,
    out: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let GlobalTargets {
        targets,
        dtype: targets_dtype,
        vocab,
        ignore_index,
    } = *global;
    let it = IndexDType::from_storage("targets", targets_dtype)?;
    let n = targets.shape.first().copied().unwrap_or(0);
    contiguous("targets", targets, &[n], it.size(), false)?;
    contiguous("picks", picks, &[2, n], 4, false)?;
    contiguous("lse", lse, &[n], 4, false)?;
    contiguous("out", out, &[n, 2], 4, true)?;
    if n == 0 {
        return Ok(());
    }
    let unbounded = match it {
        IndexDType::I32 => vocab > i32::MAX as usize,
        IndexDType::I64 => vocab > i64::MAX as usize,
    };
    let ignore = ignore_scalar(ignore_index, it);
    let (count, n32) = rows(client, n)?;
    unsafe {
        finish_kernel::launch_unchecked::<R>(
            client,
            count,
            CubeDim::new_1d(BLOCK as u32),
            FinishInputsLaunch::new(raw_arg(picks), raw_arg(lse), raw_arg(targets)),
            raw_arg(out),
            FinishScalarsLaunch::new(
                n32,
                int_scalar(vocab.min(i64::MAX as usize) as i64, it),
                unbounded as u32,
                int_scalar(ignore.unwrap_or(0), it),
                f32::NAN,
            ),
            ignore.is_some(),
            it.storage(),
        );
    }
    Ok(())
}
