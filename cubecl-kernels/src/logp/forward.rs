//! The forward: per (row block, vocabulary segment) online-softmax partials, then their merge
//! in ascending segment order.

use super::candidates::{
    Candidates, PickCfg, PickScalars, PickScalarsLaunch, empty_candidates, no_pick, noise_bar,
    offer_logit, store_candidates,
};
use super::inputs::{
    Checked, LogpInputRefs, check_inputs, check_workspace, ignore_scalar, linear,
    linear_logp_forward_workspace_len, linear_logp_num_segments, targets, tensor_core_choice, view,
};
use super::logits::{
    Linear, LogpCfg, SoftmaxMath, StatsCfg, Targets, accumulate, combine_partials, finish_softmax,
    logits_block, rescale, resolve_target, stage_logits,
};
use super::noise::row_word;
use super::tc_forward::tc_forward_partials;
use super::workspace::partials_len;
use crate::attention::math::neg_inf;
use crate::consts::{
    FMA_MICRO, FMA_THREADS, LOGP_FWD_SEGMENT, LOGP_PARTIAL_STRIDE, LOGP_ROWS, LOGP_VOCAB_TILE,
};
use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::gemm::view::{MatArg, MatArgLaunch};
use crate::util::{View, check_grid, check_out_view, expect_shape, raw_arg, to_u32};
use cubecl::prelude::*;

/// Forward: `stats_out[i] = (logp_i, lse_i)`, and `entropy_i` with [`LogpInputRefs::entropy`]
/// (f32 `[N, 2 or 3]`, any strides).
///
/// `z_ij = ((Σ_d fma-chain over d ascending of f32(hidden[i,d])·f32(weight[j,d])) + f32(bias[j]))
/// · inv_temperature` in f32 — the FMA GEMM of `hidden · weightᵀ (+ bias)`, then one product.
/// `lse_i = logsumexp_j z_ij`, `logp_i = z[i, t_i] − lse_i`,
/// `entropy_i = −Σ_j p_ij·ln p_ij = ln(s) − u/s` from the running `s = Σ exp(z − m)` and
/// `u = Σ exp(z − m)·(z − m)`. Ignored rows: `logp = 0` and `entropy = 0`, `lse` normal. A target
/// outside `[0, V)` that is not the ignore index gives `logp = NaN` (never an out-of-bounds
/// access).
///
/// Order: the vocabulary is cut into `ceil(V / LOGP_FWD_SEGMENT)` fixed segments; within a segment a
/// cube walks 64-wide vocab tiles in ascending order with an online softmax (running max, running
/// sum of `exp(z − max)`, target logit, with entropy the running `Σ exp(z − max)·(z − max)`, all
/// f32; the running sums are rescaled only when the max grows); the segment partials (workspace of
/// [`linear_logp_forward_workspace_len`] f32) are merged in ascending segment order by a second
/// kernel: `m' = max(m, m_s)`, `s' = s·exp(m − m') + s_s·exp(m_s − m')`, `lse = m + ln(s)`.
/// `exp` and `ln` are the runtime's on CUDA and HIP, the portable `exp_p` / `ln_p` elsewhere (a
/// Vulkan driver's are error bounds that it may fold into the code around them per kernel).
/// Nothing depends on N or on the device's core count.
///
/// Where [`crate::linear_logp_tensor_cores`] holds (f16/bf16 with the cmma GEMM), the logits come
/// from the cmma GEMM (f32, 16-deep MMA steps in ascending d, bias added in f32) chunk by chunk
/// into the workspace, and each (row, segment) partial from a scan in a fixed order (see
/// `tc_forward.rs`); the merge is the same.
pub fn linear_logp_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    stats_out: &TensorBinding<R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let sv = check_out_view("stats_out", stats_out, 2, 4)?;
    expect_shape("stats_out", &sv, &[c.n, c.cols])?;
    let ws_len = linear_logp_forward_workspace_len(c.n, c.v, inputs.dtype);
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;
    if c.n == 0 {
        return Ok(());
    }
    let num_seg = linear_logp_num_segments(c.v);
    match tensor_core_choice(client, &c) {
        Some(choice) => tc_forward_partials(
            client,
            inputs,
            &c,
            &choice,
            workspace,
            partials_len(c.n, c.v),
            None,
        )?,
        None => launch_fma_partials(client, inputs, &c, workspace, PickCfg::NONE, no_pick())?,
    }
    launch_merge(client, inputs, &c, stats_out, &sv, workspace, num_seg)
}

