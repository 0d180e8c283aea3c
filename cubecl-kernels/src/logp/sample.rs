//! `linear_sample`: the `linear_logp` forward's own segment pass, each (row, segment) also keeping
//! its best candidates (the Gumbel-max key `z + G`, or `z` for greedy and top-k), merged per row
//! with the segment partials: the token, and `logp = z_token − lse` with the bits
//! `linear_logp_forward` gives for that target.

use super::candidates::{
    CANDIDATE, NO_TOKEN, PickCfg, PickScalars, PickScalarsLaunch, beats, empty_candidates,
    load_candidates, merged_lists, noise_bar, offer, offer_logit, store_candidates,
    unrolled_insert,
};
use super::forward::{launch_fma_partials, merge_segments};
use super::inputs::{
    Checked, LogpInputRefs, check_inputs, check_workspace, linear_logp_num_segments, targets,
    tensor_core_choice, view,
};
use super::logits::{SoftmaxMath, Targets};
use super::noise::{gumbel, row_word};
use super::tc_forward::{LogitsChunk, LogitsChunkLaunch, tc_forward_partials};
use super::workspace::{partials_len, tc_forward_scratch_len};
use crate::attention::math::neg_inf;
use crate::consts::{LOGP_FWD_SEGMENT, LOGP_ROWS, MAX_INDEX, SCAN_BATCH, SCAN_LANES, TC_FWD_ROWS};
use crate::error::KernelError;
use crate::gemm::fma::{FmaMode, fma_mode};
use crate::gemm::view::{MatArg, MatArgLaunch};
use crate::util::{check_grid, check_out_view, expect_shape, raw_arg, to_u32};
use cubecl::prelude::*;

/// The largest `k` the kernels take.
pub const SAMPLE_K_MAX: u32 = 64;

/// The draw of a [`linear_sample_forward`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleSpec {
    /// The seed; with a row's key (the `targets` binding) it decides the row's noise.
    pub seed: u64,
    /// Candidates kept per row: 1 (Gumbel-max or greedy) or the top-k's `k`, `≤ SAMPLE_K_MAX`.
    pub k: u32,
    /// Gumbel noise: with `k = 1` on every logit, with `k > 1` on the `k` kept. Without it the
    /// token is the argmax.
    pub noise: bool,
}

/// f32 elements of workspace [`linear_sample_forward`] needs: the forward's (segment partials,
/// the tensor-core path's logits scratch) and `k` candidates of 3 words per (row, segment).
pub fn linear_sample_workspace_len(n: usize, v: usize, dtype: StorageType, k: u32) -> usize {
    let candidates = linear_logp_num_segments(v) * n * k as usize * CANDIDATE;
    let scratch = if super::workspace::is_half(dtype) {
        tc_forward_scratch_len(n, v)
    } else {
        0
    };
    partials_len(n, v) + candidates + scratch
}

/// The most rows one [`linear_sample_forward`] call takes (its workspace within 32-bit indexing
/// and the grids within the runtime's cube count); callers split larger N (rows are independent).
pub fn linear_sample_max_rows<R: Runtime>(
    client: &ComputeClient<R>,
    v: usize,
    dtype: StorageType,
    k: u32,
) -> usize {
    let rows = super::inputs::linear_logp_forward_max_rows(client, v, dtype);
    let scratch = if super::workspace::is_half(dtype) {
        TC_FWD_ROWS * super::super::consts::TC_FWD_VOCAB
    } else {
        0
    };
    let per_row = linear_logp_num_segments(v).max(1) * (4 + k as usize * CANDIDATE);
    let space = (MAX_INDEX as usize).saturating_sub(scratch) / per_row;
    (rows.min(space) / LOGP_ROWS * LOGP_ROWS).max(LOGP_ROWS)
}

