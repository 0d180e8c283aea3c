//! The public `rms_norm`: validation, the registry's choice, the primitive.
use burn::tensor::Tensor;

use super::RmsNormInputs;
use crate::backend::Problem;
use crate::backends::generic::{float_primitive, float_tensor};
use crate::registry::{check_device, implementation_for_problem};
use crate::{InvariantBackend, InvariantError, validate};

/// Deterministic, batch-invariant RMSNorm over the last dimension:
/// `y = x / sqrt(mean(x²) + eps) · gamma`, computed in f32 in a fixed order and rounded once to
/// `x`'s dtype. `x [.., D]`, `gamma [D]` in `x`'s dtype, `eps` finite and ≥ 0 (as f32). Each
/// row's result (and its `dX`) depends only on that row; `dGamma` reduces rows in fixed blocks
/// and is unchanged by appended rows whose upstream gradient is zero. Differentiable under
/// `Autodiff`.
pub fn rms_norm<B: InvariantBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> Result<Tensor<B, D>, InvariantError> {
    let shape = x.dims();
    if D == 0 {
        return Err(InvariantError::Shape {
            arg: "x",
            expected: "rank ≥ 1".into(),
            got: shape.to_vec(),
        });
    }
    let d = shape[D - 1];
    let device = x.device();
    validate::float_dtype("x", x.dtype())?;
    validate::same_dtype("gamma", "x", x.dtype(), gamma.dtype())?;
    validate::same_device::<B>("gamma", "x", &device, &gamma.device())?;
    validate::dim("gamma", &gamma.dims(), 0, d, "the last dimension of `x`")?;
    let eps32 = eps as f32;
    if !(eps >= 0.0 && eps32.is_finite()) {
        return Err(InvariantError::InvalidArgument {
            arg: "eps",
            reason: format!("must be finite and ≥ 0 as an f32, got {eps}"),
        });
    }
    validate::index_limit("x", &shape)?;
    let n = shape[..D - 1].iter().product::<usize>();
    let implementation =
        implementation_for_problem::<B>(&device, x.dtype(), Problem::RmsNorm { n, d })?;
    let inputs = RmsNormInputs {
        x: float_primitive(x.reshape([n, d])),
        gamma: float_primitive(gamma),
        eps: eps32,
    };
    let y: Tensor<B, 2> = float_tensor(B::invariant_rms_norm(inputs, implementation));
    check_device::<B>(&device)?;
    Ok(y.reshape(shape))
}
