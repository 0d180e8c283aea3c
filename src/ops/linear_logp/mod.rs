//! `linear_logp`: the fused linear log-prob head (`hidden · weightᵀ + bias`, then the
//! log-softmax at the targets, optionally the entropy) without `[N, V]` logits
//! (docs/CONTRACT.md, *linear_logp semantics*).
pub(crate) mod api;
pub(crate) mod autodiff;
#[cfg(feature = "cubecl")]
pub(crate) mod cube;
#[cfg(feature = "cubecl")]
pub(crate) mod fusion;
pub mod oracle;
mod reference;

use burn::tensor::{
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use crate::registry::Implementation;

pub use api::{
    LinearLogpOptions, LinearLogpOutput, linear_logp, linear_logp_full, linear_logp_with_lse,
};

/// The head of a `linear_logp` call beside its tensors: the softmax temperature and whether the
/// per-row entropy is computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogpHead {
    /// `1 / T`, rounded to f32 once: the logits are `(hidden · weightᵀ + bias) · inv_temperature`
    /// (1 leaves them bitwise unchanged). Finite and positive.
    pub inv_temperature: f32,
    /// Whether the statistics carry a third column, `entropy`.
    pub entropy: bool,
}

impl LogpHead {
    /// Temperature 1, no entropy: statistics `(logp, lse)`.
    pub const PLAIN: Self = Self {
        inv_temperature: 1.0,
        entropy: false,
    };

    /// Columns of the statistics and of their upstream gradient: `(logp, lse[, entropy])`.
    pub fn columns(&self) -> usize {
        2 + usize::from(self.entropy)
    }
}

impl Default for LogpHead {
    fn default() -> Self {
        Self::PLAIN
    }
}

/// Inputs of the fused linear log-prob primitives.
#[derive(Debug, Clone)]
pub struct LinearLogpInputs<B: Backend> {
    /// `[N, D]`.
    pub hidden: FloatTensor<B>,
    /// `[V, D]` (LM-head layout).
    pub weight: FloatTensor<B>,
    /// `[V]`, same dtype as `weight`.
    pub bias: Option<FloatTensor<B>>,
    /// `[N]`. A target outside `[0, V)` that is not `ignore_index` matches no column: `logp`
    /// NaN, and `dz = (dLse − dLogp)·p` (no one-hot term); the tensor-parallel leaves rely on it.
    pub targets: IntTensor<B>,
    /// Rows whose target equals this get `logp = 0`, `entropy = 0` and no gradient from either.
    pub ignore_index: Option<i64>,
    /// Temperature and entropy.
    pub head: LogpHead,
}

/// Which gradients the backward of `linear_logp` must produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GradRequest {
    /// `dHidden`.
    pub hidden: bool,
    /// `dWeight`.
    pub weight: bool,
    /// `dBias` (ignored when there is no bias).
    pub bias: bool,
}

impl GradRequest {
    /// Every gradient.
    pub const ALL: Self = Self {
        hidden: true,
        weight: true,
        bias: true,
    };
}

/// Gradients of `linear_logp`; `None` where not requested.
#[derive(Debug, Clone)]
pub struct LinearLogpGrads<B: Backend> {
    /// `[N, D]` in hidden's dtype.
    pub hidden: Option<FloatTensor<B>>,
    /// `[V, D]` in weight's dtype, accumulated in f32.
    pub weight: Option<FloatTensor<B>>,
    /// `[V]` in bias's dtype, accumulated in f32.
    pub bias: Option<FloatTensor<B>>,
}

/// The `linear_logp` primitives of a backend. They receive validated inputs and the
/// implementation the registry chose, and never fail.
pub trait LinearLogpOps: Backend {
    /// Fused `log_softmax(z)[target]` with `z = (hidden · weightᵀ + bias) · inv_temperature`:
    /// returns `[N, head.columns()]` f32 with `(logp, lse)` per row, then the entropy
    /// `lse − Σ_j softmax(z)_j·z_j` when `head.entropy` (0 for ignored rows). Never materializes
    /// `[N, V]`.
    fn invariant_linear_logp(
        inputs: LinearLogpInputs<Self>,
        implementation: Implementation,
    ) -> FloatTensor<Self>;

    /// Backward of [`Self::invariant_linear_logp`] from the saved `stats [N, C]` (the lse and
    /// entropy columns are read) and the upstream `grad [N, C]` (`dLogp`, `dLse[, dEntropy]`),
    /// recomputing logits tile by tile: `∂/∂logit = (dLogp·(onehot − p) + dLse·p
    /// − dEntropy·p·(z − lse + H)) · inv_temperature` with `p = exp(z − lse)`. Rows whose
    /// upstream gradients are all zero contribute exactly nothing.
    fn invariant_linear_logp_backward(
        inputs: LinearLogpInputs<Self>,
        stats: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        request: GradRequest,
        implementation: Implementation,
    ) -> LinearLogpGrads<Self>;
}
