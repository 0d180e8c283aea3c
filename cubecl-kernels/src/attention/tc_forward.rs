//! The tensor-core forward for f16 / bf16 on CUDA (`ldmatrix` + `mma.sync` 16×8×16, f32
//! accumulators), FA2-style: one cube of 4 warps per (batch row, KV head, 64 query rows of the
//! KV head's group), each warp owning 16 rows; keys in blocks of 64 from key 0 ascending. Where
//! the group has at most 16 query rows (decode) and Dh is 64 or 128, a cube takes 16 rows and
//! its warps split `o`'s columns instead (`split`): each computes the same scores and softmax
//! (the same bits) and a quarter of `P·V`, whose 16×8 fragments are independent of each other.
//!
//! Why the bits stay batch-invariant (docs/CONTRACT.md, *attention semantics*): an MMA output
//! row depends only on its own A row, so a row's scores, its softmax state and its `o` come from
//! its own query, the keys and values of the pinned key blocks and the pinned 16-deep k order
//! over Dh and over the keys; never from the other rows of the tile, from B, Q, KV past its keys,
//! padding or the launch split. Masked scores are replaced (select), never offset; a block the
//! row cannot see leaves `m`, `l` and `o` unchanged (`α = 1`, `p = 0`; `o` only up to the sign
//! of a zero, which the epilogue canonicalizes). Keys no row of the cube can see (at or past the
//! cube's last visible key, hence past `kv_lens`) are staged as zeros, never read.

use super::math::{div_rn, exp_p, ln_p, neg_inf};
use super::tile::{AttnParams, KEY_BLOCK, RowSrc, Strides4, kv_len_of, row_offset, visible};
use crate::gemm::fma::fma_f32;
use crate::util::FloatDType;

const _: () = assert!(TC_ROWS == KEY_BLOCK); // Q is staged in K's buffer
use cubecl::prelude::*;

/// Warps per cube; each owns 16 query rows.
pub(crate) const TC_WARPS: usize = 4;
/// Lanes per warp.
const LANES: usize = 32;
/// Query rows per cube.
pub(crate) const TC_ROWS: usize = 16 * TC_WARPS;
/// Units per cube.
const TC_THREADS: usize = LANES * TC_WARPS;
/// Padding (elements) of a staged row against bank conflicts; keeps rows 16-byte aligned.
const PAD: usize = 8;
/// 16×8 score fragments per key block.
const S_FRAGS: usize = KEY_BLOCK / 8;
/// Largest head size of the tensor-core path (its registers: Dh/16 A fragments of the query,
/// Dh/8 accumulators of `o`).
pub(crate) const TC_MAX_HEAD_DIM: usize = 128;

/// Compile-time configuration of the tensor-core forward.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct TcCfg {
    pub d: usize,
    pub causal: bool,
    pub emulate: bool,
    /// 16 query rows per cube, the warps splitting `o`'s columns.
    pub split: bool,
}

impl TcCfg {
    /// Row pitch (elements) of a staged Q, K or V tile.
    fn pitch(&self) -> usize {
        self.d + PAD
    }
    /// Query rows of a cube.
    pub(crate) fn rows(&self) -> usize {
        if self.split { 16 } else { TC_ROWS }
    }
    /// Columns of `o` a warp owns.
    fn cols(&self) -> usize {
        if self.split {
            self.d / TC_WARPS
        } else {
            self.d
        }
    }
}

/// Whether a cube may take 16 rows with the warps splitting the columns: few rows per KV head
/// (decode) and warp column shares that are whole `ldmatrix` x4 pairs (16 columns).
pub(crate) fn tc_split(group_rows: usize, head_dim: usize) -> bool {
    group_rows <= 16 && head_dim.is_multiple_of(16 * TC_WARPS)
}

/// The first row (in the cube) of this warp's 16 and the first column of its share of `o`.
#[cube]
fn warp_origin(#[comptime] cfg: TcCfg) -> (usize, usize) {
    let warp = UNIT_POS_Y as usize;
    if comptime![cfg.split] {
        (0usize, warp * comptime![cfg.cols()])
    } else {
        (warp * 16, 0usize)
    }
}