/// The sampler: `out[i] = (logp_i, lse_i[, entropy_i], token_i)` f32 `[N, C + 1]` for the row
/// keys in `inputs.targets` (`inputs.ignore_index` must be `None`).
///
/// The logits and the segment partials are those of [`crate::linear_logp_forward`] (same
/// kernels, same order), so `lse`, `entropy` and `logp = z_token − lse` are its bits for
/// `targets = tokens`. Each (row, segment) also keeps its `k` best candidates under a total
/// order (larger key, then smaller index): so the row's best are the same whatever the order in
/// which units saw them. The merge takes the segments' candidates, then with noise and `k > 1`
/// the Gumbel-max among the `k` kept. A row with no candidate (all keys −∞ or NaN) gets token −1
/// and `logp` NaN. `V ≤ 2²⁴` (tokens travel as f32).
pub fn linear_sample_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    spec: SampleSpec,
    out: &TensorBinding<R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_sample(client, inputs, spec)?;
    let ov = check_out_view("out", out, 2, 4)?;
    expect_shape("out", &ov, &[c.n, c.cols + 1])?;
    let ws_len = linear_sample_workspace_len(c.n, c.v, inputs.dtype, spec.k);
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;
    if c.n == 0 {
        return Ok(());
    }
    let pick = pick_cfg(client, spec);
    let lists = candidate_pass(client, inputs, &c, spec, workspace)?;
    let cand_off = partials_len(c.n, c.v);
    let scalars = || pick_scalars(cand_off, spec.seed);
    let (gx, _) = check_grid(client, "hidden", c.n.div_ceil(MERGE_BLOCK), 1)?;
    unsafe {
        sample_merge_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(MERGE_BLOCK as u32),
            raw_arg(workspace),
            targets(inputs, &c),
            MatArgLaunch::new(raw_arg(out), view(ov.stride(0), ov.stride(1), 0)),
            SampleMergeScalarsLaunch::new(
                c.n as u32,
                linear_logp_num_segments(c.v) as u32,
                lists as u32,
                f32::NAN,
            ),
            scalars(),
            c.entropy,
            pick,
            SoftmaxMath::of(client),
            c.it.storage(),
        );
    }
    Ok(())
}

/// The sampler's checks beyond those of the inputs: keys (no ignore index), `k`, `V ≤ 2²⁴`.
pub(super) fn check_sample<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    spec: SampleSpec,
) -> Result<Checked, KernelError> {
    let invalid = |arg, reason| Err(KernelError::InvalidArgument { arg, reason });
    if inputs.ignore_index.is_some() {
        return invalid("ignore_index", "the sampler has keys, not targets".into());
    }
    if spec.k == 0 || spec.k > SAMPLE_K_MAX {
        return invalid(
            "k",
            format!("must be in 1..={SAMPLE_K_MAX}, got {}", spec.k),
        );
    }
    let c = check_inputs(client, inputs)?;
    if c.v > NO_TOKEN as usize {
        return invalid(
            "weight",
            format!("the sampler takes V <= {NO_TOKEN}, got {}", c.v),
        );
    }
    Ok(c)
}

/// Rows per cube of the merges.
pub(super) const MERGE_BLOCK: usize = 128;

/// What the sampler's kernels keep for `spec`.
pub(super) fn pick_cfg<R: Runtime>(client: &ComputeClient<R>, spec: SampleSpec) -> PickCfg {
    PickCfg {
        k: spec.k,
        noise: spec.noise,
        emulate_fma: fma_mode(client) == FmaMode::Emulated,
        unrolled: unrolled_insert(client),
    }
}

/// The sampler's pass over the vocabulary: the forward's segment partials (at the workspace's
/// start) and the kept candidates (at [`partials_len`]), one list per (segment, row), or one per
/// row on the tensor-core path with `k > 1`. Returns the lists per row.
pub(super) fn candidate_pass<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    spec: SampleSpec,
    workspace: &TensorBinding<R>,
) -> Result<usize, KernelError> {
    let pick = pick_cfg(client, spec);
    let cand_off = partials_len(c.n, c.v);
    let tensor_cores = tensor_core_choice(client, c);
    // The tensor-core path's top-k keeps one list per row across its chunks.
    let lists = if tensor_cores.is_some() && spec.k > 1 {
        1
    } else {
        linear_logp_num_segments(c.v)
    };
    match tensor_cores {
        Some(choice) => {
            let scratch =
                cand_off + linear_logp_num_segments(c.v) * c.n * spec.k as usize * CANDIDATE;
            let pass = ChunkPass {
                workspace,
                logits_offset: scratch,
                cand_off,
                seed: spec.seed,
                pick,
            };
            let candidates = |chunk: [usize; 4], ld: usize| {
                launch_chunk_candidates(client, inputs, c, chunk, ld, &pass)
            };
            tc_forward_partials(
                client,
                inputs,
                c,
                &choice,
                workspace,
                scratch,
                Some(&candidates),
            )?;
        }
        None => launch_fma_partials(
            client,
            inputs,
            c,
            workspace,
            pick,
            pick_scalars(cand_off, spec.seed),
        )?,
    }
    Ok(lists)
}

