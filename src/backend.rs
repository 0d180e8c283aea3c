//! The backend extension trait: every op's primitives (its supertraits, one per room in
//! `crate::ops`), the candidates and limits the registry decides by, and the tensor-parallel
//! primitives with the traits of the collective.
//!
//! Primitives receive already-validated inputs and the [`Implementation`] the registry chose,
//! so a backend with several implementations (CUDA: CubeCL and SM90) dispatches without
//! re-deciding. They never fail: every check happens before, in the public API. The default
//! bodies of the tensor-parallel primitives are plain Burn ops (`backends::generic`).
use burn::tensor::{
    DType, Tensor,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use crate::InvariantError;
use crate::backends::generic;
use crate::ops::attention::AttentionOps;
use crate::ops::linear_logp::LinearLogpOps;
pub use crate::ops::linear_logp::{GradRequest, LinearLogpGrads, LinearLogpInputs, LogpHead};
use crate::ops::linear_sample::LinearSampleOps;
use crate::ops::matmul::MatmulOps;
use crate::ops::rms_norm::RmsNormOps;
pub use crate::registry::Problem;
use crate::registry::{Candidate, Implementation, Op};

/// A Burn backend that runs burn-invariant's deterministic, batch-invariant ops.
///
/// Contract of every implementation (docs/CONTRACT.md, *Invariance*): f32 accumulation, a reduction order fixed by
/// `(dtype, K, N, device)` and never by the number of rows, no split-K, no autotune, no float
/// atomics, and no `[N, V]` logits for `linear_logp`.
pub trait InvariantBackend:
    Backend + MatmulOps + LinearLogpOps + LinearSampleOps + AttentionOps + RmsNormOps
{
    /// The implementations this backend offers for `op` on `device` with inputs of `dtype`,
    /// most preferred first, each saying whether it can run.
    fn implementations(op: Op, device: &Self::Device, dtype: DType) -> Vec<Candidate>;

    /// Limits of `implementation` on `device` for a call of these sizes in `dtype` (forward and
    /// backward), beyond dtype and device support: [`crate::InvariantError::TooLarge`] where a
    /// size passes a kernel limit, [`crate::InvariantError::UnsupportedProblem`] where the
    /// kernels do not take the shape. On `Err` the registry
    /// ([`crate::registry`]) takes the next available implementation that accepts the problem,
    /// unless the refusal is for the number of rows or the refusing one was forced; then the
    /// error reaches the caller before anything runs.
    fn check_problem(
        _implementation: Implementation,
        _device: &Self::Device,
        _dtype: DType,
        _problem: Problem,
    ) -> Result<(), InvariantError> {
        Ok(())
    }

    /// What, besides the code, decides the bits this backend computes for `dtype` on `device`:
    /// the device's architecture and the kernel variants its capabilities select (for
    /// [`crate::fingerprint`]). Backend wrappers that compute the same bits (`Autodiff`,
    /// `Fusion`) return their inner backend's.
    fn invariant_kernel_choices(device: &Self::Device, dtype: DType) -> String;

    /// The failure of an earlier launch on `device`, once one was seen
    /// ([`InvariantError::DeviceFailed`]): the registry refuses every call there, and the
    /// public functions check it again after their primitives ran. Backends whose launches
    /// cannot fail after validation keep the default.
    fn invariant_device_failure(_device: &Self::Device) -> Option<InvariantError> {
        None
    }

    /// Tensor-parallel leaf targets (`crate::tp`): `t − start` where `start ≤ t < end` and `t`
    /// is not `ignore_index`, −1 (the leaves' ignore index) where ignored, −2 (matches no column
    /// of the leaf) elsewhere. `[N]`, an integer dtype (the targets', or one the backend's
    /// kernels take).
    fn invariant_tp_leaf_targets(
        targets: IntTensor<Self>,
        start: usize,
        end: usize,
        ignore_index: Option<i64>,
    ) -> IntTensor<Self> {
        generic::leaf_targets::<Self>(targets, start, end, ignore_index)
    }

    /// Tensor-parallel `lse` merge, element-wise over f32 `[N]`:
    /// `a ⊕ b = max + ln(1 + exp(−|a − b|))`, with the gap taken as 0 when `a == b`.
    fn invariant_tp_merge_lse(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        generic::merge_lse::<Self>(a, b)
    }

    /// Tensor-parallel merge of `(lse, entropy)` pairs, f32 `[2, N]` each: row 0 is
    /// [`Self::invariant_tp_merge_lse`] of the lse rows, row 1
    /// `Σ_side w·(H + lse − lse_side)` with `w = exp(lse_side − lse)` over the two sides, a side
    /// whose lse is −∞ adding exactly nothing.
    fn invariant_tp_merge_entropy(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        generic::merge_entropy::<Self>(a, b)
    }

    /// Tensor-parallel owner pick: f32 `[2, N]` holding a leaf's `(logp, lse)` from
    /// `stats [N, 2]` in the rows it owns (`leaf_targets ≥ 0`), `acc [2, N]` (or 0) elsewhere.
    fn invariant_tp_pick(
        acc: Option<FloatTensor<Self>>,
        stats: FloatTensor<Self>,
        leaf_targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        generic::pick::<Self>(acc, stats, leaf_targets)
    }

    /// Tensor-parallel result `[N, 2]` f32 `(logp, lse)` from the owners' `picks [2, N]`, the
    /// global `lse [N]` and `targets`: `logp = 0` for ignored rows,
    /// `pick_logp + (pick_lse − lse)` for targets in `[0, vocab)`, NaN otherwise.
    fn invariant_tp_finish(
        picks: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        targets: IntTensor<Self>,
        vocab: usize,
        ignore_index: Option<i64>,
    ) -> FloatTensor<Self> {
        generic::finish::<Self>(picks, lse, targets, vocab, ignore_index)
    }

    /// A `linear_logp` that `engine` computes from this backend's primitives and `group` (the
    /// tensor-parallel one, `crate::tp`), on validated inputs: `[N, C]` f32
    /// `(logp, lse[, entropy])` as [`LinearLogpOps::invariant_linear_logp`].
    /// The default runs the engine's forward; `Autodiff` overrides it to record a backward
    /// that runs the engine's backward through the same group. Fails only if the collective
    /// does.
    fn invariant_collective_linear_logp<E, G>(
        inputs: LinearLogpInputs<Self>,
        engine: &E,
        group: &G,
    ) -> Result<FloatTensor<Self>, InvariantError>
    where
        E: CollectiveLogp,
        G: Collective<Self> + Clone + 'static,
    {
        engine.forward(inputs, group)
    }
}

/// A `linear_logp` computed across the ranks of a [`Collective`] from the single-rank
/// primitives of any backend: the tensor-parallel engine. Generic over the backend so that
/// `Autodiff<B>` can run it on `B` and record its backward.
pub trait CollectiveLogp: core::fmt::Debug + Clone + Send + Sync + 'static {
    /// This rank's `[N, C]` f32 `(logp, lse[, entropy])` over the global vocabulary.
    fn forward<B: InvariantBackend, G: Collective<B>>(
        &self,
        inputs: LinearLogpInputs<B>,
        group: &G,
    ) -> Result<FloatTensor<B>, InvariantError>;

    /// Gradients of [`Self::forward`] from its `stats [N, C]` and the upstream `grad [N, C]`.
    fn backward<B: InvariantBackend, G: Collective<B>>(
        &self,
        inputs: LinearLogpInputs<B>,
        stats: FloatTensor<B>,
        grad: FloatTensor<B>,
        request: GradRequest,
        group: &G,
    ) -> Result<LinearLogpGrads<B>, InvariantError>;
}

