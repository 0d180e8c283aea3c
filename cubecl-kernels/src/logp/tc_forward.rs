//! The forward on tensor cores (f16 / bf16 where the cmma GEMM runs): per fixed (row chunk,
//! vocabulary chunk), the logits through the cmma GEMM into a bounded f32 scratch, then one scan
//! per (row, segment) into the same segment partials the FMA forward writes.

use super::Products;
use super::inputs::{Checked, LogpInputRefs, ignore_scalar};
use super::logits::{
    RowTargets, RowTargetsLaunch, SoftmaxMath, StatsCfg, accumulate, combine_partials, rescale,
    resolve_target,
};
use crate::consts::{
    LOGP_FWD_SEGMENT, LOGP_PARTIAL_STRIDE, SCAN_BATCH, SCAN_LANES, SCAN_ROWS, TC_FWD_ROWS,
    TC_FWD_VOCAB,
};
use crate::error::KernelError;

/// Levels of the scan's tree: `log2(SCAN_LANES)`.
const SCAN_LEVELS: usize = SCAN_LANES.trailing_zeros() as usize;
use crate::gemm::args::{GemmOperands, Mat, Vec1};
use crate::util::{FloatDType, check_grid, chunks, raw_arg, to_u32};
use cubecl::prelude::*;

/// The logits of row chunk `rs..rs + rh` × vocabulary chunk `cs..cs + ch` into `out` (f32,
/// row stride `ld`): `hidden · weightᵀ (+ bias)` on the pinned cmma GEMM, bias added in f32.
/// The same launch in the backward, so both directions see bitwise equal logits.
#[allow(clippy::too_many_arguments)] // one chunk's coordinates and the scratch
pub(crate) fn logits_chunk<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    choice: &Products,
    [rs, rh, cs, ch]: [usize; 4],
    out: &TensorBinding<R>,
    out_offset: usize,
    ld: usize,
) -> Result<(), KernelError> {
    let f = c.dt.storage();
    let hidden = Mat::dense(inputs.hidden, f, &c.hv).rows_from("hidden", rs)?;
    // weight [V, D] viewed as the rhs [D, V], from column cs on.
    let weight_t = Mat {
        buf: inputs.weight,
        dtype: f,
        offset: to_u32("weight", "offset", cs * c.wv.stride(0))?,
        s0: c.wv.stride(1) as u32,
        s1: c.wv.stride(0) as u32,
    };
    let bias = match (inputs.bias, &c.bv) {
        (Some(b), Some(bv)) => Some(Vec1 {
            buf: b,
            offset: to_u32("bias", "offset", cs * bv.stride(0))?,
            stride: bv.stride(0) as u32,
        }),
        _ => None,
    };
    let ops = GemmOperands {
        lhs: hidden,
        rhs: weight_t,
        bias,
        out: Mat {
            buf: out,
            dtype: FloatDType::F32.storage(),
            offset: to_u32("workspace", "offset", out_offset)?,
            s0: to_u32("workspace", "row stride", ld)?,
            s1: 1,
        },
    };
    choice.gemm(client, &ops, [rh, c.d, ch], false)
}

/// Launches on a chunk's logits besides the scan: `(chunk, row stride)`.
pub(crate) type ChunkLaunch<'a> = &'a dyn Fn([usize; 4], usize) -> Result<(), KernelError>;

/// The segment partials of every (row, segment) into `workspace[..partials]`, chunk by chunk,
/// and `also` on each chunk's logits (the sampler's candidates); the caller merges them.
pub(crate) fn tc_forward_partials<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    choice: &Products,
    workspace: &TensorBinding<R>,
    scratch_offset: usize,
    also: Option<ChunkLaunch<'_>>,
) -> Result<(), KernelError> {
    let rows_c = c.n.min(TC_FWD_ROWS);
    let cols_c = c.v.min(TC_FWD_VOCAB);
    for (rs, rh) in chunks(c.n, rows_c) {
        for (cs, ch) in chunks(c.v, cols_c) {
            let chunk = [rs, rh, cs, ch];
            logits_chunk(
                client,
                inputs,
                c,
                choice,
                chunk,
                workspace,
                scratch_offset,
                cols_c,
            )?;
            launch_scan(client, inputs, c, chunk, workspace, scratch_offset, cols_c)?;
            if let Some(also) = also {
                also(chunk, cols_c)?;
            }
        }
    }
    Ok(())
}

