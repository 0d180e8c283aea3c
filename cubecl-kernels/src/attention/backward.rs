//! The backward: the δ kernel (per query row), the dQ kernel (tiles of query rows, keys
//! ascending) and the dK/dV kernel (tiles of keys, query rows of the group ascending).

use super::forward::{query_rows, zero};
use super::inputs::{Checked, Layouts, check_inputs, grad_inputs};
use super::math::exp_p;
use super::tc_backward::{TcGradInputsLaunch, attention_tc_dkv_kernel, attention_tc_dq_kernel};
use super::tc_forward::{TC_WARPS, TcCfg, tc_backward_supported, tc_vector, vectors_fit};
use super::tile::{
    AttnCfg, AttnParams, DC, DKV_PAD, DKV_ROWS, DeltaInputs, DeltaInputsLaunch, GradInputs,
    KEY_BLOCK, KvGrads, KvGradsLaunch, RowSrc, RowState, S_PAD, SCALE_A, SCALE_B, SCALE_NONE,
    STAGE_LEN, Strides4, THREADS, Tile, UNITS, cube_tile, dot_tile, group_base, group_rows,
    key_rows, kv_base, kv_len_of, load_chunk, load_row_state, max_visible, row_state, visible,
};
use super::{AttentionGradRefs, AttentionRefs, attention_backward_workspace_len};
use crate::error::KernelError;
use crate::gemm::fma::fma_f32;
use crate::util::{View, check_out_view, check_view, expect_shape, launch_chunks, raw_arg};
use cubecl::prelude::*;

/// Backward: `grad_query`, `grad_key`, `grad_value` (the inputs' dtype, every element written).
///
/// Per query row `δ = fma-chain over d of f32(dO_d)·f32(out_d)`; rows with a negative position
/// or an all-zero `dO` row take no part (zero `dQ`, nothing added to `dK`/`dV`, NaN in them
/// included). For each visible key `p = exp_p(s_j − lse)`, `dp = fma-chain of f32(dO)·f32(v_j)`,
/// `ds = p·(dp − δ)`; `dq = (fma-chain over keys ascending of ds·f32(k_j))·scale`;
/// `dv_j = fma-chain of p·f32(dO)`, `dk_j = fma-chain of ds·q'` over the group's query heads
/// ascending, then queries ascending. Each rounded once. No atomics.
pub fn attention_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let d = c.dims;
    let es = c.dt.size();
    let q_shape = [d.batch, d.heads, d.q_len, d.head_dim];
    let kv_shape = [d.batch, d.kv_heads, d.kv_len, d.head_dim];
    let ov = check_view("out", grads.out, 4, es)?;
    expect_shape("out", &ov, &q_shape)?;
    let lv = check_view("lse", grads.lse, 3, 4)?;
    expect_shape("lse", &lv, &[d.batch, d.heads, d.q_len])?;
    let gov = check_view("grad_out", grads.grad_out, 4, es)?;
    expect_shape("grad_out", &gov, &q_shape)?;
    let gqv = check_out_view("grad_query", grads.grad_query, 4, es)?;
    expect_shape("grad_query", &gqv, &q_shape)?;
    let gkv = check_out_view("grad_key", grads.grad_key, 4, es)?;
    expect_shape("grad_key", &gkv, &kv_shape)?;
    let gvv = check_out_view("grad_value", grads.grad_value, 4, es)?;
    expect_shape("grad_value", &gvv, &kv_shape)?;
    let rows = d.batch * d.heads * d.q_len;
    let ws_len = attention_backward_workspace_len(d.batch, d.heads, d.q_len);
    let wv = check_out_view("workspace", grads.workspace, 1, 4)?;
    if wv.dim(0) < ws_len {
        return Err(KernelError::BufferTooSmall {
            arg: "workspace",
            needed: ws_len,
            got: wv.dim(0),
        });
    }
    if ws_len > 0 && wv.stride(0) != 1 {
        return Err(KernelError::Layout {
            arg: "workspace",
            reason: format!("must be contiguous (stride 1), got stride {}", wv.stride(0)),
        });
    }
    if d.head_dim == 0 {
        return Ok(()); // no gradient element exists
    }
    let layouts = Layouts {
        o: Some(&ov),
        go: Some(&gov),
        gq: Some(&gqv),
        gk: Some(&gkv),
        gv: Some(&gvv),
        lse: Some(&lv),
        ..c.layouts()
    };
    let tc = tc_backward_supported(client, c.dt, d.head_dim);
    if rows > 0 {
        launch_delta(client, inputs, grads, &c, &layouts)?;
        if tc {
            launch_tc(client, inputs, grads, &c, &layouts, TcPass::Dq);
        } else {
            launch_dq(client, inputs, grads, &c, &layouts)?;
        }
    }
    if tc {
        launch_tc(client, inputs, grads, &c, &layouts, TcPass::Dkv);
        return Ok(());
    }
    launch_dkv(client, inputs, grads, &c, &layouts)
}

