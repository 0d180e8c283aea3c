//! Column sums (`dBias`): ascending rows, f32 accumulator, one rounding.

use crate::consts::COL_SUM_BLOCK;
use crate::error::KernelError;
use crate::gemm::args::{Mat, Vec1};
use crate::gemm::view::StridedView;
use crate::util::{check_grid, launch_chunks, raw_arg, to_u32};
use cubecl::prelude::*;

/// `out[j] (+)= Σ_{i ascending} f32(x[i,j])`, one unit per column, f32 accumulator, one final
/// rounding to `O`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the launch's bindings and scalars, one argument each
pub(crate) fn col_sum_kernel<X: Float, O: Float>(
    x: &Tensor<X>,
    xo: StridedView,
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

/// Launch the column-sum kernel on explicit layouts, in as many column blocks as the runtime's
/// cube count needs.
pub(crate) fn launch_col_sum<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Mat<'_, R>,
    out: &Vec1<'_, R>,
    out_dtype: StorageType,
    m: usize,
    n: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    let m32 = to_u32("x", "M", m)?;
    for (col, cols) in launch_chunks(client, 0, n, COL_SUM_BLOCK) {
        let (x, out) = (x.cols_from("x", col)?, out.elements_from("out", col)?);
        let (gx, _) = check_grid(client, "out", cols.div_ceil(COL_SUM_BLOCK), 1)?;
        unsafe {
            col_sum_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, 1, 1),
                CubeDim::new_1d(COL_SUM_BLOCK as u32),
                raw_arg(x.buf),
                x.launch(),
                raw_arg(out.buf),
                out.offset,
                out.stride,
                m32,
                to_u32("x", "N", cols)?,
                accumulate,
                [x.dtype, out_dtype],
            );
        }
    }
    Ok(())
}
