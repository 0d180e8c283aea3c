//! The `rms_norm` kernels. Each mirrors the Reference (`src/ops/rms_norm/oracle.rs`) operation
//! for operation: every product that feeds a sum is an explicit [`fma_f32`], sums start at +0.0,
//! values are upcast to f32 on load and rounded once on store.
//!
//! Global memory moves in vectors of `w` elements (`w = 1` where a tensor is not contiguous and
//! aligned; the host picks `w`). In the row kernels a row's 256 lanes belong to `256 / w` units:
//! unit `u` loads the vectors `k·256 + w·u` (`k = 0, 1, …`) and owns lanes `w·u .. w·u + w`, so
//! lane `t` is still the fma chain over `d = t, t + 256, …` ascending. Loads are clamped into the
//! row (always valid addresses) and their terms selected away, so a batch of loads issues at once.

use crate::attention::math::{div_rn, recip_rn, sqrt_rn};
use crate::consts::{RMS_NORM_LANES, RMS_NORM_ROW_BLOCK};
use crate::gemm::fma::fma_f32;
use crate::gemm::view::StridedView;
use cubecl::prelude::*;

/// Partials each unit of the `dGamma` sum loads at once (then adds in order).
const PARTIALS_BATCH: usize = 64;

/// Levels of the lane tree (`log2(RMS_NORM_LANES)`).
const TREE_LEVELS: usize = RMS_NORM_LANES.trailing_zeros() as usize;

/// The row kernels' unit geometry: (unit of the row along x, row of the cube along y).
#[cube]
fn row_geometry() -> (usize, usize) {
    (UNIT_POS_X as usize, UNIT_POS_Y as usize)
}

/// Lanes of one sum that a level of [`lane_tree`] moves through shared memory: at most half the
/// row (level 0, and so every even level, in the first buffer), a quarter at the odd levels (the
/// second buffer).
const HALF_LANES: usize = RMS_NORM_LANES / 2;
/// f32 of [`lane_tree`]'s shared memory per row: the even levels' buffer of both sums
/// (`2·HALF_LANES`), the odd levels' (`HALF_LANES`), then the two sums.
const TREE_WORDS: usize = 3 * HALF_LANES + 2;

