//! The logits both directions recompute, target resolution, and a row's upstream gradients.
// #[cube] functions take each tensor and index as its own argument (they are expanded inline).
#![allow(clippy::too_many_arguments)]

use crate::attention::math::{exp_p, ln_p, neg_inf};
use crate::consts::{FMA_MICRO, FMA_THREADS, LOGP_VOCAB_TILE};
use crate::gemm::fma::{FmaMode, SKIP_NONE, fma_block, fma_mode};
use crate::gemm::view::{MatArg, StridedView, VecArg};
use cubecl::prelude::*;

/// The linear layer whose logits both directions recompute: `hidden [N, D]`, `weight` viewed as
/// the rhs `[D, V]`, `bias` (the weight stands in, never read, without one).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Linear<F: Float> {
    pub hidden: MatArg<F>,
    pub weight: MatArg<F>,
    pub bias: VecArg<F>,
}

/// The targets: row `i`'s at `buf[offset + i·stride]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Targets<I: Int> {
    pub buf: Tensor<I>,
    pub offset: u32,
    pub stride: u32,
}

/// Targets of a chunk's rows: row `i`'s at `buf[i·stride]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct RowTargets<I: Int> {
    pub buf: Tensor<I>,
    pub stride: u32,
}

/// The compile-time switches of the kernels that take no layer: an ignore index, the entropy,
/// the softmax's `exp` and `ln`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct StatsCfg {
    pub has_ignore: bool,
    pub entropy: bool,
    pub math: SoftmaxMath,
}

/// Where the softmax kernels take `exp` and `ln` from: the runtime's own where they are fixed
/// functions of their argument (CUDA, HIP), else the crate's portable `exp_p` / `ln_p` (chains of
/// `fma`). A Vulkan driver's `exp` is an error bound, not a definition, and the driver may fold
/// `exp(z − m)` into the arithmetic around it differently per kernel, so the kernels with and
/// without the entropy would give a row's `lse` different bits (NVIDIA's driver does:
/// `benches/results/attention-h100.md`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct SoftmaxMath {
    pub portable: bool,
    /// `fma` emulated in the portable functions (see `fma_mode`).
    pub emulate_fma: bool,
}

impl SoftmaxMath {
    /// The runtime's own: the backward's kernels, whose `p = exp(z − lse)` no other kernel
    /// must match.
    pub(crate) const NATIVE: Self = Self {
        portable: false,
        emulate_fma: false,
    };

    /// This client's choice: by runtime, never by shape.
    pub(crate) fn of<R: Runtime>(client: &ComputeClient<R>) -> Self {
        let portable = !matches!(R::name(client), "cuda" | "hip");
        Self {
            portable,
            emulate_fma: portable && fma_mode(client) == FmaMode::Emulated,
        }
    }
}

/// `eˣ` as `math` says.
#[cube]
pub(crate) fn exp_s(x: f32, #[comptime] math: SoftmaxMath) -> f32 {
    if comptime![math.portable] {
        exp_p(x, math.emulate_fma)
    } else {
        f32::exp(x)
    }
}

/// `ln x` as `math` says (`ln_p` on finite `x > 0`; 0, ∞, NaN and negative `x` take the
/// runtime's `ln`, exact there).
#[cube]
pub(crate) fn ln_s(x: f32, #[comptime] math: SoftmaxMath) -> f32 {
    let mut y = f32::ln(x);
    if comptime![math.portable] {
        let finite = x > 0.0f32 && x < f32::abs(neg_inf());
        y = select(finite, ln_p(x, math.emulate_fma), y);
    }
    y
}

/// The targets, the forward's `stats` and the upstream gradient of the backward kernels:
/// `targets[row·t_stride]`, `stats` and `grad` with their views.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct DzInputs<I: Int> {
    pub targets: Tensor<I>,
    pub t_stride: u32,
    pub stats: MatArg<f32>,
    pub grad: MatArg<f32>,
}