/// Query rows of one δ cube, one per unit.
const DELTA_ROWS: usize = THREADS;
/// Vectors of `out` and of `dO` a δ unit loads before their fma steps.
const DELTA_BATCH: usize = 8;
/// Widest global load of the δ kernel.
const DELTA_VECTOR_BYTES: usize = 16;

/// The δ kernel's compile-time configuration.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct DeltaCfg {
    /// Head size.
    pub d: usize,
    /// Elements per load of `out` and `dO` ([`delta_vector`]).
    pub vec: usize,
    pub causal: bool,
    pub emulate: bool,
}

/// The two kernels of the tensor-core backward.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TcPass {
    Dq,
    Dkv,
}

/// One kernel of the tensor-core backward ([`super::tc_backward`]): dQ per 64 query rows of a
/// KV group, dK/dV per 64 keys; cubes of 4 warps.
fn launch_tc<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
    c: &Checked,
    layouts: &Layouts<'_>,
    pass: TcPass,
) {
    let d = c.dims;
    let cfg = TcCfg {
        d: d.head_dim,
        causal: c.causal,
        emulate: false,
        split: false,
        splits: false,
        part: false,
        // 16-byte loads where Q, K, V and dO allow them; only how bytes travel changes.
        vec: tc_vector(
            &[
                (inputs.query, &c.q),
                (inputs.key, &c.k),
                (inputs.value, &c.v),
                (grads.grad_out, layouts.go.expect("the backward's layouts")),
            ],
            c.dt.size(),
        ),
        // Inactive rows must stage as zeros (padding is NaN).
        clamped: false,
        async_copy: false,
        warps: TC_WARPS,
    };
    let tiles = match pass {
        TcPass::Dq => (d.group() * d.q_len).div_ceil(cfg.rows()),
        TcPass::Dkv => d.kv_len.div_ceil(KEY_BLOCK),
    };
    let cubes = d.batch * d.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        let (count, dim) = (
            CubeCount::Static(len as u32, 1, 1),
            CubeDim::new_2d(32, TC_WARPS as u32),
        );
        let (params, dtype) = (layouts.params(c, start), c.dt.storage());
        unsafe {
            match pass {
                TcPass::Dq => attention_tc_dq_kernel::launch_unchecked::<R>(
                    client,
                    count,
                    dim,
                    cfg.vec,
                    tc_grad_inputs(inputs, grads),
                    raw_arg(grads.grad_query),
                    params,
                    cfg,
                    dtype,
                ),
                TcPass::Dkv => attention_tc_dkv_kernel::launch_unchecked::<R>(
                    client,
                    count,
                    dim,
                    cfg.vec,
                    tc_grad_inputs(inputs, grads),
                    KvGradsLaunch::new(raw_arg(grads.grad_key), raw_arg(grads.grad_value)),
                    params,
                    cfg,
                    dtype,
                ),
            }
        }
    }
}