/// Whether the f16 / bf16 forward runs on the tensor cores for this dtype and head size on this
/// device: a function of (dtype, head_dim, device) only, never of the batch or the lengths.
pub(crate) fn tc_forward_supported<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDType,
    head_dim: usize,
) -> bool {
    let half = matches!(dtype, FloatDType::F16 | FloatDType::BF16);
    let shared = 2 * KEY_BLOCK * (head_dim + PAD) * dtype.size() + 4 * TC_ROWS;
    let hw = &client.properties().hardware;
    half && head_dim > 0
        && head_dim.is_multiple_of(16)
        && head_dim <= TC_MAX_HEAD_DIM
        && hw.max_units_per_cube as usize >= TC_THREADS
        && hw.max_shared_memory_size >= shared
        && crate::gemm::manual_mma_supported(client, dtype.storage())
}

/// Where a cube works: batch row `b`, KV head `kh`, the first of its 64 rows `r0` (rows of the
/// KV head's group, `r = local_head·Q + i`), the group's rows `gq`, the row's valid keys `len`.
#[derive(CubeType, Clone, Copy)]
struct TcTile {
    b: usize,
    kh: usize,
    r0: usize,
    gq: usize,
    len: i32,
}

/// The running softmax state of one of a lane's two rows: max `m`, sum `l`, the last block's
/// `α`, and the row's visible keys.
#[derive(CubeType, Clone, Copy)]
struct Row {
    m: f32,
    l: f32,
    alpha: f32,
    vis: u32,
}

/// The cube's tile of `p`'s grid.
#[cube]
fn tc_tile(kv_lens: &Tensor<i32>, p: &AttnParams, #[comptime] cfg: TcCfg) -> TcTile {
    let rows = comptime![cfg.rows()];
    let q_len = p.q_len as usize;
    let gq = p.group as usize * q_len;
    let tiles = gq.div_ceil(rows);
    let cube = p.offset as usize + CUBE_POS_X as usize;
    let bkh = cube / tiles;
    let b = bkh / p.kv_heads as usize;
    TcTile {
        b,
        kh: bkh % p.kv_heads as usize,
        r0: (cube % tiles) * rows,
        gq,
        len: kv_len_of(kv_lens, b * p.lens as usize, p.kv_len),
    }
}

/// Stage rows `src.first .. + n` (d columns) of `t` in `smem` (pitch `d + PAD`), zeros at or
/// past `src.limit`: such rows are never read. Key rows (`keys`) skip `row_offset`'s divisions.
#[cube]
fn stage_rows<F: Float>(
    t: &Tensor<F>,
    src: &RowSrc,
    smem: &mut SharedMemory<F>,
    #[comptime] n: usize,
    #[comptime] keys: bool,
    #[comptime] cfg: TcCfg,
) {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let d = comptime![cfg.d];
    let pitch = comptime![cfg.pitch()];
    #[unroll]
    for e in 0..comptime![n * cfg.d / TC_THREADS] {
        let idx = tid + e * TC_THREADS;
        let rr = idx / d;
        let cc = idx % d;
        let r = src.first + rr;
        let mut val = F::new(0.0);
        if r < src.limit {
            let at = if comptime![keys] {
                src.base + r * src.s_inner
            } else {
                row_offset(src, r)
            };
            val = t[at + cc * src.s_d];
        }
        smem[rr * pitch + cc] = val;
    }
}