/// The FMA path's segment partials: logits by the fma chain, reduced tile by tile; with
/// `pick.k > 0` also each (row, segment)'s candidates (the sampler, `targets` holding its keys).
pub(crate) fn launch_fma_partials<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    workspace: &TensorBinding<R>,
    pick: PickCfg,
    pick_scalars: PickScalarsLaunch<R>,
) -> Result<(), KernelError> {
    let num_seg = linear_logp_num_segments(c.v);
    let f = c.dt.storage();
    let i = c.it.storage();
    let (bias_buf, bias_stride) = match (inputs.bias, &c.bv) {
        (Some(b), Some(bv)) => (b, bv.stride(0)),
        _ => (inputs.weight, 0),
    };
    if num_seg > 0 {
        let (gx, gy) = check_grid(client, "hidden", c.n.div_ceil(LOGP_ROWS), num_seg)?;
        unsafe {
            logp_partial_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, gy, 1),
                CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
                linear(inputs, c, bias_buf, bias_stride),
                targets(inputs, c),
                raw_arg(workspace),
                PartialScalarsLaunch::new(
                    c.n as u32,
                    c.d as u32,
                    c.v as u32,
                    ignore_scalar(c),
                    c.inv_t,
                    f32::NEG_INFINITY,
                ),
                pick_scalars,
                LogpCfg {
                    has_bias: inputs.bias.is_some(),
                    has_ignore: c.ignore.is_some(),
                    entropy: c.entropy,
                    emulate_fma: fma_mode(client) == FmaMode::Emulated,
                    math: SoftmaxMath::of(client),
                },
                pick,
                [f, i],
            );
        }
    }
    Ok(())
}

/// The merge of the segment partials into `stats_out`, one unit per row.
fn launch_merge<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    stats_out: &TensorBinding<R>,
    sv: &View,
    workspace: &TensorBinding<R>,
    num_seg: usize,
) -> Result<(), KernelError> {
    let block = 256usize;
    let (gx, _) = check_grid(client, "hidden", c.n.div_ceil(block), 1)?;
    unsafe {
        logp_merge_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(block as u32),
            raw_arg(workspace),
            targets(inputs, c),
            MatArgLaunch::new(raw_arg(stats_out), view(sv.stride(0), sv.stride(1), 0)),
            MergeScalarsLaunch::new(
                c.n as u32,
                c.v as u32,
                num_seg as u32,
                ignore_scalar(c),
                f32::NAN,
            ),
            StatsCfg {
                has_ignore: c.ignore.is_some(),
                entropy: c.entropy,
                math: SoftmaxMath::of(client),
            },
            c.it.storage(),
        );
    }
    Ok(())
}

/// The partial kernel's scalars: rows, `d`, `v`, the ignore index, `1 / temperature`, `−∞`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct PartialScalars {
    pub n_rows: u32,
    pub d: u32,
    pub v: u32,
    pub ignore: InputScalar,
    pub inv_t: f32,
    pub neg_inf: f32,
}

/// The merge kernel's scalars: rows, `v`, segments, the ignore index, NaN.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct MergeScalars {
    pub n_rows: u32,
    pub v: u32,
    pub num_seg: u32,
    pub ignore: InputScalar,
    pub nan: f32,
}

