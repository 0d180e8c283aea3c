//! The tensor-core forward for f16 / bf16 on CUDA (`ldmatrix` + `mma.sync` 16×8×16, f32
//! accumulators), FA2-style: one cube of `warps` warps per (batch row, KV head, `16·warps` query
//! rows of the KV head's group), each warp owning 16 rows; keys in blocks of 64 from key 0
//! ascending. Where the group has at most 16 query rows (decode) and Dh is 64 or 128, a cube
//! takes 16 rows and its warps split `o`'s columns instead (`split`): each computes the same
//! scores and softmax (the same bits) and a quarter of `P·V`, whose 16×8 fragments are
//! independent of each other.
//!
//! The pipeline: Q, K and V travel as 16-byte vectors where their layouts allow ([`tc_vector`]);
//! a block's values are loaded while its scores and softmax run, and the next block's keys while
//! its `P·V` runs, so global loads overlap the MMAs (two cube barriers per block), through
//! registers by default. With 16-byte vectors on a runtime with `cp.async`, where the host asks
//! for it (`with_async_staging`, a test and benchmark switch: not faster on an H100), K
//! and V go straight to shared memory instead, each block's copies landing on a barrier phase
//! ([`copy_rows_async`]). Without the staging registers the forward fits the 168 registers a
//! 384-unit cube allows, so there cubes take [`TC_WIDE_WARPS`] warps (one cube of 12 warps per
//! SM instead of two of 4), and a warp skips the MMAs of blocks none of its rows sees.
//!
//! The softmax takes the block max on the raw scores and `p = exp(fma(S, |scale|, −m'))` with the
//! hardware exponential; the masking selects run only in blocks where a row of the warp stops.
//!
//! Keys past one split ([`KEY_SPLIT`]): the rows restart at each split boundary after folding
//! the finished split into a state each unit parks in shared memory (`splits`), or, where the
//! tiles alone would leave the device idle (decode at a small batch over a long cache), one cube
//! per (tile, split) writes its split's state to a workspace and a merge kernel folds them in
//! the same order with the same operations (`part`): the same bits either way.
//!
//! Why the bits stay batch-invariant (docs/CONTRACT.md, *attention semantics*): an MMA output
//! row depends only on its own A row, so a row's scores, its softmax state and its `o` come from
//! its own query, the keys and values of the pinned key blocks and the pinned 16-deep k order
//! over Dh and over the keys; never from the other rows of the tile, from B, Q, KV past its keys,
//! padding or the launch split. Masked scores are replaced (select), never offset; a block the
//! row cannot see leaves `m`, `l` and `o` unchanged (`α = 1`, `p = 0`; `o` only up to the sign
//! of a zero, which the epilogue canonicalizes). Keys no row of the cube can see (at or past the
//! cube's last visible key, hence past `kv_lens`) are staged as copies of that last key (whole
//! 16-byte moves, no per-lane zeroing), never read past it.

use super::math::{div_rn, fast_exp, ln_p, neg_inf};
use super::tile::{
    AttnParams, KEY_BLOCK, KEY_SPLIT, RowSrc, SPLIT_BLOCKS, Strides4, fold_weights, key_rows,
    kv_len_of, row_offset, visible,
};
use crate::gemm::cmma::{arrive_on_copies, ring_barriers};
use crate::util::{FloatDType, View};

use cubecl::prelude::barrier::{Barrier, copy_async};
use cubecl::prelude::*;

/// Warps per cube of the backward and of decode's 16-row tiles; each owns 16 query rows (decode:
/// a share of the columns).
pub(crate) const TC_WARPS: usize = 4;
/// Warps per cube of the forward's 16-row-per-warp tiles where K and V are copied by `cp.async`:
/// one cube of 192 rows per SM, which caps the registers at 168 (spill-free without the staging
/// registers), for 12 warps per SM instead of two 4-warp cubes' 8.
pub(crate) const TC_WIDE_WARPS: usize = 12;
/// Lanes per warp.
pub(super) const LANES: usize = 32;
/// Query rows per cube of the backward.
pub(crate) const TC_ROWS: usize = 16 * TC_WARPS;
/// Units per cube of the backward.
pub(super) const TC_THREADS: usize = LANES * TC_WARPS;
/// Padding (elements) of a staged row against bank conflicts; keeps rows 16-byte aligned.
const PAD: usize = 8;
/// Elements per global load where Q, K and V allow 16-byte vectors ([`tc_vector`]).
pub(super) const TC_VECTOR: usize = 8;
/// 16×8 score fragments per key block.
pub(super) const S_FRAGS: usize = KEY_BLOCK / 8;
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
    /// Elements per global load and per staged shared-memory word (1 or [`TC_VECTOR`]).
    pub vec: usize,
    /// Rows at or past a staging limit load a copy of the last row before it (always valid,
    /// whole 128-bit moves) instead of zeros, and the maxima use `max` rather than a compare and
    /// select: the forward's staging (its masked keys get `p = 0`, a copy costs nothing). The
    /// backward stages zeros: its inactive rows may hold NaN padding within the limit.
    pub clamped: bool,
    /// K and V go from global to shared memory by `cp.async` ([`copy_rows_async`]), with
    /// [`TcCfg::clamped`] rows and 16-byte vectors, instead of through registers.
    pub async_copy: bool,
    /// The keys span more than one split: the cube folds each finished split into a state parked
    /// in shared memory ([`fold_split`]).
    pub splits: bool,
    /// One split per cube: its unnormalised state to the workspace, folded by
    /// [`attention_tc_merge_kernel`].
    pub part: bool,
    /// Warps per cube ([`TC_WARPS`] or [`TC_WIDE_WARPS`]).
    pub warps: usize,
}

