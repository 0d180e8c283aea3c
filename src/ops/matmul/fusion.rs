//! GEMM under `Fusion`: opaque custom ops over the inner backend's primitives.
use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};

use super::MatmulOps;
use crate::backends::custom_op::custom_op;
use crate::registry::Implementation;

/// The output `[rows, cols]` in `dtype`.
fn output(rows: usize, cols: usize, dtype: DType) -> [(Shape, DType); 1] {
    [(Shape::from(vec![rows, cols]), dtype)]
}

fn dims<R: FusionRuntime>(t: &FusionTensor<R>) -> Vec<usize> {
    t.shape.to_vec()
}

impl<B: FusionBackend + MatmulOps> MatmulOps for Fusion<B> {
    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = output(dims(&lhs)[0], dims(&rhs)[1], lhs.dtype);
        let name = "burn_invariant::matmul";
        let [out] = match bias {
            None => custom_op::<B, 2, 0, 1>(
                name,
                [lhs, rhs],
                [],
                out,
                Box::new(move |[lhs, rhs], []| {
                    [B::invariant_matmul(lhs, rhs, None, implementation)]
                }),
            ),
            Some(bias) => custom_op::<B, 3, 0, 1>(
                name,
                [lhs, rhs, bias],
                [],
                out,
                Box::new(move |[lhs, rhs, bias], []| {
                    [B::invariant_matmul(lhs, rhs, Some(bias), implementation)]
                }),
            ),
        };
        out
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = output(dims(&grad)[0], dims(&rhs)[0], grad.dtype);
        let [out] = custom_op::<B, 2, 0, 1>(
            "burn_invariant::matmul_grad_lhs",
            [grad, rhs],
            [],
            out,
            Box::new(move |[grad, rhs], []| {
                [B::invariant_matmul_grad_lhs(grad, rhs, implementation)]
            }),
        );
        out
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = output(dims(&lhs)[1], dims(&grad)[1], grad.dtype);
        let [out] = custom_op::<B, 2, 0, 1>(
            "burn_invariant::matmul_grad_rhs",
            [lhs, grad],
            [],
            out,
            Box::new(move |[lhs, grad], []| {
                [B::invariant_matmul_grad_rhs(lhs, grad, implementation)]
            }),
        );
        out
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = [(Shape::from(vec![dims(&grad)[1]]), grad.dtype)];
        let [out] = custom_op::<B, 1, 0, 1>(
            "burn_invariant::sum_rows",
            [grad],
            [],
            out,
            Box::new(move |[grad], []| [B::invariant_sum_rows(grad, implementation)]),
        );
        out
    }
}