/// The tensor-core backward kernels' inputs.
fn tc_grad_inputs<F: Float, N: Size, R: Runtime>(
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
) -> TcGradInputsLaunch<F, N, R> {
    TcGradInputsLaunch::new(
        raw_arg(inputs.query),
        raw_arg(inputs.key),
        raw_arg(inputs.value),
        raw_arg(grads.grad_out),
        raw_arg(grads.workspace),
        raw_arg(inputs.kv_lens),
    )
}

fn launch_delta<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
    c: &Checked,
    layouts: &Layouts<'_>,
) -> Result<(), KernelError> {
    let rows = c.dims.batch * c.dims.heads * c.dims.q_len;
    let attn = c.cfg(client, 1);
    let views = [
        (grads.out, layouts.o.expect("the backward's layouts")),
        (grads.grad_out, layouts.go.expect("the backward's layouts")),
    ];
    let cfg = DeltaCfg {
        d: attn.d,
        vec: delta_vector(client, c.dt.size(), attn.d, &views),
        causal: attn.causal,
        emulate: attn.emulate,
    };
    for (start, len) in launch_chunks(client, 0, rows, DELTA_ROWS) {
        unsafe {
            attention_delta_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len.div_ceil(DELTA_ROWS) as u32, 1, 1),
                CubeDim::new_1d(THREADS as u32),
                cfg.vec,
                DeltaInputsLaunch::new(
                    raw_arg(grads.out),
                    raw_arg(grads.grad_out),
                    raw_arg(grads.lse),
                    raw_arg(inputs.kv_lens),
                ),
                raw_arg(grads.workspace),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    Ok(())
}

/// The δ kernel's load width (elements): the widest the client offers within
/// [`DELTA_VECTOR_BYTES`] that divides d and that `out` and `dO` fit ([`vectors_fit`]); else 1.
/// Only how bytes travel depends on it.
fn delta_vector<R: Runtime>(
    client: &ComputeClient<R>,
    es: usize,
    d: usize,
    tensors: &[(&TensorBinding<R>, &View)],
) -> usize {
    client
        .io_optimized_vector_sizes(es)
        .filter(|&w| w * es <= DELTA_VECTOR_BYTES && d.is_multiple_of(w))
        .find(|&w| w == 1 || vectors_fit(tensors, w, es))
        .unwrap_or(1)
}

fn launch_dq<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
    c: &Checked,
    layouts: &Layouts<'_>,
) -> Result<(), KernelError> {
    let cfg = c.cfg(client, query_rows(c));
    let tiles = (c.dims.group() * c.dims.q_len).div_ceil(UNITS * cfg.rows);
    let cubes = c.dims.batch * c.dims.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        unsafe {
            attention_dq_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(UNITS as u32, UNITS as u32),
                grad_inputs(inputs, grads),
                raw_arg(grads.grad_query),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    Ok(())
}

fn launch_dkv<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &AttentionRefs<'_, R>,
    grads: &AttentionGradRefs<'_, R>,
    c: &Checked,
    layouts: &Layouts<'_>,
) -> Result<(), KernelError> {
    // 64 keys per cube, 32 where the accumulators of a large head would not fit in registers.
    let rows = if c.dims.head_dim > 128 { 2 } else { 4 };
    let cfg = c.cfg(client, rows);
    let tiles = c.dims.kv_len.div_ceil(UNITS * rows);
    let cubes = c.dims.batch * c.dims.kv_heads * tiles;
    for (start, len) in launch_chunks(client, 0, cubes, 1) {
        unsafe {
            attention_dkv_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(len as u32, 1, 1),
                CubeDim::new_2d(UNITS as u32, UNITS as u32),
                grad_inputs(inputs, grads),
                KvGradsLaunch::new(raw_arg(grads.grad_key), raw_arg(grads.grad_value)),
                layouts.params(c, start),
                cfg,
                c.dt.storage(),
            );
        }
    }
    Ok(())
}

