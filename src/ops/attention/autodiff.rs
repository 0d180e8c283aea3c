//! Attention under `Autodiff`: the forward runs the inner primitive and records a node whose
//! backward calls the inner backward primitive. The node keeps the inputs (checkpointed), the
//! output and the f32 `lse`: never scores.
use burn::tensor::{backend::AutodiffBackend, ops::FloatTensor};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::{AttentionGrads, AttentionInputs, AttentionOps, AttentionOutput};
use crate::InvariantBackend;
use crate::backends::grads::register_grads;
use crate::registry::Implementation;

#[derive(Debug)]
struct AttentionBackward;

#[derive(Debug, Clone)]
struct AttentionState<B: InvariantBackend> {
    query: NodeId,
    key: NodeId,
    value: NodeId,
    kv_lens: burn::tensor::ops::IntTensor<B>,
    saved: AttentionOutput<B>,
    causal: bool,
    scale: f32,
    implementation: Implementation,
}

impl<B: InvariantBackend> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let inputs = AttentionInputs {
            query: checkpointer.retrieve_node_output(state.query),
            key: checkpointer.retrieve_node_output(state.key),
            value: checkpointer.retrieve_node_output(state.value),
            kv_lens: state.kv_lens,
            causal: state.causal,
            scale: state.scale,
        };
        let computed =
            B::invariant_attention_backward(inputs, state.saved, grad, state.implementation);
        let parents = ops.parents.map(|p| p.map(|n| n.id));
        register_grads::<B>(
            grads,
            parents,
            [
                Some(computed.query),
                Some(computed.key),
                Some(computed.value),
            ],
        );
    }
}

fn inner<B: InvariantBackend, C: CheckpointStrategy>(
    inputs: &AttentionInputs<Autodiff<B, C>>,
) -> AttentionInputs<B> {
    AttentionInputs {
        query: inputs.query.primitive.clone(),
        key: inputs.key.primitive.clone(),
        value: inputs.value.primitive.clone(),
        kv_lens: inputs.kv_lens.clone(),
        causal: inputs.causal,
        scale: inputs.scale,
    }
}

impl<B: InvariantBackend, C: CheckpointStrategy> AttentionOps for Autodiff<B, C> {
    fn invariant_attention(
        inputs: AttentionInputs<Self>,
        implementation: Implementation,
    ) -> AttentionOutput<Self> {
        let parents = [&inputs.query, &inputs.key, &inputs.value].map(|t| t.node.clone());
        let forward = B::invariant_attention(inner(&inputs), implementation);
        let lse = Self::from_inner(forward.lse.clone());
        let out = match AttentionBackward
            .prepare::<C>(parents)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = AttentionState {
                    query: prep.checkpoint(&inputs.query),
                    key: prep.checkpoint(&inputs.key),
                    value: prep.checkpoint(&inputs.value),
                    kv_lens: inputs.kv_lens,
                    saved: forward.clone(),
                    causal: inputs.causal,
                    scale: inputs.scale,
                    implementation,
                };
                prep.finish(state, forward.out)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward.out),
        };
        AttentionOutput { out, lse }
    }

    fn invariant_attention_backward(
        inputs: AttentionInputs<Self>,
        saved: AttentionOutput<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> AttentionGrads<Self> {
        // A second derivative is not offered: the gradients are constants.
        let saved = AttentionOutput {
            out: saved.out.primitive,
            lse: saved.lse.primitive,
        };
        let grads =
            B::invariant_attention_backward(inner(&inputs), saved, grad.primitive, implementation);
        AttentionGrads {
            query: Self::from_inner(grads.query),
            key: Self::from_inner(grads.key),
            value: Self::from_inner(grads.value),
        }
    }
}
