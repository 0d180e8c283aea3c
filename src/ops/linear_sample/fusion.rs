//! `linear_sample` under `Fusion`: one opaque custom op over the inner backend's primitive, its
//! tensors registered as `linear_logp`'s are (floats: hidden, weight[, bias]; ints: keys).
use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{LinearSampleInputs, LinearSampleOps};
use crate::backends::custom_op::{RunVec, custom_op_vec};
use crate::ops::linear_logp::LinearLogpInputs;
use crate::ops::linear_logp::fusion::split;
use crate::registry::Implementation;

impl<B: FusionBackend + LinearSampleOps> LinearSampleOps for Fusion<B> {
    fn invariant_linear_sample(
        inputs: LinearSampleInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let rows = inputs.hidden.shape.to_vec()[0];
        let out = (
            Shape::from(vec![rows, inputs.head.columns() + 1]),
            DType::F32,
        );
        let (logits, sampler) = inputs.logits();
        let (floats, ints, head) = split::<B>(logits);
        let run: RunVec<B> = Box::new(move |floats, ints| {
            let (logits, _) = head.inputs::<B>(floats, ints);
            let inputs = LinearSampleInputs::of_logits(logits, sampler);
            vec![B::invariant_linear_sample(inputs, implementation)]
        });
        custom_op_vec::<B>(
            "burn_invariant::linear_sample",
            floats,
            ints,
            vec![out],
            run,
        )
        .into_iter()
        .next()
        .unwrap_or_else(|| unreachable!("one output"))
    }

    fn invariant_linear_top_k(
        inputs: LinearLogpInputs<Self>,
        k: usize,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let rows = inputs.hidden.shape.to_vec()[0];
        let out = (Shape::from(vec![rows, 2 * k]), DType::F32);
        let (floats, ints, head) = split::<B>(inputs);
        let run: RunVec<B> = Box::new(move |floats, ints| {
            let (inputs, _) = head.inputs::<B>(floats, ints);
            vec![B::invariant_linear_top_k(inputs, k, implementation)]
        });
        custom_op_vec::<B>("burn_invariant::linear_top_k", floats, ints, vec![out], run)
            .into_iter()
            .next()
            .unwrap_or_else(|| unreachable!("one output"))
    }
}
