//! The public `matmul` and `linear`: validation, the registry's choice, the primitive.
use burn::tensor::Tensor;

use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::{Problem, check_device, implementation_for_problem};
use crate::{InvariantBackend, InvariantError, validate};

/// Deterministic, batch-invariant `lhs [M, K] · rhs [K, N] → [M, N]`.
///
/// Row `i` of the result depends only on `lhs[i, :]` and `rhs`: never on M, on other rows,
/// or on how rows are split over calls. f32 accumulation, output in the input dtype.
pub fn matmul<B: InvariantBackend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
) -> Result<Tensor<B, 2>, InvariantError> {
    gemm(lhs, rhs, None)
}

fn gemm<B: InvariantBackend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, 2>, InvariantError> {
    let (lhs_shape, rhs_shape) = (lhs.dims(), rhs.dims());
    let device = lhs.device();
    validate::float_dtype("lhs", lhs.dtype())?;
    validate::same_dtype("rhs", "lhs", lhs.dtype(), rhs.dtype())?;
    validate::same_device::<B>("rhs", "lhs", &device, &rhs.device())?;
    validate::dim(
        "rhs",
        &rhs_shape,
        0,
        lhs_shape[1],
        "the inner dimension K of `lhs`",
    )?;
    validate::index_limit("lhs", &lhs_shape)?;
    validate::index_limit("rhs", &rhs_shape)?;
    validate::index_limit("output", &[lhs_shape[0], rhs_shape[1]])?;
    if let Some(bias) = &bias {
        validate::same_dtype("bias", "lhs", lhs.dtype(), bias.dtype())?;
        validate::same_device::<B>("bias", "lhs", &device, &bias.device())?;
        validate::dim(
            "bias",
            &bias.dims(),
            0,
            rhs_shape[1],
            "the output features N",
        )?;
    }
    let problem = Problem::Matmul {
        m: lhs_shape[0],
        k: lhs_shape[1],
        n: rhs_shape[1],
    };
    let implementation = implementation_for_problem::<B>(&device, lhs.dtype(), problem)?;
    let out = B::invariant_matmul(
        float_primitive(lhs),
        float_primitive(rhs),
        bias.map(float_primitive),
        implementation,
    );
    check_device::<B>(&device)?;
    Ok(float_tensor(out))
}

/// Batch-invariant `input [.., K] · weight [K, N] (+ bias [N]) → [.., N]`, Burn's `Linear`
/// layout. The bias is added in f32 before the final rounding.
pub fn linear<B: InvariantBackend, const D: usize>(
    input: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, D>, InvariantError> {
    let dims = input.dims();
    let Some(&k) = dims.last() else {
        return Err(InvariantError::Shape {
            arg: "input",
            expected: "at least one dimension (the features K)".into(),
            got: vec![],
        });
    };
    let [weight_k, n] = weight.dims();
    if weight_k != k {
        return Err(InvariantError::Shape {
            arg: "weight",
            expected: format!("dimension 0 = {k} (the last dimension of `input`)"),
            got: vec![weight_k, n],
        });
    }
    let Some(rows) = dims[..D - 1]
        .iter()
        .try_fold(1usize, |acc, &e| acc.checked_mul(e))
    else {
        return Err(InvariantError::TooLarge {
            arg: "input",
            what: "the rows (the product of the leading dimensions)",
            got: u64::MAX,
            limit: validate::INDEX_LIMIT,
        });
    };
    let out = gemm(input.reshape([rows, k]), weight, bias)?;
    let mut out_dims = dims;
    out_dims[D - 1] = n;
    Ok(out.reshape(out_dims))
}
