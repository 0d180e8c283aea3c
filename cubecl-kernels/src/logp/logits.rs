//! The logits both directions recompute, target resolution, and a row's upstream gradients.
// #[cube] functions take each tensor and index as its own argument (they are expanded inline).
#![allow(clippy::too_many_arguments)]

use crate::consts::{FMA_MICRO, FMA_THREADS, LOGP_VOCAB_TILE};
use crate::gemm::fma::{SKIP_NONE, fma_block};
use crate::gemm::view::StridedView;
use cubecl::prelude::*;

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

/// Row `row`'s upstream gradients `(g_logp, g_lse)` (the `g_logp` part dropped where the row is
/// ignored), its resolved target, and whether both gradients are zero (the row then contributes
/// exactly nothing).
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
) -> (f32, f32, i32, bool) {
    let gbase = go.offset as usize + row * go.s0 as usize;
    let tgt = resolve_target::<I>(
        targets[row * t_stride as usize],
        v,
        ignore.get::<I>(),
        has_ignore,
    );
    let gl = select(tgt == -1i32, 0.0f32, grad[gbase]);
    let g_lse = grad[gbase + go.s1 as usize];
    (gl, g_lse, tgt, gl == 0.0f32 && g_lse == 0.0f32)
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

/// This unit's 4×4 micro-tile of logits into the cube's `[LOGP_ROWS, LOGP_VOCAB_TILE]` tile.
#[cube]
pub(crate) fn stage_logits(acc: &Array<f32>, z_s: &mut SharedMemory<f32>) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    #[unroll]
    for r in 0..FMA_MICRO {
        #[unroll]
        for c in 0..FMA_MICRO {
            z_s[(ty + r * FMA_THREADS) * LOGP_VOCAB_TILE + tx + c * FMA_THREADS] =
                acc[r * FMA_MICRO + c];
        }
    }
}
