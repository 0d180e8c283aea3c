//! The backward: per fixed (vocabulary chunk, row chunk), the `dz` tile into an f32 scratch, then
//! `dHidden`, `dWeight` and `dBias` accumulated from it in f32, in ascending chunk order; or the
//! tensor-core path of `tc_backward.rs`.

use super::inputs::tensor_core_choice;
use super::inputs::{
    Checked, LogpGradRefs, LogpInputRefs, check_inputs, check_workspace, ignore_scalar, linear,
    linear_logp_backward_workspace_len, view,
};
use super::logits::{
    DzInputs, DzInputsLaunch, Linear, LogpCfg, SoftmaxMath, dz_value, logits_block, row_gradients,
};
use super::tc_backward::{Accumulators, tc_backward};
use super::workspace::{HalfLayout, dw_chunk_rows};
use crate::consts::{
    BWD_ROW_CHUNK, BWD_VOCAB_CHUNK, FMA_MICRO, FMA_THREADS, LOGP_ROWS, LOGP_VOCAB_TILE,
};
use crate::error::KernelError;
use crate::gemm::args::{GemmOperands, Mat, Vec1};
use crate::gemm::cast::launch_cast_2d;
use crate::gemm::col_sum::launch_col_sum;
use crate::gemm::fma::{FmaMode, SKIP_NONE, SKIP_ZERO_LHS, fma_mode, launch_fma};
use crate::gemm::view::MatArgLaunch;
use crate::util::{
    FloatDType, View, check_grid, check_out_view, check_view, chunks, expect_shape, raw_arg, to_u32,
};
use cubecl::prelude::*;

/// Backward from the saved `stats` (f32 `[N, 2 or 3]`: lse in column 1, entropy in column 2) and
/// the upstream gradient `grad` (f32, the same shape: dLogp, dLse, dEntropy).
///
/// `dlogit_ij = (g_logp_i·(1[j==t_i] − p_ij) + g_lse_i·p_ij − g_ent_i·p_ij·(z_ij − lse_i + H_i))
/// · inv_temperature`, `p_ij = exp(z_ij − lse_i)` with the tempered `z` recomputed bitwise as in
/// the forward; ignored rows drop the `g_logp` and `g_ent` parts; a row whose upstream gradients
/// are all zero has `dz = 0` exactly; a target outside `[0, V)` that is not ignored simply
/// matches no column.
///
/// FMA path (f32, and f16/bf16 without cooperative matrices): host loop over fixed vocab chunks
/// (`BWD_VOCAB_CHUNK`, outer) × row chunks (`BWD_ROW_CHUNK`, inner), both ascending: (1) the `dz`
/// chunk goes to an f32 scratch; (2) `dH[chunk] (+)= dz · W[vchunk]` —
/// one continuous f32 fma chain per element over `j = 0..V` ascending (the accumulator is carried
/// across vocab chunks), so `dHidden[i]` depends only on row i; (3) `dW[vchunk] (+)= dzᵀ ·
/// H[chunk]` — one continuous f32 fma chain over `i = 0..N` ascending, terms with `dz == 0`
/// skipped (appending zero-gradient rows leaves dW bitwise unchanged); (4) `dB[vchunk] (+)=
/// Σ_i dz` ascending. The results do not depend on the chunk sizes. f32 gradients accumulate in
/// the outputs directly; f16/bf16 accumulate in the f32 workspace and are rounded once (`dWeight`
/// when its vocab chunk is done, so only one chunk of it is held in f32). Where
/// [`crate::linear_logp_tensor_cores`] holds, the tensor-core path runs instead (logits and both
/// gradient products on the cmma GEMM, `dz` rounded once to the input dtype; see
/// `tc_backward.rs`). Extra memory: the workspace of [`linear_logp_backward_workspace_len`]; no
/// float atomics.
pub fn linear_logp_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    stats: &TensorBinding<R>,
    grad: &TensorBinding<R>,
    grads: &LogpGradRefs<'_, R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let views = check_backward(client, inputs, [stats, grad], grads, workspace)?;
    let b = Backward::new(client, inputs, [stats, grad], grads, workspace, views);
    b.zero_untouched()?;
    if let Some(choice) = tensor_core_choice(client, &b.c) {
        let [sv, gv, _, _] = &b.views;
        let acc = Accumulators {
            dh: &b.dh,
            dw: &b.dw,
            db: b.db.as_ref(),
        };
        let scratch = b.half_layout().tc;
        tc_backward(
            client,
            inputs,
            &b.c,
            &choice,
            [(stats, sv), (grad, gv)],
            &acc,
            workspace,
            scratch,
            |cs, ch| b.flush_d_weight(cs, ch),
        )?;
        return b.round_accumulators();
    }
    for (cs, ch) in chunks(b.c.v, b.cols_c) {
        for (rs, rh) in chunks(b.c.n, b.rows_c) {
            let chunk = Chunk { rs, rh, cs, ch };
            b.launch_dz(chunk)?;
            b.accumulate_d_hidden(chunk)?;
            b.accumulate_d_weight(chunk)?;
            b.accumulate_d_bias(chunk)?;
        }
        b.flush_d_weight(cs, ch)?;
    }
    b.round_accumulators()
}

