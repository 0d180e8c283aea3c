//! `linear_logp` under `Autodiff`: the forward runs the inner primitive and records a node that
//! saves hidden, weight, bias, targets and the `[N, C]` statistics (never logits); its backward
//! calls the inner backward primitive, or, for a collective `linear_logp` (`crate::tp`), the
//! engine's backward through the group the forward used ([`LogpGradients`]).
use core::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::{GradRequest, LinearLogpGrads, LinearLogpInputs, LinearLogpOps, LogpHead};
use crate::backends::grads::register_grads;
use crate::registry::Implementation;
use crate::{InvariantBackend, InvariantError};

/// How a recorded `linear_logp` node computes its gradients on the inner backend.
pub(crate) trait LogpGradients<B: InvariantBackend>:
    core::fmt::Debug + Clone + Send + 'static
{
    fn gradients(
        &self,
        inputs: LinearLogpInputs<B>,
        stats: FloatTensor<B>,
        grad: FloatTensor<B>,
        request: GradRequest,
    ) -> LinearLogpGrads<B>;
}

/// The single-rank backward primitive of the implementation that ran the forward.
#[derive(Debug, Clone)]
struct Local(Implementation);

impl<B: InvariantBackend> LogpGradients<B> for Local {
    fn gradients(
        &self,
        inputs: LinearLogpInputs<B>,
        stats: FloatTensor<B>,
        grad: FloatTensor<B>,
        request: GradRequest,
    ) -> LinearLogpGrads<B> {
        B::invariant_linear_logp_backward(inputs, stats, grad, request, self.0)
    }
}

/// What a `linear_logp` node keeps for its backward: never logits.
#[derive(Debug, Clone)]
struct LogpState<B: InvariantBackend, K> {
    hidden: NodeId,
    weight: NodeId,
    bias: Option<NodeId>,
    targets: IntTensor<B>,
    stats: FloatTensor<B>,
    ignore_index: Option<i64>,
    head: LogpHead,
    gradients: K,
}

/// The backward step of a `linear_logp` node: parents hidden, weight and, when `N = 3`, bias.
#[derive(Debug)]
struct LogpBackward<K>(PhantomData<fn() -> K>);

fn logp_backward<B: InvariantBackend, K: LogpGradients<B>, const N: usize>(
    ops: Ops<LogpState<B, K>, N>,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
) {
    let grad = grads.consume::<B>(&ops.node);
    let request = GradRequest {
        hidden: ops.parents[0].is_some(),
        weight: ops.parents[1].is_some(),
        bias: ops.parents.get(2).is_some_and(Option::is_some),
    };
    let state = ops.state;
    let inputs = LinearLogpInputs {
        hidden: checkpointer.retrieve_node_output(state.hidden),
        weight: checkpointer.retrieve_node_output(state.weight),
        bias: state.bias.map(|id| checkpointer.retrieve_node_output(id)),
        targets: state.targets,
        ignore_index: state.ignore_index,
        head: state.head,
    };
    let computed = state
        .gradients
        .gradients(inputs, state.stats, grad, request);
    let parents = ops.parents.map(|p| p.map(|n| n.id));
    register_grads::<B>(
        grads,
        parents,
        [computed.hidden, computed.weight, computed.bias],
    );
}

impl<B: InvariantBackend, K: LogpGradients<B>> Backward<B, 2> for LogpBackward<K> {
    type State = LogpState<B, K>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        logp_backward(ops, grads, checkpointer);
    }
}

impl<B: InvariantBackend, K: LogpGradients<B>> Backward<B, 3> for LogpBackward<K> {
    type State = LogpState<B, K>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        logp_backward(ops, grads, checkpointer);
    }
}

/// The inner backend's view of `inputs`.
fn inner_inputs<B: InvariantBackend, C: CheckpointStrategy>(
    inputs: &LinearLogpInputs<Autodiff<B, C>>,
) -> LinearLogpInputs<B> {
    LinearLogpInputs {
        hidden: inputs.hidden.primitive.clone(),
        weight: inputs.weight.primitive.clone(),
        bias: inputs.bias.as_ref().map(|b| b.primitive.clone()),
        targets: inputs.targets.clone(),
        ignore_index: inputs.ignore_index,
        head: inputs.head,
    }
}

/// Runs `forward` on the inner backend and, where a parent is tracked, records a node whose
/// backward is `gradients`.
fn record_logp<B, C, K, const N: usize>(
    prepared: OpsKind<LogpBackward<K>, B, LogpState<B, K>, C, N>,
    inputs: LinearLogpInputs<Autodiff<B, C>>,
    gradients: K,
    forward: impl FnOnce(LinearLogpInputs<B>) -> Result<FloatTensor<B>, InvariantError>,
) -> Result<FloatTensor<Autodiff<B, C>>, InvariantError>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    K: LogpGradients<B>,
    LogpBackward<K>: Backward<B, N, State = LogpState<B, K>>,
{
    match prepared {
        OpsKind::Tracked(mut prep) => {
            let stats = forward(inner_inputs(&inputs))?;
            let state = LogpState {
                hidden: prep.checkpoint(&inputs.hidden),
                weight: prep.checkpoint(&inputs.weight),
                bias: inputs.bias.as_ref().map(|b| prep.checkpoint(b)),
                targets: inputs.targets,
                stats: stats.clone(),
                ignore_index: inputs.ignore_index,
                head: inputs.head,
                gradients,
            };
            Ok(prep.finish(state, stats))
        }
        OpsKind::UnTracked(prep) => Ok(prep.finish(forward(inner_inputs(&inputs))?)),
    }
}

/// [`record_logp`] with the parents `inputs` has: hidden, weight and maybe bias.
pub(crate) fn record_logp_node<B, C, K>(
    inputs: LinearLogpInputs<Autodiff<B, C>>,
    gradients: K,
    forward: impl FnOnce(LinearLogpInputs<B>) -> Result<FloatTensor<B>, InvariantError>,
) -> Result<FloatTensor<Autodiff<B, C>>, InvariantError>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    K: LogpGradients<B>,
{
    let (hidden, weight) = (inputs.hidden.node.clone(), inputs.weight.node.clone());
    let backward = LogpBackward::<K>(PhantomData);
    match inputs.bias.as_ref().map(|b| b.node.clone()) {
        None => {
            let prepared = backward.prepare::<C>([hidden, weight]);
            record_logp(
                prepared.compute_bound().stateful(),
                inputs,
                gradients,
                forward,
            )
        }
        Some(bias) => {
            let prepared = backward.prepare::<C>([hidden, weight, bias]);
            record_logp(
                prepared.compute_bound().stateful(),
                inputs,
                gradients,
                forward,
            )
        }
    }
}

impl<B: InvariantBackend, C: CheckpointStrategy> LinearLogpOps for Autodiff<B, C> {
    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self> {
        let forward = |inner| Ok(B::invariant_linear_logp(inner, implementation));
        record_logp_node(inputs, Local(implementation), forward)
            .unwrap_or_else(|_: InvariantError| unreachable!("the forward primitive cannot fail"))
    }

    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self> {
        let grads = B::invariant_linear_logp_backward(
            inner_inputs(&inputs),
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
