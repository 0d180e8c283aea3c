//! The tensor-core backward for f16 / bf16 on CUDA, wherever the forward runs on the tensor cores
//! (`ldmatrix` + `mma.sync` 16×8×16, f32 accumulators). After the FMA backward's δ kernel (per
//! query row `δ`, its visible keys or 0 where it takes no part, `lse`):
//! * dQ: one cube of 4 warps per (batch row, KV head, 64 query rows of the KV head's group), each
//!   warp 16 rows; keys in blocks of 64 from key 0 ascending: `S = Q·Kᵀ`, `dP = dO·Vᵀ`,
//!   `p = exp(fma(S, scale, −lse))`, `dS = p·(dP − δ)`, `dQ += dtype(dS)·K`; `dq = dQ·scale`.
//!   The next block's K and V are loaded into registers while `dS·K` runs.
//! * dK/dV: one cube of 4 warps per (batch row, KV head, 64 keys), each warp 16 keys; over the
//!   group's query heads ascending, then blocks of 64 queries at fixed positions (from query 0)
//!   ascending: `Sᵀ = K·Qᵀ`, `dPᵀ = V·dOᵀ`, `dV += dtype(Pᵀ)·dO`, `dK += dtype(dSᵀ)·Q`;
//!   `dk = dK·scale`.
//!
//! Why the bits stay invariant: an MMA output row depends only on its own A row, so a query's
//! `dq` depends on its own row and the pinned key blocks, and a key's `dk`/`dv` on its own row
//! and the query blocks at fixed positions. Rows that take no part (the δ kernel's flag: a
//! negative position or an all-zero `dO`, padding) are staged as zeros and their `p`, `dS`
//! selected to 0, so they add exact zeros, NaN in them included; query blocks where no row sees
//! a key of the cube are skipped (an accumulator that starts at +0 never holds −0, so adding
//! zeros changes no bit either way). dK/dV stages its keys past `kv_lens[b]` as zeros; dQ's
//! loop stages keys past the cube's last visible key as copies of it (whole 16-byte moves; their
//! `p` and `dS` are selected to 0), and dK/dV loads query blocks from clamped rows before zeroing
//! the rows that take no part.

use super::math::fast_exp;
use super::tc_forward::{
    LANES, S_FRAGS, TC_ROWS, TC_THREADS, TcCfg, TcTile, a_fragment, a_fragments, accumulate_pv,
    group_row_at, group_src, key_src, lane_group_row, load_rows, probabilities, score_step, scores,
    store_rows, tc_tile, warp_min_visible, warp_origin, zero_frags,
};
use super::tile::{
    AttnParams, KEY_BLOCK, KvGrads, RowState, key_rows, kv_len_of, load_row_state, row_state,
};
use cubecl::prelude::*;

/// The backward kernels' inputs: `q`, `k`, `v`, `dOut` (`N`-element vectors), the δ kernel's
/// workspace and `kv_lens`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct TcGradInputs<F: Float, N: Size> {
    pub q: Tensor<Vector<F, N>>,
    pub k: Tensor<Vector<F, N>>,
    pub v: Tensor<Vector<F, N>>,
    pub grad_out: Tensor<Vector<F, N>>,
    pub ws: Tensor<u32>,
    pub kv_lens: Tensor<i32>,
}

/// Rows `first ..` (64, those at or past `limit` taking no part) of the δ kernel's workspace
/// into `rows`; returns the largest `vis` (every unit).
#[cube]
fn block_row_state(
    ws: &Tensor<u32>,
    base: usize,
    first: usize,
    limit: usize,
    rows: &mut RowState,
) -> usize {
    load_row_state(ws, base, first, limit, rows, TC_ROWS);
    sync_cube();
    // Two rows per lane, then the warp's maximum (each warp computes the same value).
    let lane = UNIT_POS_X as usize;
    plane_max(max(rows.vis[lane], rows.vis[lane + LANES])) as usize
}