/// The checked views of the backward's arguments.
struct BackwardViews {
    c: Checked,
    stats: View,
    grad: View,
    d_hidden: View,
    d_weight: View,
    d_bias: Option<View>,
}

/// Every shape, dtype and size check of [`linear_logp_backward`], before anything runs.
fn check_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LogpInputRefs<'_, R>,
    [stats, grad]: [&TensorBinding<R>; 2],
    grads: &LogpGradRefs<'_, R>,
    workspace: &TensorBinding<R>,
) -> Result<BackwardViews, KernelError> {
    let c = check_inputs(client, inputs)?;
    let es = c.dt.size();
    let sv = check_view("stats", stats, 2, 4)?;
    expect_shape("stats", &sv, &[c.n, c.cols])?;
    let gv = check_view("grad", grad, 2, 4)?;
    expect_shape("grad", &gv, &[c.n, c.cols])?;
    let dhv = check_out_view("d_hidden", grads.d_hidden, 2, es)?;
    expect_shape("d_hidden", &dhv, &[c.n, c.d])?;
    let dwv = check_out_view("d_weight", grads.d_weight, 2, es)?;
    expect_shape("d_weight", &dwv, &[c.v, c.d])?;
    let dbv = match (inputs.bias.is_some(), grads.d_bias) {
        (true, Some(db)) => {
            let dbv = check_out_view("d_bias", db, 1, es)?;
            expect_shape("d_bias", &dbv, &[c.v])?;
            Some(dbv)
        }
        (false, None) => None,
        (true, None) => {
            return Err(KernelError::Shape {
                arg: "d_bias",
                expected: format!("[{}] (the inputs have a bias)", c.v),
                got: vec![],
            });
        }
        (false, Some(db)) => {
            return Err(KernelError::Shape {
                arg: "d_bias",
                expected: "none (the inputs have no bias)".to_string(),
                got: db.shape.iter().copied().collect(),
            });
        }
    };
    let ws_len = linear_logp_backward_workspace_len(c.n, c.d, c.v, inputs.dtype, dbv.is_some())?;
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;
    Ok(BackwardViews {
        c,
        stats: sv,
        grad: gv,
        d_hidden: dhv,
        d_weight: dwv,
        d_bias: dbv,
    })
}

/// One (row chunk, vocabulary chunk): rows `rs..rs + rh`, columns `cs..cs + ch`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    rs: usize,
    rh: usize,
    cs: usize,
    ch: usize,
}