impl TcCfg {
    /// This configuration with [`TcCfg::clamped`] loads.
    pub(super) fn clamped(&self) -> TcCfg {
        TcCfg {
            clamped: true,
            ..*self
        }
    }
    /// Row pitch (elements) of a staged Q, K or V tile.
    pub(super) fn pitch(&self) -> usize {
        self.d + PAD
    }
    /// Units per cube.
    pub(super) fn threads(&self) -> usize {
        LANES * self.warps
    }
    /// Vectors of `vec` elements of `n` staged rows.
    pub(super) fn vectors(&self, n: usize) -> usize {
        n * self.d / self.vec
    }
    /// Vectors a unit moves to stage `n` rows (the last round partial where the units do not
    /// divide them).
    pub(super) fn loads(&self, n: usize) -> usize {
        self.vectors(n).div_ceil(self.threads())
    }
    /// Query rows of a cube.
    pub(crate) fn rows(&self) -> usize {
        if self.split { 16 } else { 16 * self.warps }
    }
    /// Columns of `o` a warp owns.
    pub(super) fn cols(&self) -> usize {
        if self.split {
            self.d / self.warps
        } else {
            self.d
        }
    }
    /// Rows of the K buffer, which stages Q first.
    fn k_rows(&self) -> usize {
        KEY_BLOCK.max(self.rows())
    }
    /// f32 words a unit parks for [`fold_split`]: its `o` pairs of both rows, then `m`, `l` of
    /// row 0 and of row 1.
    fn parked(&self) -> usize {
        self.cols() / 2 + 4
    }
}

/// Shared memory (bytes) of the tensor-core forward for `head_dim` keys of `elem` bytes in cubes
/// of `warps` warps with 16 rows each: K (staging Q first) and V tiles, the rows' visible keys,
/// and the parked split states.
pub(super) fn tc_forward_shared(head_dim: usize, elem: usize, warps: usize) -> usize {
    let rows = 16 * warps;
    (KEY_BLOCK.max(rows) + KEY_BLOCK) * (head_dim + PAD) * elem
        + 4 * rows
        + 4 * LANES * warps * (head_dim / 2 + 4)
        + 2 * BARRIER_BYTES
}

/// Shared memory of one `cp.async` barrier, counted generously.
const BARRIER_BYTES: usize = 16;

/// Whether a cube may take 16 rows with the warps splitting the columns: few rows per KV head
/// (decode) and warp column shares that are whole `ldmatrix` x4 pairs (16 columns).
pub(crate) fn tc_split(group_rows: usize, head_dim: usize) -> bool {
    group_rows <= 16 && head_dim.is_multiple_of(16 * TC_WARPS)
}

/// The first row (in the cube) of this warp's 16 and the first column of its share of `o`.
#[cube]
pub(super) fn warp_origin(#[comptime] cfg: TcCfg) -> (usize, usize) {
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
    let shared = tc_forward_shared(head_dim, dtype.size(), TC_WARPS);
    let hw = &client.properties().hardware;
    half && head_dim > 0
        && head_dim.is_multiple_of(16)
        && head_dim <= TC_MAX_HEAD_DIM
        && hw.max_units_per_cube as usize >= TC_THREADS
        && hw.max_shared_memory_size >= shared
        && crate::gemm::manual_mma_supported(client, dtype.storage())
}

/// Whether the f16 / bf16 backward runs on the tensor cores ([`super::tc_backward`]): where the
/// forward does and the dK/dV kernel's four staged tiles fit the device's shared memory.
pub(crate) fn tc_backward_supported<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: FloatDType,
    head_dim: usize,
) -> bool {
    let shared = 4 * KEY_BLOCK * (head_dim + PAD) * dtype.size() + 12 * TC_ROWS;
    tc_forward_supported(client, dtype, head_dim)
        && client.properties().hardware.max_shared_memory_size >= shared
}

/// The global load width (elements) of Q, K and V: [`TC_VECTOR`] where each has its last dim
/// contiguous, its other strides (of dims past 1) and its buffer start 16-byte aligned (a staged
/// row is then whole vectors: head sizes are multiples of 16), else 1. Only how bytes travel
/// depends on it, never the arithmetic.
pub(crate) fn tc_vector<R: Runtime>(
    tensors: &[(&TensorBinding<R>, &View)],
    elem_size: usize,
) -> usize {
    if vectors_fit(tensors, TC_VECTOR, elem_size) {
        TC_VECTOR
    } else {
        1
    }
}

/// Whether every 4-D tensor can move as `w`-element vectors: its last dim contiguous, the strides
/// of its other dims (past 1) multiples of `w` and its buffer start aligned to `w` elements.
pub(crate) fn vectors_fit<R: Runtime>(
    tensors: &[(&TensorBinding<R>, &View)],
    w: usize,
    elem_size: usize,
) -> bool {
    tensors.iter().all(|(t, view)| {
        let start = t.handle.offset_start.unwrap_or(0);
        view.strides.len() == 4
            && view.stride(3) == 1
            && (0..3).all(|i| view.dim(i) <= 1 || view.stride(i).is_multiple_of(w))
            && start.is_multiple_of((w * elem_size) as u64)
    })
}

/// Where a cube works: batch row `b`, KV head `kh`, the first of its 64 rows `r0` (rows of the
/// KV head's group, `r = local_head·Q + i`), the group's rows `gq`, the row's valid keys `len`,
/// and its split of the keys (0 unless [`TcCfg::part`]).
#[derive(CubeType, Clone, Copy)]
pub(super) struct TcTile {
    pub b: usize,
    pub kh: usize,
    pub r0: usize,
    pub gq: usize,
    pub len: i32,
    pub split: usize,
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

/// The cube's tile of `p`'s grid; within a (batch row, KV head) the last rows first (under a
/// causal mask they walk the most blocks, so the grid's tail is short).
#[cube]
pub(super) fn tc_tile(kv_lens: &Tensor<i32>, p: &AttnParams, #[comptime] cfg: TcCfg) -> TcTile {
    let rows = comptime![cfg.rows()];
    let q_len = p.q_len as usize;
    let gq = p.group as usize * q_len;
    let tiles = gq.div_ceil(rows);
    let mut cube = p.offset as usize + CUBE_POS_X as usize;
    let mut split = 0usize;
    if comptime![cfg.part] {
        let splits = (p.kv_len as usize).div_ceil(KEY_SPLIT);
        split = cube % splits;
        cube /= splits;
    }
    let bkh = cube / tiles;
    let b = bkh / p.kv_heads as usize;
    TcTile {
        b,
        kh: bkh % p.kv_heads as usize,
        r0: (tiles - 1 - cube % tiles) * rows,
        gq,
        len: kv_len_of(kv_lens, b * p.lens as usize, p.kv_len),
        split,
    }
}

/// This unit's share of rows `src.first .. + n` (d columns) of `t` as `N`-element vectors (with
/// `N > 1` the host checked `s_d == 1` and every row start a multiple of `N`), zeros at or past
/// `src.limit` (with `cfg.clamped`: copies of row `limit − 1`): such rows are never read.
#[cube]
pub(super) fn load_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    src: &RowSrc,
    #[comptime] n: usize,
    #[comptime] keys: bool,
    #[comptime] cfg: TcCfg,
) -> Array<Vector<F, N>> {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let w = comptime![cfg.vec];
    let per_row = comptime![cfg.d / cfg.vec];
    let mut regs = Array::<Vector<F, N>>::new(comptime![cfg.loads(n)]);
    #[unroll]
    for e in 0..comptime![cfg.loads(n)] {
        let idx = tid + e * comptime![cfg.threads()];
        if unit_moves(idx, n, e, cfg) {
            let r = src.first + idx / per_row;
            if comptime![cfg.clamped] {
                // The caller guarantees `limit ≥ 1`.
                let at = row_at(src, min(r, src.limit - 1), keys);
                regs[e] = t[(at + (idx % per_row) * w * src.s_d) / w];
            } else {
                let mut val = Vector::<F, N>::new(F::new(0.0));
                if r < src.limit {
                    val = t[(row_at(src, r, keys) + (idx % per_row) * w * src.s_d) / w];
                }
                regs[e] = val;
            }
        }
    }
    regs
}

