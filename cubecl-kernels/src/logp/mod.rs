//! Fused linear log-probability (`linear_logp`): forward and backward without any `[N, V]`
//! buffer.

pub(crate) mod kernels;

use crate::consts::{
    BWD_ROW_CHUNK, BWD_VOCAB_CHUNK, FMA_THREADS, LOGP_PARTIAL_STRIDE, LOGP_ROWS, LOGP_SEGMENT,
    LOGP_VOCAB_TILE,
};
use crate::error::KernelError;
use crate::gemm::fma::{OperandLaunch, SKIP_NONE, SKIP_ZERO_LHS};
use crate::gemm::{FmaMode, Mat, Vec1, fma_mode, launch_cast_2d, launch_col_sum, launch_fma};
use crate::util::{
    FloatDType, IndexDType, View, check_grid, check_out_view, check_runtime_dtype, check_view,
    expect_shape, raw_arg, to_u32,
};
use cubecl::prelude::*;

/// The inputs shared by the forward and the backward.
pub struct LinearLogpInputs<'a, R: Runtime> {
    /// `[N, D]`, dtype `dtype`, any strides.
    pub hidden: &'a TensorBinding<R>,
    /// `[V, D]` (LM-head layout), dtype `dtype`, any strides.
    pub weight: &'a TensorBinding<R>,
    /// `[V]`, dtype `dtype`.
    pub bias: Option<&'a TensorBinding<R>>,
    /// `[N]` integer targets (dtype `targets_dtype`: i32, or i64 where the runtime has it).
    pub targets: &'a TensorBinding<R>,
    /// Storage type of `targets`.
    pub targets_dtype: StorageType,
    /// Rows whose target equals this value are ignored (`logp = 0`, zero `g_logp` gradient).
    pub ignore_index: Option<i64>,
    /// Float dtype of `hidden`, `weight`, `bias` (f32 / f16 / bf16).
    pub dtype: StorageType,
}

/// The gradient outputs of [`linear_logp_backward`].
pub struct LinearLogpGrads<'a, R: Runtime> {
    /// `[N, D]`, dtype of `hidden`.
    pub d_hidden: &'a TensorBinding<R>,
    /// `[V, D]`, dtype of `weight`.
    pub d_weight: &'a TensorBinding<R>,
    /// `[V]`, dtype of `bias`; required iff the inputs have a bias.
    pub d_bias: Option<&'a TensorBinding<R>>,
}

/// Number of vocabulary segments the forward uses: `ceil(V / LOGP_SEGMENT)`.
pub fn linear_logp_num_segments(v: usize) -> usize {
    v.div_ceil(LOGP_SEGMENT)
}

/// f32 elements of workspace [`linear_logp_forward`] needs: `num_segments(V) · N · 3`.
pub fn linear_logp_forward_workspace_len(n: usize, v: usize) -> usize {
    linear_logp_num_segments(v) * n * LOGP_PARTIAL_STRIDE
}

/// f32 elements of workspace [`linear_logp_backward`] needs:
/// `min(N, BWD_ROW_CHUNK) · min(V, BWD_VOCAB_CHUNK)` for the `dz` scratch (≤ 1 Mi floats = 4 MiB
/// whatever N and V are), plus, when `dtype` is not f32, f32 accumulators of gradient size:
/// `N·D + V·D (+ V with a bias)`.
pub fn linear_logp_backward_workspace_len(
    n: usize,
    d: usize,
    v: usize,
    dtype: StorageType,
    has_bias: bool,
) -> Result<usize, KernelError> {
    let dt = FloatDType::from_storage("dtype", dtype)?;
    let scratch = n.min(BWD_ROW_CHUNK) * v.min(BWD_VOCAB_CHUNK);
    let acc = if dt == FloatDType::F32 {
        0
    } else {
        n * d + v * d + if has_bias { v } else { 0 }
    };
    Ok(scratch + acc)
}

struct Checked {
    dt: FloatDType,
    it: IndexDType,
    n: usize,
    d: usize,
    v: usize,
    hv: View,
    wv: View,
    bv: Option<View>,
    tv: View,
    /// `Some(value)` when an ignore index is set and representable in the target dtype.
    ignore: Option<i64>,
}