/// Everything the chunk launches read and write.
struct Backward<'a, 'b, R: Runtime> {
    client: &'a ComputeClient<R>,
    inputs: &'a LogpInputRefs<'b, R>,
    stats: &'a TensorBinding<R>,
    grad: &'a TensorBinding<R>,
    grads: &'a LogpGradRefs<'b, R>,
    workspace: &'a TensorBinding<R>,
    c: Checked,
    views: [View; 4],
    d_bias_view: Option<View>,
    rows_c: usize,
    cols_c: usize,
    /// Where the f32 sums go: the outputs themselves for f32, the workspace's accumulators
    /// ([`HalfLayout`]) otherwise.
    dh: Mat<'a, R>,
    dw: Mat<'a, R>,
    db: Option<Vec1<'a, R>>,
    bias: (&'a TensorBinding<R>, usize),
    emulate_fma: bool,
}

impl<'a, 'b, R: Runtime> Backward<'a, 'b, R> {
    fn new(
        client: &'a ComputeClient<R>,
        inputs: &'a LogpInputRefs<'b, R>,
        [stats, grad]: [&'a TensorBinding<R>; 2],
        grads: &'a LogpGradRefs<'b, R>,
        workspace: &'a TensorBinding<R>,
        v: BackwardViews,
    ) -> Self {
        let c = v.c;
        let f32t = FloatDType::F32.storage();
        let rows_c = c.n.min(BWD_ROW_CHUNK);
        let cols_c = c.v.min(BWD_VOCAB_CHUNK);
        let layout = HalfLayout::new(c.n, c.d, c.v, grads.d_bias.is_some());
        let is_f32 = c.dt == FloatDType::F32;
        let acc = |out: &'a TensorBinding<R>, view: &View, offset: usize, rows_stride: usize| {
            if is_f32 {
                Mat::dense(out, f32t, view)
            } else {
                Mat {
                    buf: workspace,
                    dtype: f32t,
                    offset: offset as u32,
                    s0: rows_stride as u32,
                    s1: 1,
                }
            }
        };
        let dh = acc(grads.d_hidden, &v.d_hidden, layout.d_hidden, c.d);
        // f16 / bf16: one vocabulary chunk of dWeight at a time (rounded when the chunk is done).
        let dw = acc(grads.d_weight, &v.d_weight, layout.d_weight, c.d);
        let db = match (grads.d_bias, &v.d_bias) {
            (Some(out), Some(view)) if is_f32 => Some(Vec1 {
                buf: out,
                offset: 0,
                stride: view.stride(0) as u32,
            }),
            (Some(_), Some(_)) => Some(Vec1 {
                buf: workspace,
                offset: layout.d_bias as u32,
                stride: 1,
            }),
            _ => None,
        };
        let bias = match (inputs.bias, &c.bv) {
            (Some(b), Some(bv)) => (b, bv.stride(0)),
            _ => (inputs.weight, 0),
        };
        Self {
            client,
            inputs,
            stats,
            grad,
            grads,
            workspace,
            views: [v.stats, v.grad, v.d_hidden, v.d_weight],
            d_bias_view: v.d_bias,
            rows_c,
            cols_c,
            dh,
            dw,
            db,
            bias,
            emulate_fma: fma_mode(client) == FmaMode::Emulated,
            c,
        }
    }

    /// The workspace layout of f16 / bf16.
    fn half_layout(&self) -> HalfLayout {
        let c = &self.c;
        HalfLayout::new(c.n, c.d, c.v, self.db.is_some())
    }

    /// Where `dWeight[cs..]` accumulates: the output itself (f32) or the chunk accumulator.
    fn d_weight_rows(&self, cs: usize) -> Result<Mat<'a, R>, KernelError> {
        if self.c.dt == FloatDType::F32 {
            self.dw.rows_from("d_weight", cs)
        } else {
            Ok(self.dw.shallow())
        }
    }

    /// f16 / bf16: round the finished vocabulary chunk `cs..cs + ch` of `dWeight` once.
    fn flush_d_weight(&self, cs: usize, ch: usize) -> Result<(), KernelError> {
        if self.c.dt == FloatDType::F32 {
            return Ok(());
        }
        let [_, _, _, dwv] = &self.views;
        let out =
            Mat::dense(self.grads.d_weight, self.c.dt.storage(), dwv).rows_from("d_weight", cs)?;
        launch_cast_2d(self.client, &self.dw, &out, ch, self.c.d)
    }

    /// Gradients no chunk would touch are zero: `dHidden` when V = 0, `dWeight` / `dBias` when
    /// N = 0 (a GEMM with K = 0 writes `+0.0` everywhere).
    fn zero_untouched(&self) -> Result<(), KernelError> {
        let c = &self.c;
        if c.v == 0 && c.n > 0 {
            zero_fill(self.client, &self.dh, c.n, c.d)?;
        }
        if c.n == 0 {
            let rows = if c.dt == FloatDType::F32 {
                c.v
            } else {
                dw_chunk_rows(c.v)
            };
            zero_fill(self.client, &self.dw, rows, c.d)?;
            if let Some(db) = &self.db {
                let row = Mat {
                    buf: db.buf,
                    dtype: FloatDType::F32.storage(),
                    offset: db.offset,
                    s0: 0,
                    s1: db.stride,
                };
                zero_fill(self.client, &row, 1, c.v)?;
            }
        }
        Ok(())
    }

