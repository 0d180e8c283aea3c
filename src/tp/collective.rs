//! The collective operations tensor-parallel `linear_logp` needs, and nothing more.
use burn::tensor::{Tensor, backend::Backend};

use crate::InvariantError;

/// A communicator of `world_size()` ranks, seen from one of them.
///
/// The algorithm needs only all-gathers: validation exchanges one small host block per rank,
/// the forward one `[items + 2, N]` f32 block, the backward one `[items, N, D]` f32 block.
/// Every combine then happens locally in a fixed order, so no reduction order is left to the
/// communicator (an NCCL sum-all-reduce would be).
///
/// Contract of every implementation:
/// - every rank calls the same operations in the same order, each with a block of the same
///   length; results are the blocks of ranks `0..world` concatenated, **bit for bit**;
/// - a failure (a rank missing past a timeout, blocks of different lengths) makes the call
///   return the same [`InvariantError::Collective`] on every rank in bounded time; the group
///   may be unusable afterwards.
///
/// Implementations: [`InProcessGroup`](super::InProcessGroup) (threads of one process, any
/// backend; for tests and single-host use) and, with the `cuda` feature, `NcclGroup` (one NCCL
/// communicator per GPU, `ncclAllGather` on cubecl's buffers, for the CUDA backends).
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
}
