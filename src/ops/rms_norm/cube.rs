//! `CubeCl` RMSNorm on every `CubeBackend` (the registry offers no Sm90 kernels for it): the
//! kernels of `burn_invariant_cubecl::rms_norm`, outputs and workspace allocated on the inputs'
//! stream.
use burn::tensor::{DType, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_invariant_cubecl::FloatDType;
use burn_invariant_cubecl::rms_norm::{self as kernels, RmsNormGradRefs, RmsNormRefs};

use super::oracle::{RMS_NORM_LANES, RMS_NORM_ROW_BLOCK};
use super::{RmsNormGrads, RmsNormInputs, RmsNormOps};
use crate::backends::alloc::empty;
use crate::backends::cube::{
    NO_ROWS, ROWS_FIRST, addressable, launch_class, launched, settle_launches,
};
use crate::registry::Implementation;

// The Reference reduces in the kernels' lanes and row blocks: one set of constants, checked at
// compile time.
const _: () = assert!(
    RMS_NORM_LANES == kernels::RMS_NORM_LANES && RMS_NORM_ROW_BLOCK == kernels::RMS_NORM_ROW_BLOCK
);

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> RmsNormOps
    for CubeBackend<R, F, I, BT>
{
    fn invariant_rms_norm(
        inputs: RmsNormInputs<Self>,
        _implementation: Implementation,
    ) -> FloatTensor<Self> {
        let (x, gamma) = (addressable(inputs.x), addressable(inputs.gamma));
        let out = empty(&x, x.meta.shape().to_vec(), x.dtype);
        let class = launch_class("rms_norm", &[(&x, ROWS_FIRST), (&gamma, NO_ROWS)]);
        let refs = RmsNormRefs {
            x: &x.clone().binding(),
            gamma: &gamma.binding(),
            dtype: launched(FloatDType::from_storage("x", x.dtype.into())),
            eps: inputs.eps,
        };
        launched(kernels::rms_norm_forward(
            &x.client,
            &refs,
            &out.clone().binding(),
        ));
        settle_launches(&x.client, &x.device, class);
        out
    }

    fn invariant_rms_norm_backward(
        inputs: RmsNormInputs<Self>,
        grad: FloatTensor<Self>,
        _implementation: Implementation,
    ) -> RmsNormGrads<Self> {
        let (x, gamma, grad) = (
            addressable(inputs.x),
            addressable(inputs.gamma),
            addressable(grad),
        );
        let [n, d] = [x.meta.shape()[0], x.meta.shape()[1]];
        let class = launch_class(
            "rms_norm_backward",
            &[(&x, ROWS_FIRST), (&gamma, NO_ROWS), (&grad, ROWS_FIRST)],
        );
        let grad_x = empty(&x, vec![n, d], x.dtype);
        let grad_gamma = empty(&x, vec![d], gamma.dtype);
        let workspace = empty(
            &x,
            vec![kernels::rms_norm_backward_workspace_len(n, d)],
            DType::F32,
        );
        let refs = RmsNormRefs {
            x: &x.clone().binding(),
            gamma: &gamma.binding(),
            dtype: launched(FloatDType::from_storage("x", x.dtype.into())),
            eps: inputs.eps,
        };
        let grads = RmsNormGradRefs {
            grad_out: &grad.binding(),
            grad_x: &grad_x.clone().binding(),
            grad_gamma: &grad_gamma.clone().binding(),
            workspace: &workspace.binding(),
        };
        launched(kernels::rms_norm_backward(&x.client, &refs, &grads));
        settle_launches(&x.client, &x.device, class);
        RmsNormGrads {
            x: grad_x,
            gamma: grad_gamma,
        }
    }
}
