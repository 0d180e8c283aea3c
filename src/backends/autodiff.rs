//! `InvariantBackend` for `Autodiff<B, C>`: the inner backend's candidates and limits, and the
//! collective `linear_logp` (`crate::tp`), which records the node of the `linear_logp` room
//! (`crate::ops::linear_logp`) with a backward that runs the engine's backward through the group
//! the forward used. Each op's own nodes are in the op's `autodiff.rs`.
use core::marker::PhantomData;

use burn::tensor::{DType, Shape, Tensor, TensorMetadata, ops::FloatTensor};
use burn_autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};

use crate::InvariantError;
use crate::backend::{
    Collective, CollectiveLogp, GradRequest, InvariantBackend, LinearLogpGrads, LinearLogpInputs,
    Problem,
};
use crate::ops::linear_logp::autodiff::{LogpGradients, record_logp_node};
use crate::registry::{Candidate, Implementation, Op};

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

    fn end_call(&self) -> Result<(), InvariantError> {
        self.group.end_call()
    }

    fn fail(&self, error: InvariantError) {
        self.group.fail(error)
    }

    fn device(&self) -> Option<B::Device> {
        self.group.device()
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

    fn invariant_device_failure(device: &Self::Device) -> Option<InvariantError> {
        B::invariant_device_failure(device)
    }

    fn invariant_kernel_choices(device: &Self::Device, dtype: DType) -> String {
        B::invariant_kernel_choices(device, dtype)
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
}