fn check_inputs<R: Runtime>(
    client: &ComputeClient<R>,
    inp: &LinearLogpInputs<'_, R>,
) -> Result<Checked, KernelError> {
    let dt = FloatDType::from_storage("dtype", inp.dtype)?;
    check_runtime_dtype(client, "dtype", dt.storage())?;
    let it = IndexDType::from_storage("targets", inp.targets_dtype)?;
    check_runtime_dtype(client, "targets", it.storage())?;
    let es = dt.size();
    let hv = check_view("hidden", inp.hidden, 2, es)?;
    let wv = check_view("weight", inp.weight, 2, es)?;
    let (n, d) = (hv.dim(0), hv.dim(1));
    let v = wv.dim(0);
    if wv.dim(1) != d {
        return Err(KernelError::Shape {
            arg: "weight",
            expected: format!("[V, {d}] (columns = hidden columns)"),
            got: wv.shape.clone(),
        });
    }
    let bv = match inp.bias {
        Some(b) => {
            let bv = check_view("bias", b, 1, es)?;
            expect_shape("bias", &bv, &[v])?;
            Some(bv)
        }
        None => None,
    };
    let tv = check_view("targets", inp.targets, 1, it.size())?;
    expect_shape("targets", &tv, &[n])?;
    to_u32("weight", "V", v)?;
    to_u32("hidden", "N", n)?;
    let ignore = match (inp.ignore_index, it) {
        (Some(x), IndexDType::I32) => i32::try_from(x).ok().map(i64::from),
        (Some(x), IndexDType::I64) => Some(x),
        (None, _) => None,
    };
    Ok(Checked {
        dt,
        it,
        n,
        d,
        v,
        hv,
        wv,
        bv,
        tv,
        ignore,
    })
}

fn check_workspace<R: Runtime>(ws: &TensorBinding<R>, needed: usize) -> Result<(), KernelError> {
    let wv = check_out_view("workspace", ws, 1, 4)?;
    if wv.dim(0) < needed {
        return Err(KernelError::BufferTooSmall {
            arg: "workspace",
            needed,
            got: wv.dim(0),
        });
    }
    if needed > 0 && wv.stride(0) != 1 {
        return Err(KernelError::Layout {
            arg: "workspace",
            reason: format!("must be contiguous (stride 1), got stride {}", wv.stride(0)),
        });
    }
    Ok(())
}

fn ignore_scalar(c: &Checked) -> InputScalar {
    InputScalar::new(c.ignore.unwrap_or(0), c.it.storage())
}

fn operand<R: Runtime>(s0: usize, s1: usize, offset: usize) -> OperandLaunch<R> {
    OperandLaunch::new(offset as u32, s0 as u32, s1 as u32)
}