/// `lane[t] += lane[t + s]` for `s = 128, …, 1` over the 256 lanes of each row of the cube
/// (`lanes_*[j]` is lane `w·u + j` of this unit), for one or two sums; returns lane 0 of each
/// to every unit of its row. A level whose partner units (`s / w` apart) share a plane of
/// `plane` units adds the partner's lanes through `plane_shuffle_down`; a wider one (every one
/// with `plane = 0`) goes through shared memory, two buffers taken in turn, one barrier per
/// level; the levels below `w` add inside the unit. Lane 0's sums then reach the row's units
/// through a plane shuffle, or shared memory past one plane. The same pairs at every `plane`,
/// so the same bits. Calls in a loop need no barrier between them: shared memory holds level 0
/// exactly when the sums go through it too (`units > plane`), so a row's exchange reads all
/// precede its sums' barrier, which every unit passes before the next row's writes, and its sums
/// are read before the next row's first barrier, after which they are written. Every unit of
/// the cube must call it; `plane > 0` assumes the runtime numbers a cube's units into planes
/// consecutively ([`super::tree_plane`]).
#[cube]
fn lane_tree(
    lanes_a: &Array<f32>,
    lanes_b: &Array<f32>,
    #[comptime] w: usize,
    #[comptime] rows_per_cube: usize,
    #[comptime] two: bool,
    #[comptime] plane: usize,
) -> (f32, f32) {
    let units = comptime!(RMS_NORM_LANES / w);
    let (u, ry) = row_geometry();
    let base = ry * TREE_WORDS;
    // An unused word where the whole row is one plane's.
    let words = comptime!(if units > plane { TREE_WORDS } else { 1 });
    let mut xch = SharedMemory::<f32>::new(comptime!(rows_per_cube * words));
    let mut a = Array::<f32>::new(w);
    let mut b = Array::<f32>::new(w);
    #[unroll]
    for j in 0..w {
        a[j] = lanes_a[j];
        if comptime![two] {
            b[j] = lanes_b[j];
        }
    }
    #[unroll]
    for level in 0..TREE_LEVELS {
        let s = comptime!(RMS_NORM_LANES >> (level + 1));
        if comptime!(s >= w) {
            let delta = comptime!(s / w);
            if comptime!(2 * delta > plane) {
                // Even levels in the first buffer, odd ones (half as wide) in the second.
                let (off, half) = comptime!(if level % 2 == 0 {
                    (0, HALF_LANES)
                } else {
                    (2 * HALF_LANES, HALF_LANES / 2)
                });
                let buf = base + off;
                if u >= delta && u < 2 * delta {
                    #[unroll]
                    for j in 0..w {
                        xch[buf + (u - delta) * w + j] = a[j];
                        if comptime![two] {
                            xch[buf + half + (u - delta) * w + j] = b[j];
                        }
                    }
                }
                sync_cube();
                if u < delta {
                    #[unroll]
                    for j in 0..w {
                        a[j] += xch[buf + u * w + j];
                        if comptime![two] {
                            b[j] += xch[buf + half + u * w + j];
                        }
                    }
                }
            } else {
                // Units past `delta` add lanes no later level reads.
                #[unroll]
                for j in 0..w {
                    a[j] += plane_shuffle_down(a[j], comptime!(delta as u32));
                    if comptime![two] {
                        b[j] += plane_shuffle_down(b[j], comptime!(delta as u32));
                    }
                }
            }
        } else {
            #[unroll]
            for j in 0..s {
                a[j] += a[j + s];
                if comptime![two] {
                    b[j] += b[j + s];
                }
            }
        }
    }
    if comptime!(units <= plane) {
        // The row's unit 0 within the plane (a plane may hold several rows).
        let src = ((ry * units) % plane) as u32;
        let mut b0 = 0.0f32;
        if comptime![two] {
            b0 = plane_shuffle(b[0], src);
        }
        (plane_shuffle(a[0], src), b0)
    } else {
        let at = base + comptime!(3 * HALF_LANES);
        if u == 0 {
            xch[at] = a[0];
            if comptime![two] {
                xch[at + 1] = b[0];
            }
        }
        sync_cube();
        let mut b0 = 0.0f32;
        if comptime![two] {
            b0 = xch[at + 1];
        }
        (xch[at], b0)
    }
}

/// The row kernels' compile-time configuration: the vector width `w` (rows per cube of the
/// forward and dx kernels), vectors loaded per `batch`, `fma` emulated, and the plane size of
/// the lane tree's shuffles (0: every level in shared memory; see [`lane_tree`]).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct RowCfg {
    pub w: usize,
    pub batch: usize,
    pub emulate_fma: bool,
    pub plane: usize,
}

/// The forward's inputs: `x` and its view, `gamma` at `g_off + col·g_stride`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct NormInputs<F: Float, N: Size> {
    pub x: Tensor<Vector<F, N>>,
    pub xo: StridedView,
    pub gamma: Tensor<Vector<F, N>>,
    pub g_off: u32,
    pub g_stride: u32,
}

/// A written tensor and its view (the forward's `out`).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct NormOutput<F: Float, N: Size> {
    pub out: Tensor<Vector<F, N>>,
    pub oo: StridedView,
}

/// The row kernels' sizes: `rows` of this launch, `d` (also as f32) and `eps`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct RowSizes {
    pub rows: u32,
    pub d: u32,
    pub d_f: f32,
    pub eps: f32,
}

/// The dx kernel's inputs: `x`, `dy` and their views, `gamma` at `g_off + col·g_stride`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DxInputs<F: Float, N: Size> {
    pub x: Tensor<Vector<F, N>>,
    pub xo: StridedView,
    pub dy: Tensor<Vector<F, N>>,
    pub dyo: StridedView,
    pub gamma: Tensor<Vector<F, N>>,
    pub g_off: u32,
    pub g_stride: u32,
}

/// The dx kernel's outputs: `dx` and its view, `r` of each row into `ws[r_off + row]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DxOutputs<F: Float, N: Size> {
    pub dx: Tensor<Vector<F, N>>,
    pub dxo: StridedView,
    pub ws: Tensor<f32>,
    pub r_off: u32,
}