/// The visible keys of each row of the cube into `vis_s`, and the largest (every unit gets it).
#[cube]
fn row_visibility(
    tile: &TcTile,
    p: &AttnParams,
    vis_s: &mut SharedMemory<u32>,
    #[comptime] cfg: TcCfg,
) -> u32 {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let rows = comptime![cfg.rows()];
    if tid < rows {
        let r = tile.r0 + tid;
        let mut vis = 0u32;
        if r < tile.gq {
            vis = visible(
                tile.len,
                p.q_len,
                r % p.q_len as usize,
                comptime![cfg.causal],
            );
        }
        vis_s[tid] = vis;
    }
    sync_cube();
    let mut max_vis = 0u32;
    for rr in 0..rows {
        max_vis = max(max_vis, vis_s[rr]);
    }
    max_vis
}

/// The warp's 16 query rows as `Dh/16` A fragments (through `smem`, which is free again after).
#[cube]
fn query_fragments<F: Float>(
    q: &Tensor<F>,
    tile: &TcTile,
    p: &AttnParams,
    smem: &mut SharedMemory<F>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let src = RowSrc {
        base: tile.b * p.q.b as usize + tile.kh * p.group as usize * p.q.h as usize,
        first: tile.r0,
        limit: tile.gq,
        inner: p.q_len as usize,
        s_outer: p.q.h as usize,
        s_inner: p.q.s as usize,
        s_d: p.q.d as usize,
    };
    stage_rows::<F>(q, &src, smem, comptime![cfg.rows()], false, cfg);
    sync_cube();
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let pitch = comptime![cfg.pitch()];
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let (r, _) = warp_origin(cfg);
    let mut frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
    // ldmatrix x4: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    // (rows 8-15, k 8-15), as the GEMM's A operand with k contiguous.
    #[unroll]
    for kk in 0..comptime![cfg.d / 16] {
        let e = (r + (quad % 2) * 8 + within) * pitch + kk * 16 + (quad / 2) * 8;
        frags.push(mma.load_matrix::<F, Const<2>>(
            &smem.slice(e, e + 8),
            cmma::MatrixIdent::A,
            4usize,
            false,
        ));
    }
    sync_cube();
    frags
}

/// Rows `j0 .. j0 + 64` of the key or value tensor with strides `st` (zeros at or past `limit`,
/// the cube's last visible key).
#[cube]
fn key_src(tile: &TcTile, st: &Strides4, j0: usize, limit: usize) -> RowSrc {
    RowSrc {
        base: tile.b * st.b as usize + tile.kh * st.h as usize,
        first: j0,
        limit,
        inner: limit,
        s_outer: 0usize,
        s_inner: st.s as usize,
        s_d: st.d as usize,
    }
}

/// `n` zeroed 16×8 f32 accumulators: per lane two pairs, rows `g` and `g + 8`, columns `2t`,
/// `2t + 1` (lane = `4g + t`).
#[cube]
fn zero_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<f32, Const<2>>>>::new();
    #[unroll]
    for _ in 0..n {
        let mut c = Array::<Vector<f32, Const<2>>>::new(2usize);
        c[0] = Vector::new(0.0f32);
        c[1] = Vector::new(0.0f32);
        frags.push(c);
    }
    frags
}

/// `S = Q·Kᵀ` of the warp's 16 rows and the block's 64 keys (eight 16×8 fragments), 16-deep
/// steps over Dh ascending.
#[cube]
fn scores<F: Float>(
    k_s: &SharedMemory<F>,
    qa: &Sequence<Array<Vector<F, Const<2>>>>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let pitch = comptime![cfg.pitch()];
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let mut s = zero_frags(S_FRAGS);
    #[unroll]
    for kk in 0..comptime![cfg.d / 16] {
        #[unroll]
        for j in 0..comptime![S_FRAGS / 2] {
            // B = Kᵀ staged with d contiguous (the GEMM's `b_nfast = false`): matrices
            // (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
            let e = (j * 16 + (quad / 2) * 8 + within) * pitch + kk * 16 + (quad % 2) * 8;
            let quad_b = mma.load_matrix::<F, Const<2>>(
                &k_s.slice(e, e + 8),
                cmma::MatrixIdent::B,
                4usize,
                false,
            );
            mma_pair(&mma, qa.index(kk), &quad_b, &mut s, comptime![2 * j]);
        }
    }
    s
}

