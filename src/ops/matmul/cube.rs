//! GEMM on every `CubeBackend`: the kernels of `burn_invariant_cubecl::gemm`, and on CUDA the
//! raw Sm90 ones (`crate::backends::sm90`); the one `match` between them per primitive.
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn_cubecl::{
    BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor,
};
use burn_invariant_cubecl::gemm;

use super::MatmulOps;
use crate::backends::alloc::{empty, zeros};
use crate::backends::cube::{
    NO_ROWS, ROWS_FIRST, addressable, launch_class, launched, settle_launches,
};
#[cfg(feature = "cuda")]
use crate::backends::sm90;
use crate::registry::Implementation;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> MatmulOps
    for CubeBackend<R, F, I, BT>
{
    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90
                if !is_empty(&[
                    lhs.meta.shape()[0],
                    lhs.meta.shape()[1],
                    rhs.meta.shape()[1],
                ]) =>
            {
                sm90::matmul(lhs, rhs, bias)
            }
            // An empty product is the bias or zeros whichever kernel runs (the Sm90 ones need
            // K ≥ 1). Reference is not offered here, nor Sm90 without the `cuda` feature: a
            // direct call with either runs the CubeCL kernels.
            Implementation::Sm90 | Implementation::CubeCl | Implementation::Reference => {
                matmul(lhs, rhs, bias)
            }
        }
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::matmul_grad_lhs(grad, rhs),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => matmul_grad_lhs(grad, rhs),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => matmul_grad_lhs(grad, rhs),
        }
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        match implementation {
            #[cfg(feature = "cuda")]
            Implementation::Sm90 => sm90::matmul_grad_rhs(lhs, grad),
            #[cfg(not(feature = "cuda"))]
            Implementation::Sm90 => matmul_grad_rhs(lhs, grad),
            // Reference is not offered here, nor Sm90 without the `cuda` feature: a direct call
            // with either runs the CubeCL kernels.
            Implementation::CubeCl | Implementation::Reference => matmul_grad_rhs(lhs, grad),
        }
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        // One kernel for every implementation: Sm90 has no column sum of its own.
        let (m, n) = (grad.meta.shape()[0], grad.meta.shape()[1]);
        if m == 0 || n == 0 {
            return zeros(&grad, vec![n], grad.dtype);
        }
        let out = empty(&grad, vec![n], grad.dtype);
        let grad = addressable(grad);
        let class = launch_class("sum_rows", &[(&grad, ROWS_FIRST)]);
        launched(gemm::col_sum(
            &grad.client,
            &grad.clone().binding(),
            &out.clone().binding(),
            grad.dtype.into(),
        ));
        settle_launches(&grad.client, &grad.device, class);
        out
    }
}

fn is_empty(shape: &[usize]) -> bool {
    shape.contains(&0)
}

/// CubeCL `grad · rhsᵀ`: a transposed view (strides swapped, no copy), the kernels take any
/// strides.
fn matmul_grad_lhs<R: CubeRuntime>(grad: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R> {
    matmul(
        grad,
        CubeBackend::<R, f32, i32, u8>::float_swap_dims(rhs, 0, 1),
        None,
    )
}

/// CubeCL `lhsᵀ · grad`, rows reduced in ascending order.
fn matmul_grad_rhs<R: CubeRuntime>(lhs: CubeTensor<R>, grad: CubeTensor<R>) -> CubeTensor<R> {
    let (k, n) = (lhs.meta.shape()[1], grad.meta.shape()[1]);
    let m = lhs.meta.shape()[0];
    if is_empty(&[k, n]) || m == 0 {
        return zeros(&grad, vec![k, n], grad.dtype);
    }
    let out = empty(&grad, vec![k, n], grad.dtype);
    let (lhs, grad) = (addressable(lhs), addressable(grad));
    let class = launch_class(
        "matmul_grad_rhs",
        &[(&lhs, ROWS_FIRST), (&grad, ROWS_FIRST)],
    );
    launched(gemm::matmul_row_reduction(
        &grad.client,
        &CubeBackend::<R, f32, i32, u8>::float_swap_dims(lhs, 0, 1).binding(),
        &grad.clone().binding(),
        &out.clone().binding(),
        grad.dtype.into(),
    ));
    settle_launches(&grad.client, &grad.device, class);
    out
}

/// CubeCL `matmul` with an optional bias.
fn matmul<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    let (m, n) = (lhs.meta.shape()[0], rhs.meta.shape()[1]);
    let out = empty(&lhs, vec![m, n], lhs.dtype);
    if is_empty(&[m, n]) {
        return out;
    }
    let (lhs, rhs) = (addressable(lhs), addressable(rhs));
    let bias = bias.map(addressable);
    let class = match &bias {
        Some(b) => launch_class(
            "matmul",
            &[(&lhs, ROWS_FIRST), (&rhs, NO_ROWS), (b, NO_ROWS)],
        ),
        None => launch_class("matmul", &[(&lhs, ROWS_FIRST), (&rhs, NO_ROWS)]),
    };
    let bias = bias.map(|b| b.binding());
    launched(gemm::matmul(
        &lhs.client,
        &lhs.clone().binding(),
        &rhs.binding(),
        bias.as_ref(),
        &out.clone().binding(),
        lhs.dtype.into(),
    ));
    settle_launches(&lhs.client, &lhs.device, class);
    out
}