/// The partials kernel's inputs: `x`, `dy` and their views.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct XDy<F: Float, M: Size> {
    pub x: Tensor<Vector<F, M>>,
    pub xo: StridedView,
    pub dy: Tensor<Vector<F, M>>,
    pub dyo: StridedView,
}

/// The partials kernel's sizes: `r` at `ws[r_off + row]`, `rows`, `cubes` = row blocks ·
/// `tiles`, `d`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct PartialSizes {
    pub r_off: u32,
    pub rows: u32,
    pub cubes: u32,
    pub tiles: u32,
    pub d: u32,
}

/// The block partials: `ws[part_off + block·part_stride + col]` for `blocks` blocks.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Partials {
    pub ws: Tensor<f32>,
    pub part_off: u32,
    pub part_stride: u32,
    pub blocks: u32,
}

/// A written column vector: `out[o_off + col·o_stride]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Column<F: Float> {
    pub out: Tensor<F>,
    pub o_off: u32,
    pub o_stride: u32,
}

/// `1 / sqrt(ss / D + eps)`, each division and the root IEEE-rounded on every device.
#[cube]
fn inv_rms(ss: f32, d_f: f32, eps: f32, #[comptime] emulate: bool) -> f32 {
    let ms = div_rn(ss, d_f, emulate) + eps;
    recip_rn(sqrt_rn(ms, emulate), emulate)
}

/// `y[row, :] = (x·r)·gamma` with `r = 1 / sqrt(Σ x² / D + eps)`, `rows_per_cube` rows per cube
/// (row = `CUBE_POS_X · rows_per_cube + UNIT_POS_Y`, below `rows`; from the views' offsets).
/// Each unit loads `batch` vectors at once before their fma steps; a row of at most `256·batch`
/// elements stays in registers for the output pass, longer rows are re-read.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_forward_kernel<F: Float, N: Size>(
    ins: &NormInputs<F, N>,
    outs: &mut NormOutput<F, N>,
    sz: RowSizes,
    #[comptime] cfg: RowCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (w, batch, emulate_fma) = (
        comptime![cfg.w],
        comptime![cfg.batch],
        comptime![cfg.emulate_fma],
    );
    let unroll = comptime!(!emulate_fma);
    let rows_per_cube = comptime!(w);
    let (u, ry) = row_geometry();
    let row = CUBE_POS_X as usize * rows_per_cube + ry;
    // Rows past the end run the launch's last row (valid addresses) and write nothing.
    let active = row < sz.rows as usize;
    let row_c = min(row, sz.rows as usize - 1);
    let d = sz.d as usize;
    let xb = ins.xo.offset as usize + row_c * ins.xo.s0 as usize;
    let xs = ins.xo.s1 as usize;
    let gb = ins.g_off as usize;
    let gs = ins.g_stride as usize;
    let last = d - w;
    let rounds = d.div_ceil(RMS_NORM_LANES);
    let batches = rounds.div_ceil(batch);
    let mut lanes = Array::<f32>::new(w);
    #[unroll]
    for j in 0..w {
        lanes[j] = 0.0f32;
    }
    let mut v = Array::<Vector<F, N>>::new(batch);
    for b in 0..batches {
        #[unroll]
        for k in 0..batch {
            let e = (b * batch + k) * RMS_NORM_LANES + w * u;
            v[k] = ins.x[(xb + min(e, last) * xs) / w];
        }
        #[unroll(unroll)]
        for k in 0..batch {
            let e = (b * batch + k) * RMS_NORM_LANES + w * u;
            let vk = v[k];
            #[unroll]
            for j in 0..w {
                let xe = f32::cast_from(vk[j]);
                lanes[j] = select(e < d, fma_f32(xe, xe, lanes[j], emulate_fma), lanes[j]);
            }
        }
    }
    let (ss, _) = lane_tree(
        &lanes,
        &lanes,
        w,
        rows_per_cube,
        false,
        comptime![cfg.plane],
    );
    let r = inv_rms(ss, sz.d_f, sz.eps, emulate_fma);
    let ob = outs.oo.offset as usize + row_c * outs.oo.s0 as usize;
    let os = outs.oo.s1 as usize;
    // The output pass: the row from registers where it fits one batch, else re-read (from
    // L1/L2) a batch of loads at a time.
    let mut gv = Array::<Vector<F, N>>::new(batch);
    for b in 0..batches {
        #[unroll]
        for k in 0..batch {
            let e = min((b * batch + k) * RMS_NORM_LANES + w * u, last);
            if batches > 1 {
                v[k] = ins.x[(xb + e * xs) / w];
            }
            gv[k] = ins.gamma[(gb + e * gs) / w];
        }
        #[unroll]
        for k in 0..batch {
            let e = (b * batch + k) * RMS_NORM_LANES + w * u;
            if active && e < d {
                let (vk, gk) = (v[k], gv[k]);
                let mut o = Vector::<F, N>::empty();
                #[unroll]
                for j in 0..w {
                    o[j] = F::cast_from((f32::cast_from(vk[j]) * r) * f32::cast_from(gk[j]));
                }
                outs.out[(ob + e * os) / w] = o;
            }
        }
    }
}