/// Fragments `at` and `at + 1` of `acc` += `a` times the two 16×8 B operands of an `ldmatrix`
/// x4 (`b[0..2]`: columns 0-7, `b[2..4]`: columns 8-15).
#[cube]
fn mma_pair<F: Float>(
    mma: &cmma::MmaDefinition<F, F, f32>,
    a: &Array<Vector<F, Const<2>>>,
    b: &Array<Vector<F, Const<2>>>,
    acc: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] at: usize,
) {
    let mut b_lo = Array::<Vector<F, Const<2>>>::new(2usize);
    b_lo[0] = b[0];
    b_lo[1] = b[1];
    let mut b_hi = Array::<Vector<F, Const<2>>>::new(2usize);
    b_hi[0] = b[2];
    b_hi[1] = b[3];
    mma.execute_inplace(a, &b_lo, acc.index_mut(at));
    mma.execute_inplace(a, &b_hi, acc.index_mut(comptime![at + 1]));
}

/// `max` of the four lanes of a quad (one row's lanes), the same value in each.
#[cube]
fn quad_max(x: f32) -> f32 {
    let y = plane_shuffle_xor(x, 1u32);
    let x = select(y > x, y, x);
    let y = plane_shuffle_xor(x, 2u32);
    select(y > x, y, x)
}

/// Sum over the four lanes of a quad by a fixed xor tree (every lane gets the same bits:
/// `(a + b) + (c + d)` up to commutation).
#[cube]
fn quad_sum(x: f32) -> f32 {
    let x = x + plane_shuffle_xor(x, 1u32);
    x + plane_shuffle_xor(x, 2u32)
}

/// One block's online softmax for the lane's row `h` (`g + 8h`): scores scaled in f32, −∞ (by
/// a select) past the row's visible keys; `m' = max(m, block max)`, `α = exp_p(m − m')` (exactly
/// 1 when the max does not grow: no NaN from `−∞ − −∞`), `p = exp_p(s − m')` or exactly 0 where
/// masked, `l_b` by the lane's ascending adds then the quad's tree, `l = fma(l, α, l_b)`. The
/// scores are replaced by `p`.
#[cube]
fn softmax_row(
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    row: &mut Row,
    j0: usize,
    scale: f32,
    #[comptime] h: usize,
    #[comptime] emulate: bool,
) {
    let t = UNIT_POS_X as usize % 4;
    let vis = row.vis as usize;
    let mut bm = neg_inf();
    #[unroll]
    for j in 0..S_FRAGS {
        let frag = s.index_mut(j);
        let mut pair = frag[h];
        #[unroll]
        for c in 0..2usize {
            let key = j0 + j * 8 + 2 * t + c;
            let x = select(key < vis, pair[c] * scale, neg_inf());
            pair[c] = x;
            bm = select(x > bm, x, bm);
        }
        frag[h] = pair;
    }
    let bm = quad_max(bm);
    let grow = bm > row.m;
    let mn = select(grow, bm, row.m);
    row.alpha = select(grow, exp_p(row.m - bm, emulate), 1.0f32);
    let mut lb = 0.0f32;
    #[unroll]
    for j in 0..S_FRAGS {
        let frag = s.index_mut(j);
        let mut pair = frag[h];
        #[unroll]
        for c in 0..2usize {
            let key = j0 + j * 8 + 2 * t + c;
            let pj = select(key < vis, exp_p(pair[c] - mn, emulate), 0.0f32);
            pair[c] = pj;
            lb += pj;
        }
        frag[h] = pair;
    }
    row.l = fma_f32(row.l, row.alpha, quad_sum(lb), emulate);
    row.m = mn;
}

/// `o *= α` row by row (exact for `α = 1`).
#[cube]
fn rescale(
    o: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    r0: &Row,
    r1: &Row,
    #[comptime] n: usize,
) {
    #[unroll]
    for j in 0..n {
        let frag = o.index_mut(j);
        frag[0] = frag[0] * Vector::new(r0.alpha);
        frag[1] = frag[1] * Vector::new(r1.alpha);
    }
}

