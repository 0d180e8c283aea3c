//! `Reference` `linear_logp` on NdArray: the oracle's online softmax on host copies.
use burn::tensor::{DType, ops::FloatTensor};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::oracle::{self, LogpProblem};
use super::{GradRequest, LinearLogpGrads, LinearLogpInputs, LinearLogpOps, LogpHead};
use crate::backends::ndarray::{HostFloat, device_tensor, host_float, host_int};
use crate::registry::Implementation;

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

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> LinearLogpOps
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
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