/// The backward's rows `cube·w ..` (the row of a unit as in the
/// forward): `r = 1 / sqrt(Σ x² / D + eps)` into `ws[r_off + row]`, `g = dy·gamma`,
/// `c = ((r·r)·r)·Σ g·x / D` and `dx = fma(−x, c, r·g)`. Every unit of the cube must call it.
#[cube]
#[allow(clippy::too_many_arguments)] // #[cube] helpers take each tensor and index separately
fn dx_rows<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    xo: &StridedView,
    dy: &Tensor<Vector<F, N>>,
    dyo: &StridedView,
    gamma: &Tensor<Vector<F, N>>,
    gamma_at: (usize, usize),
    dx: &mut Tensor<Vector<F, N>>,
    dxo: &StridedView,
    ws: &mut Tensor<f32>,
    r_off: usize,
    rows: usize,
    cube: usize,
    d: usize,
    d_f: f32,
    eps: f32,
    #[comptime] cfg: RowCfg,
) {
    let (w, batch, emulate_fma) = (
        comptime![cfg.w],
        comptime![cfg.batch],
        comptime![cfg.emulate_fma],
    );
    let unroll = comptime!(!emulate_fma);
    let (u, ry) = row_geometry();
    let row = cube * w + ry;
    // Rows past the end run the launch's last row (valid addresses) and write nothing.
    let active = row < rows;
    let row_c = min(row, rows - 1);
    let xb = xo.offset as usize + row_c * xo.s0 as usize;
    let xs = xo.s1 as usize;
    let db = dyo.offset as usize + row_c * dyo.s0 as usize;
    let ds = dyo.s1 as usize;
    let (gb, gs) = gamma_at;
    let last = d - w;
    let batches = d.div_ceil(RMS_NORM_LANES).div_ceil(batch);
    let mut ss_l = Array::<f32>::new(w);
    let mut dot_l = Array::<f32>::new(w);
    #[unroll]
    for j in 0..w {
        ss_l[j] = 0.0f32;
        dot_l[j] = 0.0f32;
    }
    let mut xv = Array::<Vector<F, N>>::new(batch);
    let mut dv = Array::<Vector<F, N>>::new(batch);
    let mut gv = Array::<Vector<F, N>>::new(batch);
    for b in 0..batches {
        #[unroll]
        for k in 0..batch {
            let e = min((b * batch + k) * RMS_NORM_LANES + w * u, last);
            xv[k] = x[(xb + e * xs) / w];
            dv[k] = dy[(db + e * ds) / w];
            gv[k] = gamma[(gb + e * gs) / w];
        }
        #[unroll(unroll)]
        for k in 0..batch {
            let e = (b * batch + k) * RMS_NORM_LANES + w * u;
            let (xk, dk, gk) = (xv[k], dv[k], gv[k]);
            #[unroll]
            for j in 0..w {
                let xe = f32::cast_from(xk[j]);
                let g = f32::cast_from(dk[j]) * f32::cast_from(gk[j]);
                ss_l[j] = select(e < d, fma_f32(xe, xe, ss_l[j], emulate_fma), ss_l[j]);
                dot_l[j] = select(e < d, fma_f32(g, xe, dot_l[j], emulate_fma), dot_l[j]);
            }
        }
    }
    let (ss, dot) = lane_tree(&ss_l, &dot_l, w, w, true, comptime![cfg.plane]);
    let r = inv_rms(ss, d_f, eps, emulate_fma);
    let c = div_rn(((r * r) * r) * dot, d_f, emulate_fma);
    if active && u == 0 {
        ws[r_off + row] = r;
    }
    // The dx pass: the row from registers where it fits one batch, else re-read (from L1/L2)
    // a batch of loads at a time.
    let ob = dxo.offset as usize + row_c * dxo.s0 as usize;
    let os = dxo.s1 as usize;
    for b in 0..batches {
        if batches > 1 {
            #[unroll]
            for k in 0..batch {
                let e = min((b * batch + k) * RMS_NORM_LANES + w * u, last);
                xv[k] = x[(xb + e * xs) / w];
                dv[k] = dy[(db + e * ds) / w];
                gv[k] = gamma[(gb + e * gs) / w];
            }
        }
        #[unroll(unroll)]
        for k in 0..batch {
            let e = (b * batch + k) * RMS_NORM_LANES + w * u;
            if active && e < d {
                dx[(ob + e * os) / w] =
                    dx_vector::<F, N>(xv[k], dv[k], gv[k], r, c, w, emulate_fma);
            }
        }
    }
}