/// [`store_rows`] with the rows that take no part (`vis == 0`) written as zeros.
#[cube]
fn store_active_rows<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    smem: &mut SharedMemory<Vector<F, N>>,
    vis: &SharedMemory<u32>,
    #[comptime] cfg: TcCfg,
) {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let per_row = comptime![cfg.d / cfg.vec];
    let pitch = comptime![cfg.pitch() / cfg.vec];
    // Stored whole, then overwritten with zeros where the row takes no part: a select would
    // move each half-word of the vector on its own.
    #[unroll]
    for e in 0..comptime![cfg.loads(TC_ROWS)] {
        let idx = tid + e * TC_THREADS;
        smem[(idx / per_row) * pitch + idx % per_row] = regs[e];
    }
    #[unroll]
    for e in 0..comptime![cfg.loads(TC_ROWS)] {
        let idx = tid + e * TC_THREADS;
        let rr = idx / per_row;
        if vis[rr] == 0u32 {
            smem[rr * pitch + idx % per_row] = Vector::<F, N>::new(F::new(0.0));
        }
    }
}

/// `A·Bᵀ` of the warp's 16 staged rows of `a_s` and the 64 staged rows of `b_s` (eight 16×8
/// fragments), 16-deep steps over Dh ascending; A fragments loaded one step at a time.
#[cube]
fn products<F: Float, N: Size>(
    a_s: &SharedMemory<Vector<F, N>>,
    b_s: &SharedMemory<Vector<F, N>>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut s = zero_frags(S_FRAGS);
    #[unroll]
    for kk in 0..comptime![cfg.d / 16] {
        let a = a_fragment::<F, N>(a_s, kk, cfg);
        score_step::<F, N>(b_s, &a, kk, &mut s, cfg);
    }
    s
}

/// The dQ kernel's `dS` for the lane's row `h` (`g + 8h`), in place of its scores:
/// `p = exp(fma(S, scale, −lse))`, `dS = p·(dP − δ)`, exactly 0 for keys the row does not see
/// where `masked`.
#[cube]
fn row_ds(
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp: &Sequence<Array<Vector<f32, Const<2>>>>,
    row: &LaneRow,
    scale: f32,
    j0: usize,
    #[comptime] h: usize,
    #[comptime] masked: bool,
) {
    let t = UNIT_POS_X as usize % 4;
    #[unroll]
    for j in 0..S_FRAGS {
        let dpair = dp.index(j)[h];
        let frag = s.index_mut(j);
        let mut pair = frag[h];
        #[unroll]
        for c in 0..2usize {
            let pj = fast_exp(fma(pair[c], scale, -row.lse));
            let mut ds = pj * (dpair[c] - row.del);
            if comptime![masked] {
                ds = select(j0 + j * 8 + 2 * t + c < row.vis, ds, 0.0f32);
            }
            pair[c] = ds;
        }
        frag[h] = pair;
    }
}

/// The state of one of a lane's two query rows.
#[derive(CubeType, Clone, Copy)]
struct LaneRow {
    vis: usize,
    lse: f32,
    del: f32,
}

/// The state of the lane's row `h` (`g + 8h` of its warp).
#[cube]
fn lane_row(rows: &RowState, #[comptime] h: usize, #[comptime] cfg: TcCfg) -> LaneRow {
    let (row0, _) = warp_origin(cfg);
    let r = row0 + UNIT_POS_X as usize / 4 + h * 8;
    LaneRow {
        vis: rows.vis[r] as usize,
        lse: rows.lse[r],
        del: rows.del[r],
    }
}

/// Row `h` of the lane: `dq = dQ·scale` rounded once, zeros for rows that take no part.
#[cube]
fn store_dq<F: Float>(
    grad_query: &mut Tensor<F>,
    dq: &Sequence<Array<Vector<f32, Const<2>>>>,
    vis: usize,
    tile: &TcTile,
    p: &AttnParams,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let t = UNIT_POS_X as usize % 4;
    let r = lane_group_row(tile, h, cfg);
    if r < tile.gq {
        let base = group_row_at(tile, &p.gq, p, r);
        #[unroll]
        for j in 0..comptime![cfg.d / 8] {
            let pair = dq.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                let x = select(vis > 0, pair[c] * p.scale, 0.0f32);
                grad_query[base + (j * 8 + 2 * t + c) * p.gq.d as usize] = F::cast_from(x);
            }
        }
    }
}

