//! Host-side descriptions of the buffers a GEMM launch reads and writes.

use crate::error::KernelError;
use crate::gemm::view::{MatArgLaunch, StridedViewLaunch, VecArgLaunch};
use crate::util::{View, launch_chunks, raw_arg, to_u32};
use cubecl::ir::StorageType;
use cubecl::prelude::*;

/// One operand as the FMA kernel sees it: buffer, dtype and layout.
pub(crate) struct Mat<'a, R: Runtime> {
    pub buf: &'a TensorBinding<R>,
    pub dtype: StorageType,
    pub offset: u32,
    pub s0: u32,
    pub s1: u32,
}

impl<'a, R: Runtime> Mat<'a, R> {
    /// The whole of a checked 2-D view of `buf`.
    pub(crate) fn dense(buf: &'a TensorBinding<R>, dtype: StorageType, view: &View) -> Self {
        Mat {
            buf,
            dtype,
            offset: 0,
            s0: view.stride(0) as u32,
            s1: view.stride(1) as u32,
        }
    }

    /// This view from row `row` on; `arg` names the buffer in the error if the offset passes
    /// 32 bits.
    pub(crate) fn rows_from(
        &self,
        arg: &'static str,
        row: usize,
    ) -> Result<Mat<'a, R>, KernelError> {
        let offset = self.offset as usize + row * self.s0 as usize;
        Ok(Mat {
            offset: to_u32(arg, "offset", offset)?,
            ..self.shallow()
        })
    }

    /// This view from column `col` on; `arg` names the buffer in the error if the offset passes
    /// 32 bits.
    pub(crate) fn cols_from(
        &self,
        arg: &'static str,
        col: usize,
    ) -> Result<Mat<'a, R>, KernelError> {
        let offset = self.offset as usize + col * self.s1 as usize;
        Ok(Mat {
            offset: to_u32(arg, "offset", offset)?,
            ..self.shallow()
        })
    }

    /// A copy of this descriptor (same buffer reference).
    pub(crate) fn shallow(&self) -> Mat<'a, R> {
        Mat {
            buf: self.buf,
            dtype: self.dtype,
            offset: self.offset,
            s0: self.s0,
            s1: self.s1,
        }
    }

    pub(crate) fn launch(&self) -> StridedViewLaunch<R> {
        StridedViewLaunch::new(self.offset, self.s0, self.s1)
    }

    /// The buffer and its layout as one kernel argument.
    pub(crate) fn arg<E: Float>(&self) -> MatArgLaunch<E, R> {
        MatArgLaunch::new(raw_arg(self.buf), self.launch())
    }
}

/// Bias vector: buffer, offset, stride (same dtype as the rhs).
pub(crate) struct Vec1<'a, R: Runtime> {
    pub buf: &'a TensorBinding<R>,
    pub offset: u32,
    pub stride: u32,
}

impl<'a, R: Runtime> Vec1<'a, R> {
    /// This vector from element `index` on; `arg` names the buffer in the error if the offset
    /// passes 32 bits.
    pub(crate) fn elements_from(
        &self,
        arg: &'static str,
        index: usize,
    ) -> Result<Self, KernelError> {
        let offset = self.offset as usize + index * self.stride as usize;
        Ok(Vec1 {
            buf: self.buf,
            offset: to_u32(arg, "offset", offset)?,
            stride: self.stride,
        })
    }

    /// The buffer, offset and stride as one kernel argument.
    pub(crate) fn arg<E: Float>(&self) -> VecArgLaunch<E, R> {
        VecArgLaunch::new(raw_arg(self.buf), self.offset, self.stride)
    }
}

/// The launch scalars of the GEMM kernels: M, K, N in 32 bits, and the bias binding, offset and
/// stride (the rhs stands in, never read, when there is no bias).
pub(crate) type BiasArg<'a, R> = (&'a TensorBinding<R>, u32, u32);
pub(crate) fn gemm_scalars<'a, R: Runtime>(
    m: usize,
    k: usize,
    n: usize,
    rhs: &Mat<'a, R>,
    bias: Option<&Vec1<'a, R>>,
) -> Result<([u32; 3], BiasArg<'a, R>), KernelError> {
    let dims = [
        to_u32("lhs", "M", m)?,
        to_u32("lhs", "K", k)?,
        to_u32("rhs", "N", n)?,
    ];
    let bias = match bias {
        Some(b) => (b.buf, b.offset, b.stride),
        None => (rhs.buf, 0, 0),
    };
    Ok((dims, bias))
}

/// The buffers of one GEMM launch: `out = lhs · rhs (+ bias)`.
pub(crate) struct GemmOperands<'a, R: Runtime> {
    pub lhs: Mat<'a, R>,
    pub rhs: Mat<'a, R>,
    pub bias: Option<Vec1<'a, R>>,
    pub out: Mat<'a, R>,
}

impl<'a, R: Runtime> GemmOperands<'a, R> {
    /// Runs `launch(block, rows, cols)` over the output blocks of `[m, n]` that fit the runtime's
    /// cube count at `bm × bn` outputs per cube (one block where everything fits). Every output
    /// element is computed independently of the split, so the bits are those of one launch.
    pub(crate) fn for_blocks(
        &self,
        client: &ComputeClient<R>,
        [m, n]: [usize; 2],
        [bm, bn]: [usize; 2],
        mut launch: impl FnMut(&Self, usize, usize) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        for (row, rows) in launch_chunks(client, 0, m, bm) {
            for (col, cols) in launch_chunks(client, 1, n, bn) {
                launch(&self.block(row, col)?, rows, cols)?;
            }
        }
        Ok(())
    }

    /// The operands of the output block from row `row` and column `col` on.
    fn block(&self, row: usize, col: usize) -> Result<Self, KernelError> {
        Ok(GemmOperands {
            lhs: self.lhs.rows_from("lhs", row)?,
            rhs: self.rhs.cols_from("rhs", col)?,
            bias: match &self.bias {
                Some(b) => Some(b.elements_from("bias", col)?),
                None => None,
            },
            out: self.out.rows_from("out", row)?.cols_from("out", col)?,
        })
    }
}