/// Forward pass 1: cube (row block, vocab segment) walks the segment's vocab tiles in ascending
/// order with an online softmax per row and writes `(max, sum-exp, target logit)` partials.
#[cube(launch_unchecked)]
pub(crate) fn logp_partial_kernel<F: Float, I: Int>(
    lin: &Linear<F>,
    targets: &Targets<I>,
    partial: &mut Tensor<f32>,
    sc: PartialScalars,
    pk: PickScalars,
    #[comptime] cfg: LogpCfg,
    #[comptime] pick: PickCfg,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (has_bias, has_ignore, entropy, emulate_fma) = (
        comptime![cfg.has_bias],
        comptime![cfg.has_ignore],
        comptime![cfg.entropy],
        comptime![cfg.emulate_fma],
    );
    let (v, inv_t, neg_inf) = (sc.v, sc.inv_t, sc.neg_inf);
    let n = sc.n_rows as usize;
    let dd = sc.d as usize;
    let vv = v as usize;
    let tid = UNIT_POS_Y as usize * FMA_THREADS + UNIT_POS_X as usize;
    let row0 = CUBE_POS_X as usize * LOGP_ROWS;
    let seg = CUBE_POS_Y as usize;
    let seg_start = seg * LOGP_FWD_SEGMENT;
    let seg_end = min(vv, seg_start + LOGP_FWD_SEGMENT);

    let mut z_s = SharedMemory::<f32>::new(LOGP_ROWS * LOGP_VOCAB_TILE);

    let my_row = row0 + tid;
    let row_ok = tid < LOGP_ROWS && my_row < n;
    let mut tgt = i32::from_int(-2);
    let mut row_w = 0u32;
    if row_ok {
        let t = targets.buf[targets.offset as usize + my_row * targets.stride as usize];
        if comptime![pick.k == 0] {
            tgt = resolve_target::<I>(t, v, sc.ignore.get::<I>(), has_ignore);
        } else {
            row_w = row_word(pk.seed_lo, pk.seed_hi, u32::cast_from(t));
        }
    }
    let mut list = empty_candidates(comptime![pick.slots()]);
    let has_tgt = tgt >= 0;
    let tgt_u = usize::cast_from(select(has_tgt, tgt, 0i32));

    let mut run_m = neg_inf;
    let mut run_s = 0.0f32;
    let mut run_u = 0.0f32;
    let mut t_logit = 0.0f32;

    let mut acc = Array::<f32>::new(FMA_MICRO * FMA_MICRO);
    let num_tiles = (seg_end - seg_start).div_ceil(LOGP_VOCAB_TILE);
    for t in 0..num_tiles {
        let j0 = seg_start + t * LOGP_VOCAB_TILE;
        logits_block::<F>(
            &lin.hidden.buf,
            &lin.hidden.view,
            &lin.weight.buf,
            &lin.weight.view,
            &lin.bias.buf,
            lin.bias.offset,
            lin.bias.stride,
            n,
            dd,
            seg_end,
            row0,
            j0,
            &mut acc,
            has_bias,
            emulate_fma,
        );
        stage_logits(&acc, inv_t, &mut z_s);
        sync_cube();
        if row_ok {
            let ncols = min(LOGP_VOCAB_TILE, seg_end - j0);
            let base = tid * LOGP_VOCAB_TILE;
            online_softmax(
                &z_s, base, ncols, neg_inf, &mut run_m, &mut run_s, &mut run_u, entropy, cfg.math,
            );
            if has_tgt && tgt_u >= j0 && tgt_u < j0 + ncols {
                t_logit = z_s[base + tgt_u - j0];
            }
            let tile = TileRow { base, ncols, j0 };
            offer_tile(&mut list, &z_s, tile, row_w, run_m, pick);
        }
        sync_cube();
    }
    if row_ok {
        let o = (seg * n + my_row) * LOGP_PARTIAL_STRIDE;
        partial[o] = run_m;
        partial[o + 1] = run_s;
        partial[o + 2] = t_logit;
        if comptime![entropy] {
            partial[o + 3] = run_u;
        }
        if comptime![pick.k > 0] {
            store_candidates(partial, pk.cand_off, seg * n + my_row, &list, pick.k);
        }
    }
}

/// A row's logits in a staged tile: `ncols` of them at `base` in shared memory, the first being
/// vocabulary column `j0`.
#[derive(CubeType)]
struct TileRow {
    base: usize,
    ncols: usize,
    j0: usize,
}

