//! What the attention kernels share: launch parameters, the compile-time configuration, row
//! addressing, the score tiles (fma chains over d through shared memory) and column chunks.
// #[cube] helpers take each tensor, source and tile as its own argument (expanded inline).
#![allow(clippy::too_many_arguments)]

use super::math::{exp_p, fast_exp};
use crate::gemm::fma::fma_f32;
use cubecl::prelude::*;

/// Units per cube along x and along y (a cube has `UNITS × UNITS`).
pub(crate) const UNITS: usize = 16;
/// Units per cube.
pub(crate) const THREADS: usize = UNITS * UNITS;
/// Keys per block (`ATTENTION_KEY_BLOCK`).
pub(crate) const KEY_BLOCK: usize = 64;
/// Keys per split (`ATTENTION_KEY_SPLIT`): the forward's softmax restarts at every multiple of
/// it and the splits merge in ascending order ([`fold_weights`]), so a split can run in a cube of
/// its own (long decode) with the bits of one cube walking them all.
pub(crate) const KEY_SPLIT: usize = 1024;
/// Key blocks per split.
pub(crate) const SPLIT_BLOCKS: usize = KEY_SPLIT / KEY_BLOCK;
/// Depth (in d) of one shared-memory stage of a score tile.
pub(crate) const DK: usize = 16;
/// Row pitch of a staged score operand (padded against bank conflicts).
pub(crate) const DK_PAD: usize = DK + 1;
/// Columns (in d) of one staged chunk of values, keys, queries or output gradients.
pub(crate) const DC: usize = 32;
/// Query rows per step of the dK/dV kernel.
pub(crate) const DKV_ROWS: usize = 32;
/// f32 elements of the staging buffer: a score stage of up to 64 + 64 rows, or a 64 × 32 chunk,
/// or two 32 × 32 chunks.
pub(crate) const STAGE_LEN: usize = (KEY_BLOCK + KEY_BLOCK) * DK_PAD;
/// Row pitch of a score / probability tile over a key block.
pub(crate) const S_PAD: usize = KEY_BLOCK + 1;
/// Row pitch of the dK/dV kernel's `p` and `ds` tiles (keys × query rows).
pub(crate) const DKV_PAD: usize = DKV_ROWS + 1;

/// Which operand of a score tile is a query row (`q' = f32(q)·scale`).
pub(crate) const SCALE_NONE: u32 = 0;
/// The first operand is scaled.
pub(crate) const SCALE_A: u32 = 1;
/// The second operand is scaled.
pub(crate) const SCALE_B: u32 = 2;

/// Strides (in elements) of a rank-4 `[B, heads, seq, D]` tensor (rank 3 for `lse`: `d` unused).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(crate) struct Strides4 {
    pub b: u32,
    pub h: u32,
    pub s: u32,
    pub d: u32,
}

/// Runtime parameters of every attention kernel (layouts a kernel does not take are zeros).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct AttnParams {
    pub q: Strides4,
    pub k: Strides4,
    pub v: Strides4,
    /// `out` (forward output, or the saved output in the backward).
    pub o: Strides4,
    /// `grad_out`.
    pub go: Strides4,
    /// `grad_query`.
    pub gq: Strides4,
    /// `grad_key`.
    pub gk: Strides4,
    /// `grad_value`.
    pub gv: Strides4,
    /// `lse` (`b`, `h`, `s`).
    pub lse: Strides4,
    /// Stride of `kv_lens`.
    pub lens: u32,
    pub batch: u32,
    pub heads: u32,
    pub kv_heads: u32,
    /// `heads / kv_heads`.
    pub group: u32,
    pub q_len: u32,
    pub kv_len: u32,
    pub scale: f32,
    /// First cube (first row for the δ kernel) of this launch.
    pub offset: u32,
}

/// The forward's tensor inputs (read-only bindings, in this order).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct AttnInputs<F: Float> {
    pub q: Tensor<F>,
    pub k: Tensor<F>,
    pub v: Tensor<F>,
    pub kv_lens: Tensor<i32>,
}

/// The forward's outputs: `out` (dtype) and `lse` (f32).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct AttnOutputs<F: Float> {
    pub out: Tensor<F>,
    pub lse: Tensor<f32>,
}

/// The δ kernel's inputs: the saved output and `dOut` (as `N`-element vectors), the saved
/// `lse`, `kv_lens`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DeltaInputs<F: Float, N: Size> {
    pub out: Tensor<Vector<F, N>>,
    pub grad_out: Tensor<Vector<F, N>>,
    pub lse: Tensor<f32>,
    pub kv_lens: Tensor<i32>,
}

