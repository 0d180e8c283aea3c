//! Column sums and dtype casts.

use crate::consts::COL_SUM_BLOCK;
use crate::gemm::fma::Operand;
use cubecl::prelude::*;

/// `out[j] (+)= Σ_{i ascending} f32(x[i,j])`, one unit per column, f32 accumulator, one final
/// rounding to `O`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn col_sum_kernel<X: Float, O: Float>(
    x: &Tensor<X>,
    xo: Operand,
    out: &mut Tensor<O>,
    out_off: u32,
    out_stride: u32,
    m: u32,
    n: u32,
    #[comptime] accumulate: bool,
    #[define(X, O)] _dtypes: [StorageType; 2],
) {
    let col = CUBE_POS_X as usize * COL_SUM_BLOCK + UNIT_POS_X as usize;
    let n = n as usize;
    let m = m as usize;
    if col < n {
        let o = out_off as usize + col * out_stride as usize;
        let mut acc = 0.0f32;
        if comptime![accumulate] {
            acc = f32::cast_from(out[o]);
        }
        let base = xo.offset as usize + col * xo.s1 as usize;
        let s0 = xo.s0 as usize;
        for row in 0..m {
            acc += f32::cast_from(x[base + row * s0]);
        }
        out[o] = O::cast_from(acc);
    }
}

/// `out[i,j] = O(x[i,j])` for a 2-D view; grid x covers column blocks, grid y strides over rows.
#[cube(launch_unchecked)]
pub(crate) fn cast_2d_kernel<X: Float, O: Float>(
    x: &Tensor<X>,
    xo: Operand,
    out: &mut Tensor<O>,
    oo: Operand,
    m: u32,
    n: u32,
    #[define(X, O)] _dtypes: [StorageType; 2],
) {
    let col = CUBE_POS_X as usize * COL_SUM_BLOCK + UNIT_POS_X as usize;
    let n = n as usize;
    let m = m as usize;
    if col < n {
        let mut row = CUBE_POS_Y as usize;
        let step = CUBE_COUNT_Y as usize;
        while row < m {
            out[oo.offset as usize + row * oo.s0 as usize + col * oo.s1 as usize] =
                O::cast_from(x[xo.offset as usize + row * xo.s0 as usize + col * xo.s1 as usize]);
            row += step;
        }
    }
}
