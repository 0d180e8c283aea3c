//! `linear_sample` under `Fusion`: one opaque custom op over the inner backend's primitive.
//! Floats in: hidden, weight[, bias]; ints in: keys.
use burn::tensor::{DType, Shape, ops::FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{LinearSampleInputs, LinearSampleOps};
use crate::backends::custom_op::{RunVec, custom_op_vec};
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
        let (head, sampler, has_bias) = (inputs.head, inputs.sampler, inputs.bias.is_some());
        let floats = [Some(inputs.hidden), Some(inputs.weight), inputs.bias]
            .into_iter()
            .flatten()
            .collect();
        let run: RunVec<B> = Box::new(move |floats, ints| {
            let mut floats = floats.into_iter();
            let mut next = || floats.next().unwrap_or_else(|| unreachable!("registered"));
            let (hidden, weight) = (next(), next());
            let bias = has_bias.then(next);
            let inputs = LinearSampleInputs {
                hidden,
                weight,
                bias,
                keys: ints
                    .into_iter()
                    .next()
                    .unwrap_or_else(|| unreachable!("registered")),
                head,
                sampler,
            };
            vec![B::invariant_linear_sample(inputs, implementation)]
        });
        custom_op_vec::<B>(
            "burn_invariant::linear_sample",
            floats,
            vec![inputs.keys],
            vec![out],
            run,
        )
        .into_iter()
        .next()
        .unwrap_or_else(|| unreachable!("one output"))
    }
}
