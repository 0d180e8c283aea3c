//! The forward: one cube per (batch row, KV head, tile of `16·rows` query rows of the KV head's
//! group), all query heads of the group in the tile, so each block of 64 keys and values is
//! staged once for all of them.

use super::AttentionRefs;
use super::inputs::{Checked, Layouts, attn_inputs, check_inputs};
use super::math::{div_rn, exp_p, ln_p, neg_inf};
use super::tc_forward::{
    LANES, TC_VECTOR, TC_WARPS, TC_WIDE_WARPS, TcCfg, attention_tc_forward_kernel,
    attention_tc_merge_kernel, split_workspace_len, tc_forward_shared, tc_forward_supported,
    tc_split, tc_vector,
};
use super::tile::{
    AttnCfg, AttnInputs, AttnOutputs, AttnOutputsLaunch, AttnParams, DC, KEY_BLOCK, KEY_SPLIT,
    RowSrc, S_PAD, SCALE_A, SPLIT_BLOCKS, STAGE_LEN, Tile, UNITS, cube_tile, dot_tile,
    fold_weights, group_base, group_rows, key_rows, kv_base, kv_len_of, load_chunk, max_visible,
    visible,
};
use crate::error::KernelError;
use crate::gemm::fma::fma_f32;
use crate::util::{FloatDType, check_out_view, expect_shape, launch_chunks, raw_arg};
use cubecl::prelude::*;

thread_local! {
    static ASYNC_STAGING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Test and perf hook: runs `f` with this thread's tensor-core forward copying K and V by
/// `cp.async` where they travel as 16-byte vectors (and then in cubes of twelve warps where the
/// device has room), instead of staging them through registers in cubes of four warps, so that
/// tests and benchmarks can compare the two (the same bits). The copied path is off by default:
/// on an H100 its twelve-warp cubes are slower at Dh 64 and within 2 % at Dh 128
/// (`benches/results/attention-h100.md`). Other threads are unaffected; the previous setting is
/// restored when `f` returns or unwinds.
#[doc(hidden)]
pub fn with_async_staging<T>(f: impl FnOnce() -> T) -> T {
    crate::util::with_thread_flag(&ASYNC_STAGING, f)
}

/// Whether the tensor-core forward stages K and V by `cp.async` on this client where they
/// travel as 16-byte vectors (else through registers; the same bits).
#[doc(hidden)]
pub fn attention_forward_copies_async<R: Runtime>(client: &ComputeClient<R>) -> bool {
    client.properties().features.copy_async
}

/// Forward: `out [B, H, Q, D]` (the inputs' dtype, every element written) and
/// `lse [B, H, Q]` (f32). The arithmetic is docs/CONTRACT.md's *attention semantics*, element
/// for element the Reference's: keys in blocks of [`super::ATTENTION_KEY_BLOCK`] from key 0,
/// the last cut at the query's last visible key; per block the score max, `α = exp_p(m − m')`,
/// `p_j = exp_p(s_j − m')`, `l_b` by ascending adds, `o_b` as an fma chain over the keys, then
/// `l = fma(l, α, l_b)`, `o = fma(o, α, o_b)`; the walk restarts at every multiple of
/// [`super::ATTENTION_KEY_SPLIT`] keys and the splits a query sees fold in ascending order
/// (`tile::fold_weights`); `out = o / l` rounded once, `lse = m + ln_p(l)`.
/// Queries with a negative position get zeros and `lse = −∞`. f16 / bf16 where
/// [`attention_forward_uses_tensor_cores`] says so: the tensor-core forward (the contract's
/// tensor-core arithmetic, `tc_forward.rs`).
pub fn attention_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
) -> Result<(), KernelError> {
    attention_forward_with(client, inputs, out, lse, SplitExecution::Auto)
}