/// dQ (see the module's documentation).
#[cube(launch_unchecked)]
pub(crate) fn attention_tc_dq_kernel<F: Float, N: Size>(
    ins: &TcGradInputs<F, N>,
    grad_query: &mut Tensor<F>,
    p: AttnParams,
    #[comptime] cfg: TcCfg,
    #[define(F)] _dtype: StorageType,
) {
    let tile = tc_tile(&ins.kv_lens, &p, cfg);
    let len = comptime![KEY_BLOCK * cfg.pitch() / cfg.vec];
    let mut k_s = SharedMemory::<Vector<F, N>>::new_aligned(len, 16usize);
    let mut v_s = SharedMemory::<Vector<F, N>>::new_aligned(len, 16usize);
    let mut g_s = SharedMemory::<Vector<F, N>>::new_aligned(len, 16usize);
    let mut rows = row_state(TC_ROWS);
    let group_base = (tile.b * p.heads as usize + tile.kh * p.group as usize) * p.q_len as usize;
    let max_vis = block_row_state(&ins.ws, group_base, tile.r0, tile.gq, &mut rows);
    let warp_vis = warp_min_visible(&rows.vis, &tile, max_vis as u32, cfg) as usize;
    // Q (through K's buffer) into registers, dO into its own buffer; rows that take no part
    // as zeros.
    let qsrc = group_src(&tile, &p.q, &p);
    let gsrc = group_src(&tile, &p.go, &p);
    let regs = load_rows::<F, N>(&ins.q, &qsrc, TC_ROWS, false, cfg);
    store_active_rows::<F, N>(&regs, &mut k_s, &rows.vis, cfg);
    let regs = load_rows::<F, N>(&ins.grad_out, &gsrc, TC_ROWS, false, cfg);
    store_active_rows::<F, N>(&regs, &mut g_s, &rows.vis, cfg);
    sync_cube();
    let qa = a_fragments::<F, N>(&k_s, cfg);
    sync_cube();
    let keys = load_rows::<F, N>(
        &ins.k,
        &key_src(&tile, &p.k, 0, max_vis),
        KEY_BLOCK,
        true,
        cfg,
    );
    let values = load_rows::<F, N>(
        &ins.v,
        &key_src(&tile, &p.v, 0, max_vis),
        KEY_BLOCK,
        true,
        cfg,
    );
    store_rows::<F, N>(&keys, &mut k_s, KEY_BLOCK, cfg);
    store_rows::<F, N>(&values, &mut v_s, KEY_BLOCK, cfg);
    sync_cube();
    let row_a = lane_row(&rows, 0usize, cfg);
    let row_b = lane_row(&rows, 1usize, cfg);
    let mut dq = zero_frags(comptime![cfg.d / 8]);
    for kb in 0..max_vis.div_ceil(KEY_BLOCK) {
        let j0 = kb * KEY_BLOCK;
        let mut s = scores::<F, N>(&k_s, &qa, cfg);
        let dp = products::<F, N>(&g_s, &v_s, cfg);
        if j0 + KEY_BLOCK > warp_vis {
            row_ds(&mut s, &dp, &row_a, p.scale, j0, 0usize, true);
            row_ds(&mut s, &dp, &row_b, p.scale, j0, 1usize, true);
        } else {
            row_ds(&mut s, &dp, &row_a, p.scale, j0, 0usize, false);
            row_ds(&mut s, &dp, &row_b, p.scale, j0, 1usize, false);
        }
        let dsa = probabilities::<F>(&s);
        // The next block's K and V in flight while `dS·K` runs (past `max_vis`, copies of its
        // last key: `p = dS = 0` there, whole 16-byte moves).
        let next = j0 + KEY_BLOCK;
        let keys = load_rows::<F, N>(
            &ins.k,
            &key_src(&tile, &p.k, next, max_vis),
            KEY_BLOCK,
            true,
            comptime![cfg.clamped()],
        );
        let values = load_rows::<F, N>(
            &ins.v,
            &key_src(&tile, &p.v, next, max_vis),
            KEY_BLOCK,
            true,
            comptime![cfg.clamped()],
        );
        accumulate_pv::<F, N>(&k_s, &dsa, &mut dq, cfg);
        sync_cube();
        store_rows::<F, N>(&keys, &mut k_s, KEY_BLOCK, cfg);
        store_rows::<F, N>(&values, &mut v_s, KEY_BLOCK, cfg);
        sync_cube();
    }
    store_dq::<F>(grad_query, &dq, row_a.vis, &tile, &p, 0usize, cfg);
    store_dq::<F>(grad_query, &dq, row_b.vis, &tile, &p, 1usize, cfg);
}

