//! `linear_sample`: a token per row drawn from the tempered softmax of `hidden · weightᵀ + bias`
//! in the `linear_logp` pass itself (never `[N, V]`), with the row's `logp`, `lse` and entropy
//! those `linear_logp_full` gives for that token (docs/CONTRACT.md, *linear_sample semantics*).
pub(crate) mod api;
mod autodiff;
#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
mod fusion;
pub mod noise;
pub mod oracle;
mod reference;

use burn::tensor::{
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use crate::ops::linear_logp::{LinearLogpInputs, LogpHead};
use crate::registry::Implementation;

pub use api::{LinearSampleOutput, SampleOptions, TOP_K_MAX, linear_sample};

/// How a row's token is chosen from its tempered logits `z`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SampleRule {
    /// `argmax_j z_j + G_j` (Gumbel-max): a draw from `softmax(z)`.
    Gumbel,
    /// `argmax_j z_j`.
    Greedy,
    /// `argmax_j z_j + G_j` over the `k` largest `z` (ties to the smaller index): a draw from
    /// the softmax restricted to them. `1 ≤ k ≤ TOP_K_MAX`.
    TopK(usize),
}

/// The sampler of a `linear_sample` call beside its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sampler {
    /// The run's seed; with a row's key it decides the row's noise.
    pub seed: u64,
    /// The rule.
    pub rule: SampleRule,
}

/// Inputs of the sampling primitive.
#[derive(Debug, Clone)]
pub struct LinearSampleInputs<B: Backend> {
    /// `[N, D]`.
    pub hidden: FloatTensor<B>,
    /// `[V, D]` (LM-head layout), `V ≤ 2²⁴`.
    pub weight: FloatTensor<B>,
    /// `[V]`, same dtype as `weight`.
    pub bias: Option<FloatTensor<B>>,
    /// `[N]`: each row's key (taken modulo 2³²).
    pub keys: IntTensor<B>,
    /// Temperature and entropy.
    pub head: LogpHead,
    /// Seed and rule.
    pub sampler: Sampler,
}

#[cfg(feature = "cubecl")]
impl<B: Backend> LinearSampleInputs<B> {
    /// The `linear_logp` inputs over the same logits, with the keys where the targets go.
    pub(crate) fn logits(self) -> (LinearLogpInputs<B>, Sampler) {
        let inputs = LinearLogpInputs {
            hidden: self.hidden,
            weight: self.weight,
            bias: self.bias,
            targets: self.keys,
            ignore_index: None,
            head: self.head,
        };
        (inputs, self.sampler)
    }

    /// The inverse of [`Self::logits`].
    pub(crate) fn of_logits(inputs: LinearLogpInputs<B>, sampler: Sampler) -> Self {
        Self {
            hidden: inputs.hidden,
            weight: inputs.weight,
            bias: inputs.bias,
            keys: inputs.targets,
            head: inputs.head,
            sampler,
        }
    }
}

/// The `linear_sample` primitive of a backend. It receives validated inputs and the
/// implementation the registry chose for `linear_logp` on the same problem, and never fails.
pub trait LinearSampleOps: Backend {
    /// `[N, head.columns() + 1]` f32: `(logp, lse[, entropy])` exactly as
    /// `invariant_linear_logp` gives them with the sampled tokens as targets, then the token
    /// (an integer in f32, −1 for a row whose tempered logits are all −∞ or NaN). Not
    /// differentiable.
    fn invariant_linear_sample(
        inputs: LinearSampleInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// `[N, 2k]` f32, `1 ≤ k ≤ TOP_K_MAX`: each row's `k` largest tempered logits, best first
    /// (ties to the smaller column), then their columns as f32 integers; slots past the row's
    /// ranking logits (neither −∞ nor NaN) are `(−∞, −1)`. The logits are those this backend's
    /// sampler ranks, and a column's depends on its own weight row alone, so the lists of
    /// vocabulary shards merge to the list of the whole. `inputs.targets` (`[N]`) is not read,
    /// `inputs.ignore_index` is `None`, `inputs.head.entropy` false. Not differentiable.
    fn invariant_linear_top_k(
        inputs: LinearLogpInputs<Self>,
        k: usize,
        implementation: Implementation,
    ) -> FloatTensor<Self>;
}