/// The compile-time switches of the FMA logits kernels: a bias, an ignore index, the entropy,
/// `fma` emulated, the softmax's `exp` and `ln`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct LogpCfg {
    pub has_bias: bool,
    pub has_ignore: bool,
    pub entropy: bool,
    pub emulate_fma: bool,
    pub math: SoftmaxMath,
}

/// Resolved target: `t` in `[0, v)` → `t`; `t == ignore` → -1; anything else → -2.
/// The comparisons happen in the target's own integer type, so i64 targets outside the i32
/// range can never alias a valid column.
#[cube]
pub(crate) fn resolve_target<I: Int>(t: I, v: u32, ignore: I, #[comptime] has_ignore: bool) -> i32 {
    let mut res = i32::from_int(-2);
    let mut ign = false;
    if comptime![has_ignore] {
        ign = t == ignore;
    }
    if ign {
        res = i32::from_int(-1);
    } else if t >= I::from_int(0) && t < I::cast_from(v) {
        res = i32::cast_from(t);
    }
    res
}

/// Row `row`'s upstream gradients `(g_logp, g_lse, g_entropy)` (the `g_logp` and `g_entropy`
/// parts dropped where the row is ignored; `g_entropy` is 0 without the entropy column), its
/// resolved target, and whether all of them are zero (the row then contributes exactly nothing).
#[cube]
pub(crate) fn row_gradients<I: Int>(
    targets: &Tensor<I>,
    t_stride: u32,
    grad: &Tensor<f32>,
    go: &StridedView,
    row: usize,
    v: u32,
    ignore: InputScalar,
    #[comptime] has_ignore: bool,
    #[comptime] entropy: bool,
) -> (f32, f32, f32, i32, bool) {
    let gbase = go.offset as usize + row * go.s0 as usize;
    let tgt = resolve_target::<I>(
        targets[row * t_stride as usize],
        v,
        ignore.get::<I>(),
        has_ignore,
    );
    let gl = select(tgt == -1i32, 0.0f32, grad[gbase]);
    let g_lse = grad[gbase + go.s1 as usize];
    let mut g_ent = 0.0f32;
    if comptime![entropy] {
        g_ent = select(tgt == -1i32, 0.0f32, grad[gbase + 2 * go.s1 as usize]);
    }
    let zero_row = gl == 0.0f32 && g_lse == 0.0f32 && g_ent == 0.0f32;
    (gl, g_lse, g_ent, tgt, zero_row)
}

/// `∂L/∂logit` of one (row, column) from the tempered logit `z`:
/// `(g_logp·(1[j==t] − p) + g_lse·p − g_entropy·p·(z − lse + H)) / T`, `p = exp(z − lse)`.
#[cube]
pub(crate) fn dz_value(
    z: f32,
    lse: f32,
    ent: f32,
    gl: f32,
    g_lse: f32,
    g_ent: f32,
    is_target: bool,
    inv_t: f32,
    #[comptime] entropy: bool,
) -> f32 {
    let p = f32::exp(z - lse);
    let ind = select(is_target, 1.0f32, 0.0f32);
    let mut val = gl * (ind - p) + g_lse * p;
    if comptime![entropy] {
        // p = 0 (a −∞ logit) adds nothing, where (z − lse) would make 0·∞.
        val -= select(p == 0.0f32, 0.0f32, g_ent * (p * ((z - lse) + ent)));
    }
    val * inv_t
}

/// Raise a running softmax `(max, sum-exp, Σ e·(z − max))` to the max `m_new`, rescaling the
/// sums (an empty state, sum 0, stays exactly empty).
#[cube]
pub(crate) fn rescale(
    run_m: &mut f32,
    run_s: &mut f32,
    run_u: &mut f32,
    m_new: f32,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) {
    if m_new > *run_m {
        let dm = *run_m - m_new;
        let a = exp_s(dm, math);
        if comptime![entropy] {
            *run_u = select(*run_s == 0.0f32, 0.0f32, a * (*run_u + dm * *run_s));
        }
        *run_s *= a;
        *run_m = m_new;
    }
}

