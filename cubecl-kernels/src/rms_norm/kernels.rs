//! The `rms_norm` kernels. Each mirrors the Reference (`src/ops/rms_norm/oracle.rs`) operation
//! for operation: every product that feeds a sum is an explicit [`fma_f32`], sums start at +0.0,
//! and values are upcast to f32 on load and rounded once on store.

use crate::consts::{
    RMS_NORM_BATCH, RMS_NORM_COL_TILE, RMS_NORM_LANES, RMS_NORM_ROW_BATCH, RMS_NORM_ROW_BLOCK,
};
use crate::gemm::fma::fma_f32;
use crate::gemm::view::StridedView;
use cubecl::prelude::*;

/// Levels of the lane tree (`log2(RMS_NORM_LANES)`).
const TREE_LEVELS: usize = RMS_NORM_LANES.trailing_zeros() as usize;

/// `lane[t] += lane[t + s]` for `s = 128, …, 1` over the cube's lanes, for two sums at once;
/// returns lane 0 of each. Every unit of the cube must call it.
#[cube]
fn lane_tree(a: f32, b: f32, #[comptime] two: bool) -> (f32, f32) {
    let t = UNIT_POS_X as usize;
    let mut a_s = SharedMemory::<f32>::new(RMS_NORM_LANES);
    let mut b_s = SharedMemory::<f32>::new(RMS_NORM_LANES);
    a_s[t] = a;
    if comptime![two] {
        b_s[t] = b;
    }
    sync_cube();
    #[unroll]
    for level in 0..TREE_LEVELS {
        let s = RMS_NORM_LANES >> (level + 1);
        if t < s {
            a_s[t] += a_s[t + s];
            if comptime![two] {
                b_s[t] += b_s[t + s];
            }
        }
        sync_cube();
    }
    let mut b0 = 0.0f32;
    if comptime![two] {
        b0 = b_s[0];
    }
    (a_s[0], b0)
}

/// `1 / sqrt(ss / D + eps)`.
#[cube]
fn inv_rms(ss: f32, d_f: f32, eps: f32) -> f32 {
    1.0f32 / f32::sqrt(ss / d_f + eps)
}

/// `y[row, :] = (x·r)·gamma` with `r = 1 / sqrt(Σ x² / D + eps)`: one cube of
/// `RMS_NORM_LANES` units per row (row = `CUBE_POS_X`, from the views' offsets).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn rms_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    xo: StridedView,
    gamma: &Tensor<F>,
    g_off: u32,
    g_stride: u32,
    out: &mut Tensor<F>,
    oo: StridedView,
    d: u32,
    d_f: f32,
    eps: f32,
    #[comptime] emulate_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unroll = comptime!(!emulate_fma);
    let t = UNIT_POS_X as usize;
    let row = CUBE_POS_X as usize;
    let d = d as usize;
    let xb = xo.offset as usize + row * xo.s0 as usize;
    let xs = xo.s1 as usize;
    let step = RMS_NORM_LANES * RMS_NORM_BATCH;
    let mut lane = 0.0f32;
    for b in 0..d.div_ceil(step) {
        let mut v = Array::<f32>::new(RMS_NORM_BATCH);
        #[unroll]
        for j in 0..RMS_NORM_BATCH {
            let i = b * step + j * RMS_NORM_LANES + t;
            let mut e = 0.0f32;
            if i < d {
                e = f32::cast_from(x[xb + i * xs]);
            }
            v[j] = e;
        }
        #[unroll(unroll)]
        for j in 0..RMS_NORM_BATCH {
            if b * step + j * RMS_NORM_LANES + t < d {
                lane = fma_f32(v[j], v[j], lane, emulate_fma);
            }
        }
    }
    let (ss, _) = lane_tree(lane, 0.0f32, false);
    let r = inv_rms(ss, d_f, eps);
    let ob = oo.offset as usize + row * oo.s0 as usize;
    let os = oo.s1 as usize;
    let mut i = t;
    while i < d {
        let xv = f32::cast_from(x[xb + i * xs]);
        let gv = f32::cast_from(gamma[g_off as usize + i * g_stride as usize]);
        out[ob + i * os] = F::cast_from((xv * r) * gv);
        i += RMS_NORM_LANES;
    }
}