/// Where dense query row `row` (`(b·H + h)·Q + i`) starts in a tensor with strides `st`.
#[cube]
fn dense_row_at(st: &Strides4, p: &AttnParams, row: usize) -> usize {
    let q_len = p.q_len as usize;
    let bh = row / q_len;
    let heads = p.heads as usize;
    (bh / heads) * st.b as usize + (bh % heads) * st.h as usize + (row % q_len) * st.s as usize
}

/// [`DELTA_ROWS`] query rows per cube (dense index `(b·H + h)·Q + i`), one per unit:
/// `ws[3·row] = bits(δ)` (the fma chain over d ascending from +0.0 of `f32(dO)·f32(out)`),
/// `ws[3·row + 1]` = the row's visible keys where it takes part (position ≥ 0 and `dO` not all
/// zero), else 0, `ws[3·row + 2] = bits(lse)`. A unit loads its row's `out` and `dO` as
/// `cfg.vec`-element vectors, [`DELTA_BATCH`] of each before their fma steps.
#[cube(launch_unchecked)]
pub(crate) fn attention_delta_kernel<F: Float, N: Size>(
    ins: &DeltaInputs<F, N>,
    ws: &mut Tensor<u32>,
    p: AttnParams,
    #[comptime] cfg: DeltaCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (w, vectors) = (comptime![cfg.vec], comptime![cfg.d / cfg.vec]);
    let rows = (p.batch * p.heads * p.q_len) as usize;
    let row = p.offset as usize + CUBE_POS_X as usize * DELTA_ROWS + UNIT_POS as usize;
    if row < rows {
        let ob = dense_row_at(&p.o, &p, row);
        let gb = dense_row_at(&p.go, &p, row);
        let (os, gs) = (p.o.d as usize, p.go.d as usize);
        let mut delta = 0.0f32;
        let mut any = false;
        let mut ov = Array::<Vector<F, N>>::new(DELTA_BATCH);
        let mut gv = Array::<Vector<F, N>>::new(DELTA_BATCH);
        for b in 0..comptime![vectors.div_ceil(DELTA_BATCH)] {
            #[unroll]
            for k in 0..DELTA_BATCH {
                // Past the row's last vector: a copy of it, never used.
                let col = min(b * DELTA_BATCH + k, comptime![vectors.saturating_sub(1)]) * w;
                ov[k] = ins.out[(ob + col * os) / w];
                gv[k] = ins.grad_out[(gb + col * gs) / w];
            }
            #[unroll]
            for k in 0..DELTA_BATCH {
                if b * DELTA_BATCH + k < vectors {
                    let (o, g) = (ov[k], gv[k]);
                    #[unroll]
                    for j in 0..w {
                        let ge = f32::cast_from(g[j]);
                        any = any || ge != 0.0f32;
                        delta = fma_f32(ge, f32::cast_from(o[j]), delta, comptime![cfg.emulate]);
                    }
                }
            }
        }
        let q_len = p.q_len as usize;
        let b = row / q_len / p.heads as usize;
        let len = kv_len_of(&ins.kv_lens, b * p.lens as usize, p.kv_len);
        let vis = visible(len, p.q_len, row % q_len, comptime![cfg.causal]);
        ws[3 * row] = u32::reinterpret(delta);
        ws[3 * row + 1] = select(any, vis, 0u32);
        ws[3 * row + 2] = u32::reinterpret(ins.lse[dense_row_at(&p.lse, &p, row)]);
    }
}

/// Index of the KV group's first query row among all rows (`(b·H + h)·Q + i`).
#[cube]
fn group_row_base(tile: &Tile, p: &AttnParams) -> usize {
    (tile.b * p.heads as usize + tile.kh * p.group as usize) * p.q_len as usize
}