/// The sampler's candidates of one tile of a row (nothing without a sampler); `run_m` is the
/// row's running max, which already holds this tile's.
#[cube]
fn offer_tile(
    list: &mut Candidates,
    z_s: &SharedMemory<f32>,
    tile: TileRow,
    row_w: u32,
    run_m: f32,
    #[comptime] pick: PickCfg,
) {
    if comptime![pick.k > 0] {
        let bar = noise_bar(run_m);
        for cc in 0..tile.ncols {
            let j = (tile.j0 + cc) as u32;
            offer_logit(list, z_s[tile.base + cc], j, row_w, bar, pick);
        }
    }
}

/// One tile of a row's online softmax (the row's `ncols` logits at `base` in `z_s`): raise the
/// running max to the tile's, rescaling the running sums only when it grows, then add the tile's
/// logits in ascending order (`−∞` logits add exactly nothing).
#[cube]
#[allow(clippy::too_many_arguments)] // the running state, one argument each
fn online_softmax(
    z_s: &SharedMemory<f32>,
    base: usize,
    ncols: usize,
    neg_inf: f32,
    run_m: &mut f32,
    run_s: &mut f32,
    run_u: &mut f32,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) {
    let mut tmax = neg_inf;
    for c in 0..ncols {
        let z = z_s[base + c];
        tmax = select(z > tmax, z, tmax);
    }
    rescale(run_m, run_s, run_u, tmax, entropy, math);
    let m = *run_m;
    for c in 0..ncols {
        accumulate(z_s[base + c], m, neg_inf, run_s, run_u, entropy, math);
    }
}

/// Row `row`'s segment partials merged in ascending segment order: `(lse, entropy)`.
#[cube]
pub(crate) fn merge_segments(
    partial: &Tensor<f32>,
    n: usize,
    row: usize,
    num_seg: usize,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) -> (f32, f32) {
    let mut m = neg_inf();
    let mut s = 0.0f32;
    let mut u = 0.0f32;
    for seg in 0..num_seg {
        let o = (seg * n + row) * LOGP_PARTIAL_STRIDE;
        let mut ui = 0.0f32;
        if comptime![entropy] {
            ui = partial[o + 3];
        }
        let (m_new, s_new, u_new) =
            combine_partials(m, s, u, partial[o], partial[o + 1], ui, entropy, math);
        m = m_new;
        s = s_new;
        u = u_new;
    }
    finish_softmax(m, s, u, math)
}

/// Forward pass 2: one unit per row merges the segment partials in ascending segment order and
/// writes `stats[row] = (logp, lse[, entropy])`.
#[cube(launch_unchecked)]
pub(crate) fn logp_merge_kernel<I: Int>(
    partial: &Tensor<f32>,
    targets: &Targets<I>,
    stats: &mut MatArg<f32>,
    sc: MergeScalars,
    #[comptime] cfg: StatsCfg,
    #[define(I)] _dtype: StorageType,
) {
    let (has_ignore, entropy) = (comptime![cfg.has_ignore], comptime![cfg.entropy]);
    let (v, nan) = (sc.v, sc.nan);
    let n = sc.n_rows as usize;
    let row = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if row < n {
        let (lse, ent) = merge_segments(partial, n, row, sc.num_seg as usize, entropy, cfg.math);
        let tgt = resolve_target::<I>(
            targets.buf[targets.offset as usize + row * targets.stride as usize],
            v,
            sc.ignore.get::<I>(),
            has_ignore,
        );
        let mut logp = nan;
        if tgt == -1i32 {
            logp = 0.0f32;
        } else if tgt >= 0i32 {
            let seg_t = usize::cast_from(tgt) / LOGP_FWD_SEGMENT;
            let tl = partial[(seg_t * n + row) * LOGP_PARTIAL_STRIDE + 2];
            logp = tl - lse;
        }
        let base = stats.view.offset as usize + row * stats.view.s0 as usize;
        stats.buf[base] = logp;
        stats.buf[base + stats.view.s1 as usize] = lse;
        if comptime![entropy] {
            stats.buf[base + 2 * stats.view.s1 as usize] = select(tgt == -1i32, 0.0f32, ent);
        }
    }
}