/// `P` (f32, rounded once to `F`) as the A fragments of the four 16-key steps of `P·V`: the
/// m16n8k16 A registers are (row g, k 2t..), (row g + 8, k 2t..), (row g, k 2t + 8..),
/// (row g + 8, k 2t + 8..), i.e. the C pairs of score fragments `2kk` and `2kk + 1`.
#[cube]
fn probabilities<F: Float>(
    s: &Sequence<Array<Vector<f32, Const<2>>>>,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let mut pa = Sequence::<Array<Vector<F, Const<2>>>>::new();
    #[unroll]
    for kk in 0..comptime![KEY_BLOCK / 16] {
        let lo = s.index(comptime![2 * kk]);
        let hi = s.index(comptime![2 * kk + 1]);
        let mut a = Array::<Vector<F, Const<2>>>::new(4usize);
        a[0] = to_half::<F>(lo[0]);
        a[1] = to_half::<F>(lo[1]);
        a[2] = to_half::<F>(hi[0]);
        a[3] = to_half::<F>(hi[1]);
        pa.push(a);
    }
    pa
}

/// An f32 pair rounded to `F`.
#[cube]
fn to_half<F: Float>(x: Vector<f32, Const<2>>) -> Vector<F, Const<2>> {
    let mut y = Vector::<F, Const<2>>::empty();
    y[0] = F::cast_from(x[0]);
    y[1] = F::cast_from(x[1]);
    y
}

/// `o += P·V`: keys in four 16-deep steps ascending, Dh in 16×8 fragments.
#[cube]
fn accumulate_pv<F: Float>(
    v_s: &SharedMemory<F>,
    pa: &Sequence<Array<Vector<F, Const<2>>>>,
    o: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] cfg: TcCfg,
) {
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let pitch = comptime![cfg.pitch()];
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let (_, col0) = warp_origin(cfg);
    #[unroll]
    for kk in 0..comptime![KEY_BLOCK / 16] {
        #[unroll]
        for j in 0..comptime![cfg.cols() / 16] {
            // B = V staged with d contiguous (the GEMM's `b_nfast = true`, transposed
            // ldmatrix): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
            // (keys 8-15, d 8-15).
            let e = (kk * 16 + (quad % 2) * 8 + within) * pitch + col0 + j * 16 + (quad / 2) * 8;
            let quad_b = mma.load_matrix::<F, Const<2>>(
                &v_s.slice(e, e + 8),
                cmma::MatrixIdent::B,
                4usize,
                true,
            );
            mma_pair(&mma, pa.index(kk), &quad_b, o, comptime![2 * j]);
        }
    }
}

/// Row `h` (`g + 8h`) of the lane: `out = o / l` rounded once, −0 canonicalized to +0 (a
/// masked key's `0·v` may turn a −0 sum into +0, so decode and prefill could differ only there);
/// zeros for rows without a visible key.
#[cube]
fn store_row<F: Float>(
    out: &mut Tensor<F>,
    o: &Sequence<Array<Vector<f32, Const<2>>>>,
    row: &Row,
    tile: &TcTile,
    p: &AttnParams,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let (row0, col0) = warp_origin(cfg);
    let r = tile.r0 + row0 + g + h * 8;
    if r < tile.gq {
        let q_len = p.q_len as usize;
        let head = tile.kh * p.group as usize + r / q_len;
        let base = tile.b * p.o.b as usize + head * p.o.h as usize + (r % q_len) * p.o.s as usize;
        let active = row.vis > 0u32;
        #[unroll]
        for j in 0..comptime![cfg.cols() / 8] {
            let pair = o.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                let x = div_rn(pair[c], row.l, comptime![cfg.emulate]);
                let x = select(active && x != 0.0f32, x, 0.0f32);
                out[base + (col0 + j * 8 + 2 * t + c) * p.o.d as usize] = F::cast_from(x);
            }
        }
    }
}