/// How the tensor-core forward runs keys that span several splits: chosen by speed
/// (`Auto`), or forced for the tests that check both give the same bits.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitExecution {
    /// `Parts` where the tiles alone would leave the device idle (decode at a small batch over
    /// a long cache), else `InCube`.
    Auto,
    /// Each cube walks every split of its rows, folding them as it goes.
    InCube,
    /// One cube per (tile, split), then a kernel that folds the splits (where its f32 workspace
    /// stays within 1 GiB).
    Parts,
}

/// [`attention_forward`] with the split execution of the tensor-core forward chosen by the
/// caller; the FMA forward has one execution.
#[doc(hidden)]
pub fn attention_forward_with<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    out: &TensorBinding<R>,
    lse: &TensorBinding<R>,
    execution: SplitExecution,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let dims = c.dims;
    let ov = check_out_view("out", out, 4, c.dt.size())?;
    expect_shape(
        "out",
        &ov,
        &[dims.batch, dims.heads, dims.q_len, dims.head_dim],
    )?;
    let lv = check_out_view("lse", lse, 3, 4)?;
    expect_shape("lse", &lv, &[dims.batch, dims.heads, dims.q_len])?;
    let rows = dims.batch * dims.heads * dims.q_len;
    if rows == 0 {
        return Ok(());
    }
    let layouts = Layouts {
        o: Some(&ov),
        lse: Some(&lv),
        ..c.layouts()
    };
    if tc_forward_supported(client, c.dt, dims.head_dim) {
        let outs = TcOutputs {
            out,
            lse,
            execution,
        };
        launch_tc(client, inputs, &c, &outs, &layouts);
        return Ok(());
    }
    let cfg = AttnCfg {
        splits: dims.kv_len > KEY_SPLIT,
        ..c.cfg(client, query_rows(&c))
    };
    let tiles = (dims.group() * dims.q_len).div_ceil(UNITS * cfg.rows);
    let cubes = dims.batch * dims.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        unsafe {
            attention_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(UNITS as u32, UNITS as u32),
                attn_inputs(inputs),
                AttnOutputsLaunch::new(raw_arg(out), raw_arg(lse)),
                layouts.params(&c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    Ok(())
}

/// Largest f32 workspace (words, 1 GiB) of [`SplitExecution::Parts`]; past it the cubes fold their
/// splits in shared memory (the same bits).
const PARTS_MAX_WORDS: usize = 1 << 28;

/// The tensor-core forward's outputs and how it runs several splits.
struct TcOutputs<'a, R: Runtime> {
    out: &'a TensorBinding<R>,
    lse: &'a TensorBinding<R>,
    execution: SplitExecution,
}

/// The tensor-core forward's tiling and staging for these inputs (every choice changes no bit):
/// 16 rows per cube where the group has at most 16 (the warps splitting the columns), else 16 per
/// warp; K and V copied by `cp.async` where they travel as 16-byte vectors and
/// [`with_async_staging`] asks for it, and then twelve warps per cube where the device has room,
/// else four.
fn tc_config<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    c: &Checked,
) -> TcCfg {
    let dims = c.dims;
    let mut cfg = TcCfg {
        d: dims.head_dim,
        causal: c.causal,
        emulate: c.cfg(client, 1).emulate,
        split: tc_split(dims.group() * dims.q_len, dims.head_dim),
        // 16-byte loads where Q, K and V allow them; only how bytes travel changes.
        vec: tc_vector(
            &[
                (inputs.query, &c.q),
                (inputs.key, &c.k),
                (inputs.value, &c.v),
            ],
            c.dt.size(),
        ),
        clamped: true,
        async_copy: false,
        splits: false,
        part: false,
        warps: TC_WARPS,
    };
    cfg.async_copy = cfg.vec == TC_VECTOR
        && attention_forward_copies_async(client)
        && ASYNC_STAGING.with(|flag| flag.get());
    let hw = &client.properties().hardware;
    if cfg.async_copy
        && !cfg.split
        && hw.max_units_per_cube as usize >= LANES * TC_WIDE_WARPS
        && hw.max_shared_memory_size >= tc_forward_shared(dims.head_dim, c.dt.size(), TC_WIDE_WARPS)
    {
        cfg.warps = TC_WIDE_WARPS;
    }
    cfg
}

