//! `Reference` `linear_sample` on NdArray: the oracle on host copies.
use burn::tensor::{DType, ops::FloatTensor};
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::{LinearSampleInputs, LinearSampleOps, oracle};
use crate::backends::ndarray::{device_tensor, host_float, host_int};
use crate::ops::linear_logp::LinearLogpInputs;
use crate::ops::linear_logp::oracle::LogpProblem;
use crate::registry::Implementation;

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> LinearSampleOps
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
    fn invariant_linear_sample(
        inputs: LinearSampleInputs<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (hidden, weight) = (host_float(&inputs.hidden), host_float(&inputs.weight));
        let bias = inputs.bias.as_ref().map(host_float);
        let keys = host_int(&inputs.keys);
        let problem = LogpProblem {
            hidden: &hidden.data,
            weight: &weight.data,
            bias: bias.as_ref().map(|b| b.data.as_slice()),
            targets: &keys,
            ignore_index: None,
            n: hidden.shape[0],
            d: hidden.shape[1],
            v: weight.shape[0],
            inv_temperature: inputs.head.inv_temperature,
            entropy: inputs.head.entropy,
        };
        let out = oracle::linear_sample(&problem, &inputs.sampler);
        device_tensor(out, vec![problem.n, problem.columns() + 1], DType::F32)
    }

    fn invariant_linear_top_k(
        inputs: LinearLogpInputs<Self>,
        k: usize,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (hidden, weight) = (host_float(&inputs.hidden), host_float(&inputs.weight));
        let bias = inputs.bias.as_ref().map(host_float);
        let problem = LogpProblem {
            hidden: &hidden.data,
            weight: &weight.data,
            bias: bias.as_ref().map(|b| b.data.as_slice()),
            targets: &[],
            ignore_index: None,
            n: hidden.shape[0],
            d: hidden.shape[1],
            v: weight.shape[0],
            inv_temperature: inputs.head.inv_temperature,
            entropy: false,
        };
        let out = oracle::linear_top_k(&problem, k);
        device_tensor(out, vec![problem.n, 2 * k], DType::F32)
    }
}