/// The candidate scalars: where the candidates lie, the seed's halves.
fn pick_scalars<R: Runtime>(cand_off: usize, seed: u64) -> PickScalarsLaunch<R> {
    PickScalarsLaunch::new(cand_off as u32, seed as u32, (seed >> 32) as u32)
}

/// What every chunk's candidate launch shares: the workspace with the chunk's logits at
/// `logits_offset` and the candidates at `cand_off`, the seed, what to keep.
struct ChunkPass<'a, R: Runtime> {
    workspace: &'a TensorBinding<R>,
    logits_offset: usize,
    cand_off: usize,
    seed: u64,
    pick: PickCfg,
}

/// One candidate launch over a tensor-core chunk's logits (row stride `ld`): a cube of
/// `SCAN_LANES` units per (row, segment), or per row for top-k.
fn launch_chunk_candidates<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    [rs, rh, cs, ch]: [usize; 4],
    ld: usize,
    pass: &ChunkPass<'_, R>,
) -> Result<(), KernelError> {
    let ChunkPass {
        workspace,
        logits_offset: scratch_offset,
        pick,
        ..
    } = *pass;
    let scalars = pick_scalars(pass.cand_off, pass.seed);
    if pick.k > 1 {
        let (gx, _) = check_grid(client, "hidden", rh, 1)?;
        unsafe {
            chunk_top_k_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, 1, 1),
                CubeDim::new_1d(SCAN_LANES as u32),
                LogitsChunkLaunch::new(
                    raw_arg(workspace),
                    to_u32("workspace", "offset", scratch_offset)?,
                    ld as u32,
                ),
                raw_arg(workspace),
                ChunkScalarsLaunch::new(c.n as u32, rs as u32, cs as u32, ch as u32, c.inv_t),
                scalars,
                pick.k,
                pick.unrolled,
            );
        }
        return Ok(());
    }
    let (gx, gy) = check_grid(client, "hidden", rh, ch.div_ceil(LOGP_FWD_SEGMENT))?;
    unsafe {
        chunk_candidates_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_1d(SCAN_LANES as u32),
            LogitsChunkLaunch::new(
                raw_arg(workspace),
                to_u32("workspace", "offset", scratch_offset)?,
                ld as u32,
            ),
            targets(inputs, c),
            raw_arg(workspace),
            ChunkScalarsLaunch::new(c.n as u32, rs as u32, cs as u32, ch as u32, c.inv_t),
            scalars,
            pick,
            c.it.storage(),
        );
    }
    Ok(())
}

/// A chunk's coordinates for the candidate kernel: rows, first row and column, columns, `1/T`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct ChunkScalars {
    pub n_rows: u32,
    pub row_start: u32,
    pub col_start: u32,
    pub cols_here: u32,
    pub inv_t: f32,
}

