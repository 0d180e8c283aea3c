//! A strided 2-D view into a buffer, as the kernels take it.

use cubecl::prelude::*;

/// Layout of a 2-D matrix inside its buffer, in elements.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(crate) struct StridedView {
    pub offset: u32,
    /// Stride between consecutive rows of the logical matrix.
    pub s0: u32,
    /// Stride between consecutive columns of the logical matrix.
    pub s1: u32,
}

/// A matrix as a kernel argument: its buffer and its layout.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct MatArg<E: Float> {
    pub buf: Tensor<E>,
    pub view: StridedView,
}

/// A vector as a kernel argument: element `j` at `buf[offset + j·stride]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct VecArg<E: Float> {
    pub buf: Tensor<E>,
    pub offset: u32,
    pub stride: u32,
}

/// The read operands of a GEMM: `lhs [m, k]`, `rhs [k, n]`, `bias [n]` (the rhs stands in,
/// never read, without one).
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Operands<A: Float, B: Float> {
    pub lhs: MatArg<A>,
    pub rhs: MatArg<B>,
    pub bias: VecArg<B>,
}

/// The sizes of a GEMM: `out [m, n] = lhs [m, k] · rhs [k, n]`.
#[derive(CubeType, CubeLaunch)]
pub(crate) struct Mkn {
    pub m: u32,
    pub k: u32,
    pub n: u32,
}