/// One scan launch over a chunk's logits: a cube per (`SCAN_ROWS` rows, segment).
fn launch_scan<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    [rs, rh, cs, ch]: [usize; 4],
    workspace: &TensorBinding<R>,
    scratch_offset: usize,
    ld: usize,
) -> Result<(), KernelError> {
    let (gx, gy) = check_grid(
        client,
        "hidden",
        rh.div_ceil(SCAN_ROWS),
        ch.div_ceil(LOGP_FWD_SEGMENT),
    )?;
    unsafe {
        logp_scan_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_2d(SCAN_LANES as u32, SCAN_ROWS as u32),
            LogitsChunkLaunch::new(
                raw_arg(workspace),
                to_u32("workspace", "offset", scratch_offset)?,
                ld as u32,
            ),
            RowTargetsLaunch::new(raw_arg(inputs.targets), c.tv.stride(0) as u32),
            raw_arg(workspace),
            ScanScalarsLaunch::new(
                c.n as u32,
                rs as u32,
                rh as u32,
                cs as u32,
                ch as u32,
                c.v as u32,
                ignore_scalar(c),
                c.inv_t,
                f32::NEG_INFINITY,
            ),
            StatsCfg {
                has_ignore: c.ignore.is_some(),
                entropy: c.entropy,
                math: SoftmaxMath::of(client),
            },
            c.it.storage(),
        );
    }
    Ok(())
}

/// A chunk of logits in the scratch: row `r`, column `c` at `buf[offset + r·ld + c]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct LogitsChunk {
    pub buf: Tensor<f32>,
    pub offset: u32,
    pub ld: u32,
}

/// The scan kernel's scalars: rows, the chunk (`row_start`, `rows_here`, `col_start`,
/// `cols_here`), `v`, the ignore index, `1 / temperature`, `−∞`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct ScanScalars {
    pub n_rows: u32,
    pub row_start: u32,
    pub rows_here: u32,
    pub col_start: u32,
    pub cols_here: u32,
    pub v: u32,
    pub ignore: InputScalar,
    pub inv_t: f32,
    pub neg_inf: f32,
}

