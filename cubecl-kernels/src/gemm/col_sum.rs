//! Column sums (`dBias`): ascending rows, f32 accumulator, one rounding.

use crate::consts::COL_SUM_BLOCK;
use crate::error::KernelError;
use crate::gemm::args::{Mat, Vec1};
use crate::gemm::view::{MatArg, VecArg};
use crate::util::{check_grid, launch_chunks, to_u32};
use cubecl::prelude::*;

/// `out[j] (+)= Σ_{i ascending} f32(x[i,j])`, one unit per column, f32 accumulator, one final
/// rounding to `O`.
#[cube(launch_unchecked)]
pub(crate) fn col_sum_kernel<X: Float, O: Float>(
    x: &MatArg<X>,
    out: &mut VecArg<O>,
    m: u32,
    n: u32,
    #[comptime] accumulate: bool,
    #[define(X, O)] _dtypes: [StorageType; 2],
) {
    let col = CUBE_POS_X as usize * COL_SUM_BLOCK + UNIT_POS_X as usize;
    let n = n as usize;
    let m = m as usize;
    if col < n {
        let o = out.offset as usize + col * out.stride as usize;
        let mut acc = 0.0f32;
        if comptime![accumulate] {
            acc = f32::cast_from(out.buf[o]);
        }
        let base = x.view.offset as usize + col * x.view.s1 as usize;
        let s0 = x.view.s0 as usize;
        for row in 0..m {
            acc += f32::cast_from(x.buf[base + row * s0]);
        }
        out.buf[o] = O::cast_from(acc);
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
                x.arg(),
                out.arg(),
                m32,
                to_u32("x", "N", cols)?,
                accumulate,
                [x.dtype, out_dtype],
            );
        }
    }
    Ok(())
}