/// Row `h`'s `lse = m + ln_p(l)` (−∞ without a visible key), written by one lane.
#[cube]
fn store_lse(
    lse: &mut Tensor<f32>,
    row: &Row,
    tile: &TcTile,
    p: &AttnParams,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let lane = UNIT_POS_X as usize;
    let (g, t) = (lane / 4, lane % 4);
    let (row0, col0) = warp_origin(cfg);
    let r = tile.r0 + row0 + g + h * 8;
    // One lane per row: the quad's first, of the warp owning the first columns.
    if r < tile.gq && t == 0 && col0 == 0 {
        let q_len = p.q_len as usize;
        let head = tile.kh * p.group as usize + r / q_len;
        let at =
            tile.b * p.lse.b as usize + head * p.lse.h as usize + (r % q_len) * p.lse.s as usize;
        let mut val = neg_inf();
        if row.vis > 0u32 {
            val = row.m + ln_p(row.l, comptime![cfg.emulate]);
        }
        lse[at] = val;
    }
}

/// The tensor-core forward (see the module's documentation).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the kernel's bindings; the scalars travel in `p`
pub(crate) fn attention_tc_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    kv_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    p: AttnParams,
    #[comptime] cfg: TcCfg,
    #[define(F)] _dtype: StorageType,
) {
    let tile = tc_tile(kv_lens, &p, cfg);
    // Q, then K, share one buffer: the query's fragments live in registers after the start.
    let len = comptime![KEY_BLOCK * cfg.pitch()];
    let mut k_s = SharedMemory::<F>::new_aligned(len, 16usize);
    let mut v_s = SharedMemory::<F>::new_aligned(len, 16usize);
    let mut vis_s = SharedMemory::<u32>::new(TC_ROWS);
    let max_vis = row_visibility(&tile, &p, &mut vis_s, cfg) as usize;
    let qa = query_fragments::<F>(q, &tile, &p, &mut k_s, cfg);
    let (row0, _) = warp_origin(cfg);
    let row = row0 + UNIT_POS_X as usize / 4;
    let mut r0 = Row {
        m: neg_inf(),
        l: 0.0f32,
        alpha: 1.0f32,
        vis: vis_s[row],
    };
    let mut r1 = Row {
        m: neg_inf(),
        l: 0.0f32,
        alpha: 1.0f32,
        vis: vis_s[row + 8],
    };
    let mut o = zero_frags(comptime![cfg.cols() / 8]);
    // Up to the last block any row of the cube sees; a block a row cannot see changes nothing
    // of it.
    for kb in 0..max_vis.div_ceil(KEY_BLOCK) {
        let j0 = kb * KEY_BLOCK;
        let ksrc = key_src(&tile, &p.k, j0, max_vis);
        let vsrc = key_src(&tile, &p.v, j0, max_vis);
        stage_rows::<F>(k, &ksrc, &mut k_s, KEY_BLOCK, true, cfg);
        stage_rows::<F>(v, &vsrc, &mut v_s, KEY_BLOCK, true, cfg);
        sync_cube();
        let mut s = scores::<F>(&k_s, &qa, cfg);
        softmax_row(&mut s, &mut r0, j0, p.scale, 0usize, comptime![cfg.emulate]);
        softmax_row(&mut s, &mut r1, j0, p.scale, 1usize, comptime![cfg.emulate]);
        rescale(&mut o, &r0, &r1, comptime![cfg.cols() / 8]);
        let pa = probabilities::<F>(&s);
        accumulate_pv::<F>(&v_s, &pa, &mut o, cfg);
        sync_cube();
    }
    store_row::<F>(out, &o, &r0, &tile, &p, 0usize, cfg);
    store_row::<F>(out, &o, &r1, &tile, &p, 1usize, cfg);
    store_lse(lse, &r0, &tile, &p, 0usize, cfg);
    store_lse(lse, &r1, &tile, &p, 1usize, cfg);
}
