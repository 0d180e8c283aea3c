//! `linear_logp` kernels: per-segment online-softmax partials, the segment merge, and the
//! backward `dz` tile.

use crate::consts::{
    FMA_MICRO, FMA_THREADS, LOGP_PARTIAL_STRIDE, LOGP_ROWS, LOGP_SEGMENT, LOGP_VOCAB_TILE,
};
use crate::gemm::fma::{Operand, SKIP_NONE, fma_block};
use cubecl::prelude::*;

/// Resolved target: `t` in `[0, v)` → `t`; `t == ignore` → -1; anything else → -2.
/// The comparisons happen in the target's own integer type, so i64 targets outside the i32
/// range can never alias a valid column.
#[cube]
pub(crate) fn resolve_target<I: Int>(t: I, v: u32, ignore: I, #[comptime] has_ignore: bool) -> i32 {
    let mut res = i32::from_int(-2);
    let mut ign = false;
    if comptime![has_ignore] {
        ign = t == ignore;
    }
    if ign {
        res = i32::from_int(-1);
    } else if t >= I::from_int(0) && t < I::cast_from(v) {
        res = i32::cast_from(t);
    }
    res
}

/// Compute the logits block `z[row0.., col0..]` (64×64, f32, bias added) into the caller's
/// 4×4 micro-tile. Same arithmetic in forward and backward, so both see bitwise equal logits.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn logits_block<F: Float>(
    hidden: &Tensor<F>,
    ho: &Operand,
    weight: &Tensor<F>,
    wo: &Operand,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    m: usize,
    d: usize,
    n: usize,
    row0: usize,
    col0: usize,
    acc: &mut Array<f32>,
    #[comptime] has_bias: bool,
    #[comptime] emulate_fma: bool,
) {
    #[unroll]
    for i in 0..(FMA_MICRO * FMA_MICRO) {
        acc[i] = 0.0f32;
    }
    fma_block::<F, F>(
        hidden,
        ho,
        weight,
        wo,
        m,
        d,
        n,
        row0,
        col0,
        acc,
        SKIP_NONE,
        emulate_fma,
    );
    if comptime![has_bias] {
        let tx = UNIT_POS_X as usize;
        #[unroll]
        for c in 0..FMA_MICRO {
            let col = col0 + tx + c * FMA_THREADS;
            if col < n {
                let b = f32::cast_from(bias[bias_off as usize + col * bias_stride as usize]);
                #[unroll]
                for r in 0..FMA_MICRO {
                    acc[r * FMA_MICRO + c] += b;
                }
            }
        }
    }
}

/// Forward pass 1: cube (row block, vocab segment) walks the segment's vocab tiles in ascending
/// order with an online softmax per row and writes `(max, sum-exp, target logit)` partials.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn logp_partial_kernel<F: Float, I: Int>(
    hidden: &Tensor<F>,
    ho: Operand,
    weight: &Tensor<F>,
    wo: Operand,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    targets: &Tensor<I>,
    t_off: u32,
    t_stride: u32,
    partial: &mut Tensor<f32>,
    n_rows: u32,
    d: u32,
    v: u32,
    ignore: InputScalar,
    neg_inf: f32,
    #[comptime] has_bias: bool,
    #[comptime] has_ignore: bool,
    #[comptime] emulate_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let n = n_rows as usize;
    let dd = d as usize;
    let vv = v as usize;
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let tid = ty * FMA_THREADS + tx;
    let row0 = CUBE_POS_X as usize * LOGP_ROWS;
    let seg = CUBE_POS_Y as usize;
    let seg_start = seg * LOGP_SEGMENT;
    let seg_end = min(vv, seg_start + LOGP_SEGMENT);

    let mut z_s = SharedMemory::<f32>::new(LOGP_ROWS * LOGP_VOCAB_TILE);

    let my_row = row0 + tid;
    let row_ok = tid < LOGP_ROWS && my_row < n;
    let mut tgt = i32::from_int(-2);
    if row_ok {
        tgt = resolve_target::<I>(
            targets[t_off as usize + my_row * t_stride as usize],
            v,
            ignore.get::<I>(),
            has_ignore,
        );
    }
    let has_tgt = tgt >= 0;
    let tgt_u = usize::cast_from(select(has_tgt, tgt, 0i32));

    let mut run_m = neg_inf;
    let mut run_s = 0.0f32;
    let mut t_logit = 0.0f32;

    let mut acc = Array::<f32>::new(FMA_MICRO * FMA_MICRO);
    let num_tiles = (seg_end - seg_start).div_ceil(LOGP_VOCAB_TILE);
    for t in 0..num_tiles {
        let j0 = seg_start + t * LOGP_VOCAB_TILE;
        logits_block::<F>(
            hidden,
            &ho,
            weight,
            &wo,
            bias,
            bias_off,
            bias_stride,
            n,
            dd,
            seg_end,
            row0,
            j0,
            &mut acc,
            has_bias,
            emulate_fma,
        );
        #[unroll]
        for r in 0..FMA_MICRO {
            #[unroll]
            for c in 0..FMA_MICRO {
                z_s[(ty + r * FMA_THREADS) * LOGP_VOCAB_TILE + tx + c * FMA_THREADS] =
                    acc[r * FMA_MICRO + c];
            }
        }
        sync_cube();
        if row_ok {
            let ncols = min(LOGP_VOCAB_TILE, seg_end - j0);
            let base = tid * LOGP_VOCAB_TILE;
            let mut tmax = neg_inf;
            for c in 0..ncols {
                let z = z_s[base + c];
                tmax = select(z > tmax, z, tmax);
            }
            if tmax > run_m {
                run_s *= f32::exp(run_m - tmax);
                run_m = tmax;
            }
            for c in 0..ncols {
                let z = z_s[base + c];
                run_s += select(z == neg_inf, 0.0f32, f32::exp(z - run_m));
            }
            if has_tgt && tgt_u >= j0 && tgt_u < j0 + ncols {
                t_logit = z_s[base + tgt_u - j0];
            }
        }
        sync_cube();
    }
    if row_ok {
        let o = (seg * n + my_row) * LOGP_PARTIAL_STRIDE;
        partial[o] = run_m;
        partial[o + 1] = run_s;
        partial[o + 2] = t_logit;
    }
}