/// `dx = fma(−x, c, r·(dy·gamma))` of one vector, rounded once.
#[cube]
fn dx_vector<F: Float, N: Size>(
    xk: Vector<F, N>,
    dk: Vector<F, N>,
    gk: Vector<F, N>,
    r: f32,
    c: f32,
    #[comptime] w: usize,
    #[comptime] emulate_fma: bool,
) -> Vector<F, N> {
    let mut o = Vector::<F, N>::empty();
    #[unroll]
    for j in 0..w {
        let g = f32::cast_from(dk[j]) * f32::cast_from(gk[j]);
        o[j] = F::cast_from(fma_f32(-f32::cast_from(xk[j]), c, r * g, emulate_fma));
    }
    o
}

/// One (row block, column tile) of the backward's `dGamma` (`cube` = block ·
/// `tiles` + tile), each of the cube's 256 units owning `wg` adjacent columns: per column the
/// block's `dGamma` partial, `fma(dy, x·r, part)` over its rows ascending from +0.0 (rows with
/// `dy == 0` skipped), into `ws[block·d + col]`. Each unit loads `row_batch` rows before
/// their steps. Every unit of the cube must call it.
#[cube]
#[allow(clippy::too_many_arguments)] // #[cube] helpers take each tensor and index separately
fn dgamma_block<F: Float, M: Size>(
    x: &Tensor<Vector<F, M>>,
    xo: &StridedView,
    dy: &Tensor<Vector<F, M>>,
    dyo: &StridedView,
    ws: &mut Tensor<f32>,
    r_off: usize,
    rows: usize,
    cube: usize,
    tiles: usize,
    d: usize,
    #[comptime] wg: usize,
    #[comptime] row_batch: usize,
    #[comptime] emulate_fma: bool,
) {
    let unroll = comptime!(!emulate_fma);
    let u = (UNIT_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let block = cube / tiles;
    let col = ((cube % tiles) * RMS_NORM_LANES + u) * wg;
    let row0 = block * RMS_NORM_ROW_BLOCK;
    let end = min(rows, row0 + RMS_NORM_ROW_BLOCK);
    // The block's r, staged once per cube.
    let mut r_s = SharedMemory::<f32>::new(RMS_NORM_ROW_BLOCK);
    if u < end - row0 {
        r_s[u] = ws[r_off + row0 + u];
    }
    sync_cube();
    if col < d {
        let mut part = Array::<f32>::new(wg);
        #[unroll]
        for j in 0..wg {
            part[j] = 0.0f32;
        }
        let xb = xo.offset as usize + col * xo.s1 as usize;
        let xs = xo.s0 as usize;
        let db = dyo.offset as usize + col * dyo.s1 as usize;
        let ds = dyo.s0 as usize;
        let mut xv = Array::<Vector<F, M>>::new(row_batch);
        let mut dv = Array::<Vector<F, M>>::new(row_batch);
        for b in 0..(end - row0).div_ceil(row_batch) {
            let first = row0 + b * row_batch;
            #[unroll]
            for i in 0..row_batch {
                let row = min(first + i, end - 1);
                xv[i] = x[(xb + row * xs) / wg];
                dv[i] = dy[(db + row * ds) / wg];
            }
            #[unroll(unroll)]
            for i in 0..row_batch {
                let row = first + i;
                let re = r_s[min(row, end - 1) - row0];
                let (xk, dk) = (xv[i], dv[i]);
                #[unroll]
                for j in 0..wg {
                    let de = f32::cast_from(dk[j]);
                    let next = fma_f32(de, f32::cast_from(xk[j]) * re, part[j], emulate_fma);
                    part[j] = select(row >= end || de == 0.0f32, part[j], next);
                }
            }
        }
        #[unroll]
        for j in 0..wg {
            ws[block * d + col + j] = part[j];
        }
    }
}

/// The one-pass backward's outputs: `dx` and its view, the `dGamma` partial of row block
/// `block_off + CUBE_POS_X` into `ws[(block_off + CUBE_POS_X)·d + col]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct OnePassOutputs<F: Float, N: Size> {
    pub dx: Tensor<Vector<F, N>>,
    pub dxo: StridedView,
    pub ws: Tensor<f32>,
    pub block_off: u32,
}

