//! `linear_sample` under `Autodiff`: the inner primitive; its outputs are not differentiable.
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};
use burn_autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};

use super::{LinearSampleInputs, LinearSampleOps};
use crate::InvariantBackend;
use crate::ops::linear_logp::LinearLogpInputs;
use crate::registry::Implementation;

impl<B: InvariantBackend, C: CheckpointStrategy> LinearSampleOps for Autodiff<B, C> {
    fn invariant_linear_sample(
        inputs: LinearSampleInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let inner = LinearSampleInputs {
            hidden: inputs.hidden.primitive,
            weight: inputs.weight.primitive,
            bias: inputs.bias.map(|b| b.primitive),
            keys: inputs.keys,
            head: inputs.head,
            sampler: inputs.sampler,
        };
        Self::from_inner(B::invariant_linear_sample(inner, implementation))
    }

    fn invariant_linear_top_k(
        inputs: LinearLogpInputs<Self>,
        k: usize,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let inner = LinearLogpInputs {
            hidden: inputs.hidden.primitive,
            weight: inputs.weight.primitive,
            bias: inputs.bias.map(|b| b.primitive),
            targets: inputs.targets,
            ignore_index: inputs.ignore_index,
            head: inputs.head,
        };
        Self::from_inner(B::invariant_linear_top_k(inner, k, implementation))
    }
}