/// Per row of the chunk (row = `CUBE_POS_X`): `r = 1 / sqrt(Σ x² / D + eps)` and
/// `c = ((r·r)·r)·Σ (dy·gamma)·x / D`, into `ws[r_off + row]` and `ws[c_off + row]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn rms_norm_stats_kernel<F: Float>(
    x: &Tensor<F>,
    xo: StridedView,
    dy: &Tensor<F>,
    dyo: StridedView,
    gamma: &Tensor<F>,
    g_off: u32,
    g_stride: u32,
    ws: &mut Tensor<f32>,
    r_off: u32,
    c_off: u32,
    d: u32,
    d_f: f32,
    eps: f32,
    #[comptime] emulate_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unroll = comptime!(!emulate_fma);
    let t = UNIT_POS_X as usize;
    let row = CUBE_POS_X as usize;
    let d = d as usize;
    let xb = xo.offset as usize + row * xo.s0 as usize;
    let xs = xo.s1 as usize;
    let db = dyo.offset as usize + row * dyo.s0 as usize;
    let ds = dyo.s1 as usize;
    let step = RMS_NORM_LANES * RMS_NORM_BATCH;
    let mut ss_lane = 0.0f32;
    let mut dot_lane = 0.0f32;
    for b in 0..d.div_ceil(step) {
        let mut xv = Array::<f32>::new(RMS_NORM_BATCH);
        let mut gv = Array::<f32>::new(RMS_NORM_BATCH);
        #[unroll]
        for j in 0..RMS_NORM_BATCH {
            let i = b * step + j * RMS_NORM_LANES + t;
            let mut xe = 0.0f32;
            let mut ge = 0.0f32;
            if i < d {
                xe = f32::cast_from(x[xb + i * xs]);
                let dye = f32::cast_from(dy[db + i * ds]);
                ge = dye * f32::cast_from(gamma[g_off as usize + i * g_stride as usize]);
            }
            xv[j] = xe;
            gv[j] = ge;
        }
        #[unroll(unroll)]
        for j in 0..RMS_NORM_BATCH {
            if b * step + j * RMS_NORM_LANES + t < d {
                ss_lane = fma_f32(xv[j], xv[j], ss_lane, emulate_fma);
                dot_lane = fma_f32(gv[j], xv[j], dot_lane, emulate_fma);
            }
        }
    }
    let (ss, dot) = lane_tree(ss_lane, dot_lane, true);
    if t == 0 {
        let r = inv_rms(ss, d_f, eps);
        ws[r_off as usize + row] = r;
        ws[c_off as usize + row] = ((r * r) * r) * dot / d_f;
    }
}

