//! RMSNorm under `Fusion`: opaque custom ops over the inner backend's primitives.
use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{RmsNormGrads, RmsNormInputs, RmsNormOps};
use crate::backends::custom_op::custom_op;
use crate::registry::Implementation;

impl<B: FusionBackend + RmsNormOps> RmsNormOps for Fusion<B> {
    fn invariant_rms_norm(
        inputs: RmsNormInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let RmsNormInputs { x, gamma, eps } = inputs;
        let output = [(x.shape.clone(), x.dtype)];
        let [y] = custom_op::<B, 2, 0, 1>(
            "burn_invariant::rms_norm",
            [x, gamma],
            [],
            output,
            Box::new(move |[x, gamma], []| {
                [B::invariant_rms_norm(
                    RmsNormInputs { x, gamma, eps },
                    implementation,
                )]
            }),
        );
        y
    }

    fn invariant_rms_norm_backward(
        inputs: RmsNormInputs<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> RmsNormGrads<Self> {
        let RmsNormInputs { x, gamma, eps } = inputs;
        let outputs = [
            (x.shape.clone(), x.dtype),
            (gamma.shape.clone(), gamma.dtype),
        ];
        let [x, gamma] = custom_op::<B, 3, 0, 2>(
            "burn_invariant::rms_norm_backward",
            [x, gamma, grad],
            [],
            outputs,
            Box::new(move |[x, gamma, grad], []| {
                let grads = B::invariant_rms_norm_backward(
                    RmsNormInputs { x, gamma, eps },
                    grad,
                    implementation,
                );
                [grads.x, grads.gamma]
            }),
        );
        RmsNormGrads { x, gamma }
    }
}