/// Whether vector `idx` (this unit's round `e`) of `n` staged rows exists: always but in a
/// partial last round.
#[cube]
pub(super) fn unit_moves(
    idx: usize,
    #[comptime] n: usize,
    #[comptime] e: usize,
    #[comptime] cfg: TcCfg,
) -> bool {
    let mut moves = true;
    if comptime![(e + 1) * cfg.threads() > cfg.vectors(n)] {
        moves = idx < comptime![cfg.vectors(n)];
    }
    moves
}

/// Where row `r` of `src` starts; key rows (`keys`) skip `row_offset`'s divisions.
#[cube]
fn row_at(src: &RowSrc, r: usize, #[comptime] keys: bool) -> usize {
    if comptime![keys] {
        src.base + r * src.s_inner
    } else {
        row_offset(src, r)
    }
}

/// [`load_rows`]' vectors into `smem` (pitch `d + PAD`).
#[cube]
pub(super) fn store_rows<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    smem: &mut SharedMemory<Vector<F, N>>,
    #[comptime] n: usize,
    #[comptime] cfg: TcCfg,
) {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let per_row = comptime![cfg.d / cfg.vec];
    let pitch = comptime![cfg.pitch() / cfg.vec];
    #[unroll]
    for e in 0..comptime![cfg.loads(n)] {
        let idx = tid + e * comptime![cfg.threads()];
        if unit_moves(idx, n, e, cfg) {
            smem[(idx / per_row) * pitch + idx % per_row] = regs[e];
        }
    }
}

/// [`load_rows`]' clamped vectors straight into `smem` (pitch `d + PAD`) by `cp.async`: rows at
/// or past `src.limit` copy row `limit − 1` (the caller guarantees `limit ≥ 1`), so every copy
/// is a whole in-bounds 16-byte vector. Visible once the unit's barrier phase completes.
#[cube]
fn copy_rows_async<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    src: &RowSrc,
    smem: &mut SharedMemory<Vector<F, N>>,
    #[comptime] n: usize,
    #[comptime] cfg: TcCfg,
) {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let w = comptime![cfg.vec];
    let per_row = comptime![cfg.d / cfg.vec];
    let pitch = comptime![cfg.pitch() / cfg.vec];
    #[unroll]
    for e in 0..comptime![cfg.loads(n)] {
        let idx = tid + e * comptime![cfg.threads()];
        if unit_moves(idx, n, e, cfg) {
            let r = min(src.first + idx / per_row, src.limit - 1);
            let at = (row_at(src, r, true) + (idx % per_row) * w) / w;
            let dst = (idx / per_row) * pitch + idx % per_row;
            copy_async(
                &t.slice(at, at + 1),
                &mut smem.slice_mut(dst, dst + 1),
                comptime!(w as u32),
            );
        }
    }
}

/// The visible keys of each row of the cube into `vis_s`; returns the largest over the cube
/// (the blocks to walk), the smallest over the warp's rows of the group (blocks before it
/// need no mask for any of them) and the largest over the warp's rows (blocks from it on change
/// none of them).
#[cube]
fn row_visibility(
    tile: &TcTile,
    p: &AttnParams,
    vis_s: &mut SharedMemory<u32>,
    #[comptime] cfg: TcCfg,
) -> (u32, u32, u32) {
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
    let (row0, _) = warp_origin(cfg);
    let mut warp_max = 0u32;
    for rr in 0..16usize {
        warp_max = max(warp_max, vis_s[row0 + rr]);
    }
    (
        max_vis,
        warp_min_visible(vis_s, tile, max_vis, cfg),
        warp_max,
    )
}

/// The smallest `vis` (in `vis_s`, by row of the cube) of the warp's rows of the group: blocks
/// before it need no mask for any of them. Every row's `vis` is at most `max_vis`, so a warp
/// without rows of the group masks only its last block, which changes nothing.
#[cube]
pub(super) fn warp_min_visible(
    vis_s: &SharedMemory<u32>,
    tile: &TcTile,
    max_vis: u32,
    #[comptime] cfg: TcCfg,
) -> u32 {
    let (row0, _) = warp_origin(cfg);
    let mut warp_vis = max_vis;
    for rr in 0..16usize {
        if tile.r0 + row0 + rr < tile.gq {
            warp_vis = min(warp_vis, vis_s[row0 + rr]);
        }
    }
    warp_vis
}

/// The cube's rows of the KV group (`r = local_head·Q + i`, from `tile.r0`) in a tensor with
/// strides `st`.
#[cube]
pub(super) fn group_src(tile: &TcTile, st: &Strides4, p: &AttnParams) -> RowSrc {
    RowSrc {
        base: tile.b * st.b as usize + tile.kh * p.group as usize * st.h as usize,
        first: tile.r0,
        limit: tile.gq,
        inner: p.q_len as usize,
        s_outer: st.h as usize,
        s_inner: st.s as usize,
        s_d: st.d as usize,
    }
}