/// A communicator of `world_size()` ranks, seen from one of them.
///
/// The tensor-parallel algorithm needs only all-gathers: validation exchanges one small host
/// block per rank, the forward one `[items + 2, N]` f32 block (`[2·items + 2, N]` with entropy),
/// the backward one `[items, N, D]` f32 block. Every combine then happens locally in a fixed
/// order, so no reduction order is left to the communicator (an NCCL sum-all-reduce would be).
///
/// Contract of every implementation:
/// - every rank calls the same operations in the same order, each with a block of the same
///   length; results are the blocks of ranks `0..world` concatenated, **bit for bit**;
/// - a failure (a rank missing past a timeout, blocks of different lengths) makes the call
///   return the same [`InvariantError::Collective`] on every rank in bounded time; the group
///   may be unusable afterwards. An implementation whose tensor exchange only enqueues work
///   reports that exchange's failure from [`Collective::settle`], which the tensor-parallel
///   calls run before they return (through [`Collective::end_call`]).
///
/// Implementations: `tp::InProcessGroup` (threads of one process, any backend; for tests and
/// single-host use) and, with the `cuda` feature, `tp::NcclGroup` (one NCCL communicator per
/// GPU, `ncclAllGather` on cubecl's buffers, for the CUDA backends).
///
/// Under `Autodiff<B>` the group is called with untracked `Autodiff<B>` tensors, also from
/// inside the backward pass; it must be `Clone` (a cheap handle to the same communicator) so
/// the backward can keep it.
pub trait Collective<B: Backend>: core::fmt::Debug + Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// All-gather of a small host block: returns the `world_size()` blocks in rank order.
    fn all_gather_host(&self, block: &[u64]) -> Result<Vec<u64>, InvariantError>;

    /// All-gather of an f32 device block `[len]`: returns `[world_size() · len]`, the blocks in
    /// rank order, on `block`'s device.
    fn all_gather(&self, block: Tensor<B, 1>) -> Result<Tensor<B, 1>, InvariantError>;

    /// Returns once every exchange this rank enqueued so far has completed or failed (a peer
    /// missing past the group's timeout is a failure): the error of a failed one. The default suits groups whose
    /// exchanges complete before they return.
    fn settle(&self) -> Result<(), InvariantError> {
        Ok(())
    }

    /// What every tensor-parallel call runs before it returns: by default [`Self::settle`], so
    /// a failed exchange fails its own call. A group may defer that wait (`NcclGroup`'s
    /// `with_deferred_failures`): it then returns only failures already known, and a failed
    /// exchange is reported by its next call or `settle`.
    fn end_call(&self) -> Result<(), InvariantError> {
        self.settle()
    }

    /// Breaks the group with `error`, for a rank that failed where it cannot return the
    /// error (a backward step): every later call on every rank should return it, and ranks
    /// waiting in an exchange should return it without waiting for the timeout where the
    /// group can reach them. The default does nothing: the peers then fail by their timeout.
    fn fail(&self, error: InvariantError) {
        let _ = error;
    }

    /// The device this rank's tensors must be on, when the group is bound to one: the
    /// tensor-parallel validation fails every rank when a rank's tensors are elsewhere (a
    /// rank whose exchange cannot start would otherwise leave its peers waiting).
    fn device(&self) -> Option<B::Device> {
        None
    }
}