/// Scan of one (row, segment) of a logits chunk: each of the row's `SCAN_LANES` units runs an
/// online softmax over its tempered logits (`z · inv_t`; columns `lane + SCAN_LANES·i`,
/// ascending, `SCAN_BATCH` at a time), then the units' `(max, sum-exp[, Σ e·(z − max)])` meet in
/// a fixed binary tree; the first unit writes the segment partial. The order is a function of the
/// segment alone.
#[cube(launch_unchecked)]
pub(crate) fn logp_scan_kernel<I: Int>(
    chunk: &LogitsChunk,
    targets: &RowTargets<I>,
    partial: &mut Tensor<f32>,
    sc: ScanScalars,
    #[comptime] cfg: StatsCfg,
    #[define(I)] _dtype: StorageType,
) {
    let (has_ignore, entropy) = (comptime![cfg.has_ignore], comptime![cfg.entropy]);
    let (z_off, ld, n_rows) = (chunk.offset, chunk.ld, sc.n_rows);
    let (row_start, rows_here, col_start, cols_here) =
        (sc.row_start, sc.rows_here, sc.col_start, sc.cols_here);
    let (v, ignore, inv_t, neg_inf) = (sc.v, sc.ignore, sc.inv_t, sc.neg_inf);
    let lane = UNIT_POS_X as usize;
    let ry = UNIT_POS_Y as usize;
    let rs = row_start as usize;
    let rh = rows_here as usize;
    let cs = col_start as usize;
    let ch = cols_here as usize;
    let local_row = CUBE_POS_X as usize * SCAN_ROWS + ry;
    let seg0 = CUBE_POS_Y as usize * LOGP_FWD_SEGMENT;
    let seg1 = min(ch, seg0 + LOGP_FWD_SEGMENT);
    let row_ok = local_row < rh;
    let zbase = z_off as usize + local_row * ld as usize;

    let mut run_m = neg_inf;
    let mut run_s = 0.0f32;
    let mut run_u = 0.0f32;
    if row_ok {
        let step = SCAN_LANES * SCAN_BATCH;
        let steps = (seg1 - seg0).div_ceil(step);
        let mut vals = Array::<f32>::new(SCAN_BATCH);
        for t in 0..steps {
            let c0 = seg0 + t * step + lane;
            let mut tmax = neg_inf;
            #[unroll]
            for b in 0..SCAN_BATCH {
                let col = c0 + b * SCAN_LANES;
                let mut z = neg_inf;
                if col < seg1 {
                    z = chunk.buf[zbase + col] * inv_t;
                }
                vals[b] = z;
                tmax = select(z > tmax, z, tmax);
            }
            rescale(&mut run_m, &mut run_s, &mut run_u, tmax, entropy, cfg.math);
            #[unroll]
            for b in 0..SCAN_BATCH {
                accumulate(
                    vals[b], run_m, neg_inf, &mut run_s, &mut run_u, entropy, cfg.math,
                );
            }
        }
    }

    let (m, s, u) = tree_merge(run_m, run_s, run_u, lane, ry, entropy, cfg.math);

    if row_ok && lane == 0 {
        let row = rs + local_row;
        let tgt = resolve_target::<I>(
            targets.buf[row * targets.stride as usize],
            v,
            ignore.get::<I>(),
            has_ignore,
        );
        let mut t_logit = 0.0f32;
        let lo = cs + seg0;
        let hi = cs + seg1;
        if tgt >= 0i32 {
            let t = usize::cast_from(tgt);
            if t >= lo && t < hi {
                t_logit = chunk.buf[zbase + t - cs] * inv_t;
            }
        }
        let seg = lo / LOGP_FWD_SEGMENT;
        let o = (seg * n_rows as usize + row) * LOGP_PARTIAL_STRIDE;
        partial[o] = m;
        partial[o + 1] = s;
        partial[o + 2] = t_logit;
        if comptime![entropy] {
            partial[o + 3] = u;
        }
    }
}

/// The row's `SCAN_LANES` softmax partials merged in a fixed binary tree through shared memory
/// (halves, then quarters, …) by `combine_partials`. Every unit of the cube must call it.
#[cube]
fn tree_merge(
    run_m: f32,
    run_s: f32,
    run_u: f32,
    lane: usize,
    ry: usize,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) -> (f32, f32, f32) {
    let mut m_s = SharedMemory::<f32>::new(SCAN_ROWS * SCAN_LANES);
    let mut s_s = SharedMemory::<f32>::new(SCAN_ROWS * SCAN_LANES);
    let mut u_s = SharedMemory::<f32>::new(SCAN_ROWS * SCAN_LANES);
    let at = ry * SCAN_LANES + lane;
    m_s[at] = run_m;
    s_s[at] = run_s;
    u_s[at] = run_u;
    sync_cube();
    #[unroll]
    for level in 0..SCAN_LEVELS {
        let half = SCAN_LANES >> (level + 1);
        if lane < half {
            let (m, s, u) = combine_partials(
                m_s[at],
                s_s[at],
                u_s[at],
                m_s[at + half],
                s_s[at + half],
                u_s[at + half],
                entropy,
                math,
            );
            m_s[at] = m;
            s_s[at] = s;
            u_s[at] = u;
        }
        sync_cube();
    }
    let first = ry * SCAN_LANES;
    (m_s[first], s_s[first], u_s[first])
}