/// The dQ and dK/dV kernels' inputs: `q`, `k`, `v`, `dOut` and the δ kernel's workspace.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct GradInputs<F: Float> {
    pub q: Tensor<F>,
    pub k: Tensor<F>,
    pub v: Tensor<F>,
    pub grad_out: Tensor<F>,
    pub ws: Tensor<u32>,
}

/// The dK/dV kernel's outputs.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct KvGrads<F: Float> {
    pub grad_key: Tensor<F>,
    pub grad_value: Tensor<F>,
}

/// Compile-time configuration: head size, rows per unit (the cube's row tile is `16·rows`),
/// causal masking, `fma` emulation, and (forward) whether the keys span more than one split.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct AttnCfg {
    pub d: usize,
    pub rows: usize,
    pub causal: bool,
    pub emulate: bool,
    pub splits: bool,
}

impl AttnCfg {
    /// Chunks of `DC` columns covering d.
    pub(crate) fn chunks(&self) -> usize {
        self.d.div_ceil(DC)
    }
    /// Output columns a unit owns per row (`tx + 16·c`, two per chunk), at least 1.
    pub(crate) fn cols(&self) -> usize {
        (2 * self.chunks()).max(1)
    }
}

/// How rows of a tile map to a tensor: row `r` (of a run of `limit` rows) starts at
/// `base + (r / inner)·s_outer + (r % inner)·s_inner`; rows `first ..` are loaded, those at or
/// past `limit` read as zeros. Query rows of a KV group are `r = local_head·Q + i`.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct RowSrc {
    pub base: usize,
    pub first: usize,
    pub limit: usize,
    pub inner: usize,
    pub s_outer: usize,
    pub s_inner: usize,
    pub s_d: usize,
}

#[cube]
pub(crate) fn row_offset(src: &RowSrc, r: usize) -> usize {
    src.base + (r / src.inner) * src.s_outer + (r % src.inner) * src.s_inner
}

/// Where an FMA cube works: batch row `b`, KV head `kh`, the first row of its tile (`first`: a
/// query row `local_head·Q + i` of the KV group, or a key for dK/dV), the group's rows `gq`.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Tile {
    pub b: usize,
    pub kh: usize,
    pub first: usize,
    pub gq: usize,
}

/// The cube's tile of `size` rows out of `extent` (the group's `gq` query rows, or the keys).
#[cube]
pub(crate) fn cube_tile(p: &AttnParams, gq: usize, extent: usize, #[comptime] size: usize) -> Tile {
    let tiles = extent.div_ceil(size);
    let cube = p.offset as usize + CUBE_POS_X as usize;
    let tile = cube % tiles;
    let bkh = cube / tiles;
    let kvh = p.kv_heads as usize;
    Tile {
        b: bkh / kvh,
        kh: bkh % kvh,
        first: tile * size,
        gq,
    }
}

/// Offset of the KV group's first query head in a `[B, H, Q, D]` tensor with strides `st`.
#[cube]
pub(crate) fn group_base(st: &Strides4, tile: &Tile, p: &AttnParams) -> usize {
    tile.b * st.b as usize + tile.kh * p.group as usize * st.h as usize
}

/// Offset of the cube's KV head in a `[B, KH, KV, D]` tensor with strides `st`.
#[cube]
pub(crate) fn kv_base(st: &Strides4, tile: &Tile) -> usize {
    tile.b * st.b as usize + tile.kh * st.h as usize
}

/// The KV group's query rows `first ..` (of `gq`) from `base`, a tensor with strides `st`.
#[cube]
pub(crate) fn group_rows(
    base: usize,
    first: usize,
    gq: usize,
    st: &Strides4,
    p: &AttnParams,
) -> RowSrc {
    RowSrc {
        base,
        first,
        limit: gq,
        inner: p.q_len as usize,
        s_outer: st.h as usize,
        s_inner: st.s as usize,
        s_d: st.d as usize,
    }
}

/// Key (or value) rows `first .. limit` of one KV head at `base`, a tensor with strides `st`.
#[cube]
pub(crate) fn key_rows(base: usize, first: usize, limit: usize, st: &Strides4) -> RowSrc {
    RowSrc {
        base,
        first,
        limit,
        inner: limit,
        s_outer: 0usize,
        s_inner: st.s as usize,
        s_d: st.d as usize,
    }
}

/// Query-row state of a tile in shared memory: visible keys (0: takes no part), `lse`, `δ`.
#[derive(CubeType)]
pub(crate) struct RowState {
    pub vis: SharedMemory<u32>,
    pub lse: SharedMemory<f32>,
    pub del: SharedMemory<f32>,
}

#[cube]
pub(crate) fn row_state(#[comptime] n: usize) -> RowState {
    RowState {
        vis: SharedMemory::<u32>::new(n),
        lse: SharedMemory::<f32>::new(n),
        del: SharedMemory::<f32>::new(n),
    }
}

