//! Dtype casts of 2-D views (the one rounding of f32 accumulators into a gradient's dtype).

use crate::consts::COL_SUM_BLOCK;
use crate::error::KernelError;
use crate::gemm::args::Mat;
use crate::gemm::view::StridedView;
use crate::util::{check_grid, launch_chunks, raw_arg, to_u32};
use cubecl::prelude::*;

/// `out[i,j] = O(x[i,j])` for a 2-D view; grid x covers column blocks, grid y strides over rows.
#[cube(launch_unchecked)]
pub(crate) fn cast_2d_kernel<X: Float, O: Float>(
    x: &Tensor<X>,
    xo: StridedView,
    out: &mut Tensor<O>,
    oo: StridedView,
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

/// Launch the 2-D cast kernel on explicit layouts, in as many column blocks as the runtime's
/// cube count needs.
pub(crate) fn launch_cast_2d<R: Runtime>(
    client: &ComputeClient<R>,
    x: &Mat<'_, R>,
    out: &Mat<'_, R>,
    m: usize,
    n: usize,
) -> Result<(), KernelError> {
    if m == 0 {
        return Ok(());
    }
    let m32 = to_u32("x", "M", m)?;
    // Grid y strides over the rows (see the kernel).
    let gy = m.min(client.properties().hardware.max_cube_count.1 as usize);
    for (col, cols) in launch_chunks(client, 0, n, COL_SUM_BLOCK) {
        let (x, out) = (x.cols_from("x", col)?, out.cols_from("out", col)?);
        let (gx, gy) = check_grid(client, "out", cols.div_ceil(COL_SUM_BLOCK), gy)?;
        unsafe {
            cast_2d_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(gx, gy, 1),
                CubeDim::new_1d(COL_SUM_BLOCK as u32),
                raw_arg(x.buf),
                x.launch(),
                raw_arg(out.buf),
                out.launch(),
                m32,
                to_u32("x", "N", cols)?,
                [x.dtype, out.dtype],
            );
        }
    }
    Ok(())
}
