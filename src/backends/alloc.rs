//! Output and workspace allocation on a tensor's own client and device, so kernels order with
//! every other Burn op on that stream.
use burn::tensor::{DType, Shape};
use burn_cubecl::{
    CubeRuntime,
    ops::numeric::{empty_device_contiguous_dtype, zeros_client},
    tensor::CubeTensor,
};

/// An uninitialized contiguous tensor beside `like`.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// Zeros beside `like`; an empty shape only allocates (a fill kernel over zero elements is an
/// invalid launch on CUDA).
pub(crate) fn zeros<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<R> {
    if shape.contains(&0) {
        return empty(like, shape, dtype);
    }
    zeros_client(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}
