//! `Reference` GEMM on NdArray: the oracle's `f32::mul_add` chains on host copies.
use burn::tensor::ops::FloatTensor;
use burn_ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArray, NdArrayTensor, QuantElement, SharedArray,
};

use super::MatmulOps;
use super::oracle::{self, MatRef};
use crate::backends::ndarray::{device_tensor, host_float};
use crate::registry::Implementation;

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> MatmulOps for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
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
}