/// For one (row block = `CUBE_POS_Y`, column tile = `CUBE_POS_X`) of the chunk, one unit per
/// column: `dx = fma(-x, c, r·(dy·gamma))` for every row of the block, and the block's `dGamma`
/// partial `fma(dy, x·r, part)` over its rows ascending (rows with `dy == 0` skipped) into
/// `ws[part_off + block·part_stride + col]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn rms_norm_grad_kernel<F: Float>(
    x: &Tensor<F>,
    xo: StridedView,
    dy: &Tensor<F>,
    dyo: StridedView,
    gamma: &Tensor<F>,
    g_off: u32,
    g_stride: u32,
    dx: &mut Tensor<F>,
    dxo: StridedView,
    ws: &mut Tensor<f32>,
    r_off: u32,
    c_off: u32,
    part_off: u32,
    part_stride: u32,
    rows: u32,
    cols: u32,
    #[comptime] emulate_fma: bool,
    #[define(F)] _dtype: StorageType,
) {
    let unroll = comptime!(!emulate_fma);
    let col = CUBE_POS_X as usize * RMS_NORM_COL_TILE + UNIT_POS_X as usize;
    let block = CUBE_POS_Y as usize;
    let row0 = block * RMS_NORM_ROW_BLOCK;
    let end = min(rows as usize, row0 + RMS_NORM_ROW_BLOCK);
    if col < cols as usize {
        let gam = f32::cast_from(gamma[g_off as usize + col * g_stride as usize]);
        let xb = xo.offset as usize + col * xo.s1 as usize;
        let xs = xo.s0 as usize;
        let db = dyo.offset as usize + col * dyo.s1 as usize;
        let ds = dyo.s0 as usize;
        let ob = dxo.offset as usize + col * dxo.s1 as usize;
        let os = dxo.s0 as usize;
        let mut part = 0.0f32;
        for b in 0..(end - row0).div_ceil(RMS_NORM_ROW_BATCH) {
            let first = row0 + b * RMS_NORM_ROW_BATCH;
            let mut xv = Array::<f32>::new(RMS_NORM_ROW_BATCH);
            let mut dv = Array::<f32>::new(RMS_NORM_ROW_BATCH);
            let mut rv = Array::<f32>::new(RMS_NORM_ROW_BATCH);
            let mut cv = Array::<f32>::new(RMS_NORM_ROW_BATCH);
            #[unroll]
            for j in 0..RMS_NORM_ROW_BATCH {
                let row = first + j;
                let mut xe = 0.0f32;
                let mut de = 0.0f32;
                let mut re = 0.0f32;
                let mut ce = 0.0f32;
                if row < end {
                    xe = f32::cast_from(x[xb + row * xs]);
                    de = f32::cast_from(dy[db + row * ds]);
                    re = ws[r_off as usize + row];
                    ce = ws[c_off as usize + row];
                }
                xv[j] = xe;
                dv[j] = de;
                rv[j] = re;
                cv[j] = ce;
            }
            #[unroll(unroll)]
            for j in 0..RMS_NORM_ROW_BATCH {
                let row = first + j;
                if row < end {
                    let (xe, de, re) = (xv[j], dv[j], rv[j]);
                    let g = de * gam;
                    dx[ob + row * os] = F::cast_from(fma_f32(-xe, cv[j], re * g, emulate_fma));
                    if de != 0.0f32 {
                        part = fma_f32(de, xe * re, part, emulate_fma);
                    }
                }
            }
        }
        ws[part_off as usize + block * part_stride as usize + col] = part;
    }
}

/// `dGamma[col] = Σ_blocks partial[block, col]` in ascending block order from +0.0, partials equal
/// to zero skipped, one rounding; one unit per column (`RMS_NORM_LANES` per cube). With no
/// blocks, `+0.0`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn rms_norm_dgamma_kernel<F: Float>(
    ws: &Tensor<f32>,
    part_off: u32,
    part_stride: u32,
    blocks: u32,
    out: &mut Tensor<F>,
    o_off: u32,
    o_stride: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let col = CUBE_POS_X as usize * RMS_NORM_LANES + UNIT_POS_X as usize;
    if col < cols as usize {
        let mut total = 0.0f32;
        for b in 0..blocks as usize {
            let p = ws[part_off as usize + b * part_stride as usize + col];
            if p != 0.0f32 {
                total += p;
            }
        }
        out[o_off as usize + col * o_stride as usize] = F::cast_from(total);
    }
}

/// `out[col] = +0.0` (the `dGamma` of no rows); one unit per column.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_zero_kernel<F: Float>(
    out: &mut Tensor<F>,
    o_off: u32,
    o_stride: u32,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let col = CUBE_POS_X as usize * RMS_NORM_LANES + UNIT_POS_X as usize;
    if col < cols as usize {
        out[o_off as usize + col * o_stride as usize] = F::cast_from(0.0f32);
    }
}