/// Forward: `stats_out[i] = (logp_i, lse_i)` (f32 `[N, 2]`, any strides).
///
/// `z_ij = (Σ_d fma-chain over d ascending of f32(hidden[i,d])·f32(weight[j,d])) + f32(bias[j])`
/// in f32 — bitwise the FMA GEMM of `hidden · weightᵀ (+ bias)`. `lse_i = logsumexp_j z_ij`,
/// `logp_i = z[i, t_i] − lse_i`. Ignored rows: `logp = 0`, `lse` normal. A target outside
/// `[0, V)` that is not the ignore index gives `logp = NaN` (never an out-of-bounds access).
///
/// Order: the vocabulary is cut into `ceil(V / LOGP_SEGMENT)` fixed segments; within a segment a
/// cube walks 64-wide vocab tiles in ascending order with an online softmax (running max, running
/// sum of `exp(z − max)`, target logit, all f32; the running sum is rescaled by
/// `exp(old_max − new_max)` only when the max grows); the segment partials (workspace of
/// [`linear_logp_forward_workspace_len`] f32) are merged in ascending segment order by a second
/// kernel: `m' = max(m, m_s)`, `s' = s·exp(m − m') + s_s·exp(m_s − m')`, `lse = m + ln(s)`.
/// Nothing depends on N or on the device's core count.
pub fn linear_logp_forward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LinearLogpInputs<'_, R>,
    stats_out: &TensorBinding<R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let sv = check_out_view("stats_out", stats_out, 2, 4)?;
    expect_shape("stats_out", &sv, &[c.n, 2])?;
    let ws_len = linear_logp_forward_workspace_len(c.n, c.v);
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;
    if c.n == 0 {
        return Ok(());
    }
    let num_seg = linear_logp_num_segments(c.v);
    let f = c.dt.storage();
    let i = c.it.storage();
    let (bias_buf, bias_stride) = match (inputs.bias, &c.bv) {
        (Some(b), Some(bv)) => (b, bv.stride(0)),
        _ => (inputs.weight, 0),
    };
    if num_seg > 0 {
        let (gx, gy) = check_grid(client, "hidden", c.n.div_ceil(LOGP_ROWS), num_seg)?;
        unsafe {
            kernels::logp_partial_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, gy, 1),
                CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
                raw_arg(inputs.hidden),
                operand(c.hv.stride(0), c.hv.stride(1), 0),
                raw_arg(inputs.weight),
                // weight viewed as the rhs [D, V]: row stride = along d, column stride = along v
                operand(c.wv.stride(1), c.wv.stride(0), 0),
                raw_arg(bias_buf),
                0,
                bias_stride as u32,
                raw_arg(inputs.targets),
                0,
                c.tv.stride(0) as u32,
                raw_arg(workspace),
                c.n as u32,
                c.d as u32,
                c.v as u32,
                ignore_scalar(&c),
                f32::NEG_INFINITY,
                inputs.bias.is_some(),
                c.ignore.is_some(),
                fma_mode(client) == FmaMode::Emulated,
                [f, i],
            );
        }
    }
    let block = 256usize;
    let (gx, _) = check_grid(client, "hidden", c.n.div_ceil(block), 1)?;
    unsafe {
        kernels::logp_merge_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(gx, 1, 1),
            CubeDim::new_1d(block as u32),
            raw_arg(workspace),
            raw_arg(inputs.targets),
            0,
            c.tv.stride(0) as u32,
            raw_arg(stats_out),
            operand(sv.stride(0), sv.stride(1), 0),
            c.n as u32,
            c.v as u32,
            num_seg as u32,
            ignore_scalar(&c),
            f32::NEG_INFINITY,
            f32::NAN,
            c.ignore.is_some(),
            i,
        );
    }
    Ok(())
}