/// `dQ`: one cube per (batch row, KV head, tile of `16·rows` query rows of the group).
#[cube(launch_unchecked)]
pub(crate) fn attention_dq_kernel<F: Float>(
    ins: &GradInputs<F>,
    grad_query: &mut Tensor<F>,
    p: AttnParams,
    #[comptime] cfg: AttnCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (ra, d, emulate) = (
        comptime![cfg.rows],
        comptime![cfg.d],
        comptime![cfg.emulate],
    );
    let br = comptime![UNITS * cfg.rows];
    let gq = p.group as usize * p.q_len as usize;
    let tile = cube_tile(&p, gq, gq, br);
    let row_base = group_row_base(&tile, &p);
    let mut stage = SharedMemory::<f32>::new(STAGE_LEN);
    let mut ss = SharedMemory::<f32>::new(br * S_PAD);
    let mut rows = row_state(br);
    load_row_state(&ins.ws, row_base, tile.first, gq, &mut rows, br);
    sync_cube();
    let max_vis = max_visible(&rows.vis, br);
    let qsrc = group_rows(group_base(&p.q, &tile, &p), tile.first, gq, &p.q, &p);
    let gsrc = group_rows(group_base(&p.go, &tile, &p), tile.first, gq, &p.go, &p);
    let kbase = kv_base(&p.k, &tile);
    let vbase = kv_base(&p.v, &tile);

    let mut dq = Array::<f32>::new(comptime![cfg.rows * cfg.cols()]);
    zero(&mut dq, comptime![cfg.rows * cfg.cols()]);
    let mut s = Array::<f32>::new(comptime![cfg.rows * 4]);
    let mut dp = Array::<f32>::new(comptime![cfg.rows * 4]);
    for kb in 0..max_vis.div_ceil(KEY_BLOCK) {
        let j0 = kb * KEY_BLOCK;
        let bend = min(j0 + KEY_BLOCK, max_vis);
        let ksrc = key_rows(kbase, j0, bend, &p.k);
        let vsrc = key_rows(vbase, j0, bend, &p.v);
        dot_tile::<F>(
            &ins.q, &qsrc, &ins.k, &ksrc, p.scale, &mut stage, &mut s, ra, 4usize, SCALE_A, d,
            emulate,
        );
        dot_tile::<F>(
            &ins.grad_out,
            &gsrc,
            &ins.v,
            &vsrc,
            p.scale,
            &mut stage,
            &mut dp,
            ra,
            4usize,
            SCALE_NONE,
            d,
            emulate,
        );
        query_ds(&s, &dp, j0, &rows, &mut ss, cfg);
        accumulate_dsk::<F>(
            &ins.k,
            &ksrc,
            p.scale,
            j0,
            bend - j0,
            &ss,
            &rows,
            &mut stage,
            &mut dq,
            cfg,
        );
    }
    write_dq::<F>(grad_query, &dq, &tile, &rows, &p, cfg);
}

/// `ds = p·(dp − δ)`, `p = exp_p(s − lse)`, for the unit's (query row, key) pairs of visible keys,
/// into `ss`.
#[cube]
fn query_ds(
    s: &Array<f32>,
    dp: &Array<f32>,
    j0: usize,
    rows: &RowState,
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
            if ((j0 + key) as u32) < rows.vis[row] {
                let pr = exp_p(s[i * 4 + c] - rows.lse[row], comptime![cfg.emulate]);
                ss[row * S_PAD + key] = pr * (dp[i * 4 + c] - rows.del[row]);
            }
        }
    }
    sync_cube();
}

