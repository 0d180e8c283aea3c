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