/// The dK/dV kernel's `Pᵀ` and `dSᵀ` for the lane's key row `h` (`g + 8h`, key `key`) over the
/// block's 64 queries (columns), in place of `Sᵀ` and `dPᵀ`: `p = exp(fma(S, scale, −lse_q))`,
/// `dS = p·(dP − δ_q)`, both exactly 0 where the query does not see the key (or takes no part).
#[cube]
fn key_row_grads(
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    dp: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    rows: &RowState,
    key: usize,
    scale: f32,
    #[comptime] h: usize,
) {
    let t = UNIT_POS_X as usize % 4;
    #[unroll]
    for j in 0..S_FRAGS {
        let sf = s.index_mut(j);
        let mut sp = sf[h];
        let df = dp.index_mut(j);
        let mut dpp = df[h];
        #[unroll]
        for c in 0..2usize {
            let col = j * 8 + 2 * t + c;
            let seen = key < rows.vis[col] as usize;
            let pj = fast_exp(fma(sp[c], scale, -rows.lse[col]));
            let ds = pj * (dpp[c] - rows.del[col]);
            sp[c] = select(seen, pj, 0.0f32);
            dpp[c] = select(seen, ds, 0.0f32);
        }
        sf[h] = sp;
        df[h] = dpp;
    }
}

/// Key row `h` of the lane (the cube's keys start at `tile.r0`): `dk = dK·scale` and `dv = dV`,
/// rounded once.
#[cube]
fn store_dkv<F: Float>(
    outs: &mut KvGrads<F>,
    dk: &Sequence<Array<Vector<f32, Const<2>>>>,
    dv: &Sequence<Array<Vector<f32, Const<2>>>>,
    tile: &TcTile,
    p: &AttnParams,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let t = UNIT_POS_X as usize % 4;
    let key = lane_group_row(tile, h, cfg);
    if key < p.kv_len as usize {
        let kbase = tile.b * p.gk.b as usize + tile.kh * p.gk.h as usize + key * p.gk.s as usize;
        let vbase = tile.b * p.gv.b as usize + tile.kh * p.gv.h as usize + key * p.gv.s as usize;
        #[unroll]
        for j in 0..comptime![cfg.d / 8] {
            let kp = dk.index(j)[h];
            let vp = dv.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                let col = j * 8 + 2 * t + c;
                outs.grad_key[kbase + col * p.gk.d as usize] = F::cast_from(kp[c] * p.scale);
                outs.grad_value[vbase + col * p.gv.d as usize] = F::cast_from(vp[c]);
            }
        }
    }
}

/// The first block of 64 queries with a row that can see key `k0` (the blocks before it add
/// nothing: their rows see fewer keys): causal, row `i` sees `k0` from `i = k0 + Q − len`;
/// otherwise every row with a position (`i ≥ Q − len`) sees it where `k0 < len`, none else.
#[cube]
fn first_query_block(k0: usize, len: usize, q_len: usize, #[comptime] causal: bool) -> usize {
    let mut first = q_len;
    if k0 < len {
        let mut from = q_len;
        if comptime![causal] {
            from += k0;
        }
        first = 0usize;
        if from > len {
            first = from - len;
        }
    }
    first / TC_ROWS
}