/// `dq += ds·k` over the block's `nk` keys ascending (one fma chain per element), chunk by chunk
/// of `DC` columns.
#[cube]
fn accumulate_dsk<F: Float>(
    k: &Tensor<F>,
    ksrc: &RowSrc,
    scale: f32,
    j0: usize,
    nk: usize,
    ss: &SharedMemory<f32>,
    rows: &RowState,
    stage: &mut SharedMemory<f32>,
    dq: &mut Array<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let ncol = comptime![cfg.cols()];
    let emulate = comptime![cfg.emulate];
    let unroll = comptime![!cfg.emulate];
    #[unroll(unroll)]
    for ch in 0..comptime![cfg.chunks()] {
        load_chunk::<F>(
            k,
            ksrc,
            ch * DC,
            scale,
            stage,
            0usize,
            KEY_BLOCK,
            false,
            comptime![cfg.d],
        );
        sync_cube();
        for j in 0..nk {
            let k0 = stage[j * DC + tx];
            let k1 = stage[j * DC + tx + UNITS];
            #[unroll]
            for i in 0..comptime![cfg.rows] {
                let row = ty + i * UNITS;
                if ((j0 + j) as u32) < rows.vis[row] {
                    let ds = ss[row * S_PAD + j];
                    let x = i * ncol + ch * 2;
                    dq[x] = fma_f32(ds, k0, dq[x], emulate);
                    dq[x + 1] = fma_f32(ds, k1, dq[x + 1], emulate);
                }
            }
        }
        sync_cube();
    }
}

/// `grad_query = dq·scale` rounded once, zeros for rows that take no part.
#[cube]
fn write_dq<F: Float>(
    grad_query: &mut Tensor<F>,
    dq: &Array<f32>,
    tile: &Tile,
    rows: &RowState,
    p: &AttnParams,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let d = comptime![cfg.d];
    let ncol = comptime![cfg.cols()];
    let unroll = comptime![!cfg.emulate];
    let q_len = p.q_len as usize;
    #[unroll]
    for i in 0..comptime![cfg.rows] {
        let row = ty + i * UNITS;
        let r = tile.first + row;
        if r < tile.gq {
            let h = tile.kh * p.group as usize + r / q_len;
            let qi = r % q_len;
            let base = tile.b * p.gq.b as usize + h * p.gq.h as usize + qi * p.gq.s as usize;
            let active = rows.vis[row] > 0u32;
            #[unroll(unroll)]
            for ch in 0..comptime![cfg.chunks()] {
                #[unroll]
                for c in 0..2usize {
                    let col = ch * DC + tx + c * UNITS;
                    if col < d {
                        let val = select(active, dq[i * ncol + ch * 2 + c] * p.scale, 0.0f32);
                        grad_query[base + col * p.gq.d as usize] = F::cast_from(val);
                    }
                }
            }
        }
    }
}

/// The dK/dV kernel's tiles of `p` and `ds` (keys × the step's query rows, pitch `DKV_PAD`).
#[derive(CubeType)]
struct KeyTiles {
    p: SharedMemory<f32>,
    ds: SharedMemory<f32>,
}

