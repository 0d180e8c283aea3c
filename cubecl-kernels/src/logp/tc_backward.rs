//! The backward on tensor cores (f16 / bf16 where the cmma GEMM runs). Per fixed vocabulary
//! chunk, ascending, and within it per fixed row chunk, ascending: the chunk's hidden rows with
//! zero-gradient rows zeroed; the logits again (the forward's launch, so the same bits) into an
//! f32 scratch; `dz` from them (f32 in place, and rounded once to the input dtype); then
//! `dHidden += dz · W`, `dWeight += dzᵀ · H` on the cmma GEMM and `dBias += Σ_rows dz` (f32)
//! into the f32 accumulators. A finished vocabulary chunk of `dWeight` is rounded at once, so
//! its accumulator is one chunk, not `[V, D]`. Every sum runs over fixed chunks in ascending
//! order.

use super::Products;
use super::inputs::{Checked, LogpInputRefs, ignore_scalar, view};
use super::logits::{DzInputs, DzInputsLaunch, SoftmaxMath, StatsCfg, dz_value, row_gradients};
use super::tc_forward::logits_chunk;
use super::workspace::TcScratch;
use crate::consts::{TC_BWD_ROWS, TC_BWD_VOCAB};
use crate::error::KernelError;
use crate::gemm::args::{GemmOperands, Mat, Vec1};
use crate::gemm::col_sum::launch_col_sum;
use crate::gemm::view::{MatArg, MatArgLaunch};
use crate::util::{FloatDType, View, check_grid, chunks, raw_arg, to_u32};
use cubecl::prelude::*;

use crate::consts::{EW_COLUMNS_PER_CUBE, EW_PER_UNIT, EW_UNITS};

/// The f32 accumulators the backward adds into (the workspace's, f16 / bf16 gradients).
pub(crate) struct Accumulators<'a, R: Runtime> {
    pub dh: &'a Mat<'a, R>,
    pub dw: &'a Mat<'a, R>,
    pub db: Option<&'a Vec1<'a, R>>,
}

/// Run the whole backward into `acc`.
#[allow(clippy::too_many_arguments)] // the backward's bindings, each its own argument
pub(crate) fn tc_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    choice: &Products,
    [stats, grad]: [(&TensorBinding<R>, &View); 2],
    acc: &Accumulators<'_, R>,
    workspace: &TensorBinding<R>,
    scratch: TcScratch,
    flush_d_weight: impl Fn(usize, usize) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let rows_c = c.n.min(TC_BWD_ROWS);
    let cols_c = c.v.min(TC_BWD_VOCAB);
    let f = c.dt.storage();
    let half = |at: usize, s0: usize, s1: usize| -> Result<Mat<'_, R>, KernelError> {
        Ok(Mat {
            buf: workspace,
            dtype: f,
            offset: to_u32("workspace", "offset", 2 * at)?,
            s0: s0 as u32,
            s1: s1 as u32,
        })
    };
    let row_grads = RowGrads {
        stats,
        grad,
        ignore: ignore_scalar(c),
    };
    let dz = Mat {
        buf: workspace,
        dtype: FloatDType::F32.storage(),
        offset: to_u32("workspace", "offset", scratch.z)?,
        s0: cols_c as u32,
        s1: 1,
    };
    for (cs, ch) in chunks(c.v, cols_c) {
        for (rs, rh) in chunks(c.n, rows_c) {
            let chunk = [rs, rh, cs, ch];
            launch_mask_hidden(client, inputs, c, &row_grads, [rs, rh], workspace, scratch)?;
            logits_chunk(
                client, inputs, c, choice, chunk, workspace, scratch.z, cols_c,
            )?;
            launch_dz(
                client, inputs, c, &row_grads, chunk, workspace, scratch, cols_c,
            )?;
            // dHidden[rs..] (+)= dz[rh, ch] · W[cs.., :]
            let ops = GemmOperands {
                lhs: half(scratch.dz_half, cols_c, 1)?,
                rhs: Mat::dense(inputs.weight, f, &c.wv).rows_from("weight", cs)?,
                bias: None,
                out: acc.dh.rows_from("d_hidden", rs)?,
            };
            choice.gemm(client, &ops, [rh, ch, c.d], cs > 0)?;
            // dWeight[cs..] (+)= dzᵀ[ch, rh] · H'[rh, D], into the chunk accumulator
            let ops = GemmOperands {
                lhs: half(scratch.dz_half, 1, cols_c)?,
                rhs: half(scratch.hidden_half, c.d, 1)?,
                bias: None,
                out: acc.dw.shallow(),
            };
            choice.gemm(client, &ops, [ch, rh, c.d], rs > 0)?;
            if let Some(db) = acc.db {
                let out = db.elements_from("d_bias", cs)?;
                launch_col_sum(client, &dz, &out, dz.dtype, rh, ch, rs > 0)?;
            }
        }
        flush_d_weight(cs, ch)?;
    }
    Ok(())
}