/// Backward from the saved `stats` (`[N, 2]` f32, lse in column 1) and the upstream gradient
/// `grad` (`[N, 2]` f32: column 0 = dLogp, column 1 = dLse).
///
/// `dz_ij = g_logp_i·(1[j==t_i] − p_ij) + g_lse_i·p_ij`, `p_ij = exp(z_ij − lse_i)` with `z`
/// recomputed bitwise as in the forward; ignored rows drop the `g_logp` part; a row whose two
/// upstream gradients are both zero has `dz = 0` exactly; a target outside `[0, V)` that is not
/// ignored simply matches no column.
///
/// Host loop over fixed row chunks (`BWD_ROW_CHUNK`) × vocab chunks (`BWD_VOCAB_CHUNK`), both
/// ascending: (1) the `dz` chunk goes to an f32 scratch; (2) `dH[chunk] (+)= dz · W[vchunk]` —
/// one continuous f32 fma chain per element over `j = 0..V` ascending (the accumulator is carried
/// across vocab chunks), so `dHidden[i]` depends only on row i; (3) `dW[vchunk] (+)= dzᵀ ·
/// H[chunk]` — one continuous f32 fma chain over `i = 0..N` ascending, terms with `dz == 0`
/// skipped (appending zero-gradient rows leaves dW bitwise unchanged); (4) `dB[vchunk] (+)=
/// Σ_i dz` ascending. The results do not depend on the chunk sizes. f32 gradients accumulate in
/// the outputs directly; f16/bf16 accumulate in the f32 workspace and are rounded once at the
/// end. Extra memory: the workspace of [`linear_logp_backward_workspace_len`]; no float atomics.
pub fn linear_logp_backward<R: Runtime>(
    client: &ComputeClient<R>,
    inputs: &LinearLogpInputs<'_, R>,
    stats: &TensorBinding<R>,
    grad: &TensorBinding<R>,
    grads: &LinearLogpGrads<'_, R>,
    workspace: &TensorBinding<R>,
) -> Result<(), KernelError> {
    let c = check_inputs(client, inputs)?;
    let es = c.dt.size();
    let sv = check_view("stats", stats, 2, 4)?;
    expect_shape("stats", &sv, &[c.n, 2])?;
    let gv = check_view("grad", grad, 2, 4)?;
    expect_shape("grad", &gv, &[c.n, 2])?;
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
    let has_bias = dbv.is_some();
    let ws_len = linear_logp_backward_workspace_len(c.n, c.d, c.v, inputs.dtype, has_bias)?;
    check_workspace(workspace, ws_len)?;
    to_u32("workspace", "length", ws_len)?;

    let f = c.dt.storage();
    let f32t = FloatDType::F32.storage();
    let i = c.it.storage();
    let rows_c = c.n.min(BWD_ROW_CHUNK);
    let cols_c = c.v.min(BWD_VOCAB_CHUNK);
    let scratch = rows_c * cols_c;
    let is_f32 = c.dt == FloatDType::F32;

    // Accumulator destinations (f32): the outputs themselves for f32, the workspace otherwise.
    let (dh_buf, dh_off, dh_s0, dh_s1) = if is_f32 {
        (grads.d_hidden, 0, dhv.stride(0), dhv.stride(1))
    } else {
        (workspace, scratch, c.d, 1)
    };
    let (dw_buf, dw_off, dw_s0, dw_s1) = if is_f32 {
        (grads.d_weight, 0, dwv.stride(0), dwv.stride(1))
    } else {
        (workspace, scratch + c.n * c.d, c.d, 1)
    };
    let db_acc = match (&grads.d_bias, &dbv) {
        (Some(db), Some(dbv)) => Some(if is_f32 {
            (*db, 0usize, dbv.stride(0))
        } else {
            (workspace, scratch + c.n * c.d + c.v * c.d, 1)
        }),
        _ => None,
    };
    let dh_mat = Mat {
        buf: dh_buf,
        dtype: f32t,
        offset: 0,
        s0: dh_s0 as u32,
        s1: dh_s1 as u32,
    };
    let dw_mat = Mat {
        buf: dw_buf,
        dtype: f32t,
        offset: dw_off as u32,
        s0: dw_s0 as u32,
        s1: dw_s1 as u32,
    };

    // Degenerate sizes: gradients that no chunk would touch are zero.
    if c.v == 0 && c.n > 0 {
        zero_fill(
            client,
            &Mat {
                offset: dh_off as u32,
                ..dh_mat.shallow()
            },
            c.n,
            c.d,
        )?;
    }
    if c.n == 0 {
        zero_fill(client, &dw_mat, c.v, c.d)?;
        if let Some((b, off, st)) = db_acc {
            zero_vec(client, b, off, st, c.v)?;
        }
    }

    let (bias_buf, bias_stride) = match (inputs.bias, &c.bv) {
        (Some(b), Some(bv)) => (b, bv.stride(0)),
        _ => (inputs.weight, 0),
    };

    let emulate_fma = fma_mode(client) == FmaMode::Emulated;
    let mut rs = 0usize;
    while rs < c.n {
        let rh = rows_c.min(c.n - rs);
        let mut cs = 0usize;
        while cs < c.v {
            let ch = cols_c.min(c.v - cs);
            // (1) dz chunk.
            let (gx, gy) = check_grid(
                client,
                "hidden",
                rh.div_ceil(LOGP_ROWS),
                ch.div_ceil(LOGP_VOCAB_TILE),
            )?;
            unsafe {
                kernels::logp_dz_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(gx, gy, 1),
                    CubeDim::new_2d(FMA_THREADS as u32, FMA_THREADS as u32),
                    raw_arg(inputs.hidden),
                    operand(c.hv.stride(0), c.hv.stride(1), 0),
                    raw_arg(inputs.weight),
                    operand(c.wv.stride(1), c.wv.stride(0), 0),
                    raw_arg(bias_buf),
                    0,
                    bias_stride as u32,
                    raw_arg(inputs.targets),
                    0,
                    c.tv.stride(0) as u32,
                    raw_arg(stats),
                    operand(sv.stride(0), sv.stride(1), 0),
                    raw_arg(grad),
                    operand(gv.stride(0), gv.stride(1), 0),
                    raw_arg(workspace),
                    cols_c as u32,
                    rs as u32,
                    rh as u32,
                    cs as u32,
                    ch as u32,
                    c.d as u32,
                    c.v as u32,
                    ignore_scalar(&c),
                    has_bias,
                    c.ignore.is_some(),
                    emulate_fma,
                    [f, i],
                );
            }
            let dz_mat = Mat {
                buf: workspace,
                dtype: f32t,
                offset: 0,
                s0: cols_c as u32,
                s1: 1,
            };
            // (2) dH[rs..rs+rh, :] (+)= dz[rh, ch] · W[cs..cs+ch, :]
            launch_fma(
                client,
                &dz_mat,
                &Mat {
                    buf: inputs.weight,
                    dtype: f,
                    offset: to_u32("weight", "offset", cs * c.wv.stride(0))?,
                    s0: c.wv.stride(0) as u32,
                    s1: c.wv.stride(1) as u32,
                },
                None,
                &Mat {
                    offset: to_u32("d_hidden", "offset", dh_off + rs * dh_s0)?,
                    ..dh_mat.shallow()
                },
                rh,
                ch,
                c.d,
                cs > 0,
                SKIP_NONE,
            )?;
            // (3) dW[cs..cs+ch, :] (+)= dzᵀ[ch, rh] · H[rs..rs+rh, :]
            launch_fma(
                client,
                &Mat {
                    buf: workspace,
                    dtype: f32t,
                    offset: 0,
                    s0: 1,
                    s1: cols_c as u32,
                },
                &Mat {
                    buf: inputs.hidden,
                    dtype: f,
                    offset: to_u32("hidden", "offset", rs * c.hv.stride(0))?,
                    s0: c.hv.stride(0) as u32,
                    s1: c.hv.stride(1) as u32,
                },
                None,
                &Mat {
                    offset: to_u32("d_weight", "offset", dw_off + cs * dw_s0)?,
                    ..dw_mat.shallow()
                },
                ch,
                rh,
                c.d,
                rs > 0,
                SKIP_ZERO_LHS,
            )?;
            // (4) dB[cs..cs+ch] (+)= Σ_rows dz
            if let Some((b, off, st)) = db_acc {
                launch_col_sum(
                    client,
                    &dz_mat,
                    &Vec1 {
                        buf: b,
                        offset: to_u32("d_bias", "offset", off + cs * st)?,
                        stride: st as u32,
                    },
                    f32t,
                    rh,
                    ch,
                    rs > 0,
                )?;
            }
            cs += ch;
        }
        rs += rh;
    }

    if !is_f32 {
        // One rounding of the f32 accumulators into the gradient dtype.
        launch_cast_2d(
            client,
            &Mat {
                offset: dh_off as u32,
                ..dh_mat.shallow()
            },
            &Mat {
                buf: grads.d_hidden,
                dtype: f,
                offset: 0,
                s0: dhv.stride(0) as u32,
                s1: dhv.stride(1) as u32,
            },
            c.n,
            c.d,
        )?;
        launch_cast_2d(
            client,
            &dw_mat,
            &Mat {
                buf: grads.d_weight,
                dtype: f,
                offset: 0,
                s0: dwv.stride(0) as u32,
                s1: dwv.stride(1) as u32,
            },
            c.v,
            c.d,
        )?;
        if let (Some((b, off, st)), Some(db), Some(dbv)) = (db_acc, grads.d_bias, &dbv) {
            launch_cast_2d(
                client,
                &Mat {
                    buf: b,
                    dtype: f32t,
                    offset: off as u32,
                    s0: 0,
                    s1: st as u32,
                },
                &Mat {
                    buf: db,
                    dtype: f,
                    offset: 0,
                    s0: 0,
                    s1: dbv.stride(0) as u32,
                },
                1,
                c.v,
            )?;
        }
    }
    Ok(())
}

/// Zero an f32 `[m, n]` view (a GEMM with K = 0 writes `+0.0` everywhere).
fn zero_fill<R: Runtime>(
    client: &ComputeClient<R>,
    out: &Mat<'_, R>,
    m: usize,
    n: usize,
) -> Result<(), KernelError> {
    launch_fma(client, out, out, None, out, m, 0, n, false, SKIP_NONE)
}

fn zero_vec<R: Runtime>(
    client: &ComputeClient<R>,
    buf: &TensorBinding<R>,
    off: usize,
    stride: usize,
    n: usize,
) -> Result<(), KernelError> {
    let m = Mat {
        buf,
        dtype: FloatDType::F32.storage(),
        offset: off as u32,
        s0: 0,
        s1: stride as u32,
    };
    zero_fill(client, &m, 1, n)
}