/// The one-pass backward's compile-time configuration: the vector width `w`, `rounds` (a power
/// of two, at least `ceil(D / 256)`: the vectors of a row each unit holds), `fma` emulated, the
/// plane size of the lane tree's shuffles (0: the tree in shared memory; see [`lane_tree`]),
/// and `exact`: `D = 256·rounds` with unit-stride rows (`w > 1`), so that every round is whole
/// and a unit's vectors sit at fixed offsets from one base per row and tensor (no clamped
/// indices, no bounds selects in the sums; the same operations on the same values).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct OnePassCfg {
    pub w: usize,
    pub rounds: usize,
    pub emulate_fma: bool,
    pub plane: usize,
    pub exact: bool,
}

/// The one pass's `(Σ x², Σ g·x)` of the row held in `xv`, `dv` (`g = dy·gamma`; unit `u` holds
/// its vectors at `k·256 + w·u`): each lane an fma chain ascending from +0.0, then the lane tree.
/// Every unit of the cube must call it.
#[cube]
fn held_row_sums<F: Float, N: Size>(
    xv: &Array<Vector<F, N>>,
    dv: &Array<Vector<F, N>>,
    ins: &DxInputs<F, N>,
    u: usize,
    d: usize,
    #[comptime] cfg: OnePassCfg,
) -> (f32, f32) {
    let (w, rounds, emulate_fma, exact) = (
        comptime![cfg.w],
        comptime![cfg.rounds],
        comptime![cfg.emulate_fma],
        comptime![cfg.exact],
    );
    let step = comptime!(RMS_NORM_LANES / w);
    let (gb, gs) = (ins.g_off as usize, ins.g_stride as usize);
    let gv = gb / w + u;
    let last = d - w;
    let mut ss_l = Array::<f32>::new(w);
    let mut dot_l = Array::<f32>::new(w);
    #[unroll]
    for j in 0..w {
        ss_l[j] = 0.0f32;
        dot_l[j] = 0.0f32;
    }
    #[unroll]
    for k in 0..rounds {
        let e = k * RMS_NORM_LANES + w * u;
        if comptime![exact] {
            let gk = ins.gamma[gv + k * step];
            let (xk, dk) = (xv[k], dv[k]);
            #[unroll]
            for j in 0..w {
                let xe = f32::cast_from(xk[j]);
                let g = f32::cast_from(dk[j]) * f32::cast_from(gk[j]);
                ss_l[j] = fma_f32(xe, xe, ss_l[j], emulate_fma);
                dot_l[j] = fma_f32(g, xe, dot_l[j], emulate_fma);
            }
        } else if k * RMS_NORM_LANES < d {
            let gk = ins.gamma[(gb + min(e, last) * gs) / w];
            let (xk, dk) = (xv[k], dv[k]);
            #[unroll]
            for j in 0..w {
                let xe = f32::cast_from(xk[j]);
                let g = f32::cast_from(dk[j]) * f32::cast_from(gk[j]);
                ss_l[j] = select(e < d, fma_f32(xe, xe, ss_l[j], emulate_fma), ss_l[j]);
                dot_l[j] = select(e < d, fma_f32(g, xe, dot_l[j], emulate_fma), dot_l[j]);
            }
        }
    }
    lane_tree(&ss_l, &dot_l, w, 1usize, true, comptime![cfg.plane])
}