/// Rows `r0 .. r0 + n` (of `gq`) of the state, from the workspace (the δ kernel's row `r` at
/// `3·(row_base + r)`), by the cube's first `n` units.
#[cube]
pub(crate) fn load_row_state(
    ws: &Tensor<u32>,
    row_base: usize,
    r0: usize,
    gq: usize,
    rows: &mut RowState,
    #[comptime] n: usize,
) {
    let tid = UNIT_POS as usize;
    if tid < n {
        let r = r0 + tid;
        let mut vis = 0u32;
        let mut l = 0.0f32;
        let mut del = 0.0f32;
        if r < gq {
            let at = 3 * (row_base + r);
            del = f32::reinterpret(ws[at]);
            vis = ws[at + 1];
            l = f32::reinterpret(ws[at + 2]);
        }
        rows.vis[tid] = vis;
        rows.lse[tid] = l;
        rows.del[tid] = del;
    }
}

/// The largest of the `n` rows' visible keys (after a `sync_cube` that published them).
#[cube]
pub(crate) fn max_visible(vis_s: &SharedMemory<u32>, #[comptime] n: usize) -> usize {
    let mut max_vis = 0u32;
    for rr in 0..n {
        max_vis = max(max_vis, vis_s[rr]);
    }
    max_vis as usize
}

/// The weights that fold a split's softmax state (max `m_s`) into the running one (max `m`):
/// `(M, a, b)` with `M` the larger, `a = exp(m − M)`, `b = exp(m_s − M)`, each exactly 1 on the
/// side that holds `M` (no NaN from `−∞ − −∞`); then `l = fma(l, a, l_s·b)`, `o = fma(o, a,
/// o_s·b)`. `hw`: the device's `__expf` (the tensor-core forward), else `exp_p`.
#[cube]
pub(crate) fn fold_weights(
    m: f32,
    m_s: f32,
    #[comptime] hw: bool,
    #[comptime] emulate: bool,
) -> (f32, f32, f32) {
    let mx = select(m_s > m, m_s, m);
    let (ea, eb) = if comptime![hw] {
        (fast_exp(m - mx), fast_exp(m_s - mx))
    } else {
        (exp_p(m - mx, emulate), exp_p(m_s - mx, emulate))
    };
    (
        mx,
        select(m == mx, 1.0f32, ea),
        select(m_s == mx, 1.0f32, eb),
    )
}

/// Row `b`'s valid keys, `kv_lens[b]` clamped to `[0, kv_len]`.
#[cube]
pub(crate) fn kv_len_of(kv_lens: &Tensor<i32>, at: usize, kv_len: u32) -> i32 {
    let kv = i32::cast_from(kv_len);
    let l = kv_lens[at];
    select(l < 0i32, 0i32, select(l > kv, kv, l))
}

/// Keys query `i` of a row with `len` valid keys sees (`0..visible`): 0 when its position
/// `len − Q + i` is negative, else `pos + 1` (causal) or `len`.
#[cube]
pub(crate) fn visible(len: i32, q_len: u32, i: usize, #[comptime] causal: bool) -> u32 {
    let pos = len + (i32::cast_from(i) - i32::cast_from(q_len));
    let mut vis = 0u32;
    if pos >= 0i32 {
        if comptime![causal] {
            vis = u32::cast_from(pos) + 1u32;
        } else {
            vis = u32::cast_from(len);
        }
    }
    vis
}

/// Stage `16·n` rows × `DK` columns (from `d0`) of `t` at `off` in `stage` (pitch `DK_PAD`).
#[cube]
fn stage_rows<F: Float>(
    t: &Tensor<F>,
    src: &RowSrc,
    d0: usize,
    scale: f32,
    stage: &mut SharedMemory<f32>,
    #[comptime] off: usize,
    #[comptime] n: usize,
    #[comptime] scaled: bool,
    #[comptime] d: usize,
) {
    let tid = UNIT_POS_Y as usize * UNITS + UNIT_POS_X as usize;
    // 16·n rows × 16 columns = n elements per unit.
    #[unroll]
    for e in 0usize..n {
        let idx = tid + e * THREADS;
        let rr = idx / DK;
        let kk = idx % DK;
        let r = src.first + rr;
        let dd = d0 + kk;
        let mut val = 0.0f32;
        if r < src.limit && dd < d {
            val = f32::cast_from(t[row_offset(src, r) + dd * src.s_d]);
            if comptime![scaled] {
                val *= scale;
            }
        }
        stage[off + rr * DK_PAD + kk] = val;
    }
}