/// The candidates of one (row, segment) of a chunk: unit `lane` offers columns
/// `lane + SCAN_LANES·i` (the tempered logit as the scan computes it), then the first unit merges
/// the units' lists through shared memory and stores the segment's.
#[cube(launch_unchecked)]
pub(crate) fn chunk_candidates_kernel<I: Int>(
    chunk: &LogitsChunk,
    keys: &Targets<I>,
    ws: &mut Tensor<f32>,
    sc: ChunkScalars,
    pk: PickScalars,
    #[comptime] pick: PickCfg,
    #[define(I)] _dtype: StorageType,
) {
    let k = comptime![pick.k];
    let kk = comptime![pick.k as usize];
    let lane = UNIT_POS_X as usize;
    let local_row = CUBE_POS_X as usize;
    let row = sc.row_start as usize + local_row;
    let seg0 = CUBE_POS_Y as usize * LOGP_FWD_SEGMENT;
    let seg1 = min(sc.cols_here as usize, seg0 + LOGP_FWD_SEGMENT);
    let zbase = chunk.offset as usize + local_row * chunk.ld as usize;
    let cs = sc.col_start as usize;
    let key = keys.buf[keys.offset as usize + row * keys.stride as usize];
    let rw = row_word(pk.seed_lo, pk.seed_hi, u32::cast_from(key));

    let mut list = empty_candidates(kk);
    let mut m = neg_inf();
    let steps = (seg1 - seg0).div_ceil(SCAN_LANES);
    for t in 0..steps {
        let col = seg0 + t * SCAN_LANES + lane;
        if col < seg1 {
            let z = chunk.buf[zbase + col] * sc.inv_t;
            m = select(z > m, z, m);
            offer_logit(
                &mut list,
                z,
                u32::cast_from(cs + col),
                rw,
                noise_bar(m),
                pick,
            );
        }
    }

    let mut sk = SharedMemory::<f32>::new(comptime![SCAN_LANES * kk]);
    let mut sz = SharedMemory::<f32>::new(comptime![SCAN_LANES * kk]);
    let mut si = SharedMemory::<u32>::new(comptime![SCAN_LANES * kk]);
    #[unroll]
    for e in 0..kk {
        sk[lane * kk + e] = list.key[e];
        sz[lane * kk + e] = list.z[e];
        si[lane * kk + e] = list.idx[e];
    }
    sync_cube();
    if lane == 0 {
        for other in 1..SCAN_LANES {
            // A flag, not `break`: the inner range is comptime, so the loop is unrolled and a
            // `break` would leave the outer one. A list is sorted: once one entry stays out,
            // the rest do.
            let mut open = true;
            for e in 0..kk {
                let at = other * kk + e;
                if open {
                    open = offer(&mut list, sk[at], sz[at], si[at], k, pick.unrolled);
                }
            }
        }
        let seg = (cs + seg0) / LOGP_FWD_SEGMENT;
        store_candidates(ws, pk.cand_off, seg * sc.n_rows as usize + row, &list, k);
    }
}

/// The top-k of one row over a tensor-core chunk's logits, continuing the row's list from the
/// earlier chunks (`col_start > 0`) in `ws`. The list lives with the first unit; per step every
/// unit tests `SCAN_BATCH` columns against the list's last entry (published in shared memory) and
/// keeps those that pass, then the first unit offers them to the list. Entries enter only past the
/// k-th best so far, about `k·ln(V/k)` of them per row whatever the chunking, and the kept set is
/// the row's under the total order whatever the order of arrival.
#[cube(launch_unchecked)]
pub(crate) fn chunk_top_k_kernel(
    chunk: &LogitsChunk,
    ws: &mut Tensor<f32>,
    sc: ChunkScalars,
    pk: PickScalars,
    #[comptime] k: u32,
    #[comptime] unrolled: bool,
) {
    let kk = comptime![k as usize];
    let last = comptime![k as usize - 1];
    let lane = UNIT_POS_X as usize;
    let local_row = CUBE_POS_X as usize;
    let row = sc.row_start as usize + local_row;
    let zbase = chunk.offset as usize + local_row * chunk.ld as usize;
    let cs = sc.col_start as usize;
    let ch = sc.cols_here as usize;

    let mut list = empty_candidates(kk);
    let mut bar = SharedMemory::<f32>::new(1usize);
    let mut bar_j = SharedMemory::<u32>::new(1usize);
    let mut cnt = SharedMemory::<u32>::new(SCAN_LANES);
    let mut ck = SharedMemory::<f32>::new(SCAN_LANES * SCAN_BATCH);
    let mut cj = SharedMemory::<u32>::new(SCAN_LANES * SCAN_BATCH);
    if lane == 0 {
        if cs > 0 {
            load_candidates(ws, pk.cand_off, row, &mut list, k);
        }
        bar[0usize] = list.key[last];
        bar_j[0usize] = list.idx[last];
    }
    sync_cube();
    let steps = ch.div_ceil(SCAN_LANES * SCAN_BATCH);
    for t in 0..steps {
        let (b, bj) = (bar[0usize], bar_j[0usize]);
        let mut mine = 0usize;
        #[unroll]
        for i in 0..SCAN_BATCH {
            let col = (t * SCAN_BATCH + i) * SCAN_LANES + lane;
            let mut z = neg_inf();
            if col < ch {
                z = chunk.buf[zbase + col] * sc.inv_t;
            }
            let j = u32::cast_from(cs + col);
            if beats(z, j, b, bj) {
                ck[lane * SCAN_BATCH + mine] = z;
                cj[lane * SCAN_BATCH + mine] = j;
                mine += 1;
            }
        }
        cnt[lane] = mine as u32;
        sync_cube();
        if lane == 0 {
            for q in 0..SCAN_LANES {
                for c in 0..cnt[q] as usize {
                    let x = ck[q * SCAN_BATCH + c];
                    offer(&mut list, x, x, cj[q * SCAN_BATCH + c], k, unrolled);
                }
            }
            bar[0usize] = list.key[last];
            bar_j[0usize] = list.idx[last];
        }
        sync_cube();
    }
    if lane == 0 {
        store_candidates(ws, pk.cand_off, row, &list, k);
    }
}