/// The warp's 16 query rows as `Dh/16` A fragments (through `smem`, which is free again after);
/// for a negative scale those of `−q` (the same products, negated exactly), so the softmax runs
/// on `|scale|`.
#[cube]
fn query_fragments<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    tile: &TcTile,
    p: &AttnParams,
    smem: &mut SharedMemory<Vector<F, N>>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let regs = load_rows::<F, N>(
        q,
        &group_src(tile, &p.q, p),
        comptime![cfg.rows()],
        false,
        cfg,
    );
    store_rows::<F, N>(&regs, smem, comptime![cfg.rows()], cfg);
    sync_cube();
    let mut frags = a_fragments::<F, N>(smem, cfg);
    if p.scale < 0.0f32 {
        #[unroll]
        for kk in 0..comptime![cfg.d / 16] {
            let a = frags.index_mut(kk);
            #[unroll]
            for i in 0..4usize {
                a[i] = negated::<F>(a[i]);
            }
        }
    }
    sync_cube();
    frags
}

/// The warp's 16 staged rows of `smem` (from [`warp_origin`]'s row) as `Dh/16` MMA A fragments.
#[cube]
pub(super) fn a_fragments<F: Float, N: Size>(
    smem: &SharedMemory<Vector<F, N>>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let mut frags = Sequence::<Array<Vector<F, Const<2>>>>::new();
    #[unroll]
    for kk in 0..comptime![cfg.d / 16] {
        frags.push(a_fragment::<F, N>(smem, kk, cfg));
    }
    frags
}

/// Step `kk` (d `16·kk ..`) of [`a_fragments`]: `ldmatrix` x4 of the matrices (rows 0-7, k 0-7),
/// (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15), as the GEMM's A operand with k
/// contiguous.
#[cube]
pub(super) fn a_fragment<F: Float, N: Size>(
    smem: &SharedMemory<Vector<F, N>>,
    kk: usize,
    #[comptime] cfg: TcCfg,
) -> Array<Vector<F, Const<2>>> {
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let (r, _) = warp_origin(cfg);
    let e = ((r + (quad % 2) * 8 + within) * comptime![cfg.pitch()] + kk * 16 + (quad / 2) * 8)
        / comptime![cfg.vec];
    mma.load_matrix::<Vector<F, N>, Const<2>>(
        &smem.slice(e, e + comptime![8 / cfg.vec]),
        cmma::MatrixIdent::A,
        4usize,
        false,
    )
}

/// The lane's row `h` (`g + 8h` of its warp) as a row of the KV group.
#[cube]
pub(super) fn lane_group_row(tile: &TcTile, #[comptime] h: usize, #[comptime] cfg: TcCfg) -> usize {
    let (row0, _) = warp_origin(cfg);
    tile.r0 + row0 + UNIT_POS_X as usize / 4 + h * 8
}

/// Where row `r` of the KV group (`local_head·Q + i`) starts in a tensor with strides `st`.
#[cube]
pub(super) fn group_row_at(tile: &TcTile, st: &Strides4, p: &AttnParams, r: usize) -> usize {
    let q_len = p.q_len as usize;
    tile.b * st.b as usize
        + (tile.kh * p.group as usize + r / q_len) * st.h as usize
        + (r % q_len) * st.s as usize
}

/// Rows `j0 .. j0 + 64` of the key or value tensor with strides `st` (zeros at or past `limit`,
/// the cube's last visible key).
#[cube]
pub(super) fn key_src(tile: &TcTile, st: &Strides4, j0: usize, limit: usize) -> RowSrc {
    key_rows(
        tile.b * st.b as usize + tile.kh * st.h as usize,
        j0,
        limit,
        st,
    )
}