/// Add logit `z` to a running softmax at max `m` (`−∞` adds exactly nothing).
#[cube]
pub(crate) fn accumulate(
    z: f32,
    m: f32,
    neg_inf: f32,
    run_s: &mut f32,
    run_u: &mut f32,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) {
    let e = select(z == neg_inf, 0.0f32, exp_s(z - m, math));
    *run_s += e;
    if comptime![entropy] {
        *run_u += select(e == 0.0f32, 0.0f32, e * (z - m));
    }
}

/// Two softmax partials `(max, sum-exp, Σ e·(z − max))` merged: `m' = max`,
/// `s' = s_a·e^(m_a − m') + s_b·e^(m_b − m')`, `u'` likewise with the shift `(m − m')·s`; an empty
/// side (sum 0) adds exactly nothing. Symmetric in its two sides.
#[cube]
pub(crate) fn combine_partials(
    ma: f32,
    sa: f32,
    ua: f32,
    mb: f32,
    sb: f32,
    ub: f32,
    #[comptime] entropy: bool,
    #[comptime] math: SoftmaxMath,
) -> (f32, f32, f32) {
    let m = select(mb > ma, mb, ma);
    let fa = exp_s(ma - m, math);
    let fb = exp_s(mb - m, math);
    let s = select(sa == 0.0f32, 0.0f32, sa * fa) + select(sb == 0.0f32, 0.0f32, sb * fb);
    let mut u = 0.0f32;
    if comptime![entropy] {
        u = select(sa == 0.0f32, 0.0f32, fa * (ua + (ma - m) * sa))
            + select(sb == 0.0f32, 0.0f32, fb * (ub + (mb - m) * sb));
    }
    (m, s, u)
}

/// `lse = m + ln(s)` and the entropy `H = ln(s) − u / s` of a merged softmax.
#[cube]
pub(crate) fn finish_softmax(m: f32, s: f32, u: f32, #[comptime] math: SoftmaxMath) -> (f32, f32) {
    let ls = ln_s(s, math);
    (m + ls, ls - u / s)
}

/// Compute the logits block `z[row0.., col0..]` (64×64, f32, bias added) into the caller's
/// 4×4 micro-tile. Same arithmetic in forward and backward, so both see bitwise equal logits.
#[cube]
pub(crate) fn logits_block<F: Float>(
    hidden: &Tensor<F>,
    ho: &StridedView,
    weight: &Tensor<F>,
    wo: &StridedView,
    bias: &Tensor<F>,
    bias_off: u32,
    bias_stride: u32,
    m: usize,
    d: usize,
    n: usize,
    row0: usize,
    col0: usize,
    acc: &mut Array<f32>,
    #[comptime] has_bias: bool,
    #[comptime] emulate_fma: bool,
) {
    #[unroll]
    for i in 0..(FMA_MICRO * FMA_MICRO) {
        acc[i] = 0.0f32;
    }
    fma_block::<F, F>(
        hidden,
        ho,
        weight,
        wo,
        m,
        d,
        n,
        row0,
        col0,
        acc,
        SKIP_NONE,
        emulate_fma,
    );
    if comptime![has_bias] {
        let tx = UNIT_POS_X as usize;
        #[unroll]
        for c in 0..FMA_MICRO {
            let col = col0 + tx + c * FMA_THREADS;
            if col < n {
                let b = f32::cast_from(bias[bias_off as usize + col * bias_stride as usize]);
                #[unroll]
                for r in 0..FMA_MICRO {
                    acc[r * FMA_MICRO + c] += b;
                }
            }
        }
    }
}

/// This unit's 4×4 micro-tile of logits, times `inv_t`, into the cube's
/// `[LOGP_ROWS, LOGP_VOCAB_TILE]` tile.
#[cube]
pub(crate) fn stage_logits(acc: &Array<f32>, inv_t: f32, z_s: &mut SharedMemory<f32>) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    #[unroll]
    for r in 0..FMA_MICRO {
        #[unroll]
        for c in 0..FMA_MICRO {
            z_s[(ty + r * FMA_THREADS) * LOGP_VOCAB_TILE + tx + c * FMA_THREADS] =
                acc[r * FMA_MICRO + c] * inv_t;
        }
    }
}