/// The tensor-core forward ([`super::tc_forward`]): one cube per tile of [`tc_config`]; with
/// [`SplitExecution::Parts`] one per (such tile, split of the keys), then the merge.
fn launch_tc<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    c: &Checked,
    outs: &TcOutputs<'_, R>,
    layouts: &Layouts<'_>,
) {
    let dims = c.dims;
    let group_rows = dims.group() * dims.q_len;
    let rows = dims.batch * dims.heads * dims.q_len;
    let splits = dims.kv_len.div_ceil(KEY_SPLIT).max(1);
    let mut cfg = tc_config(client, inputs, c);
    let cubes = dims.batch * dims.kv_heads * group_rows.div_ceil(cfg.rows());
    let ws_len = split_workspace_len(splits, rows, dims.head_dim);
    // Parts where the tiles fill less than two cubes per SM; a choice that changes no bit.
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(0) as usize;
    let parts = splits > 1
        && ws_len <= PARTS_MAX_WORDS
        && match outs.execution {
            SplitExecution::Auto => cubes < 2 * sms,
            SplitExecution::InCube => false,
            SplitExecution::Parts => true,
        };
    cfg.splits = splits > 1 && !parts;
    cfg.part = parts;
    // The kernel takes a workspace argument either way; in-cube calls get a one-word stand-in.
    let ws_len = if parts { ws_len } else { 1 };
    let ws = client.empty(4 * ws_len);
    let grid = if parts { cubes * splits } else { cubes };
    for (start, len) in launch_chunks(client, 0, grid, 1) {
        unsafe {
            attention_tc_forward_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(32, cfg.warps as u32),
                cfg.vec,
                raw_arg(inputs.query),
                raw_arg(inputs.key),
                raw_arg(inputs.value),
                raw_arg(inputs.kv_lens),
                raw_arg(outs.out),
                raw_arg(outs.lse),
                ArrayArg::from_raw_parts(ws.clone(), ws_len),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    if !parts {
        return;
    }
    const MERGE_UNITS: usize = 256;
    for (start, len) in launch_chunks(client, 0, rows * dims.head_dim, MERGE_UNITS) {
        unsafe {
            attention_tc_merge_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len.div_ceil(MERGE_UNITS) as u32, 1, 1),
                CubeDim::new_1d(MERGE_UNITS as u32),
                ArrayArg::from_raw_parts(ws.clone(), ws_len),
                raw_arg(inputs.kv_lens),
                raw_arg(outs.out),
                raw_arg(outs.lse),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
}

/// Which forward runs for `dtype` and `head_dim` on this client: the tensor-core one (f16 /
/// bf16, head sizes multiples of 16 up to 128, CUDA's `mma.sync`) or the FMA one. Depends on
/// nothing else (never on the batch or the lengths).
#[doc(hidden)]
pub fn attention_forward_uses_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDType,
    head_dim: usize,
) -> bool {
    tc_forward_supported(client, dtype, head_dim)
}

/// Rows per unit of the query-row kernels (forward, dQ): the tile is `16·rows` query rows of a
/// KV group. Every element's arithmetic is the same whatever the tile, so the tile may follow
/// the shape: small groups of queries (decode) take 16-row tiles.
pub(crate) fn query_rows(c: &Checked) -> usize {
    let gq = c.dims.group() * c.dims.q_len;
    if gq > 2 * UNITS {
        4
    } else if gq > UNITS {
        2
    } else {
        1
    }
}

/// The forward's per-row values in shared memory: visible keys, the block's visible keys, its
/// max `m'`, `α`, and at the end `l`.
#[derive(CubeType)]
struct RowShared {
    vis: SharedMemory<u32>,
    cnt: SharedMemory<u32>,
    mx: SharedMemory<f32>,
    al: SharedMemory<f32>,
    l: SharedMemory<f32>,
}

/// The FMA forward (see [`attention_forward`]): per key block the scores, the block max and `α`,
/// the probabilities, the row sums and `P·V`; then `lse` and the output.
#[cube(launch_unchecked)]
pub(crate) fn attention_forward_kernel<F: Float>(
    ins: &AttnInputs<F>,
    outs: &mut AttnOutputs<F>,
    p: AttnParams,
    #[comptime] cfg: AttnCfg,
    #[define(F)] _dtype: StorageType,
) {
    let br = comptime![UNITS * cfg.rows];
    // The unit's index: row owners are the units `tid < br`.
    let tid = UNIT_POS_Y as usize * UNITS + UNIT_POS_X as usize;
    let gq = p.group as usize * p.q_len as usize;
    let tile = cube_tile(&p, gq, gq, br);
    let len = kv_len_of(&ins.kv_lens, tile.b * p.lens as usize, p.kv_len);
    let mut stage = SharedMemory::<f32>::new(STAGE_LEN);
    let mut ss = SharedMemory::<f32>::new(br * S_PAD);
    let mut rows = RowShared {
        vis: SharedMemory::<u32>::new(br),
        cnt: SharedMemory::<u32>::new(br),
        mx: SharedMemory::<f32>::new(br),
        al: SharedMemory::<f32>::new(br),
        l: SharedMemory::<f32>::new(br),
    };
    row_visibility(tid, &tile, len, &p, &mut rows.vis, cfg);
    sync_cube();
    let max_vis = max_visible(&rows.vis, br);
    let qsrc = group_rows(group_base(&p.q, &tile, &p), tile.first, tile.gq, &p.q, &p);
    let kbase = kv_base(&p.k, &tile);
    let vbase = kv_base(&p.v, &tile);

    // The split's state, and the splits folded so far (where the keys span several).
    let mut cur = softmax_state(cfg);
    let mut run = softmax_state(cfg);
    let mut s = Array::<f32>::new(comptime![cfg.rows * 4]);
    let blocks = max_vis.div_ceil(KEY_BLOCK);
    for kb in 0..blocks {
        if kb > 0 && kb % SPLIT_BLOCKS == 0 {
            let s0 = kb * KEY_BLOCK - KEY_SPLIT;
            fold_split(tid, s0, s0 == 0, &mut cur, &mut run, &mut rows, cfg);
        }
        let j0 = kb * KEY_BLOCK;
        let bend = min(j0 + KEY_BLOCK, max_vis);
        let ksrc = key_rows(kbase, j0, bend, &p.k);
        block_scores::<F>(
            &ins.q, &qsrc, &ins.k, &ksrc, p.scale, &mut stage, &mut s, &mut ss, cfg,
        );
        block_max(tid, &ss, j0, cur.m, &mut rows, cfg);
        probabilities(&s, &rows, &mut ss, cfg);
        update_sum(tid, &ss, &rows, &mut cur, cfg);
        let vsrc = key_rows(vbase, j0, bend, &p.v);
        accumulate_pv::<F>(
            &ins.v,
            &vsrc,
            p.scale,
            bend - j0,
            &ss,
            &rows,
            &mut stage,
            &mut cur.o,
            cfg,
        );
        // The next block rewrites the scores (needed where no chunk loop ran: D = 0).
        sync_cube();
    }
    if blocks > SPLIT_BLOCKS {
        let s0 = (blocks - 1) / SPLIT_BLOCKS * KEY_SPLIT;
        fold_split(tid, s0, false, &mut cur, &mut run, &mut rows, cfg);
        adopt(&mut cur, &run, cfg);
    }
    write_lse(&mut outs.lse, tid, &tile, cur.m, cur.l, &mut rows, &p, cfg);
    sync_cube();
    write_out::<F>(&mut outs.out, &cur.o, &tile, &rows, &p, cfg);
}

/// A softmax state: the row owner's (unit `tid < 16·rows`, row `first + tid`) max and sum,
/// every unit's `o` accumulators.
#[derive(CubeType)]
struct Softmax {
    m: f32,
    l: f32,
    o: Array<f32>,
}

/// A fresh state: `m = −∞`, `l = 0`, `o = 0`.
#[cube]
fn softmax_state(#[comptime] cfg: AttnCfg) -> Softmax {
    let mut o = Array::<f32>::new(comptime![cfg.rows * cfg.cols()]);
    zero(&mut o, comptime![cfg.rows * cfg.cols()]);
    Softmax {
        m: neg_inf(),
        l: 0.0f32,
        o,
    }
}

/// `cur = run`: the folded splits as the result (where `cfg.splits`).
#[cube]
fn adopt(cur: &mut Softmax, run: &Softmax, #[comptime] cfg: AttnCfg) {
    if comptime![cfg.splits] {
        cur.m = run.m;
        cur.l = run.l;
        #[unroll]
        for x in 0..comptime![cfg.rows * cfg.cols()] {
            cur.o[x] = run.o[x];
        }
    }
}

/// At a split boundary: the finished split `cur` (its keys from `s0`) folded into `run` for the
/// rows that see one of its keys (taken as it is where it is the `first`), then `cur` restarts.
/// Only where `cfg.splits` (no row sees a key past the first split otherwise).
#[cube]
fn fold_split(
    tid: usize,
    s0: usize,
    first: bool,
    cur: &mut Softmax,
    run: &mut Softmax,
    rows: &mut RowShared,
    #[comptime] cfg: AttnCfg,
) {
    if comptime![cfg.splits] {
        let emulate = comptime![cfg.emulate];
        if tid < comptime![UNITS * cfg.rows] {
            let seen = (s0 as u32) < rows.vis[tid];
            let mut a = 1.0f32;
            let mut b = 1.0f32;
            if first {
                run.m = cur.m;
                run.l = cur.l;
            } else if seen {
                let (mx, wa, wb) = fold_weights(run.m, cur.m, false, emulate);
                run.l = fma_f32(run.l, wa, cur.l * wb, emulate);
                run.m = mx;
                a = wa;
                b = wb;
            }
            rows.al[tid] = a;
            rows.mx[tid] = b;
            rows.cnt[tid] = u32::cast_from(first || seen);
            cur.m = neg_inf();
            cur.l = 0.0f32;
        }
        sync_cube();
        let ty = UNIT_POS_Y as usize;
        let ncol = comptime![cfg.cols()];
        #[unroll]
        for i in 0..comptime![cfg.rows] {
            let row = ty + i * UNITS;
            let take = rows.cnt[row] > 0u32;
            #[unroll]
            for c in 0..ncol {
                let x = i * ncol + c;
                if first {
                    run.o[x] = cur.o[x];
                } else if take {
                    run.o[x] = fma_f32(run.o[x], rows.al[row], cur.o[x] * rows.mx[row], emulate);
                }
                cur.o[x] = 0.0f32;
            }
        }
    }
}

/// `n` zeros into `a`.
#[cube]
pub(crate) fn zero(a: &mut Array<f32>, #[comptime] n: usize) {
    #[unroll]
    for x in 0..n {
        a[x] = 0.0f32;
    }
}

/// Row owners (unit `tid < 16·rows`): the row's visible keys into `vis_s` (0 past the group).
#[cube]
fn row_visibility(
    tid: usize,
    tile: &Tile,
    len: i32,
    p: &AttnParams,
    vis_s: &mut SharedMemory<u32>,
    #[comptime] cfg: AttnCfg,
) {
    if tid < comptime![UNITS * cfg.rows] {
        let r = tile.first + tid;
        let mut vis = 0u32;
        if r < tile.gq {
            vis = visible(len, p.q_len, r % p.q_len as usize, comptime![cfg.causal]);
        }
        vis_s[tid] = vis;
    }
}

/// The unit's scores of one key block (`s = q'·k`, one fma chain over d each), also into `ss`
/// for the row owners.
#[cube]
fn block_scores<F: Float>(
    q: &Tensor<F>,
    qsrc: &RowSrc,
    k: &Tensor<F>,
    ksrc: &RowSrc,
    scale: f32,
    stage: &mut SharedMemory<f32>,
    s: &mut Array<f32>,
    ss: &mut SharedMemory<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let ra = comptime![cfg.rows];
    dot_tile::<F>(
        q,
        qsrc,
        k,
        ksrc,
        scale,
        stage,
        s,
        ra,
        4usize,
        SCALE_A,
        comptime![cfg.d],
        comptime![cfg.emulate],
    );
    #[unroll]
    for i in 0..ra {
        #[unroll]
        for c in 0..4usize {
            ss[(ty + i * UNITS) * S_PAD + tx + c * UNITS] = s[i * 4 + c];
        }
    }
    sync_cube();
}

/// Row owners: the block's max `m'` over the row's visible keys (from `m`), `α = exp_p(m − m')`
/// and the row's visible keys in the block.
#[cube]
fn block_max(
    tid: usize,
    ss: &SharedMemory<f32>,
    j0: usize,
    m: f32,
    rows: &mut RowShared,
    #[comptime] cfg: AttnCfg,
) {
    if tid < comptime![UNITS * cfg.rows] {
        let vis = rows.vis[tid] as usize;
        let mut cnt = 0usize;
        if vis > j0 {
            cnt = min(KEY_BLOCK, vis - j0);
        }
        let mut mn = m;
        for j in 0..cnt {
            let x = ss[tid * S_PAD + j];
            mn = select(x > mn, x, mn);
        }
        rows.mx[tid] = mn;
        rows.al[tid] = exp_p(m - mn, comptime![cfg.emulate]);
        rows.cnt[tid] = cnt as u32;
    }
    sync_cube();
}

/// `p = exp_p(s − m')` over the unit's own scores of visible keys, in `ss`.
#[cube]
fn probabilities(
    s: &Array<f32>,
    rows: &RowShared,
    ss: &mut SharedMemory<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    #[unroll]
    for i in 0..comptime![cfg.rows] {
        let row = ty + i * UNITS;
        #[unroll]
        for c in 0..4usize {
            let key = tx + c * UNITS;
            if (key as u32) < rows.cnt[row] {
                ss[row * S_PAD + key] = exp_p(s[i * 4 + c] - rows.mx[row], comptime![cfg.emulate]);
            }
        }
    }
    sync_cube();
}

/// Row owners: `l_b` by ascending adds, `l = fma(l, α, l_b)`, `m = m'`.
#[cube]
fn update_sum(
    tid: usize,
    ss: &SharedMemory<f32>,
    rows: &RowShared,
    cur: &mut Softmax,
    #[comptime] cfg: AttnCfg,
) {
    if tid < comptime![UNITS * cfg.rows] {
        let cnt = rows.cnt[tid] as usize;
        if cnt > 0 {
            let mut lb = 0.0f32;
            for j in 0..cnt {
                lb += ss[tid * S_PAD + j];
            }
            cur.l = fma_f32(cur.l, rows.al[tid], lb, comptime![cfg.emulate]);
            cur.m = rows.mx[tid];
        }
    }
}

/// `o_b` = fma chain over the block's `nk` keys of `p·v`, then `o = fma(o, α, o_b)`, chunk by
/// chunk of `DC` columns.
#[cube]
fn accumulate_pv<F: Float>(
    v: &Tensor<F>,
    vsrc: &RowSrc,
    scale: f32,
    nk: usize,
    ss: &SharedMemory<f32>,
    rows: &RowShared,
    stage: &mut SharedMemory<f32>,
    o: &mut Array<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let ty = UNIT_POS_Y as usize;
    let ra = comptime![cfg.rows];
    let ncol = comptime![cfg.cols()];
    let emulate = comptime![cfg.emulate];
    let unroll = comptime![!cfg.emulate];
    #[unroll(unroll)]
    for ch in 0..comptime![cfg.chunks()] {
        load_chunk::<F>(
            v,
            vsrc,
            ch * DC,
            scale,
            stage,
            0usize,
            KEY_BLOCK,
            false,
            comptime![cfg.d],
        );
        sync_cube();
        let mut ob = Array::<f32>::new(comptime![cfg.rows * 2]);
        zero(&mut ob, comptime![cfg.rows * 2]);
        chunk_pv(stage, ss, rows, nk, &mut ob, cfg);
        #[unroll]
        for i in 0..ra {
            let row = ty + i * UNITS;
            if rows.cnt[row] > 0u32 {
                #[unroll]
                for c in 0..2usize {
                    let x = i * ncol + ch * 2 + c;
                    o[x] = fma_f32(o[x], rows.al[row], ob[i * 2 + c], emulate);
                }
            }
        }
        sync_cube();
    }
}

/// One chunk's `o_b`: fma chain over the block's keys ascending of `p·v` (staged values).
#[cube]
fn chunk_pv(
    stage: &SharedMemory<f32>,
    ss: &SharedMemory<f32>,
    rows: &RowShared,
    nk: usize,
    ob: &mut Array<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    for j in 0..nk {
        let v0 = stage[j * DC + tx];
        let v1 = stage[j * DC + tx + UNITS];
        #[unroll]
        for i in 0..comptime![cfg.rows] {
            let row = ty + i * UNITS;
            if (j as u32) < rows.cnt[row] {
                let pj = ss[row * S_PAD + j];
                ob[i * 2] = fma_f32(pj, v0, ob[i * 2], comptime![cfg.emulate]);
                ob[i * 2 + 1] = fma_f32(pj, v1, ob[i * 2 + 1], comptime![cfg.emulate]);
            }
        }
    }
}

/// Row owners: `lse = m + ln_p(l)` (−∞ without a visible key), and `l` into shared memory for
/// the output.
#[cube]
fn write_lse(
    lse: &mut Tensor<f32>,
    tid: usize,
    tile: &Tile,
    m: f32,
    l: f32,
    rows: &mut RowShared,
    p: &AttnParams,
    #[comptime] cfg: AttnCfg,
) {
    if tid < comptime![UNITS * cfg.rows] {
        rows.l[tid] = l;
        let r = tile.first + tid;
        if r < tile.gq {
            let q_len = p.q_len as usize;
            let h = tile.kh * p.group as usize + r / q_len;
            let i = r % q_len;
            let at = tile.b * p.lse.b as usize + h * p.lse.h as usize + i * p.lse.s as usize;
            let mut val = neg_inf();
            if rows.vis[tid] > 0u32 {
                val = m + ln_p(l, comptime![cfg.emulate]);
            }
            lse[at] = val;
        }
    }
}

/// `out = o / l` rounded once, zeros for rows without a visible key.
#[cube]
fn write_out<F: Float>(
    out: &mut Tensor<F>,
    o: &Array<f32>,
    tile: &Tile,
    rows: &RowShared,
    p: &AttnParams,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let d = comptime![cfg.d];
    let ncol = comptime![cfg.cols()];
    let emulate = comptime![cfg.emulate];
    let unroll = comptime![!cfg.emulate];
    let q_len = p.q_len as usize;
    #[unroll]
    for i in 0..comptime![cfg.rows] {
        let row = ty + i * UNITS;
        let r = tile.first + row;
        if r < tile.gq {
            let h = tile.kh * p.group as usize + r / q_len;
            let qi = r % q_len;
            let base = tile.b * p.o.b as usize + h * p.o.h as usize + qi * p.o.s as usize;
            let active = rows.vis[row] > 0u32;
            let lv = rows.l[row];
            #[unroll(unroll)]
            for ch in 0..comptime![cfg.chunks()] {
                #[unroll]
                for c in 0..2usize {
                    let col = ch * DC + tx + c * UNITS;
                    if col < d {
                        let val = select(
                            active,
                            div_rn(o[i * ncol + ch * 2 + c], lv, emulate),
                            0.0f32,
                        );
                        out[base + col * p.o.d as usize] = F::cast_from(val);
                    }
                }
            }
        }
    }
}