/// Forward pass 2: one unit per row merges the segment partials in ascending segment order and
/// writes `stats[row] = (logp, lse)`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn logp_merge_kernel<I: Int>(
    partial: &Tensor<f32>,
    targets: &Tensor<I>,
    t_off: u32,
    t_stride: u32,
    stats: &mut Tensor<f32>,
    so: Operand,
    n_rows: u32,
    v: u32,
    num_seg: u32,
    ignore: InputScalar,
    neg_inf: f32,
    nan: f32,
    #[comptime] has_ignore: bool,
    #[define(I)] _dtype: StorageType,
) {
    let n = n_rows as usize;
    let row = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if row < n {
        let mut m = neg_inf;
        let mut s = 0.0f32;
        for seg in 0..num_seg as usize {
            let o = (seg * n + row) * LOGP_PARTIAL_STRIDE;
            let mi = partial[o];
            let si = partial[o + 1];
            let m_new = select(mi > m, mi, m);
            let sa = select(s == 0.0f32, 0.0f32, s * f32::exp(m - m_new));
            let sb = select(si == 0.0f32, 0.0f32, si * f32::exp(mi - m_new));
            s = sa + sb;
            m = m_new;
        }
        let lse = m + f32::ln(s);
        let tgt = resolve_target::<I>(
            targets[t_off as usize + row * t_stride as usize],
            v,
            ignore.get::<I>(),
            has_ignore,
        );
        let mut logp = nan;
        if tgt == -1i32 {
            logp = 0.0f32;
        } else if tgt >= 0i32 {
            let seg_t = usize::cast_from(tgt) / LOGP_SEGMENT;
            let tl = partial[(seg_t * n + row) * LOGP_PARTIAL_STRIDE + 2];
            logp = tl - lse;
        }
        let base = so.offset as usize + row * so.s0 as usize;
        stats[base] = logp;
        stats[base + so.s1 as usize] = lse;
    }
}

/// Backward: recompute the logits block and write
/// `dz = g_logp·(1[j==t] − p) + g_lse·p`, `p = exp(z − lse)`, into the f32 scratch.
/// Ignored rows drop the `g_logp` part. Rows whose two upstream gradients are both zero get
/// `dz = 0` exactly (so they contribute nothing, even if their logits are NaN/Inf).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn logp_dz_kernel<F: Float, I: Int>(
    hidden: &Tensor<F>,
    ho: Operand,
    weight: &Tensor<F>,
    wo: Operand,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    targets: &Tensor<I>,
    t_off: u32,
    t_stride: u32,
    stats: &Tensor<f32>,
    so: Operand,
    grad: &Tensor<f32>,
    go: Operand,
    dz: &mut Tensor<f32>,
    dz_stride: u32,
    row_start: u32,
    rows_here: u32,
    col_start: u32,
    cols_here: u32,
    d: u32,
    v: u32,
    ignore: InputScalar,
    #[comptime] has_bias: bool,
    #[comptime] has_ignore: bool,
    #[comptime] emulate_fma: bool,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let rs = row_start as usize;
    let cs = col_start as usize;
    let m_end = rs + rows_here as usize;
    let n_end = cs + cols_here as usize;
    let row0 = rs + CUBE_POS_X as usize * LOGP_ROWS;
    let col0 = cs + CUBE_POS_Y as usize * LOGP_VOCAB_TILE;

    let mut acc = Array::<f32>::new(FMA_MICRO * FMA_MICRO);
    logits_block::<F>(
        hidden,
        &ho,
        weight,
        &wo,
        bias,
        bias_off,
        bias_stride,
        m_end,
        d as usize,
        n_end,
        row0,
        col0,
        &mut acc,
        has_bias,
        emulate_fma,
    );

    #[unroll]
    for r in 0..FMA_MICRO {
        let row = row0 + ty + r * FMA_THREADS;
        if row < m_end {
            let lse = stats[so.offset as usize + row * so.s0 as usize + so.s1 as usize];
            let gbase = go.offset as usize + row * go.s0 as usize;
            let g_logp = grad[gbase];
            let g_lse = grad[gbase + go.s1 as usize];
            let tgt = resolve_target::<I>(
                targets[t_off as usize + row * t_stride as usize],
                v,
                ignore.get::<I>(),
                has_ignore,
            );
            let gl = select(tgt == -1i32, 0.0f32, g_logp);
            let zero_row = gl == 0.0f32 && g_lse == 0.0f32;
            let has_tgt = tgt >= 0i32;
            let tgt_u = usize::cast_from(select(has_tgt, tgt, 0i32));
            #[unroll]
            for c in 0..FMA_MICRO {
                let col = col0 + tx + c * FMA_THREADS;
                if col < n_end {
                    let z = acc[r * FMA_MICRO + c];
                    let p = f32::exp(z - lse);
                    let ind = select(has_tgt && col == tgt_u, 1.0f32, 0.0f32);
                    let val = gl * (ind - p) + g_lse * p;
                    dz[(row - rs) * dz_stride as usize + (col - cs)] =
                        select(zero_row, 0.0f32, val);
                }
            }
        }
    }
}