/// The saved statistics and the upstream gradient, as the element-wise kernels read them.
struct RowGrads<'a, R: Runtime> {
    stats: (&'a TensorBinding<R>, &'a View),
    grad: (&'a TensorBinding<R>, &'a View),
    ignore: InputScalar,
}

/// `hidden_half[r, :] = hidden[rs + r, :]`, or zeros where the row's upstream gradients are
/// all zero (so such rows add exactly nothing to `dWeight`, even when they hold NaN / Inf).
fn launch_mask_hidden<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    g: &RowGrads<'_, R>,
    [rs, rh]: [usize; 2],
    workspace: &TensorBinding<R>,
    scratch: TcScratch,
) -> Result<(), KernelError> {
    let (gx, gy) = check_grid(client, "hidden", c.d.div_ceil(EW_COLUMNS_PER_CUBE), rh)?;
    let gv = g.grad.1;
    unsafe {
        logp_mask_hidden_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_1d(EW_UNITS as u32),
            MaskInputsLaunch::new(
                MatArgLaunch::new(
                    raw_arg(inputs.hidden),
                    view(c.hv.stride(0), c.hv.stride(1), 0),
                ),
                raw_arg(inputs.targets),
                c.tv.stride(0) as u32,
                MatArgLaunch::new(raw_arg(g.grad.0), view(gv.stride(0), gv.stride(1), 0)),
            ),
            ScratchLaunch::new(
                raw_arg(workspace),
                to_u32("workspace", "offset", 2 * scratch.hidden_half)?,
            ),
            MaskScalarsLaunch::new(rs as u32, c.d as u32, c.v as u32, g.ignore),
            StatsCfg {
                has_ignore: c.ignore.is_some(),
                entropy: c.entropy,
                math: SoftmaxMath::NATIVE,
            },
            [c.dt.storage(), c.it.storage()],
        );
    }
    Ok(())
}

/// `dz` of a chunk from its logits in the scratch: f32 in place, and rounded once into
/// `dz_half`.
#[allow(clippy::too_many_arguments)] // one chunk's coordinates and the scratch
fn launch_dz<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    c: &Checked,
    g: &RowGrads<'_, R>,
    [rs, rh, cs, ch]: [usize; 4],
    workspace: &TensorBinding<R>,
    scratch: TcScratch,
    ld: usize,
) -> Result<(), KernelError> {
    let (gx, gy) = check_grid(client, "hidden", ch.div_ceil(EW_COLUMNS_PER_CUBE), rh)?;
    let (sv, gv) = (g.stats.1, g.grad.1);
    unsafe {
        logp_dz_from_logits_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, gy, 1),
            CubeDim::new_1d(EW_UNITS as u32),
            DzChunkLaunch::new(
                raw_arg(workspace),
                to_u32("workspace", "offset", scratch.z)?,
                raw_arg(workspace),
                to_u32("workspace", "offset", 2 * scratch.dz_half)?,
                ld as u32,
            ),
            DzInputsLaunch::new(
                raw_arg(inputs.targets),
                c.tv.stride(0) as u32,
                MatArgLaunch::new(raw_arg(g.stats.0), view(sv.stride(0), sv.stride(1), 0)),
                MatArgLaunch::new(raw_arg(g.grad.0), view(gv.stride(0), gv.stride(1), 0)),
            ),
            DzChunkScalarsLaunch::new(
                rs as u32, cs as u32, ch as u32, c.v as u32, g.ignore, c.inv_t,
            ),
            StatsCfg {
                has_ignore: c.ignore.is_some(),
                entropy: c.entropy,
                math: SoftmaxMath::NATIVE,
            },
            [c.dt.storage(), c.it.storage()],
        );
    }
    Ok(())
}

/// The mask kernel's inputs: `hidden` and its view, the targets (`targets[row·t_stride]`), the
/// upstream gradient and its view.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct MaskInputs<F: Float, I: Int> {
    pub hidden: MatArg<F>,
    pub targets: Tensor<I>,
    pub t_stride: u32,
    pub grad: MatArg<f32>,
}

/// A written block of the scratch from `buf[offset]` on.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Scratch<F: Float> {
    pub buf: Tensor<F>,
    pub offset: u32,
}

/// The mask kernel's scalars: the chunk's first row, `d`, `v`, the ignore index.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct MaskScalars {
    pub row_start: u32,
    pub d: u32,
    pub v: u32,
    pub ignore: InputScalar,
}

