//! `tp::linear_logp` under `Autodiff<B, C>`: the forward runs [`engine::forward`] on the inner
//! backend and records one node whose backward runs [`engine::backward`], which needs the
//! collective (the `dHidden` exchange), so the node keeps a clone of the group handle.
use core::marker::PhantomData;

use burn::tensor::{
    Tensor,
    ops::{FloatTensor, IntTensor},
};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use super::{Collective, Plan, engine};
use crate::InvariantError;
use crate::backend::{GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs};
use crate::registry::Implementation;

/// An `Autodiff<B, C>` group used on inner tensors (wrapped untracked, unwrapped after).
struct Lowered<'a, G, C> {
    group: &'a G,
    _strategy: PhantomData<fn() -> C>,
}

impl<'a, G, C> Lowered<'a, G, C> {
    fn new(group: &'a G) -> Self {
        Self {
            group,
            _strategy: PhantomData,
        }
    }
}

impl<G: core::fmt::Debug, C> core::fmt::Debug for Lowered<'_, G, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        self.group.fmt(f)
    }
}

impl<B, C, G> Collective<B> for Lowered<'_, G, C>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    G: Collective<Autodiff<B, C>>,
{
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world_size(&self) -> usize {
        self.group.world_size()
    }

    fn all_gather_host(&self, block: &[u64]) -> Result<Vec<u64>, InvariantError> {
        self.group.all_gather_host(block)
    }

    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, InvariantError> {
        self.group
            .all_gather(Tensor::from_inner(block))
            .map(Tensor::inner)
    }
}

#[derive(Debug, Clone)]
struct TpState<B: InvariantBackend, G> {
    hidden: NodeId,
    weight: NodeId,
    bias: Option<NodeId>,
    targets: IntTensor<B>,
    stats: FloatTensor<B>,
    ignore_index: Option<i64>,
    plan: Plan,
    group: G,
    implementation: Implementation,
}

impl<B: InvariantBackend, G> TpState<B, G> {
    fn backward<C>(
        self,
        grad: FloatTensor<B>,
        request: GradRequest,
        checkpointer: &mut Checkpointer,
    ) -> LinearLogpGrads<B>
    where
        C: CheckpointStrategy,
        G: Collective<Autodiff<B, C>>,
    {
        let inputs = LinearLogpInputs {
            hidden: checkpointer.retrieve_node_output(self.hidden),
            weight: checkpointer.retrieve_node_output(self.weight),
            bias: self.bias.map(|id| checkpointer.retrieve_node_output(id)),
            targets: self.targets,
            ignore_index: self.ignore_index,
        };
        let group = Lowered::<G, C>::new(&self.group);
        // A backward step cannot return an error; the group's timeout bounds the wait.
        engine::backward(
            inputs,
            self.stats,
            grad,
            request,
            &self.plan,
            &group,
            self.implementation,
        )
        .unwrap_or_else(|error| panic!("burn-invariant tp::linear_logp backward: {error}"))
    }
}

fn register<B: InvariantBackend>(
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

struct TpBackward<G, C>(PhantomData<fn() -> (G, C)>);

struct TpBiasBackward<G, C>(PhantomData<fn() -> (G, C)>);

impl<G, C> core::fmt::Debug for TpBackward<G, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("TpLinearLogpBackward")
    }
}

impl<G, C> core::fmt::Debug for TpBiasBackward<G, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("TpLinearLogpBiasBackward")
    }
}

impl<B, C, G> Backward<B, 2> for TpBackward<G, C>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    G: Collective<Autodiff<B, C>> + Clone + 'static,
{
    type State = TpState<B, G>;

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
        let computed = ops.state.backward::<C>(grad, request, checkpointer);
        register::<B>(
            grads,
            [hidden.map(|n| n.id), weight.map(|n| n.id), None],
            computed,
        );
    }
}

impl<B, C, G> Backward<B, 3> for TpBiasBackward<G, C>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    G: Collective<Autodiff<B, C>> + Clone + 'static,
{
    type State = TpState<B, G>;

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
        let computed = ops.state.backward::<C>(grad, request, checkpointer);
        register::<B>(
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

/// `InvariantBackend::invariant_tp_linear_logp` for `Autodiff<B, C>`.
pub(crate) fn forward<B, C, G>(
    inputs: LinearLogpInputs<Autodiff<B, C>>,
    plan: &Plan,
    group: &G,
    implementation: Implementation,
) -> Result<FloatTensor<Autodiff<B, C>>, InvariantError>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    G: Collective<Autodiff<B, C>> + Clone + 'static,
{
    let LinearLogpInputs {
        hidden,
        weight,
        bias,
        targets,
        ignore_index,
    } = inputs;
    let lowered = Lowered::<G, C>::new(group);
    let run = || {
        let inner = LinearLogpInputs::<B> {
            hidden: hidden.primitive.clone(),
            weight: weight.primitive.clone(),
            bias: bias.as_ref().map(|b| b.primitive.clone()),
            targets: targets.clone(),
            ignore_index,
        };
        engine::forward::<B, _>(inner, plan, &lowered, implementation)
    };
    macro_rules! record {
        ($backward:ty, $n:literal, $nodes:expr) => {
            match <$backward as Backward<B, $n>>::prepare::<C>(
                <$backward>::default_marker(),
                $nodes,
            )
            .compute_bound()
            .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let stats = run()?;
                    let state = TpState::<B, G> {
                        hidden: prep.checkpoint(&hidden),
                        weight: prep.checkpoint(&weight),
                        bias: bias.as_ref().map(|b| prep.checkpoint(b)),
                        targets: targets.clone(),
                        stats: stats.clone(),
                        ignore_index,
                        plan: plan.clone(),
                        group: group.clone(),
                        implementation,
                    };
                    Ok(prep.finish(state, stats))
                }
                OpsKind::UnTracked(prep) => Ok(prep.finish(run()?)),
            }
        };
    }
    match &bias {
        None => record!(
            TpBackward<G, C>,
            2,
            [hidden.node.clone(), weight.node.clone()]
        ),
        Some(b) => record!(
            TpBiasBackward<G, C>,
            3,
            [hidden.node.clone(), weight.node.clone(), b.node.clone()]
        ),
    }
}

impl<G, C> TpBackward<G, C> {
    fn default_marker() -> Self {
        Self(PhantomData)
    }
}

impl<G, C> TpBiasBackward<G, C> {
    fn default_marker() -> Self {
        Self(PhantomData)
    }
}