    /// The chunk's `dz` into the f32 scratch (row stride `cols_c`).
    fn launch_dz(&self, k: Chunk) -> Result<(), KernelError> {
        let c = &self.c;
        let [sv, gv, _, _] = &self.views;
        let (gx, gy) = check_grid(
            self.client,
            "hidden",
            k.rh.div_ceil(LOGP_ROWS),
            k.ch.div_ceil(LOGP_VOCAB_TILE),
        )?;
        unsafe {
            logp_dz_kernel::launch_unchecked::<R>(
                self.client,
                CubeCount::Static(gx, gy, 1),
                CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
                linear(self.inputs, c, self.bias.0, self.bias.1),
                DzInputsLaunch::new(
                    raw_arg(self.inputs.targets),
                    c.tv.stride(0) as u32,
                    MatArgLaunch::new(raw_arg(self.stats), view(sv.stride(0), sv.stride(1), 0)),
                    MatArgLaunch::new(raw_arg(self.grad), view(gv.stride(0), gv.stride(1), 0)),
                ),
                DzScratchLaunch::new(raw_arg(self.workspace), self.cols_c as u32),
                DzScalarsLaunch::new(
                    k.rs as u32,
                    k.rh as u32,
                    k.cs as u32,
                    k.ch as u32,
                    c.d as u32,
                    c.v as u32,
                    ignore_scalar(c),
                    c.inv_t,
                ),
                LogpCfg {
                    has_bias: self.db.is_some(),
                    has_ignore: c.ignore.is_some(),
                    entropy: c.entropy,
                    emulate_fma: self.emulate_fma,
                    math: SoftmaxMath::NATIVE,
                },
                [c.dt.storage(), c.it.storage()],
            );
        }
        Ok(())
    }

    /// The `dz` scratch as a `[rh, ch]` matrix (transposed: `[ch, rh]`).
    fn dz(&self, transposed: bool) -> Mat<'a, R> {
        let (s0, s1) = if transposed {
            (1, self.cols_c as u32)
        } else {
            (self.cols_c as u32, 1)
        };
        Mat {
            buf: self.workspace,
            dtype: FloatDType::F32.storage(),
            offset: 0,
            s0,
            s1,
        }
    }

    /// `dH[rs..rs+rh, :] (+)= dz[rh, ch] · W[cs..cs+ch, :]`: one f32 fma chain per element over
    /// the whole vocabulary in ascending order (carried across vocabulary chunks).
    fn accumulate_d_hidden(&self, k: Chunk) -> Result<(), KernelError> {
        let c = &self.c;
        let weight = Mat::dense(self.inputs.weight, c.dt.storage(), &c.wv);
        let ops = GemmOperands {
            lhs: self.dz(false),
            rhs: weight.rows_from("weight", k.cs)?,
            bias: None,
            out: self.dh.rows_from("d_hidden", k.rs)?,
        };
        launch_fma(self.client, &ops, [k.rh, k.ch, c.d], k.cs > 0, SKIP_NONE)
    }

    /// `dW[cs..cs+ch, :] (+)= dzᵀ[ch, rh] · H[rs..rs+rh, :]`: one f32 fma chain per element over
    /// all rows in ascending order, terms with `dz == 0` skipped (appended zero-gradient rows
    /// leave it bitwise unchanged).
    fn accumulate_d_weight(&self, k: Chunk) -> Result<(), KernelError> {
        let c = &self.c;
        let hidden = Mat::dense(self.inputs.hidden, c.dt.storage(), &c.hv);
        let ops = GemmOperands {
            lhs: self.dz(true),
            rhs: hidden.rows_from("hidden", k.rs)?,
            bias: None,
            out: self.d_weight_rows(k.cs)?,
        };
        let dims = [k.ch, k.rh, c.d];
        launch_fma(self.client, &ops, dims, k.rs > 0, SKIP_ZERO_LHS)
    }

    /// `dB[cs..cs+ch] (+)= Σ_rows dz`, rows ascending.
    fn accumulate_d_bias(&self, k: Chunk) -> Result<(), KernelError> {
        let Some(db) = &self.db else {
            return Ok(());
        };
        let out = db.elements_from("d_bias", k.cs)?;
        let f32t = FloatDType::F32.storage();
        launch_col_sum(
            self.client,
            &self.dz(false),
            &out,
            f32t,
            k.rh,
            k.ch,
            k.rs > 0,
        )
    }

    /// One rounding of the f32 accumulators into the gradients' dtype (f16/bf16 only).
    fn round_accumulators(&self) -> Result<(), KernelError> {
        let c = &self.c;
        if c.dt == FloatDType::F32 {
            return Ok(());
        }
        let f = c.dt.storage();
        let [_, _, dhv, _] = &self.views;
        let dh_out = Mat::dense(self.grads.d_hidden, f, dhv);
        launch_cast_2d(self.client, &self.dh, &dh_out, c.n, c.d)?;
        if let (Some(db), Some(out), Some(dbv)) = (&self.db, self.grads.d_bias, &self.d_bias_view) {
            let acc = Mat {
                buf: db.buf,
                dtype: FloatDType::F32.storage(),
                offset: db.offset,
                s0: 0,
                s1: db.stride,
            };
            let out = Mat {
                buf: out,
                dtype: f,
                offset: 0,
                s0: 0,
                s1: dbv.stride(0) as u32,
            };
            launch_cast_2d(self.client, &acc, &out, 1, c.v)?;
        }
        Ok(())
    }
}

