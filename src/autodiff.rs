//! `InvariantBackend` for `Autodiff<B, C>`: custom backward steps that call the plugin's own
//! primitives (never `B::float_matmul`, which is not batch-invariant). `linear_logp` saves
//! hidden, weight, bias, targets and the `[N, 2]` statistics: never logits.
use burn::tensor::{
    DType,
    ops::{FloatTensor, IntTensor},
};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use crate::backend::{GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs, Problem};
use crate::registry::{Candidate, Implementation, Op};

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
        if let (Some(node), Some(g)) = (lhs_node, grad_lhs) {
            grads.register::<B>(node.id, g);
        }
        if let (Some(node), Some(g)) = (rhs_node, grad_rhs) {
            grads.register::<B>(node.id, g);
        }
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
        if let (Some(node), Some(g)) = (lhs_node, grad_lhs) {
            grads.register::<B>(node.id, g);
        }
        if let (Some(node), Some(g)) = (rhs_node, grad_rhs) {
            grads.register::<B>(node.id, g);
        }
        if let Some(node) = bias_node {
            grads.register::<B>(
                node.id,
                B::invariant_sum_rows(grad, ops.state.implementation),
            );
        }
    }
}

#[derive(Debug)]
struct LinearLogpBackward;

#[derive(Debug, Clone)]
struct LinearLogpState<B: InvariantBackend> {
    hidden: NodeId,
    weight: NodeId,
    bias: Option<NodeId>,
    targets: IntTensor<B>,
    stats: FloatTensor<B>,
    ignore_index: Option<i64>,
    implementation: Implementation,
}

impl<B: InvariantBackend> LinearLogpState<B> {
    fn backward(
        self,
        grad: FloatTensor<B>,
        request: GradRequest,
        checkpointer: &mut Checkpointer,
    ) -> LinearLogpGrads<B> {
        let inputs = LinearLogpInputs {
            hidden: checkpointer.retrieve_node_output(self.hidden),
            weight: checkpointer.retrieve_node_output(self.weight),
            bias: self.bias.map(|id| checkpointer.retrieve_node_output(id)),
            targets: self.targets,
            ignore_index: self.ignore_index,
        };
        B::invariant_linear_logp_backward(inputs, self.stats, grad, request, self.implementation)
    }
}

fn register_logp_grads<B: InvariantBackend>(
    grads: &mut Gradients,
    nodes: [Option<NodeId>; 3],
    computed: LinearLogpGrads<B>,
) {
    let [hidden, weight, bias] = nodes;
    for (node, grad) in [
        (hidden, computed.hidden),
        (weight, computed.weight),
        (bias, computed.bias),
    ] {
        if let (Some(node), Some(grad)) = (node, grad) {
            grads.register::<B>(node, grad);
        }
    }
}

impl<B: InvariantBackend> Backward<B, 2> for LinearLogpBackward {
    type State = LinearLogpState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [hidden, weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let request = GradRequest {
            hidden: hidden.is_some(),
            weight: weight.is_some(),
            bias: false,
        };
        let computed = ops.state.backward(grad, request, checkpointer);
        register_logp_grads::<B>(
            grads,
            [hidden.map(|n| n.id), weight.map(|n| n.id), None],
            computed,
        );
    }
}

#[derive(Debug)]
struct LinearLogpBiasBackward;

impl<B: InvariantBackend> Backward<B, 3> for LinearLogpBiasBackward {
    type State = LinearLogpState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [hidden, weight, bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let request = GradRequest {
            hidden: hidden.is_some(),
            weight: weight.is_some(),
            bias: bias.is_some(),
        };
        let computed = ops.state.backward(grad, request, checkpointer);
        register_logp_grads::<B>(
            grads,
            [
                hidden.map(|n| n.id),
                weight.map(|n| n.id),
                bias.map(|n| n.id),
            ],
            computed,
        );
    }
}

impl<B: InvariantBackend, C: CheckpointStrategy> InvariantBackend for Autodiff<B, C> {
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        B::implementations(op, device, dtype)
    }

    fn check_problem(implementation: Implementation, problem: Problem) -> Result<(), String> {
        B::check_problem(implementation, problem)
    }

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

    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let LinearLogpInputs {
            hidden,
            weight,
            bias,
            targets,
            ignore_index,
        } = inputs;
        let inner = |bias: Option<FloatTensor<B>>| LinearLogpInputs::<B> {
            hidden: hidden.primitive.clone(),
            weight: weight.primitive.clone(),
            bias,
            targets: targets.clone(),
            ignore_index,
        };
        macro_rules! tracked {
            ($backward:expr, $nodes:expr, $bias:expr) => {
                match $backward.prepare::<C>($nodes).compute_bound().stateful() {
                    OpsKind::Tracked(mut prep) => {
                        let stats = B::invariant_linear_logp(
                            inner($bias.map(|b| b.primitive.clone())),
                            implementation,
                        );
                        let state = LinearLogpState::<B> {
                            hidden: prep.checkpoint(&hidden),
                            weight: prep.checkpoint(&weight),
                            bias: $bias.map(|b| prep.checkpoint(b)),
                            targets: targets.clone(),
                            stats: stats.clone(),
                            ignore_index,
                            implementation,
                        };
                        prep.finish(state, stats)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::invariant_linear_logp(
                        inner($bias.map(|b| b.primitive.clone())),
                        implementation,
                    )),
                }
            };
        }
        match &bias {
            None => tracked!(
                LinearLogpBackward,
                [hidden.node.clone(), weight.node.clone()],
                None::<&FloatTensor<Self>>
            ),
            Some(b) => tracked!(
                LinearLogpBiasBackward,
                [hidden.node.clone(), weight.node.clone(), b.node.clone()],
                Some(b)
            ),
        }
    }

    fn invariant_tp_linear_logp<G: crate::tp::Collective<Self> + Clone + 'static>(
        inputs: LinearLogpInputs<Self>,
        plan: &crate::tp::Plan,
        group: &G,
        implementation: Implementation,
    ) -> Result<FloatTensor<Self>, crate::InvariantError> {
        crate::tp::autodiff_forward::<B, C, G>(inputs, plan, group, implementation)
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        let inner = LinearLogpInputs::<B> {
            hidden: inputs.hidden.primitive,
            weight: inputs.weight.primitive,
            bias: inputs.bias.map(|b| b.primitive),
            targets: inputs.targets,
            ignore_index: inputs.ignore_index,
        };
        let grads = B::invariant_linear_logp_backward(
            inner,
            stats.primitive,
            grad.primitive,
            request,
            implementation,
        );
        let lift = |t: Option<FloatTensor<B>>| {
            t.map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
        };
        LinearLogpGrads {
            hidden: lift(grads.hidden),
            weight: lift(grads.weight),
            bias: lift(grads.bias),
        }
    }
}
