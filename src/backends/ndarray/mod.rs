//! The `Reference` implementation: plain Rust on `burn_ndarray::NdArray`, the oracle every
//! other implementation is tested against (each op's in its room, `crate::ops::<op>::reference`;
//! here the candidates and the host copies they share). f32 and f64 tensors are supported; arithmetic is
//! f32 (f64 inputs are rounded to f32 at the boundary, and results converted back), which is
//! the contract of every implementation. bf16/f16 data is converted to f32 when it enters
//! NdArray, so the reference for a bf16 call is the f32 computation on the rounded values.
use burn::tensor::{DType, TensorData, TensorMetadata};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use crate::InvariantBackend;
use crate::registry::{Candidate, Implementation, Op};

/// Host copy of a float tensor in f32, with its shape and original dtype.
pub(crate) struct HostFloat {
    pub(crate) data: Vec<f32>,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
}

pub(crate) fn host_float(tensor: &NdArrayTensor) -> HostFloat {
    let dtype = tensor.dtype();
    let shape = tensor.shape().to_vec();
    // `view().iter()` walks logical row-major order whatever the strides.
    let data = match tensor {
        NdArrayTensor::F32(s) => s.view().iter().copied().collect(),
        NdArrayTensor::F64(s) => s.view().iter().map(|v| *v as f32).collect(),
        other => unreachable!(
            "the registry admits only f32/f64 on NdArray, got {:?}",
            other.dtype()
        ),
    };
    HostFloat { data, shape, dtype }
}

pub(crate) fn host_int(tensor: &NdArrayTensor) -> Vec<i64> {
    match tensor {
        NdArrayTensor::I64(s) => s.view().iter().copied().collect(),
        NdArrayTensor::I32(s) => s.view().iter().map(|v| *v as i64).collect(),
        NdArrayTensor::I16(s) => s.view().iter().map(|v| *v as i64).collect(),
        NdArrayTensor::I8(s) => s.view().iter().map(|v| *v as i64).collect(),
        NdArrayTensor::U64(s) => s
            .view()
            .iter()
            .map(|v| i64::try_from(*v).unwrap_or(i64::MAX))
            .collect(),
        NdArrayTensor::U32(s) => s.view().iter().map(|v| *v as i64).collect(),
        NdArrayTensor::U16(s) => s.view().iter().map(|v| *v as i64).collect(),
        NdArrayTensor::U8(s) => s.view().iter().map(|v| *v as i64).collect(),
        other => unreachable!("targets are an int tensor, got {:?}", other.dtype()),
    }
}

pub(crate) fn device_tensor(data: Vec<f32>, shape: Vec<usize>, dtype: DType) -> NdArrayTensor {
    NdArrayTensor::from_data(TensorData::new(data, shape).convert_dtype(dtype))
}

pub(crate) fn reference_candidates(dtype: DType) -> Vec<Candidate> {
    match dtype {
        DType::F32 | DType::F64 => vec![Candidate::available(Implementation::Reference)],
        other => vec![Candidate::unavailable(
            Implementation::Reference,
            format!(
                "NdArray tensors are f32 or f64 (got {other:?}); convert bf16/f16 data to f32 when creating them"
            ),
        )],
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> InvariantBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
    fn implementations(op: Op, _device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        // Every op has its oracle here.
        match op {
            Op::Matmul | Op::LinearLogp | Op::Attention | Op::RmsNorm => {
                reference_candidates(dtype)
            }
        }
    }

    fn invariant_kernel_choices(_device: &Self::Device, _dtype: DType) -> String {
        // The oracle's arithmetic is plain Rust, the same on every CPU.
        "ndarray".into()
    }
}