/// `dK`, `dV`: one cube per (batch row, KV head, tile of `16·rows` keys); the query rows of the
/// group (`local_head·Q + i`) in steps of `DKV_ROWS`, ascending.
#[cube(launch_unchecked)]
pub(crate) fn attention_dkv_kernel<F: Float>(
    ins: &GradInputs<F>,
    outs: &mut KvGrads<F>,
    p: AttnParams,
    #[comptime] cfg: AttnCfg,
    #[define(F)] _dtype: StorageType,
) {
    let (ra, d, emulate) = (
        comptime![cfg.rows],
        comptime![cfg.d],
        comptime![cfg.emulate],
    );
    let bk = comptime![UNITS * cfg.rows];
    let nq = comptime![DKV_ROWS / UNITS];
    let gq = p.group as usize * p.q_len as usize;
    let tile = cube_tile(&p, gq, p.kv_len as usize, bk);
    let row_base = group_row_base(&tile, &p);
    let mut stage = SharedMemory::<f32>::new(STAGE_LEN);
    let mut kt = KeyTiles {
        p: SharedMemory::<f32>::new(bk * DKV_PAD),
        ds: SharedMemory::<f32>::new(bk * DKV_PAD),
    };
    let mut rows = row_state(DKV_ROWS);

    let mut dk = Array::<f32>::new(comptime![cfg.rows * cfg.cols()]);
    let mut dv = Array::<f32>::new(comptime![cfg.rows * cfg.cols()]);
    #[unroll]
    for x in 0..comptime![cfg.rows * cfg.cols()] {
        dk[x] = 0.0f32;
        dv[x] = 0.0f32;
    }
    let mut s = Array::<f32>::new(comptime![cfg.rows * DKV_ROWS / UNITS]);
    let mut dp = Array::<f32>::new(comptime![cfg.rows * DKV_ROWS / UNITS]);
    let kbase = kv_base(&p.k, &tile);
    let vbase = kv_base(&p.v, &tile);
    let qbase = group_base(&p.q, &tile, &p);
    let gbase = group_base(&p.go, &tile, &p);

    for st in 0..gq.div_ceil(DKV_ROWS) {
        let r0 = st * DKV_ROWS;
        load_row_state(&ins.ws, row_base, r0, gq, &mut rows, DKV_ROWS);
        sync_cube();
        let tmax = max_visible(&rows.vis, DKV_ROWS);
        // Uniform over the cube: skip steps whose rows see none of the tile's keys.
        if tmax > tile.first {
            let klimit = min(tile.first + bk, tmax);
            let ksrc = key_rows(kbase, tile.first, klimit, &p.k);
            let vsrc = key_rows(vbase, tile.first, klimit, &p.v);
            let qsrc = group_rows(qbase, r0, gq, &p.q, &p);
            let gsrc = group_rows(gbase, r0, gq, &p.go, &p);
            dot_tile::<F>(
                &ins.k, &ksrc, &ins.q, &qsrc, p.scale, &mut stage, &mut s, ra, nq, SCALE_B, d,
                emulate,
            );
            dot_tile::<F>(
                &ins.v,
                &vsrc,
                &ins.grad_out,
                &gsrc,
                p.scale,
                &mut stage,
                &mut dp,
                ra,
                nq,
                SCALE_NONE,
                d,
                emulate,
            );
            key_p_ds(&s, &dp, tile.first, &rows, &mut kt, cfg);
            let nr = min(DKV_ROWS, gq - r0);
            accumulate_dkv::<F>(
                &ins.q,
                &qsrc,
                &ins.grad_out,
                &gsrc,
                p.scale,
                nr,
                tile.first,
                &rows,
                &kt,
                &mut stage,
                &mut dk,
                &mut dv,
                cfg,
            );
        }
        sync_cube();
    }
    write_dkv::<F>(
        &mut outs.grad_key,
        &mut outs.grad_value,
        &dk,
        &dv,
        &tile,
        &p,
        cfg,
    );
}

/// `p = exp_p(s − lse)` and `ds = p·(dp − δ)` for the unit's (key, query row) pairs where the
/// row sees the key, into the key tiles.
#[cube]
fn key_p_ds(
    s: &Array<f32>,
    dp: &Array<f32>,
    k0: usize,
    rows: &RowState,
    kt: &mut KeyTiles,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let nq = comptime![DKV_ROWS / UNITS];
    #[unroll]
    for i in 0..comptime![cfg.rows] {
        let kr = ty + i * UNITS;
        #[unroll]
        for c in 0..nq {
            let rr = tx + c * UNITS;
            if ((k0 + kr) as u32) < rows.vis[rr] {
                let pr = exp_p(s[i * nq + c] - rows.lse[rr], comptime![cfg.emulate]);
                kt.p[kr * DKV_PAD + rr] = pr;
                kt.ds[kr * DKV_PAD + rr] = pr * (dp[i * nq + c] - rows.del[rr]);
            }
        }
    }
    sync_cube();
}