/// dK/dV (see the module's documentation).
#[cube(launch_unchecked)]
pub(crate) fn attention_tc_dkv_kernel<F: Float, N: Size>(
    ins: &TcGradInputs<F, N>,
    outs: &mut KvGrads<F>,
    p: AttnParams,
    #[comptime] cfg: TcCfg,
    #[define(F)] _dtype: StorageType,
) {
    let key_tiles = (p.kv_len as usize).div_ceil(KEY_BLOCK);
    let cube = p.offset as usize + CUBE_POS_X as usize;
    let bkh = cube / key_tiles;
    let b = bkh / p.kv_heads as usize;
    let kh = bkh % p.kv_heads as usize;
    let k0 = (cube % key_tiles) * KEY_BLOCK;
    let len = kv_len_of(&ins.kv_lens, b * p.lens as usize, p.kv_len) as usize;
    // The tile's rows are the cube's keys.
    let tile = TcTile {
        b,
        kh,
        r0: k0,
        gq: 0usize,
        len: 0i32,
        split: 0usize,
    };
    let smem_len = comptime![KEY_BLOCK * cfg.pitch() / cfg.vec];
    let mut k_s = SharedMemory::<Vector<F, N>>::new_aligned(smem_len, 16usize);
    let mut v_s = SharedMemory::<Vector<F, N>>::new_aligned(smem_len, 16usize);
    let mut q_s = SharedMemory::<Vector<F, N>>::new_aligned(smem_len, 16usize);
    let mut g_s = SharedMemory::<Vector<F, N>>::new_aligned(smem_len, 16usize);
    let mut rows = row_state(TC_ROWS);
    let keys = load_rows::<F, N>(&ins.k, &key_src(&tile, &p.k, k0, len), KEY_BLOCK, true, cfg);
    let values = load_rows::<F, N>(&ins.v, &key_src(&tile, &p.v, k0, len), KEY_BLOCK, true, cfg);
    store_rows::<F, N>(&keys, &mut k_s, KEY_BLOCK, cfg);
    store_rows::<F, N>(&values, &mut v_s, KEY_BLOCK, cfg);
    let key_a = lane_group_row(&tile, 0usize, cfg);
    let mut dk = zero_frags(comptime![cfg.d / 8]);
    let mut dv = zero_frags(comptime![cfg.d / 8]);
    let q_len = p.q_len as usize;
    let qb0 = first_query_block(k0, len, q_len, comptime![cfg.causal]);
    for hq in 0..p.group as usize {
        let head = kh * p.group as usize + hq;
        let row_base = (b * p.heads as usize + head) * q_len;
        for qb in qb0..q_len.div_ceil(TC_ROWS) {
            let i0 = qb * TC_ROWS;
            // Also orders the previous block's reads of q_s / g_s before this block's stores.
            let block_vis = block_row_state(&ins.ws, row_base, i0, q_len, &mut rows);
            if block_vis > k0 {
                let src = key_rows(b * p.q.b as usize + head * p.q.h as usize, i0, q_len, &p.q);
                let regs = load_rows::<F, N>(&ins.q, &src, TC_ROWS, true, comptime![cfg.clamped()]);
                store_active_rows::<F, N>(&regs, &mut q_s, &rows.vis, cfg);
                let src = key_rows(
                    b * p.go.b as usize + head * p.go.h as usize,
                    i0,
                    q_len,
                    &p.go,
                );
                let regs =
                    load_rows::<F, N>(&ins.grad_out, &src, TC_ROWS, true, comptime![cfg.clamped()]);
                store_active_rows::<F, N>(&regs, &mut g_s, &rows.vis, cfg);
                sync_cube();
                let mut s = products::<F, N>(&k_s, &q_s, cfg);
                let mut dp = products::<F, N>(&v_s, &g_s, cfg);
                key_row_grads(&mut s, &mut dp, &rows, key_a, p.scale, 0usize);
                key_row_grads(&mut s, &mut dp, &rows, key_a + 8, p.scale, 1usize);
                let pa = probabilities::<F>(&s);
                let dsa = probabilities::<F>(&dp);
                accumulate_pv::<F, N>(&g_s, &pa, &mut dv, cfg);
                accumulate_pv::<F, N>(&q_s, &dsa, &mut dk, cfg);
            }
            sync_cube();
        }
    }
    store_dkv::<F>(outs, &dk, &dv, &tile, &p, 0usize, cfg);
    store_dkv::<F>(outs, &dk, &dv, &tile, &p, 1usize, cfg);
}

const _: () = assert!(TC_ROWS == KEY_BLOCK); // query blocks and key blocks share the buffers' size
const _: () = assert!(TC_ROWS == 2 * LANES); // block_row_state: two rows per lane
