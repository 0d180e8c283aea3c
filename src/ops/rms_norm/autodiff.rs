//! RMSNorm under `Autodiff`: the forward runs the inner primitive and records a node whose
//! backward calls the inner backward primitive (inputs checkpointed; `1/rms` is recomputed).
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::{RmsNormGrads, RmsNormInputs, RmsNormOps};
use crate::InvariantBackend;
use crate::backends::grads::register_grads;
use crate::registry::Implementation;

#[derive(Debug)]
struct RmsNormBackward;

#[derive(Debug, Clone)]
struct RmsNormState {
    x: NodeId,
    gamma: NodeId,
    eps: f32,
    implementation: Implementation,
}

impl<B: InvariantBackend> Backward<B, 2> for RmsNormBackward {
    type State = RmsNormState;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let inputs = RmsNormInputs {
            x: checkpointer.retrieve_node_output(state.x),
            gamma: checkpointer.retrieve_node_output(state.gamma),
            eps: state.eps,
        };
        let computed = B::invariant_rms_norm_backward(inputs, grad, state.implementation);
        let parents = ops.parents.map(|p| p.map(|n| n.id));
        register_grads::<B>(grads, parents, [Some(computed.x), Some(computed.gamma)]);
    }
}

impl<B: InvariantBackend, C: CheckpointStrategy> RmsNormOps for Autodiff<B, C> {
    fn invariant_rms_norm(
        inputs: RmsNormInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let inner = RmsNormInputs {
            x: inputs.x.primitive.clone(),
            gamma: inputs.gamma.primitive.clone(),
            eps: inputs.eps,
        };
        match RmsNormBackward
            .prepare::<C>([inputs.x.node.clone(), inputs.gamma.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = RmsNormState {
                    x: prep.checkpoint(&inputs.x),
                    gamma: prep.checkpoint(&inputs.gamma),
                    eps: inputs.eps,
                    implementation,
                };
                prep.finish(state, B::invariant_rms_norm(inner, implementation))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::invariant_rms_norm(inner, implementation)),
        }
    }

    fn invariant_rms_norm_backward(
        inputs: RmsNormInputs<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> RmsNormGrads<Self> {
        // A second derivative is not offered: the gradients are constants.
        let inner = RmsNormInputs {
            x: inputs.x.primitive,
            gamma: inputs.gamma.primitive,
            eps: inputs.eps,
        };
        let grads = B::invariant_rms_norm_backward(inner, grad.primitive, implementation);
        RmsNormGrads {
            x: Self::from_inner(grads.x),
            gamma: Self::from_inner(grads.gamma),
        }
    }
}
