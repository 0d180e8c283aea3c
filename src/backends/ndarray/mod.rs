//! The `Reference` implementation: plain Rust on `burn_ndarray::NdArray`, the oracle every
//! other implementation is tested against. f32 and f64 tensors are supported; arithmetic is
//! f32 (f64 inputs are rounded to f32 at the boundary, and results converted back), which is
//! the contract of every implementation. bf16/f16 data is converted to f32 when it enters
//! NdArray, so the reference for a bf16 call is the f32 computation on the rounded values.
pub mod oracle;

use burn::tensor::{DType, TensorData, TensorMetadata, ops::FloatTensor};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use crate::backend::{GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs, LogpHead};
use crate::registry::{Candidate, Implementation, Op};
use oracle::{LogpProblem, MatRef};

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

fn logp_problem<'a>(
    hidden: &'a HostFloat,
    weight: &'a HostFloat,
    bias: Option<&'a HostFloat>,
    targets: &'a [i64],
    ignore_index: Option<i64>,
    head: LogpHead,
) -> LogpProblem<'a> {
    LogpProblem {
        hidden: &hidden.data,
        weight: &weight.data,
        bias: bias.map(|b| b.data.as_slice()),
        targets,
        ignore_index,
        n: hidden.shape[0],
        d: hidden.shape[1],
        v: weight.shape[0],
        inv_temperature: head.inv_temperature,
        entropy: head.entropy,
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

    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (lhs, rhs) = (host_float(&lhs), host_float(&rhs));
        let bias = bias.as_ref().map(host_float);
        let (m, k, n) = (lhs.shape[0], lhs.shape[1], rhs.shape[1]);
        let out = oracle::gemm(
            MatRef::row_major(&lhs.data, m, k),
            MatRef::row_major(&rhs.data, k, n),
            bias.as_ref().map(|b| b.data.as_slice()),
        );
        device_tensor(out, vec![m, n], lhs.dtype)
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (grad, rhs) = (host_float(&grad), host_float(&rhs));
        let (m, n, k) = (grad.shape[0], grad.shape[1], rhs.shape[0]);
        let out = oracle::gemm(
            MatRef::row_major(&grad.data, m, n),
            MatRef::row_major(&rhs.data, k, n).t(),
            None,
        );
        device_tensor(out, vec![m, k], grad.dtype)
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (lhs, grad) = (host_float(&lhs), host_float(&grad));
        let (m, k, n) = (lhs.shape[0], lhs.shape[1], grad.shape[1]);
        // One ascending chain over all rows: trivially "ascending fixed-size blocks".
        let out = oracle::gemm(
            MatRef::row_major(&lhs.data, m, k).t(),
            MatRef::row_major(&grad.data, m, n),
            None,
        );
        device_tensor(out, vec![k, n], grad.dtype)
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let grad = host_float(&grad);
        let (m, n) = (grad.shape[0], grad.shape[1]);
        let out = oracle::sum_rows(MatRef::row_major(&grad.data, m, n));
        device_tensor(out, vec![n], grad.dtype)
    }

    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (hidden, weight) = (host_float(&inputs.hidden), host_float(&inputs.weight));
        let bias = inputs.bias.as_ref().map(host_float);
        let targets = host_int(&inputs.targets);
        let problem = logp_problem(
            &hidden,
            &weight,
            bias.as_ref(),
            &targets,
            inputs.ignore_index,
            inputs.head,
        );
        let stats = oracle::linear_logp(&problem);
        device_tensor(stats, vec![problem.n, problem.columns()], DType::F32)
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        _implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        let (hidden, weight) = (host_float(&inputs.hidden), host_float(&inputs.weight));
        let bias = inputs.bias.as_ref().map(host_float);
        let targets = host_int(&inputs.targets);
        let (stats, grad) = (host_float(&stats), host_float(&grad));
        let problem = logp_problem(
            &hidden,
            &weight,
            bias.as_ref(),
            &targets,
            inputs.ignore_index,
            inputs.head,
        );
        let (dh, dw, db) = oracle::linear_logp_backward(
            &problem,
            &stats.data,
            &grad.data,
            request.hidden,
            request.weight,
            request.bias && bias.is_some(),
        );
        LinearLogpGrads {
            hidden: dh.map(|g| device_tensor(g, hidden.shape.clone(), hidden.dtype)),
            weight: dw.map(|g| device_tensor(g, weight.shape.clone(), weight.dtype)),
            bias: db
                .zip(bias.as_ref())
                .map(|(g, b)| device_tensor(g, b.shape.clone(), b.dtype)),
        }
    }
}
