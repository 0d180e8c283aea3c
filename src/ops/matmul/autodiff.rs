//! GEMM under `Autodiff`: the forward runs the inner primitive and records a node whose backward
//! calls the plugin's own gradient primitives (never `B::float_matmul`, which is not
//! batch-invariant). The node keeps lhs and rhs (checkpointed).
use burn::tensor::ops::FloatTensor;
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::MatmulOps;
use crate::InvariantBackend;
use crate::backends::grads::register_grads;
use crate::registry::Implementation;

#[derive(Debug)]
struct MatmulBackward;

#[derive(Debug)]
struct MatmulBiasBackward;

#[derive(Debug, Clone)]
struct MatmulState {
    lhs: NodeId,
    rhs: NodeId,
    implementation: Implementation,
}

/// The lhs and rhs gradients: dLhs needs rhs, dRhs needs lhs.
fn matmul_grads<B: InvariantBackend>(
    state: &MatmulState,
    grad: &FloatTensor<B>,
    want_lhs: bool,
    want_rhs: bool,
    checkpointer: &mut Checkpointer,
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let grad_lhs = want_lhs.then(|| {
        let rhs = checkpointer.retrieve_node_output(state.rhs);
        B::invariant_matmul_grad_lhs(grad.clone(), rhs, state.implementation)
    });
    let grad_rhs = want_rhs.then(|| {
        let lhs = checkpointer.retrieve_node_output(state.lhs);
        B::invariant_matmul_grad_rhs(lhs, grad.clone(), state.implementation)
    });
    (grad_lhs, grad_rhs)
}

impl<B: InvariantBackend> Backward<B, 2> for MatmulBackward {
    type State = MatmulState;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [lhs_node, rhs_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (grad_lhs, grad_rhs) = matmul_grads::<B>(
            &ops.state,
            &grad,
            lhs_node.is_some(),
            rhs_node.is_some(),
            checkpointer,
        );
        let parents = [lhs_node, rhs_node].map(|p| p.map(|n| n.id));
        register_grads::<B>(grads, parents, [grad_lhs, grad_rhs]);
    }
}

impl<B: InvariantBackend> Backward<B, 3> for MatmulBiasBackward {
    type State = MatmulState;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [lhs_node, rhs_node, bias_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (grad_lhs, grad_rhs) = matmul_grads::<B>(
            &ops.state,
            &grad,
            lhs_node.is_some(),
            rhs_node.is_some(),
            checkpointer,
        );
        let grad_bias = bias_node
            .as_ref()
            .map(|_| B::invariant_sum_rows(grad, ops.state.implementation));
        let parents = [lhs_node, rhs_node, bias_node].map(|p| p.map(|n| n.id));
        register_grads::<B>(grads, parents, [grad_lhs, grad_rhs, grad_bias]);
    }
}

impl<B: InvariantBackend, C: CheckpointStrategy> MatmulOps for Autodiff<B, C> {
    fn invariant_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let forward =
            |bias: Option<FloatTensor<B>>, lhs: FloatTensor<Self>, rhs: FloatTensor<Self>| {
                B::invariant_matmul(lhs.primitive, rhs.primitive, bias, implementation)
            };
        match bias {
            None => match MatmulBackward
                .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = MatmulState {
                        lhs: prep.checkpoint(&lhs),
                        rhs: prep.checkpoint(&rhs),
                        implementation,
                    };
                    prep.finish(state, forward(None, lhs, rhs))
                }
                OpsKind::UnTracked(prep) => prep.finish(forward(None, lhs, rhs)),
            },
            Some(bias) => match MatmulBiasBackward
                .prepare::<C>([lhs.node.clone(), rhs.node.clone(), bias.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let state = MatmulState {
                        lhs: prep.checkpoint(&lhs),
                        rhs: prep.checkpoint(&rhs),
                        implementation,
                    };
                    prep.finish(state, forward(Some(bias.primitive), lhs, rhs))
                }
                OpsKind::UnTracked(prep) => prep.finish(forward(Some(bias.primitive), lhs, rhs)),
            },
        }
    }

    fn invariant_matmul_grad_lhs(
        grad: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        // Not differentiated again: second-order gradients are out of scope.
        let out = B::invariant_matmul_grad_lhs(grad.primitive, rhs.primitive, implementation);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }

    fn invariant_matmul_grad_rhs(
        lhs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = B::invariant_matmul_grad_rhs(lhs.primitive, grad.primitive, implementation);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }

    fn invariant_sum_rows(
        grad: FloatTensor<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let out = B::invariant_sum_rows(grad.primitive, implementation);
        <Self as burn::tensor::backend::AutodiffBackend>::from_inner(out)
    }
}