/// `dv += p·dO` and `dk += ds·q'` over the step's `nr` query rows ascending (one fma chain per
/// element), chunk by chunk of `DC` columns.
#[cube]
fn accumulate_dkv<F: Float>(
    q: &Tensor<F>,
    qsrc: &RowSrc,
    grad_out: &Tensor<F>,
    gsrc: &RowSrc,
    scale: f32,
    nr: usize,
    k0: usize,
    rows: &RowState,
    kt: &KeyTiles,
    stage: &mut SharedMemory<f32>,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let d = comptime![cfg.d];
    let unroll = comptime![!cfg.emulate];
    #[unroll(unroll)]
    for ch in 0..comptime![cfg.chunks()] {
        load_chunk::<F>(
            grad_out,
            gsrc,
            ch * DC,
            scale,
            stage,
            0usize,
            DKV_ROWS,
            false,
            d,
        );
        load_chunk::<F>(
            q,
            qsrc,
            ch * DC,
            scale,
            stage,
            comptime![DKV_ROWS * DC],
            DKV_ROWS,
            true,
            d,
        );
        sync_cube();
        chunk_dkv(stage, nr, k0, ch, rows, kt, dk, dv, cfg);
        sync_cube();
    }
}

/// One chunk of [`accumulate_dkv`] from the staged `dO` and `q'` rows.
#[cube]
fn chunk_dkv(
    stage: &SharedMemory<f32>,
    nr: usize,
    k0: usize,
    ch: usize,
    rows: &RowState,
    kt: &KeyTiles,
    dk: &mut Array<f32>,
    dv: &mut Array<f32>,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let ncol = comptime![cfg.cols()];
    let emulate = comptime![cfg.emulate];
    for rr in 0..nr {
        let g0 = stage[rr * DC + tx];
        let g1 = stage[rr * DC + tx + UNITS];
        let q0 = stage[DKV_ROWS * DC + rr * DC + tx];
        let q1 = stage[DKV_ROWS * DC + rr * DC + tx + UNITS];
        let vr = rows.vis[rr];
        #[unroll]
        for i in 0..comptime![cfg.rows] {
            let kr = ty + i * UNITS;
            if ((k0 + kr) as u32) < vr {
                let pr = kt.p[kr * DKV_PAD + rr];
                let ds = kt.ds[kr * DKV_PAD + rr];
                let x = i * ncol + ch * 2;
                dv[x] = fma_f32(pr, g0, dv[x], emulate);
                dv[x + 1] = fma_f32(pr, g1, dv[x + 1], emulate);
                dk[x] = fma_f32(ds, q0, dk[x], emulate);
                dk[x + 1] = fma_f32(ds, q1, dk[x + 1], emulate);
            }
        }
    }
}

/// `grad_key`, `grad_value` rounded once, for the tile's keys.
#[cube]
fn write_dkv<F: Float>(
    grad_key: &mut Tensor<F>,
    grad_value: &mut Tensor<F>,
    dk: &Array<f32>,
    dv: &Array<f32>,
    tile: &Tile,
    p: &AttnParams,
    #[comptime] cfg: AttnCfg,
) {
    let (tx, ty) = (UNIT_POS_X as usize, UNIT_POS_Y as usize);
    let d = comptime![cfg.d];
    let ncol = comptime![cfg.cols()];
    let unroll = comptime![!cfg.emulate];
    let (b, kh) = (tile.b, tile.kh);
    #[unroll]
    for i in 0..comptime![cfg.rows] {
        let key = tile.first + ty + i * UNITS;
        if key < p.kv_len as usize {
            let kb = b * p.gk.b as usize + kh * p.gk.h as usize + key * p.gk.s as usize;
            let vb = b * p.gv.b as usize + kh * p.gv.h as usize + key * p.gv.s as usize;
            #[unroll(unroll)]
            for ch in 0..comptime![cfg.chunks()] {
                #[unroll]
                for c in 0..2usize {
                    let col = ch * DC + tx + c * UNITS;
                    if col < d {
                        let x = i * ncol + ch * 2 + c;
                        grad_key[kb + col * p.gk.d as usize] = F::cast_from(dk[x]);
                        grad_value[vb + col * p.gv.d as usize] = F::cast_from(dv[x]);
                    }
                }
            }
        }
    }
}