/// Zero an f32 `[m, n]` view (a GEMM with K = 0 writes `+0.0` everywhere).
fn zero_fill<R: Runtime>(
    client: &ComputeClient<R>,
    out: &Mat<'_, R>,
    m: usize,
    n: usize,
) -> Result<(), KernelError> {
    let ops = GemmOperands {
        lhs: out.shallow(),
        rhs: out.shallow(),
        bias: None,
        out: out.shallow(),
    };
    launch_fma(client, &ops, [m, 0, n], false, SKIP_NONE)
}

/// The dz scratch: `buf[(row − row_start)·stride + (col − col_start)]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DzScratch {
    pub buf: Tensor<f32>,
    pub stride: u32,
}

/// The dz kernel's chunk (`row_start`, `rows_here`, `col_start`, `cols_here`), `d`, `v`, the
/// ignore index and `1 / temperature`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DzScalars {
    pub row_start: u32,
    pub rows_here: u32,
    pub col_start: u32,
    pub cols_here: u32,
    pub d: u32,
    pub v: u32,
    pub ignore: InputScalar,
    pub inv_t: f32,
}

/// Backward: recompute the logits block, temper it, and write its `dz` (`dz_value`) into the f32
/// scratch. Ignored rows drop the `g_logp` and `g_ent` parts. Rows whose upstream gradients are all
/// zero get `dz = 0` exactly (so they contribute nothing, even if their logits are NaN/Inf).
#[cube(launch_unchecked)]
pub(crate) fn logp_dz_kernel<F: Float, I: Int>(
    lin: &Linear<F>,
    ins: &DzInputs<I>,
    dz: &mut DzScratch,
    sc: DzScalars,
    #[comptime] cfg: LogpCfg,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (has_bias, has_ignore, entropy, emulate_fma) = (
        comptime![cfg.has_bias],
        comptime![cfg.has_ignore],
        comptime![cfg.entropy],
        comptime![cfg.emulate_fma],
    );
    let (row_start, rows_here, col_start, cols_here) =
        (sc.row_start, sc.rows_here, sc.col_start, sc.cols_here);
    let (d, v, ignore, inv_t) = (sc.d, sc.v, sc.ignore, sc.inv_t);
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let rs = row_start as usize;
    let cs = col_start as usize;
    let m_end = rs + rows_here as usize;
    let n_end = cs + cols_here as usize;
    let row0 = rs + CUBE_POS_X as usize * LOGP_ROWS;
    let col0 = cs + CUBE_POS_Y as usize * LOGP_VOCAB_TILE;

    let mut acc = Array::<f32>::new(FMA_MICRO * FMA_MICRO);
    logits_block::<F>(
        &lin.hidden.buf,
        &lin.hidden.view,
        &lin.weight.buf,
        &lin.weight.view,
        &lin.bias.buf,
        lin.bias.offset,
        lin.bias.stride,
        m_end,
        d as usize,
        n_end,
        row0,
        col0,
        &mut acc,
        has_bias,
        emulate_fma,
    );

    #[unroll]
    for r in 0..FMA_MICRO {
        let row = row0 + ty + r * FMA_THREADS;
        if row < m_end {
            let sbase = ins.stats.view.offset as usize + row * ins.stats.view.s0 as usize;
            let lse = ins.stats.buf[sbase + ins.stats.view.s1 as usize];
            let mut ent = 0.0f32;
            if comptime![entropy] {
                ent = ins.stats.buf[sbase + 2 * ins.stats.view.s1 as usize];
            }
            let (gl, g_lse, g_ent, tgt, zero_row) = row_gradients::<I>(
                &ins.targets,
                ins.t_stride,
                &ins.grad.buf,
                &ins.grad.view,
                row,
                v,
                ignore,
                has_ignore,
                entropy,
            );
            let has_tgt = tgt >= 0i32;
            let tgt_u = usize::cast_from(select(has_tgt, tgt, 0i32));
            #[unroll]
            for c in 0..FMA_MICRO {
                let col = col0 + tx + c * FMA_THREADS;
                if col < n_end {
                    let z = acc[r * FMA_MICRO + c] * inv_t;
                    let is_target = has_tgt && col == tgt_u;
                    let val = dz_value(z, lse, ent, gl, g_lse, g_ent, is_target, inv_t, entropy);
                    dz.buf[(row - rs) * dz.stride as usize + (col - cs)] =
                        select(zero_row, 0.0f32, val);
                }
            }
        }
    }
}