/// `n` zeroed 16×8 f32 accumulators: per lane two pairs, rows `g` and `g + 8`, columns `2t`,
/// `2t + 1` (lane = `4g + t`).
#[cube]
pub(super) fn zero_frags(#[comptime] n: usize) -> Sequence<Array<Vector<f32, Const<2>>>> {
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
pub(super) fn scores<F: Float, N: Size>(
    k_s: &SharedMemory<Vector<F, N>>,
    qa: &Sequence<Array<Vector<F, Const<2>>>>,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<f32, Const<2>>>> {
    let mut s = zero_frags(S_FRAGS);
    #[unroll]
    for kk in 0..comptime![cfg.d / 16] {
        score_step::<F, N>(k_s, qa.index(kk), kk, &mut s, cfg);
    }
    s
}

/// `s += a·Bᵀ` over d `16·kk ..` for the 64 staged rows of `b_s` (eight 16×8 fragments).
#[cube]
pub(super) fn score_step<F: Float, N: Size>(
    b_s: &SharedMemory<Vector<F, N>>,
    a: &Array<Vector<F, Const<2>>>,
    kk: usize,
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] cfg: TcCfg,
) {
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let pitch = comptime![cfg.pitch()];
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let w = comptime![cfg.vec];
    #[unroll]
    for j in 0..comptime![S_FRAGS / 2] {
        // B = Kᵀ staged with d contiguous (the GEMM's `b_nfast = false`): matrices
        // (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
        let e = ((j * 16 + (quad / 2) * 8 + within) * pitch + kk * 16 + (quad % 2) * 8) / w;
        let quad_b = mma.load_matrix::<Vector<F, N>, Const<2>>(
            &b_s.slice(e, e + comptime![8 / cfg.vec]),
            cmma::MatrixIdent::B,
            4usize,
            false,
        );
        mma_pair(&mma, a, &quad_b, s, comptime![2 * j]);
    }
}

/// Fragments `at` and `at + 1` of `acc` += `a` times the two 16×8 B operands of an `ldmatrix`
/// x4 (`b[0..2]`: columns 0-7, `b[2..4]`: columns 8-15).
#[cube]
pub(super) fn mma_pair<F: Float>(
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
    let x = max(x, plane_shuffle_xor(x, 1u32));
    max(x, plane_shuffle_xor(x, 2u32))
}

/// Sum over the four lanes of a quad by a fixed xor tree (every lane gets the same bits:
/// `(a + b) + (c + d)` up to commutation).
#[cube]
pub(super) fn quad_sum(x: f32) -> f32 {
    let x = x + plane_shuffle_xor(x, 1u32);
    x + plane_shuffle_xor(x, 2u32)
}

/// The largest raw score of the lane's row `h` (`g + 8h`) in the block, over the keys it sees
/// where `masked` (a select, never an offset), −∞ for none.
#[cube]
fn block_max(
    s: &Sequence<Array<Vector<f32, Const<2>>>>,
    vis: usize,
    j0: usize,
    #[comptime] h: usize,
    #[comptime] masked: bool,
) -> f32 {
    let t = UNIT_POS_X as usize % 4;
    let mut bm = neg_inf();
    #[unroll]
    for j in 0..S_FRAGS {
        let pair = s.index(j)[h];
        #[unroll]
        for c in 0..2usize {
            let mut x = pair[c];
            if comptime![masked] {
                x = select(j0 + j * 8 + 2 * t + c < vis, x, neg_inf());
            }
            bm = max(bm, x);
        }
    }
    bm
}

/// The row's `p = exp(fma(S, a, −m'))` in place of its scores (exactly 0 for keys it does not
/// see where `masked`), and their sum by the lane's ascending adds.
#[cube]
fn block_probabilities(
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    neg_m: f32,
    a: f32,
    vis: usize,
    j0: usize,
    #[comptime] h: usize,
    #[comptime] masked: bool,
) -> f32 {
    let t = UNIT_POS_X as usize % 4;
    let mut lb = 0.0f32;
    #[unroll]
    for j in 0..S_FRAGS {
        let frag = s.index_mut(j);
        let mut pair = frag[h];
        #[unroll]
        for c in 0..2usize {
            let mut pj = fast_exp(fma(pair[c], a, neg_m));
            if comptime![masked] {
                pj = select(j0 + j * 8 + 2 * t + c < vis, pj, 0.0f32);
            }
            pair[c] = pj;
            lb += pj;
        }
        frag[h] = pair;
    }
    lb
}

/// One block's online softmax for the lane's row `h` (`g + 8h`), `a = |scale|` (the query's
/// fragments carry the sign): `m' = max(m, a·(block max of S))`, `α = exp(m − m')` (exactly 1
/// when the max does not grow: no NaN from `−∞ − −∞`), `p = exp(fma(S, a, −m'))` or exactly 0
/// where masked, `l_b` by the lane's ascending adds then the quad's tree, `l = fma(l, α, l_b)`.
/// Masked and unmasked blocks run the same operations on the keys a row sees (the same bits
/// whichever a block takes). The scores are replaced by `p`.
#[cube]
fn softmax_row(
    s: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    row: &mut Row,
    j0: usize,
    a: f32,
    masked: bool,
    #[comptime] h: usize,
) {
    let vis = row.vis as usize;
    let bm = if masked {
        block_max(s, vis, j0, h, true)
    } else {
        block_max(s, vis, j0, h, false)
    };
    let bm = quad_max(bm) * a;
    let grow = bm > row.m;
    let mn = select(grow, bm, row.m);
    row.alpha = select(grow, fast_exp(row.m - bm), 1.0f32);
    let lb = if masked {
        block_probabilities(s, -mn, a, vis, j0, h, true)
    } else {
        block_probabilities(s, -mn, a, vis, j0, h, false)
    };
    row.l = fma(row.l, row.alpha, quad_sum(lb));
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
pub(super) fn probabilities<F: Float>(
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

/// `−x` of a pair, through f32 (exact; CUDA's bf16 pairs have no negation operator).
#[cube]
fn negated<F: Float>(x: Vector<F, Const<2>>) -> Vector<F, Const<2>> {
    let mut y = Vector::<F, Const<2>>::empty();
    y[0] = F::cast_from(-f32::cast_from(x[0]));
    y[1] = F::cast_from(-f32::cast_from(x[1]));
    y
}

/// An f32 pair rounded to `F`.
#[cube]
pub(super) fn to_half<F: Float>(x: Vector<f32, Const<2>>) -> Vector<F, Const<2>> {
    let mut y = Vector::<F, Const<2>>::empty();
    y[0] = F::cast_from(x[0]);
    y[1] = F::cast_from(x[1]);
    y
}

/// `o += P·V`: keys in four 16-deep steps ascending, Dh in 16×8 fragments.
#[cube]
pub(super) fn accumulate_pv<F: Float, N: Size>(
    v_s: &SharedMemory<Vector<F, N>>,
    pa: &Sequence<Array<Vector<F, Const<2>>>>,
    o: &mut Sequence<Array<Vector<f32, Const<2>>>>,
    #[comptime] cfg: TcCfg,
) {
    let mma = cmma::MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let pitch = comptime![cfg.pitch()];
    let lane = UNIT_POS_X as usize;
    let (quad, within) = (lane / 8, lane % 8);
    let (_, col0) = warp_origin(cfg);
    let w = comptime![cfg.vec];
    #[unroll]
    for kk in 0..comptime![KEY_BLOCK / 16] {
        #[unroll]
        for j in 0..comptime![cfg.cols() / 16] {
            // B = V staged with d contiguous (the GEMM's `b_nfast = true`, transposed
            // ldmatrix): matrices (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15),
            // (keys 8-15, d 8-15).
            let e =
                ((kk * 16 + (quad % 2) * 8 + within) * pitch + col0 + j * 16 + (quad / 2) * 8) / w;
            let quad_b = mma.load_matrix::<Vector<F, N>, Const<2>>(
                &v_s.slice(e, e + comptime![8 / cfg.vec]),
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
    let t = UNIT_POS_X as usize % 4;
    let (_, col0) = warp_origin(cfg);
    let r = lane_group_row(tile, h, cfg);
    if r < tile.gq {
        let base = group_row_at(tile, &p.o, p, r);
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
        let at = group_row_at(tile, &p.lse, p, r);
        let mut val = neg_inf();
        if row.vis > 0u32 {
            val = row.m + ln_p(row.l, comptime![cfg.emulate]);
        }
        lse[at] = val;
    }
}

/// At a split boundary: the finished split (its keys from `s0`) folded into the parked state for
/// the lane's rows that see one of its keys (taken as it is where it is the `first`), then the
/// rows restart (`m = −∞`, `l = 0`, `o = 0`). Each unit parks its own words: no barrier. Only
/// where `cfg.splits` (nothing otherwise).
#[cube]
fn fold_split<F: Float>(
    s0: usize,
    first: bool,
    w: &mut WarpState<F>,
    park: &mut SharedMemory<f32>,
    #[comptime] cfg: TcCfg,
) {
    if comptime![cfg.splits] {
        fold_row(s0, first, &w.o, &mut w.r0, park, 0usize, cfg);
        fold_row(s0, first, &w.o, &mut w.r1, park, 1usize, cfg);
        #[unroll]
        for j in 0..comptime![cfg.cols() / 8] {
            let frag = w.o.index_mut(j);
            frag[0] = Vector::new(0.0f32);
            frag[1] = Vector::new(0.0f32);
        }
    }
}

/// [`fold_split`] for the lane's row `h`: `M = max`, `l = fma(L, a, l·b)`, `o = fma(O, a, o·b)`
/// ([`fold_weights`]).
#[cube]
fn fold_row(
    s0: usize,
    first: bool,
    o: &Sequence<Array<Vector<f32, Const<2>>>>,
    row: &mut Row,
    park: &mut SharedMemory<f32>,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
    let n = comptime![cfg.cols() / 8];
    let at_m = comptime![(cfg.cols() / 2 + 2 * h) * cfg.threads()] + tid;
    let at_l = at_m + comptime![cfg.threads()];
    if first {
        park[at_m] = row.m;
        park[at_l] = row.l;
        #[unroll]
        for j in 0..n {
            let pair = o.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                park[comptime![((j * 2 + h) * 2 + c) * cfg.threads()] + tid] = pair[c];
            }
        }
    } else if (s0 as u32) < row.vis {
        let (mx, a, b) = fold_weights(park[at_m], row.m, true, false);
        park[at_l] = fma(park[at_l], a, row.l * b);
        park[at_m] = mx;
        #[unroll]
        for j in 0..n {
            let pair = o.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                let at = comptime![((j * 2 + h) * 2 + c) * cfg.threads()] + tid;
                park[at] = fma(park[at], a, pair[c] * b);
            }
        }
    }
    row.m = neg_inf();
    row.l = 0.0f32;
    row.alpha = 1.0f32;
}

/// The parked state back into the lane's rows and `o` (where `cfg.splits`).
#[cube]
fn unpark<F: Float>(w: &mut WarpState<F>, park: &SharedMemory<f32>, #[comptime] cfg: TcCfg) {
    if comptime![cfg.splits] {
        let tid = UNIT_POS_Y as usize * LANES + UNIT_POS_X as usize;
        let ml = comptime![cfg.cols() / 2 * cfg.threads()] + tid;
        w.r0.m = park[ml];
        w.r0.l = park[ml + comptime![cfg.threads()]];
        w.r1.m = park[ml + comptime![2 * cfg.threads()]];
        w.r1.l = park[ml + comptime![3 * cfg.threads()]];
        #[unroll]
        for j in 0..comptime![cfg.cols() / 8] {
            let frag = w.o.index_mut(j);
            #[unroll]
            for h in 0..2usize {
                let mut pair = frag[h];
                #[unroll]
                for c in 0..2usize {
                    pair[c] = park[comptime![((j * 2 + h) * 2 + c) * cfg.threads()] + tid];
                }
                frag[h] = pair;
            }
        }
    }
}

/// Words of the split workspace: per (split, row of `B·H·Q`) the unnormalised `o` (Dh words),
/// then per (split, row) `m` and `l`.
pub(crate) fn split_workspace_len(splits: usize, rows: usize, head_dim: usize) -> usize {
    splits * rows * (head_dim + 2)
}

/// [`TcCfg::part`]: row `h`'s state of the cube's split into the workspace, at row
/// `(b·KH + kh)·gq + r` of split `tile.split` (`m`, `l` by one lane).
#[cube]
fn store_partial(
    ws: &mut Array<f32>,
    o: &Sequence<Array<Vector<f32, Const<2>>>>,
    row: &Row,
    tile: &TcTile,
    p: &AttnParams,
    #[comptime] h: usize,
    #[comptime] cfg: TcCfg,
) {
    let t = UNIT_POS_X as usize % 4;
    let (_, col0) = warp_origin(cfg);
    let r = lane_group_row(tile, h, cfg);
    if r < tile.gq {
        let rows = p.batch as usize * p.kv_heads as usize * tile.gq;
        let at = tile.split * rows + (tile.b * p.kv_heads as usize + tile.kh) * tile.gq + r;
        #[unroll]
        for j in 0..comptime![cfg.cols() / 8] {
            let pair = o.index(j)[h];
            #[unroll]
            for c in 0..2usize {
                ws[at * comptime![cfg.d] + col0 + j * 8 + 2 * t + c] = pair[c];
            }
        }
        if t == 0 && col0 == 0 {
            let ml = (p.kv_len as usize).div_ceil(KEY_SPLIT) * rows * comptime![cfg.d] + 2 * at;
            ws[ml] = row.m;
            ws[ml + 1] = row.l;
        }
    }
}

/// The splits' states of [`TcCfg::part`] cubes folded per output element (one unit per (row,
/// column), rows as the workspace's) in ascending order as [`fold_split`] folds them (split 0
/// as it is, then each split the row sees), then [`store_row`]'s and [`store_lse`]'s epilogue.
#[cube(launch_unchecked)]
pub(crate) fn attention_tc_merge_kernel<F: Float>(
    ws: &Array<f32>,
    kv_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    p: AttnParams,
    #[comptime] cfg: TcCfg,
    #[define(F)] _dtype: StorageType,
) {
    let d = comptime![cfg.d];
    let q_len = p.q_len as usize;
    let gq = p.group as usize * q_len;
    let rows = p.batch as usize * p.kv_heads as usize * gq;
    let g = p.offset as usize + ABSOLUTE_POS;
    if g < rows * d {
        let (row, col) = (g / d, g % d);
        let r = row % gq;
        let bkh = row / gq;
        let tile = TcTile {
            b: bkh / p.kv_heads as usize,
            kh: bkh % p.kv_heads as usize,
            r0: 0usize,
            gq,
            len: 0i32,
            split: 0usize,
        };
        let len = kv_len_of(kv_lens, tile.b * p.lens as usize, p.kv_len);
        let vis = visible(len, p.q_len, r % q_len, comptime![cfg.causal]);
        let splits = (p.kv_len as usize).div_ceil(KEY_SPLIT);
        let ml = splits * rows * d;
        let mut m = ws[ml + 2 * row];
        let mut l = ws[ml + 2 * row + 1];
        let mut o = ws[row * d + col];
        for s in 1..splits {
            if ((s * KEY_SPLIT) as u32) < vis {
                let at = s * rows + row;
                let (mx, a, b) = fold_weights(m, ws[ml + 2 * at], true, false);
                l = fma(l, a, ws[ml + 2 * at + 1] * b);
                o = fma(o, a, ws[at * d + col] * b);
                m = mx;
            }
        }
        let x = div_rn(o, l, comptime![cfg.emulate]);
        let x = select(vis > 0u32 && x != 0.0f32, x, 0.0f32);
        out[group_row_at(&tile, &p.o, &p, r) + col * p.o.d as usize] = F::cast_from(x);
        if col == 0 {
            let mut val = neg_inf();
            if vis > 0u32 {
                val = m + ln_p(l, comptime![cfg.emulate]);
            }
            lse[group_row_at(&tile, &p.lse, &p, r)] = val;
        }
    }
}

/// The cube's staged keys and values (`k_s` stages Q first) and, with `cp.async`, the barriers
/// their copies complete: 0 keys, 1 values (none otherwise).
#[derive(CubeType)]
struct KvStage<F: Float, N: Size> {
    k_s: SharedMemory<Vector<F, N>>,
    v_s: SharedMemory<Vector<F, N>>,
    bars: Sequence<Shared<Barrier>>,
}

/// What a warp carries through the walk: Q's A fragments and `a = |scale|` (fixed), `o` and
/// its lanes' two rows (running).
#[derive(CubeType)]
struct WarpState<F: Float> {
    qa: Sequence<Array<Vector<F, Const<2>>>>,
    a: f32,
    o: Sequence<Array<Vector<f32, Const<2>>>>,
    r0: Row,
    r1: Row,
}

/// One step of the walk: block `j0` (the `parity` of both barriers' phases), whether a row of
/// the warp sees one of its keys (`active`) and whether one of them misses one (`masked`);
/// where its values and the next block's keys come from.
#[derive(CubeType)]
struct KeyBlock {
    j0: usize,
    parity: u32,
    active: bool,
    masked: bool,
    values: RowSrc,
    next_keys: RowSrc,
}

/// The block's scores of the warp's rows from the staged keys and their online softmax
/// ([`softmax_row`]), `o` rescaled where a row grew its max; returns `P` as `P·V`'s A fragments.
/// Where no row of the warp sees a key of the block (not `active`), the MMAs are skipped: every
/// score is masked, so `m`, `l` and `o` keep their bits (`α = 1`, `p = 0`).
#[cube]
fn block_softmax<F: Float, N: Size>(
    k_s: &SharedMemory<Vector<F, N>>,
    w: &mut WarpState<F>,
    blk: &KeyBlock,
    #[comptime] cfg: TcCfg,
) -> Sequence<Array<Vector<F, Const<2>>>> {
    let mut s = zero_frags(S_FRAGS);
    if blk.active {
        #[unroll]
        for kk in 0..comptime![cfg.d / 16] {
            score_step::<F, N>(k_s, w.qa.index(kk), kk, &mut s, cfg);
        }
    }
    softmax_row(&mut s, &mut w.r0, blk.j0, w.a, blk.masked, 0usize);
    softmax_row(&mut s, &mut w.r1, blk.j0, w.a, blk.masked, 1usize);
    // `o·1` is exact: skipped where no row of the warp grew its max.
    if !plane_all(w.r0.alpha == 1.0f32 && w.r1.alpha == 1.0f32) {
        rescale(&mut w.o, &w.r0, &w.r1, comptime![cfg.cols() / 8]);
    }
    probabilities::<F>(&s)
}

/// One block: its values on their way while its scores and softmax run, the next block's keys
/// while its `P·V` runs; staged by `cp.async` or through registers ([`fetch_rows`]).
#[cube]
fn key_block<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    st: &mut KvStage<F, N>,
    blk: &KeyBlock,
    w: &mut WarpState<F>,
    #[comptime] cfg: TcCfg,
) {
    let values = fetch_rows::<F, N>(v, &blk.values, &mut st.v_s, &st.bars, 1usize, cfg);
    await_copies(&st.bars, 0usize, blk.parity, cfg);
    let pa = block_softmax::<F, N>(&st.k_s, w, blk, cfg);
    await_copies(&st.bars, 1usize, blk.parity, cfg);
    store_fetched::<F, N>(&values, &mut st.v_s, cfg);
    // Every warp is done with `k_s`; `v_s` is whole.
    sync_cube();
    let keys = fetch_rows::<F, N>(k, &blk.next_keys, &mut st.k_s, &st.bars, 0usize, cfg);
    if blk.active {
        accumulate_pv::<F, N>(&st.v_s, &pa, &mut w.o, cfg);
    }
    store_fetched::<F, N>(&keys, &mut st.k_s, cfg);
    // Every warp is done with `v_s`; `k_s` is whole (copies: once their phase completes).
    sync_cube();
}

/// A block of key or value rows on its way to `smem`: copied by `cp.async`, completing the
/// unit's next phase of barrier `slot` (nothing held), or loaded into registers for
/// [`store_fetched`].
#[cube]
fn fetch_rows<F: Float, N: Size>(
    t: &Tensor<Vector<F, N>>,
    src: &RowSrc,
    smem: &mut SharedMemory<Vector<F, N>>,
    bars: &Sequence<Shared<Barrier>>,
    #[comptime] slot: usize,
    #[comptime] cfg: TcCfg,
) -> Array<Vector<F, N>> {
    if comptime![cfg.async_copy] {
        copy_rows_async::<F, N>(t, src, smem, KEY_BLOCK, cfg);
        arrive_on_copies(bars, slot);
        Array::<Vector<F, N>>::new(1usize)
    } else {
        load_rows::<F, N>(t, src, KEY_BLOCK, true, cfg)
    }
}

/// [`fetch_rows`]' registers into `smem` (nothing where it copied).
#[cube]
fn store_fetched<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    smem: &mut SharedMemory<Vector<F, N>>,
    #[comptime] cfg: TcCfg,
) {
    if comptime![!cfg.async_copy] {
        store_rows::<F, N>(regs, smem, KEY_BLOCK, cfg);
    }
}

/// With `cp.async`: waits for phase `parity` of barrier `slot` (this unit's copies of it
/// landed); nothing otherwise.
#[cube]
fn await_copies(
    bars: &Sequence<Shared<Barrier>>,
    #[comptime] slot: usize,
    parity: u32,
    #[comptime] cfg: TcCfg,
) {
    if comptime![cfg.async_copy] {
        bars.index(slot).wait_parity(parity);
    }
}

/// A row's state before its first key: `m = −∞`, `l = 0`, `α = 1`.
#[cube]
fn fresh_row(vis: u32) -> Row {
    Row {
        m: neg_inf(),
        l: 0.0f32,
        alpha: 1.0f32,
        vis,
    }
}

/// The cube's walk over `blocks` (up to the last block any row of the cube sees; a block a
/// row cannot see changes nothing of it): its blocks `kb0 .. kb1` (the cube's split with
/// `part`) in steps of `span` blocks, one split where the cube folds them (the fold outside
/// the block loop keeps `o` in the same registers through it), else one step.
#[cube]
fn walk_plan(tile: &TcTile, blocks: usize, #[comptime] cfg: TcCfg) -> (usize, usize, usize) {
    let mut kb0 = 0usize;
    let mut kb1 = blocks;
    if comptime![cfg.part] {
        kb0 = min(tile.split * SPLIT_BLOCKS, blocks);
        kb1 = min(kb0 + SPLIT_BLOCKS, blocks);
    }
    let mut span = max(blocks, 1usize);
    if comptime![cfg.splits] {
        span = SPLIT_BLOCKS;
    }
    (kb0, kb1, span)
}

/// The tensor-core forward (see the module's documentation).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the kernel's bindings; the scalars travel in `p`
pub(crate) fn attention_tc_forward_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    kv_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    ws: &mut Array<f32>,
    p: AttnParams,
    #[comptime] cfg: TcCfg,
    #[define(F)] _dtype: StorageType,
) {
    let tile = tc_tile(kv_lens, &p, cfg);
    // Q, then K, share one buffer: the query's fragments live in registers after the start.
    let k_len = comptime![cfg.k_rows() * cfg.pitch() / cfg.vec];
    let v_len = comptime![KEY_BLOCK * cfg.pitch() / cfg.vec];
    let mut st = KvStage::<F, N> {
        k_s: SharedMemory::<Vector<F, N>>::new_aligned(k_len, 16usize),
        v_s: SharedMemory::<Vector<F, N>>::new_aligned(v_len, 16usize),
        // Initialized before `row_visibility`'s cube barrier.
        bars: ring_barriers(comptime![if cfg.async_copy { 2usize } else { 0usize }]),
    };
    let mut vis_s = SharedMemory::<u32>::new(comptime![cfg.rows()]);
    let mut park = SharedMemory::<f32>::new(comptime![if cfg.splits {
        cfg.parked() * cfg.threads()
    } else {
        1
    }]);
    let (max_vis, warp_vis, warp_max) = row_visibility(&tile, &p, &mut vis_s, cfg);
    let (max_vis, warp_vis, warp_max) = (max_vis as usize, warp_vis as usize, warp_max as usize);
    let (row0, _) = warp_origin(cfg);
    let row = row0 + UNIT_POS_X as usize / 4;
    let mut w = WarpState::<F> {
        qa: query_fragments::<F, N>(q, &tile, &p, &mut st.k_s, cfg),
        a: f32::abs(p.scale),
        o: zero_frags(comptime![cfg.cols() / 8]),
        r0: fresh_row(vis_s[row]),
        r1: fresh_row(vis_s[row + 8]),
    };
    let (kb0, kb1, span) = walk_plan(&tile, max_vis.div_ceil(KEY_BLOCK), cfg);
    let mut steps = 0usize;
    if kb1 > kb0 {
        steps = (kb1 - kb0).div_ceil(span);
        // The first block's keys; the clamped loads need a row to copy (with no block `k_s`
        // is never read).
        let first = key_src(&tile, &p.k, kb0 * KEY_BLOCK, max_vis);
        let keys = fetch_rows::<F, N>(k, &first, &mut st.k_s, &st.bars, 0usize, cfg);
        store_fetched::<F, N>(&keys, &mut st.k_s, cfg);
    } else if comptime![cfg.async_copy] {
        // Phase 0 of the keys' barrier completes without copies (the exit waits for it).
        arrive_on_copies(&st.bars, 0usize);
    }
    sync_cube();
    for step in 0..steps {
        let from = kb0 + step * span;
        for kb in from..min(from + span, kb1) {
            let j0 = kb * KEY_BLOCK;
            // Whether a row of this warp sees a key of the block (a warp-uniform branch; the
            // copied path's cubes of twelve warps skip the others).
            let mut active = true;
            if comptime![cfg.async_copy] {
                active = j0 < warp_max;
            }
            let blk = KeyBlock {
                j0,
                // Block `kb − kb0` is each barrier's phase of that index.
                parity: ((kb - kb0) % 2) as u32,
                active,
                masked: j0 + KEY_BLOCK > warp_vis,
                values: key_src(&tile, &p.v, j0, max_vis),
                // Past the walk: copies of the last visible key, unused.
                next_keys: key_src(&tile, &p.k, j0 + KEY_BLOCK, max_vis),
            };
            key_block::<F, N>(k, v, &mut st, &blk, &mut w, cfg);
        }
        // (Only where `cfg.splits`: `span` is the whole walk otherwise.)
        if steps > 1 {
            fold_split(step * KEY_SPLIT, step == 0, &mut w, &mut park, cfg);
        }
    }
    if steps > 1 {
        unpark(&mut w, &park, cfg);
    }
    // The last keys' copies (phase `kb1 − kb0`) land before the cube exits.
    await_copies(&st.bars, 0usize, ((kb1 - kb0) % 2) as u32, cfg);
    if comptime![cfg.part] {
        store_partial(ws, &w.o, &w.r0, &tile, &p, 0usize, cfg);
        store_partial(ws, &w.o, &w.r1, &tile, &p, 1usize, cfg);
    } else {
        store_row::<F>(out, &w.o, &w.r0, &tile, &p, 0usize, cfg);
        store_row::<F>(out, &w.o, &w.r1, &tile, &p, 1usize, cfg);
        store_lse(lse, &w.r0, &tile, &p, 0usize, cfg);
        store_lse(lse, &w.r1, &tile, &p, 1usize, cfg);
    }
}