/// The whole backward of one block of `RMS_NORM_ROW_BLOCK` rows in one pass over `x` and `dy`
/// (block = `CUBE_POS_X`, rows from the views' offsets, below `rows`). The cube's `256 / w`
/// units walk the block's rows in ascending order; unit `u` holds the row's vectors at
/// `k·256 + w·u` (its lanes `w·u ..`) in registers: both lane sums and the tree, then `dx` as
/// [`dx_rows`] computes it, then the unit's `dGamma` partials `fma(dy, x·r, part)` (terms with
/// `dy == 0` skipped), which stay in registers across the rows and are written once at the end,
/// the partials kernel's bits.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_backward_kernel<F: Float, N: Size>(
    ins: &DxInputs<F, N>,
    outs: &mut OnePassOutputs<F, N>,
    sz: RowSizes,
    #[comptime] cfg: OnePassCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (w, rounds, emulate_fma, exact) = (
        comptime![cfg.w],
        comptime![cfg.rounds],
        comptime![cfg.emulate_fma],
        comptime![cfg.exact],
    );
    let step = comptime!(RMS_NORM_LANES / w);
    let (u, _) = row_geometry();
    let d = sz.d as usize;
    let last = d - w;
    let row0 = CUBE_POS_X as usize * RMS_NORM_ROW_BLOCK;
    let end = min(sz.rows as usize, row0 + RMS_NORM_ROW_BLOCK);
    let (xs, ds, os) = (
        ins.xo.s1 as usize,
        ins.dyo.s1 as usize,
        outs.dxo.s1 as usize,
    );
    let (gb, gs) = (ins.g_off as usize, ins.g_stride as usize);
    let held = comptime!(rounds * w);
    let mut part = Array::<f32>::new(held);
    #[unroll]
    for i in 0..held {
        part[i] = 0.0f32;
    }
    let mut xv = Array::<Vector<F, N>>::new(rounds);
    let mut dv = Array::<Vector<F, N>>::new(rounds);
    for i in 0..end - row0 {
        let row = row0 + i;
        let xb = ins.xo.offset as usize + row * ins.xo.s0 as usize;
        let db = ins.dyo.offset as usize + row * ins.dyo.s0 as usize;
        let (xr, dr) = (xb / w + u, db / w + u);
        // Rounds past the row (the power-of-two padding of `rounds`) load nothing.
        #[unroll]
        for k in 0..rounds {
            if comptime![exact] {
                xv[k] = ins.x[xr + k * step];
                dv[k] = ins.dy[dr + k * step];
            } else if k * RMS_NORM_LANES < d {
                let e = min(k * RMS_NORM_LANES + w * u, last);
                xv[k] = ins.x[(xb + e * xs) / w];
                dv[k] = ins.dy[(db + e * ds) / w];
            }
        }
        let (ss, dot) = held_row_sums::<F, N>(&xv, &dv, ins, u, d, cfg);
        let r = inv_rms(ss, sz.d_f, sz.eps, emulate_fma);
        let c = div_rn(((r * r) * r) * dot, sz.d_f, emulate_fma);
        let ob = outs.dxo.offset as usize + row * outs.dxo.s0 as usize;
        let (orow, grow) = (ob / w + u, gb / w + u);
        #[unroll]
        for k in 0..rounds {
            let e = k * RMS_NORM_LANES + w * u;
            if comptime![exact] || e < d {
                let (xk, dk) = (xv[k], dv[k]);
                let (gi, oi) = if comptime![exact] {
                    (grow + k * step, orow + k * step)
                } else {
                    ((gb + e * gs) / w, (ob + e * os) / w)
                };
                let gk = ins.gamma[gi];
                outs.dx[oi] = dx_vector::<F, N>(xk, dk, gk, r, c, w, emulate_fma);
                #[unroll]
                for j in 0..w {
                    let de = f32::cast_from(dk[j]);
                    let at = k * w + j;
                    let next = fma_f32(de, f32::cast_from(xk[j]) * r, part[at], emulate_fma);
                    part[at] = select(de == 0.0f32, part[at], next);
                }
            }
        }
    }
    let pb = (outs.block_off + CUBE_POS_X) as usize * d;
    #[unroll]
    for k in 0..rounds {
        let e = k * RMS_NORM_LANES + w * u;
        if comptime![exact] || e < d {
            #[unroll]
            for j in 0..w {
                outs.ws[pb + e + j] = part[k * w + j];
            }
        }
    }
}

