//! The one way to see a tensor as a cubecl-cuda tensor: generic `CubeBackend<R>` code that
//! the registry routed to CUDA (`Sm90`) downcasts its primitives here, and [`CudaBackend`]
//! gives the tensor-level view the NCCL group needs, through `Fusion` and `Autodiff` too.
use std::any::Any;

use burn::tensor::{Tensor, TensorPrimitive, backend::Backend};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use cubecl::cuda::{CudaDevice, CudaRuntime};

/// A cubecl-cuda tensor.
pub(crate) type CudaTensor = CubeTensor<CudaRuntime>;

/// Burn's ops on [`CudaTensor`]s (the element types are only defaults: every op follows the
/// tensor's own dtype).
pub(crate) type CudaOps = CubeBackend<CudaRuntime, f32, i32, u8>;

/// `tensor` as a [`CudaTensor`], or `None` when `R` is not the CUDA runtime.
pub(crate) fn as_cuda<R: CubeRuntime>(tensor: CubeTensor<R>) -> Option<CudaTensor> {
    (Box::new(tensor) as Box<dyn Any>)
        .downcast::<CudaTensor>()
        .ok()
        .map(|t| *t)
}

/// The inverse of [`as_cuda`]; `None` when `R` is not the CUDA runtime.
pub(crate) fn from_cuda<R: CubeRuntime>(tensor: CudaTensor) -> Option<CubeTensor<R>> {
    (Box::new(tensor) as Box<dyn Any>)
        .downcast::<CubeTensor<R>>()
        .ok()
        .map(|t| *t)
}

/// Backends whose float tensors live in cubecl-cuda buffers, so the NCCL group can hand them
/// to NCCL: `CubeBackend<CudaRuntime, ..>`, `Fusion` of it, and `Autodiff` of either.
pub trait CudaBackend: Backend {
    /// The tensor's cubecl-cuda form (pending fusion work is executed first).
    fn into_cuda(tensor: Tensor<Self, 1>) -> CudaTensor;
    /// Back from [`CudaBackend::into_cuda`]'s form.
    fn from_cuda(tensor: CudaTensor) -> Tensor<Self, 1>;
    /// This backend's name for a CUDA device.
    fn device_from_cuda(device: &CudaDevice) -> Self::Device;
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> CudaBackend
    for CubeBackend<CudaRuntime, F, I, BT>
{
    fn into_cuda(tensor: Tensor<Self, 1>) -> CudaTensor {
        tensor.into_primitive().tensor()
    }

    fn from_cuda(tensor: CudaTensor) -> Tensor<Self, 1> {
        Tensor::from_primitive(TensorPrimitive::Float(tensor))
    }

    fn device_from_cuda(device: &CudaDevice) -> Self::Device {
        device.clone()
    }
}

impl<B: burn_fusion::FusionBackend + CudaBackend> CudaBackend for burn_fusion::Fusion<B> {
    fn into_cuda(tensor: Tensor<Self, 1>) -> CudaTensor {
        let tensor = tensor.into_primitive().tensor();
        let client = tensor.client.clone();
        let inner = client.resolve_tensor_float::<B>(tensor);
        B::into_cuda(Tensor::from_primitive(TensorPrimitive::Float(inner)))
    }

    fn from_cuda(tensor: CudaTensor) -> Tensor<Self, 1> {
        use burn_fusion::{NoOp, get_client, stream::OperationStreams};
        use burn_ir::{InitOperationIr, OperationIr};
        let inner = B::from_cuda(tensor);
        let (shape, dtype, device) = (inner.shape(), inner.dtype(), inner.device());
        let client = get_client::<B>(&device);
        let handle = B::float_tensor_handle(inner.into_primitive().tensor());
        let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        let out = client
            .register(
                OperationStreams::default(),
                OperationIr::Init(desc),
                NoOp::<B>::new(),
            )
            // One `Init` output was registered, so one tensor comes back.
            .remove(0);
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn device_from_cuda(device: &CudaDevice) -> Self::Device {
        B::device_from_cuda(device)
    }
}

impl<B: CudaBackend, C: burn_autodiff::checkpoint::strategy::CheckpointStrategy> CudaBackend
    for burn_autodiff::Autodiff<B, C>
{
    fn into_cuda(tensor: Tensor<Self, 1>) -> CudaTensor {
        B::into_cuda(tensor.inner())
    }

    fn from_cuda(tensor: CudaTensor) -> Tensor<Self, 1> {
        Tensor::from_inner(B::from_cuda(tensor))
    }

    fn device_from_cuda(device: &CudaDevice) -> Self::Device {
        B::device_from_cuda(device)
    }
}
