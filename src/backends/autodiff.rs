//! `InvariantBackend` for `Autodiff<B, C>`: custom backward steps that call the plugin's own
//! primitives (never `B::float_matmul`, which is not batch-invariant). `linear_logp` saves
//! hidden, weight, bias, targets and the `[N, 2]` statistics: never logits. A collective
//! `linear_logp` (`crate::tp`) records the same node, whose backward runs the engine's
//! backward through the group the forward used.
use core::marker::PhantomData;

use burn::tensor::{
    DType, Shape, Tensor, TensorMetadata,
    ops::{FloatTensor, IntTensor},
};
use burn_autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};

use crate::InvariantError;
use crate::backend::{
    Collective, CollectiveLogp, GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs,
    LogpHead, Problem,
};
use crate::registry::{Candidate, Implementation, Op};

/// Registers the computed gradients of the parents that are tracked.
pub(crate) fn register_grads<B: InvariantBackend>(
    grads: &mut Gradients,
    parents: impl IntoIterator<Item = Option<NodeId>>,
    computed: impl IntoIterator<Item = Option<FloatTensor<B>>>,
) {
    for (node, grad) in parents.into_iter().zip(computed) {
        if let (Some(node), Some(grad)) = (node, grad) {
            grads.register::<B>(node, grad);
        }
    }
}

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

/// How a recorded `linear_logp` node computes its gradients on the inner backend.
trait LogpGradients<B: InvariantBackend>: core::fmt::Debug + Clone + Send + 'static {
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

/// A collective engine's backward, through the group of the forward.
struct Sharded<E, G, C> {
    engine: E,
    group: G,
    _strategy: PhantomData<fn() -> C>,
}

impl<E: Clone, G: Clone, C> Clone for Sharded<E, G, C> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            group: self.group.clone(),
            _strategy: PhantomData,
        }
    }
}

impl<E: core::fmt::Debug, G: core::fmt::Debug, C> core::fmt::Debug for Sharded<E, G, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Sharded")
            .field("engine", &self.engine)
            .field("group", &self.group)
            .finish()
    }
}

impl<B, C, E, G> LogpGradients<B> for Sharded<E, G, C>
where
    B: InvariantBackend,
    C: CheckpointStrategy,
    E: CollectiveLogp,
    G: Collective<Autodiff<B, C>> + Clone + 'static,
{
    fn gradients(
        &self,
        inputs: LinearLogpInputs<B>,
        stats: FloatTensor<B>,
        grad: FloatTensor<B>,
        request: GradRequest,
    ) -> LinearLogpGrads<B> {
        let group = Lowered::<G, C>::new(&self.group);
        let shapes = GradShapes::of(&inputs, request);
        match self.engine.backward(inputs, stats, grad, request, &group) {
            Ok(grads) => grads,
            Err(error) => {
                // A backward step cannot return an error: the gradients become NaN and the
                // group carries the error to the next call of every rank.
                log::error!("burn-invariant tp::linear_logp backward: {error}");
                self.group.fail(error);
                shapes.nan()
            }
        }
    }
}

/// Shape, dtype and device of each requested gradient: the NaN stand-ins of a failed
/// collective backward.
struct GradShapes<B: InvariantBackend> {
    hidden: Option<(Shape, DType)>,
    weight: Option<(Shape, DType)>,
    bias: Option<(Shape, DType)>,
    device: B::Device,
}

impl<B: InvariantBackend> GradShapes<B> {
    fn of(inputs: &LinearLogpInputs<B>, request: GradRequest) -> Self {
        let describe = |t: &FloatTensor<B>| (t.shape(), t.dtype());
        Self {
            hidden: request.hidden.then(|| describe(&inputs.hidden)),
            weight: request.weight.then(|| describe(&inputs.weight)),
            bias: (inputs.bias.as_ref())
                .filter(|_| request.bias)
                .map(describe),
            device: B::float_device(&inputs.hidden),
        }
    }

    fn nan(self) -> LinearLogpGrads<B> {
        let device = self.device;
        let nan = |(shape, dtype): (Shape, DType)| {
            B::float_full(shape, f32::NAN.into(), &device, dtype.into())
        };
        LinearLogpGrads {
            hidden: self.hidden.map(nan),
            weight: self.weight.map(nan),
            bias: self.bias.map(nan),
        }
    }
}

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

    fn settle(&self) -> Result<(), InvariantError> {
        self.group.settle()
    }

    fn fail(&self, error: InvariantError) {
        self.group.fail(error)
    }

    fn device(&self) -> Option<B::Device> {
        self.group.device()
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
fn record_logp_node<B, C, K>(
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

impl<B: InvariantBackend, C: CheckpointStrategy> InvariantBackend for Autodiff<B, C> {
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate> {
        B::implementations(op, device, dtype)
    }

    fn check_problem(
        implementation: Implementation,
        device: &Self::Device,
        dtype: DType,
        problem: Problem,
    ) -> Result<(), InvariantError> {
        B::check_problem(implementation, device, dtype, problem)
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
        let forward = |inner| Ok(B::invariant_linear_logp(inner, implementation));
        record_logp_node(inputs, Local(implementation), forward)
            .unwrap_or_else(|_: InvariantError| unreachable!("the forward primitive cannot fail"))
    }

    fn invariant_collective_linear_logp<E, G>(
        inputs: LinearLogpInputs<Self>,
        engine: &E,
        group: &G,
    ) -> Result<FloatTensor<Self>, InvariantError>
    where
        E: CollectiveLogp,
        G: Collective<Self> + Clone + 'static,
    {
        let gradients = Sharded::<E, G, C> {
            engine: engine.clone(),
            group: group.clone(),
            _strategy: PhantomData,
        };
        let lowered = Lowered::<G, C>::new(group);
        record_logp_node(inputs, gradients, |inner| engine.forward(inner, &lowered))
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
