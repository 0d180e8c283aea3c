//! `Reference` RMSNorm on NdArray: the oracle's arithmetic on host copies.
use burn::tensor::ops::FloatTensor;
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::oracle;
use super::{RmsNormGrads, RmsNormInputs, RmsNormOps};
use crate::backends::ndarray::{device_tensor, host_float};
use crate::registry::Implementation;

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> RmsNormOps for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
    fn invariant_rms_norm(
        inputs: RmsNormInputs<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (x, gamma) = (host_float(&inputs.x), host_float(&inputs.gamma));
        let y = oracle::rms_norm_forward(&x.data, &gamma.data, inputs.eps);
        device_tensor(y, x.shape, x.dtype)
    }

    fn invariant_rms_norm_backward(
        inputs: RmsNormInputs<Self>,
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> RmsNormGrads<Self> {
        let (x, gamma, grad) = (
            host_float(&inputs.x),
            host_float(&inputs.gamma),
            host_float(&grad),
        );
        let (dx, dgamma) = oracle::rms_norm_backward(&x.data, &gamma.data, &grad.data, inputs.eps);
        RmsNormGrads {
            x: device_tensor(dx, x.shape, x.dtype),
            gamma: device_tensor(dgamma, gamma.shape, gamma.dtype),
        }
    }
}