/// The merge's scalars: rows, segments, candidate lists per row (one per segment, or one for the
/// tensor-core path's top-k), NaN.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct SampleMergeScalars {
    pub n_rows: u32,
    pub num_seg: u32,
    pub lists: u32,
    pub nan: f32,
}

/// One unit per row: the segment partials merged as `linear_logp`'s merge does, the segments'
/// candidates merged into the row's `k` best, the token picked; writes
/// `(logp, lse[, entropy], token)`.
#[cube(launch_unchecked)]
pub(crate) fn sample_merge_kernel<I: Int>(
    ws: &Tensor<f32>,
    keys: &Targets<I>,
    out: &mut MatArg<f32>,
    sc: SampleMergeScalars,
    pk: PickScalars,
    #[comptime] entropy: bool,
    #[comptime] pick: PickCfg,
    #[comptime] math: SoftmaxMath,
    #[define(I)] _dtype: StorageType,
) {
    let k = comptime![pick.k];
    let kk = comptime![pick.k as usize];
    let n = sc.n_rows as usize;
    let row = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if row < n {
        let (lse, ent) = merge_segments(ws, n, row, sc.num_seg as usize, entropy, math);
        let list = merged_lists(ws, pk.cand_off, n, row, sc.lists as usize, k, pick.unrolled);
        // The token's slot: the best, or with noise over k > 1 kept the Gumbel-max among them.
        let mut best = 0usize;
        if comptime![pick.noise && pick.k > 1] {
            let key = keys.buf[keys.offset as usize + row * keys.stride as usize];
            let rw = row_word(pk.seed_lo, pk.seed_hi, u32::cast_from(key));
            let mut best_key = neg_inf();
            let mut best_j = u32::new(NO_TOKEN as i64);
            for e in 0..kk {
                let j = list.idx[e];
                if j != NO_TOKEN {
                    let g = list.z[e] + gumbel(rw, j, pick.emulate_fma);
                    if beats(g, j, best_key, best_j) {
                        best = e;
                        best_key = g;
                        best_j = j;
                    }
                }
            }
        }
        let j = list.idx[best];
        let found = j != NO_TOKEN;
        let logp = select(found, list.z[best] - lse, sc.nan);
        let token = select(found, f32::cast_from(j), f32::new(-1.0));
        let base = out.view.offset as usize + row * out.view.s0 as usize;
        let s1 = out.view.s1 as usize;
        out.buf[base] = logp;
        out.buf[base + s1] = lse;
        let mut col = 2usize;
        if comptime![entropy] {
            out.buf[base + 2 * s1] = ent;
            col = 3usize;
        }
        out.buf[base + col * s1] = token;
    }
}