/// Score tile: `acc[i·nb + j] = fma-chain over d ascending (from +0.0) of a[row_i, d]·b[row_j, d]`
/// for the unit's rows `ty + 16·i` of `a` (i < na) and `tx + 16·j` of `b` (j < nb), rows counted
/// from `asrc.first` / `bsrc.first`. The operand named by `scaled` is `f32(x)·scale` (a query
/// row). The last stage is bounded by d (no padded terms). Every unit of the cube must call it
/// (it synchronizes); it leaves `stage` free.
#[cube]
pub(crate) fn dot_tile<F: Float>(
    a: &Tensor<F>,
    asrc: &RowSrc,
    b: &Tensor<F>,
    bsrc: &RowSrc,
    scale: f32,
    stage: &mut SharedMemory<f32>,
    acc: &mut Array<f32>,
    #[comptime] na: usize,
    #[comptime] nb: usize,
    #[comptime] scaled: u32,
    #[comptime] d: usize,
    #[comptime] emulate: bool,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let unroll = comptime![!emulate];
    let b_off = comptime![UNITS * na * DK_PAD];
    #[unroll]
    for x in 0usize..na * nb {
        acc[x] = 0.0f32;
    }
    // Whole stages, then the partial one (its depth known at compile time): never a padded term.
    let full = comptime![d / DK];
    let rem = comptime![d % DK];
    for st in 0..full {
        let d0 = st * DK;
        stage_rows::<F>(
            a,
            asrc,
            d0,
            scale,
            stage,
            0usize,
            na,
            comptime![scaled == SCALE_A],
            d,
        );
        stage_rows::<F>(
            b,
            bsrc,
            d0,
            scale,
            stage,
            b_off,
            nb,
            comptime![scaled == SCALE_B],
            d,
        );
        sync_cube();
        #[unroll(unroll)]
        for kk in 0..DK {
            micro_step(stage, acc, kk, tx, ty, na, nb, emulate);
        }
        sync_cube();
    }
    if comptime![rem > 0] {
        let d0 = full * DK;
        stage_rows::<F>(
            a,
            asrc,
            d0,
            scale,
            stage,
            0usize,
            na,
            comptime![scaled == SCALE_A],
            d,
        );
        stage_rows::<F>(
            b,
            bsrc,
            d0,
            scale,
            stage,
            b_off,
            nb,
            comptime![scaled == SCALE_B],
            d,
        );
        sync_cube();
        #[unroll(unroll)]
        for kk in 0..rem {
            micro_step(stage, acc, kk, tx, ty, na, nb, emulate);
        }
        sync_cube();
    }
}

/// One d step of a score tile: `acc[i·nb + j] = fma(a_i, b_j, acc[i·nb + j])`.
#[cube]
fn micro_step(
    stage: &SharedMemory<f32>,
    acc: &mut Array<f32>,
    kk: usize,
    tx: usize,
    ty: usize,
    #[comptime] na: usize,
    #[comptime] nb: usize,
    #[comptime] emulate: bool,
) {
    let unroll = comptime![!emulate];
    let b_off = comptime![UNITS * na * DK_PAD];
    let mut av = Array::<f32>::new(na);
    let mut bv = Array::<f32>::new(nb);
    #[unroll]
    for i in 0usize..na {
        av[i] = stage[(ty + i * UNITS) * DK_PAD + kk];
    }
    #[unroll]
    for j in 0usize..nb {
        bv[j] = stage[b_off + (tx + j * UNITS) * DK_PAD + kk];
    }
    #[unroll(unroll)]
    for i in 0usize..na {
        #[unroll(unroll)]
        for j in 0usize..nb {
            let x = i * nb + j;
            acc[x] = fma_f32(av[i], bv[j], acc[x], emulate);
        }
    }
}

/// Stage `n` rows × `DC` columns (from `c0`) of `t` at `off` in `stage` (pitch `DC`), zeros past
/// `src.limit` or d.
#[cube]
pub(crate) fn load_chunk<F: Float>(
    t: &Tensor<F>,
    src: &RowSrc,
    c0: usize,
    scale: f32,
    stage: &mut SharedMemory<f32>,
    #[comptime] off: usize,
    #[comptime] n: usize,
    #[comptime] scaled: bool,
    #[comptime] d: usize,
) {
    let tid = UNIT_POS_Y as usize * UNITS + UNIT_POS_X as usize;
    #[unroll]
    for e in 0usize..n * DC / THREADS {
        let idx = tid + e * THREADS;
        let rr = idx / DC;
        let cc = idx % DC;
        let r = src.first + rr;
        let col = c0 + cc;
        let mut val = 0.0f32;
        if r < src.limit && col < d {
            val = f32::cast_from(t[row_offset(src, r) + col * src.s_d]);
            if comptime![scaled] {
                val *= scale;
            }
        }
        stage[off + idx] = val;
    }
}