/// `dx` and `r` of the launch's rows, `w` rows per cube (see [`dx_rows`]).
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_dx_kernel<F: Float, N: Size>(
    ins: &DxInputs<F, N>,
    outs: &mut DxOutputs<F, N>,
    sz: RowSizes,
    #[comptime] cfg: RowCfg,
    #[define(F)] _dtype: StorageType,
) {
    dx_rows::<F, N>(
        &ins.x,
        &ins.xo,
        &ins.dy,
        &ins.dyo,
        &ins.gamma,
        (ins.g_off as usize, ins.g_stride as usize),
        &mut outs.dx,
        &outs.dxo,
        &mut outs.ws,
        outs.r_off as usize,
        sz.rows as usize,
        CUBE_POS_X as usize,
        sz.d as usize,
        sz.d_f,
        sz.eps,
        cfg,
    );
}

/// The `dGamma` block partials: cube `CUBE_POS_Y · CUBE_COUNT_X + CUBE_POS_X` (below `cubes`)
/// is (row block, column tile) = (cube / tiles, cube % tiles) (see [`dgamma_block`]).
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_partials_kernel<F: Float, M: Size>(
    ins: &XDy<F, M>,
    ws: &mut Tensor<f32>,
    sz: PartialSizes,
    #[comptime] cfg: RowCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (wg, row_batch, emulate_fma) = (
        comptime![cfg.w],
        comptime![cfg.batch],
        comptime![cfg.emulate_fma],
    );
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if id < sz.cubes as usize {
        dgamma_block::<F, M>(
            &ins.x,
            &ins.xo,
            &ins.dy,
            &ins.dyo,
            ws,
            sz.r_off as usize,
            sz.rows as usize,
            id,
            sz.tiles as usize,
            sz.d as usize,
            wg,
            row_batch,
            emulate_fma,
        );
    }
}

/// `dGamma[col] = Σ_blocks partial[block, col]` in ascending block order from +0.0, partials equal
/// to zero skipped, one rounding; one unit per column (`CUBE_DIM_X` per cube). With no blocks,
/// `+0.0`.
#[cube(launch_unchecked)]
pub(crate) fn rms_norm_dgamma_kernel<F: Float>(
    parts: &Partials,
    out: &mut Column<F>,
    cols: u32,
    #[define(F)] _dtype: StorageType,
) {
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if col < cols as usize {
        let blocks = parts.blocks as usize;
        let base = parts.part_off as usize + col;
        let stride = parts.part_stride as usize;
        let mut total = 0.0f32;
        let mut p = Array::<f32>::new(PARTIALS_BATCH);
        for b in 0..blocks.div_ceil(PARTIALS_BATCH) {
            #[unroll]
            for i in 0..PARTIALS_BATCH {
                p[i] = parts.ws[base + min(b * PARTIALS_BATCH + i, blocks - 1) * stride];
            }
            #[unroll]
            for i in 0..PARTIALS_BATCH {
                if b * PARTIALS_BATCH + i < blocks && p[i] != 0.0f32 {
                    total += p[i];
                }
            }
        }
        out.out[out.o_off as usize + col * out.o_stride as usize] = F::cast_from(total);
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

/// `with_rejected_launch`'s kernel: the bits of a literal, which cubecl's C++ generator writes as
/// `reinterpret_cast` of a prvalue and NVRTC rejects.
#[cube(launch_unchecked)]
pub(crate) fn rejected_kernel(out: &mut Array<u32>) {
    out[0] = u32::reinterpret(1.0f32);
}