/// The chunk `dz` is computed in: the f32 logits `z` (overwritten by `dz`) at `z_off`, `dz_half`
/// at `dzh_off`, both with row pitch `ld`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DzChunk<F: Float> {
    pub z: Tensor<f32>,
    pub z_off: u32,
    pub dz_half: Tensor<F>,
    pub dzh_off: u32,
    pub ld: u32,
}

/// The dz-from-logits kernel's scalars: the chunk (`row_start`, `col_start`, `cols_here`), `v`,
/// the ignore index, `1 / temperature`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DzChunkScalars {
    pub row_start: u32,
    pub col_start: u32,
    pub cols_here: u32,
    pub v: u32,
    pub ignore: InputScalar,
    pub inv_t: f32,
}

/// Cube (column block, row of the chunk): `hidden_half[r, d]` for its columns.
#[cube(launch_unchecked)]
pub(crate) fn logp_mask_hidden_kernel<F: Float, I: Int>(
    ins: &MaskInputs<F, I>,
    out: &mut Scratch<F>,
    sc: MaskScalars,
    #[comptime] cfg: StatsCfg,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (has_ignore, entropy) = (comptime![cfg.has_ignore], comptime![cfg.entropy]);
    let ho = &ins.hidden.view;
    let r = CUBE_POS_Y as usize;
    let row = sc.row_start as usize + r;
    let (_, _, _, _, zero_row) = row_gradients::<I>(
        &ins.targets,
        ins.t_stride,
        &ins.grad.buf,
        &ins.grad.view,
        row,
        sc.v,
        sc.ignore,
        has_ignore,
        entropy,
    );
    let dd = sc.d as usize;
    let c0 = CUBE_POS_X as usize * EW_UNITS * EW_PER_UNIT + UNIT_POS_X as usize;
    #[unroll]
    for q in 0..EW_PER_UNIT {
        let col = c0 + q * EW_UNITS;
        if col < dd {
            let x =
                ins.hidden.buf[ho.offset as usize + row * ho.s0 as usize + col * ho.s1 as usize];
            out.buf[out.offset as usize + r * dd + col] = select(zero_row, F::new(0.0), x);
        }
    }
}

/// Cube (column block, row of the chunk): `dz` (`dz_value`) of the tempered logits, exactly zero
/// where the upstream gradients are all zero; written over the logits (f32) and rounded once into
/// `dz_half`.
#[cube(launch_unchecked)]
pub(crate) fn logp_dz_from_logits_kernel<F: Float, I: Int>(
    outs: &mut DzChunk<F>,
    ins: &DzInputs<I>,
    sc: DzChunkScalars,
    #[comptime] cfg: StatsCfg,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (has_ignore, entropy) = (comptime![cfg.has_ignore], comptime![cfg.entropy]);
    let (z_off, dzh_off, ld) = (outs.z_off, outs.dzh_off, outs.ld);
    let (col_start, inv_t) = (sc.col_start, sc.inv_t);
    let so = &ins.stats.view;
    let r = CUBE_POS_Y as usize;
    let row = sc.row_start as usize + r;
    let (gl, g_lse, g_ent, tgt, zero_row) = row_gradients::<I>(
        &ins.targets,
        ins.t_stride,
        &ins.grad.buf,
        &ins.grad.view,
        row,
        sc.v,
        sc.ignore,
        has_ignore,
        entropy,
    );
    let sbase = so.offset as usize + row * so.s0 as usize;
    let lse = ins.stats.buf[sbase + so.s1 as usize];
    let mut ent = 0.0f32;
    if comptime![entropy] {
        ent = ins.stats.buf[sbase + 2 * so.s1 as usize];
    }
    let has_tgt = tgt >= 0i32;
    let tgt_local = select(has_tgt, tgt - i32::cast_from(col_start), -1i32);
    let c0 = CUBE_POS_X as usize * EW_UNITS * EW_PER_UNIT + UNIT_POS_X as usize;
    let ch = sc.cols_here as usize;
    #[unroll]
    for q in 0..EW_PER_UNIT {
        let col = c0 + q * EW_UNITS;
        if col < ch {
            let at = r * ld as usize + col;
            let zt = outs.z[z_off as usize + at] * inv_t;
            let is_target = i32::cast_from(col) == tgt_local;
            let val = dz_value(zt, lse, ent, gl, g_lse, g_ent, is_target, inv_t, entropy);
            let val = select(zero_row, 0.0f32, val);
            outs.z[z_off as usize + at] = val;
            outs.dz_half[dzh_off as usize + at] = F::cast_from(val);
        }
    }
}
